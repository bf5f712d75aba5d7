package rdma

import (
	"context"
	"os"
	"sync"
	"testing"
	"time"

	"github.com/ferry-project/ferry/transport"
	"github.com/ferry-project/ferry/transport/tcp"
	"github.com/ferry-project/ferry/transport/transporttest"
)

// requiredEnv, set to 1, turns "no RDMA device" into a test failure: the
// soft-RoCE VM sets it so that nothing there runs on the fake NIC.
const requiredEnv = "FERRY_RDMA_REQUIRED"

// realPort is the port the tests use when the machine has RDMA.
var realPort = sync.OnceValues(func() (Choice, error) {
	inv, err := Discover()
	if err != nil {
		return Choice{}, err
	}
	return Choose(inv, Want{GIDIndex: -1})
})

var fakeNote sync.Once

// onDevice reports whether the tests run on a real RDMA port. Without one
// they run on a fake NIC, unless FERRY_RDMA_REQUIRED=1 makes that a
// failure.
func onDevice(t testing.TB) bool {
	t.Helper()
	_, err := realPort()
	if err == nil {
		return true
	}
	if os.Getenv(requiredEnv) == "1" {
		t.Fatalf("%s=1 but there is no usable RDMA port: %v", requiredEnv, err)
	}
	fakeNote.Do(func() { t.Logf("no RDMA port (%v): running on the fake NIC", err) })
	return false
}

// testNIC opens a nic to test the verbs layer with: the real port, or a
// NIC of fabric f.
func testNIC(t testing.TB, f *fabric, id byte) nic {
	t.Helper()
	if !onDevice(t) {
		return f.nic(id)
	}
	c, _ := realPort()
	n, err := openNIC(c)
	if err != nil {
		t.Fatal(err)
	}
	return n
}

// listenT starts a transport on loopback over the real port or a NIC of
// f, and closes it when t ends, failing t if Close reports a leak.
func listenT(t testing.TB, f *fabric, cfg Config) *Transport {
	t.Helper()
	if cfg.TCP.Addr == "" {
		cfg.TCP.Addr = "127.0.0.1:0"
	}
	if cfg.TCP.Sink == nil {
		cfg.TCP.Sink = transporttest.NewSlots(0)
	}
	if cfg.TCP.Logf == nil {
		cfg.TCP.Logf = t.Logf
	}
	var tr *Transport
	var err error
	if onDevice(t) {
		c, _ := realPort()
		tr, err = Listen(cfg, c)
	} else {
		tr, err = listen(cfg, f.nic(1), Choice{Device: "fake0", Port: 1, Why: "test"})
	}
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := tr.Close(); err != nil {
			t.Errorf("transport close: %v", err)
		}
	})
	return tr
}

func ctxFor(t *testing.T, d time.Duration) context.Context {
	ctx, cancel := context.WithTimeout(t.Context(), d)
	t.Cleanup(cancel)
	return ctx
}

func TestConformance(t *testing.T) {
	f := newFabric()
	transporttest.Run(t, func(t *testing.T, sink transport.Sink) transport.Transport {
		return listenT(t, f, Config{TCP: tcp.Config{Sink: sink}})
	})
}
