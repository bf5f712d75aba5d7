package rdma

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ferry-project/ferry/transport"
	"github.com/ferry-project/ferry/transport/peer"
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
	cfg = testConfig(t, cfg)
	if !onDevice(t) {
		return listenFake(t, f, cfg)
	}
	c, _ := realPort()
	tr, err := Listen(cfg, c)
	if err != nil {
		t.Fatal(err)
	}
	closeAtEnd(t, tr)
	return tr
}

// testConfig fills in what the tests leave out of cfg: a loopback port,
// a Sink, the TCP fallback, the test's log, and timeouts long enough for
// the VM.
func testConfig(t testing.TB, cfg Config) Config {
	if cfg.TCP == nil {
		cfg.TCP = overTCP
	}
	if cfg.Peer.Addr == "" {
		cfg.Peer.Addr = "127.0.0.1:0"
	}
	if cfg.Peer.Sink == nil {
		cfg.Peer.Sink = transporttest.NewSlots(0)
	}
	if cfg.Peer.Logf == nil {
		cfg.Peer.Logf = t.Logf
	}
	// A loaded machine running the VM under TCG can take seconds for a
	// handshake; the tests bound their own waits.
	if cfg.Peer.HandshakeTimeout == 0 {
		cfg.Peer.HandshakeTimeout = 30 * time.Second
	}
	if cfg.Peer.IOTimeout == 0 {
		cfg.Peer.IOTimeout = 30 * time.Second
	}
	return cfg
}

// listenFake is listenT on a fake NIC whatever the machine has.
func listenFake(t testing.TB, f *fabric, cfg Config) *Transport {
	t.Helper()
	if cfg.Peer.Addr == "" {
		cfg.Peer.Addr = "127.0.0.1:0"
	}
	if cfg.Peer.Sink == nil {
		cfg.Peer.Sink = transporttest.NewSlots(0)
	}
	if cfg.TCP == nil {
		cfg.TCP = overTCP
	}
	tr, err := listen(cfg, f.nic(1))
	if err != nil {
		t.Fatal(err)
	}
	closeAtEnd(t, tr)
	return tr
}

// closeAtEnd closes tr when t ends, failing t if Close reports a leak.
func closeAtEnd(t testing.TB, tr *Transport) {
	t.Cleanup(func() {
		if err := tr.Close(); err != nil {
			t.Errorf("transport close: %v", err)
		}
	})
}

// dialT opens a session from tx to rx, closed when t ends.
func dialT(t *testing.T, tx, rx *Transport) transport.Session {
	t.Helper()
	s, err := tx.Dial(ctxFor(t, 30*time.Second), rx.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close() })
	return s
}

func ctxFor(t *testing.T, d time.Duration) context.Context {
	ctx, cancel := context.WithTimeout(t.Context(), d)
	t.Cleanup(cancel)
	return ctx
}

func TestConformance(t *testing.T) {
	f := newFabric()
	transporttest.Run(t, func(t *testing.T, sink transport.Sink) transport.Transport {
		return listenT(t, f, Config{Peer: peer.Config{Sink: sink}})
	})
}

func TestDiscover(t *testing.T) {
	inv, err := Discover()
	if err != nil {
		t.Fatal(err)
	}
	if !onDevice(t) {
		if len(inv.NICs) != 0 || inv.Why == "" {
			t.Errorf("no usable port, yet the inventory lists %d NICs and says %q", len(inv.NICs), inv.Why)
		}
		return
	}
	t.Logf("%+v", inv)
	c, _ := realPort()
	for _, n := range inv.NICs {
		if n.Name != c.Device {
			continue
		}
		p := n.Ports[c.Port-1]
		if !p.Active || p.MTU == 0 || len(p.GIDs) == 0 {
			t.Errorf("chosen port %s/%d: %+v", n.Name, p.Num, p)
		}
		if p.LinkLayer == "Ethernet" && len(n.Netdevs) == 0 {
			t.Errorf("RoCE device %s lists no netdev", n.Name)
		}
		return
	}
	t.Errorf("chosen device %s not in the inventory", c.Device)
}

func TestChoose(t *testing.T) {
	gid := func(i int, typ, ip, dev string) GID {
		return GID{Index: i, GID: net.ParseIP(ip).String(), Type: typ, Netdev: dev}
	}
	roce := Port{Num: 1, State: "ACTIVE", Active: true, LinkLayer: "Ethernet", MTU: 1024, GIDs: []GID{
		gid(0, "RoCE v1", "fe80::1", "eth0"),
		gid(1, "RoCE v2", "fe80::1", "eth0"),
		gid(2, "RoCE v1", "10.0.0.5", "eth0"),
		gid(3, "RoCE v2", "10.0.0.5", "eth0"),
		gid(5, "RoCE v2", "10.1.0.5", "eth0.100"),
	}}
	down := Port{Num: 1, State: "DOWN", LinkLayer: "Ethernet", GIDs: roce.GIDs}
	ib := Port{Num: 1, State: "ACTIVE", Active: true, LinkLayer: "InfiniBand", MTU: 4096, LID: 7, GIDs: []GID{gid(0, "IB", "fe80::2", "")}}
	inv := Inventory{NICs: []NIC{{Name: "mlx5_0", Ports: []Port{roce}}, {Name: "mlx5_1", Ports: []Port{down}}, {Name: "ib0", Ports: []Port{ib}}}}
	for _, c := range []struct {
		name      string
		inv       Inventory
		want      Want
		dev       string
		idx       int
		why, fail string
	}{
		{"AdvertisedAddress", inv, Want{GIDIndex: -1, Addr: net.ParseIP("10.1.0.5")}, "mlx5_0", 5, "advertised address 10.1.0.5", ""},
		{"NoAddressFirstV2IPv4", inv, Want{GIDIndex: -1}, "mlx5_0", 3, "first RoCE v2 IPv4 GID", ""},
		{"AddressElsewhere", inv, Want{GIDIndex: -1, Addr: net.ParseIP("192.168.1.1")}, "mlx5_0", 3, "192.168.1.1 is on no RDMA netdev", ""},
		{"InfiniBand", inv, Want{Device: "ib0", GIDIndex: -1}, "ib0", 0, "InfiniBand", ""},
		{"GIDIndexOverride", inv, Want{Device: "mlx5_0", GIDIndex: 1}, "mlx5_0", 1, "GID index 1, as asked", ""},
		{"GIDIndexUnused", inv, Want{Device: "mlx5_0", GIDIndex: 4}, "", 0, "", "no active port has a GID at index 4"},
		{"UnknownDevice", inv, Want{Device: "mlx5_9", GIDIndex: -1}, "", 0, "", "device mlx5_9 is not among the RDMA devices seen (mlx5_0, mlx5_1, ib0)"},
		{"PortDown", inv, Want{Device: "mlx5_1", GIDIndex: -1}, "", 0, "", "mlx5_1 port 1 is DOWN"},
		{"NoDevices", Inventory{Why: "the kernel has no RDMA support"}, Want{GIDIndex: -1}, "", 0, "", "the kernel has no RDMA support"},
	} {
		t.Run(c.name, func(t *testing.T) {
			got, err := Choose(c.inv, c.want)
			if c.fail != "" {
				if !errors.Is(err, ErrNoPort) || !strings.Contains(err.Error(), c.fail) {
					t.Fatalf("got %+v, %v; want ErrNoPort saying %q", got, err, c.fail)
				}
				return
			}
			if err != nil || got.Device != c.dev || got.GIDIndex != c.idx || !strings.Contains(got.Why, c.why) {
				t.Fatalf("got %+v, %v; want %s GID %d because %q", got, err, c.dev, c.idx, c.why)
			}
		})
	}
}

// tcpPair is a connected pair of loopback TCP connections.
func tcpPair(t *testing.T) (*net.TCPConn, *net.TCPConn) {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	a, err := net.Dial("tcp", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	b, err := ln.Accept()
	if err != nil {
		t.Fatal(err)
	}
	return a.(*net.TCPConn), b.(*net.TCPConn)
}

// loop is two QPs of one NIC connected to each other, each with a lane's
// poller, and a registered buffer on each side.
type loop struct {
	n          nic
	a, b       *lane
	abuf, bbuf []byte
	areg, breg region
}

func newLoop(t *testing.T, size int) *loop {
	t.Helper()
	n := testNIC(t, newFabric(), 1)
	lp := &loop{n: n, abuf: mapT(t, size), bbuf: mapT(t, size)}
	t.Cleanup(func() {
		if err := n.Close(); err != nil {
			t.Errorf("nic close: %v", err)
		}
	})
	qa, err := n.NewQP(sendDepth, recvDepth)
	if err != nil {
		t.Fatal(err)
	}
	qb, err := n.NewQP(sendDepth, recvDepth)
	if err != nil {
		t.Fatal(err)
	}
	ea, eb := n.Endpoint(), n.Endpoint()
	ea.QPN, ea.PSN = qa.QPN(), 0x1234
	eb.QPN, eb.PSN = qb.QPN(), 0x5678
	if err := qb.PostRecvs(recvDepth); err != nil {
		t.Fatal(err)
	}
	if err := qa.Connect(ea.PSN, eb); err != nil {
		t.Fatal(err)
	}
	if err := qb.Connect(eb.PSN, ea); err != nil {
		t.Fatal(err)
	}
	ca, cb := tcpPair(t)
	lp.a, lp.b = newLane(qa, ca, sendDepth+recvDepth), newLane(qb, cb, sendDepth+recvDepth)
	if lp.areg, err = n.Register(lp.abuf, peerWrites); err != nil {
		t.Fatal(err)
	}
	if lp.breg, err = n.Register(lp.bbuf, peerWrites); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		for _, err := range []error{lp.a.close(), lp.b.close(), lp.areg.Close(), lp.breg.Close()} {
			if err != nil {
				t.Error(err)
			}
		}
	})
	return lp
}

func (lp *loop) wait(t *testing.T, l *lane) completion {
	t.Helper()
	c, err := wait(l, l.wcs, time.Now().Add(30*time.Second), nil)
	if err != nil {
		t.Fatalf("waiting for a completion: %v", err)
	}
	return c
}

// TestLoopback writes with an immediate from one QP into another's
// registered memory, byte-exact, at sizes from 1 byte to 16 MiB.
func TestLoopback(t *testing.T) {
	const max = 16 << 20
	lp := newLoop(t, max)
	for i, n := range []int{1, 255, 4 << 10, 1<<20 + 7, max} {
		src := lp.abuf[:n]
		for j := range src {
			src[j] = byte(j*31 + i)
		}
		clear(lp.bbuf[:n])
		imm := uint32(0xfe000000 + i)
		err := lp.a.qp.Post([]op{{WRID: 1, Local: addrOf(src), Remote: addrOf(lp.bbuf), Len: uint32(n),
			LKey: lp.areg.LKey(), RKey: lp.breg.RKey(), Imm: imm, Signaled: true, WithImm: true}})
		if err != nil {
			t.Fatal(err)
		}
		if c := lp.wait(t, lp.a); c.Status != wcSuccess || c.WRID != 1 || c.Opcode != opcodeRDMAWrite {
			t.Fatalf("%d bytes: send completion %+v", n, c)
		}
		c := lp.wait(t, lp.b)
		if c.Status != wcSuccess || c.Opcode != opcodeRecvRDMAWithImm || !c.HasImm || c.Imm != imm || c.ByteLen != uint32(n) {
			t.Fatalf("%d bytes: receive completion %+v, want immediate %#x and %d bytes", n, c, imm, n)
		}
		lp.b.qp.PostRecvs(1)
		if !bytes.Equal(lp.bbuf[:n], src) {
			t.Fatalf("%d bytes: written bytes differ", n)
		}
	}
}

// TestRemoteReadRefused: no ferry QP or registration answers an RDMA
// READ (a Mooncake descriptor hands out the arena's rkey): the peer's NIC
// refuses it and no byte of its memory comes back.
func TestRemoteReadRefused(t *testing.T) {
	lp := newLoop(t, 4096)
	for j := range lp.bbuf {
		lp.bbuf[j] = byte(j*7 + 1)
	}
	clear(lp.abuf)
	err := lp.a.qp.Post([]op{{WRID: 2, Local: addrOf(lp.abuf), Remote: addrOf(lp.bbuf), Len: 4096,
		LKey: lp.areg.LKey(), RKey: lp.breg.RKey(), Signaled: true, Read: true}})
	if err != nil {
		t.Fatal(err)
	}
	// The responder's QP refuses the opcode (INV_REQ); a NIC that checks
	// the registration first refuses the access.
	if c := lp.wait(t, lp.a); c.Status != wcRemInvReqErr && c.Status != wcRemAccessErr {
		t.Fatalf("an RDMA READ of the peer's registered memory: completion %+v (%s), want REM_INV_REQ_ERR or REM_ACCESS_ERR",
			c, c.Status.String())
	}
	if !isZero(lp.abuf) {
		t.Error("a refused read brought the peer's bytes back")
	}
}

// TestWrongRKey: the NIC refuses a write whose rkey names no registration
// of the peer, and the error says so by name.
func TestWrongRKey(t *testing.T) {
	lp := newLoop(t, 4096)
	bad := lp.breg.RKey() ^ 0x5a5a00
	err := lp.a.qp.Post([]op{{WRID: 7, Local: addrOf(lp.abuf), Remote: addrOf(lp.bbuf), Len: 4096,
		LKey: lp.areg.LKey(), RKey: bad, Imm: 1, Signaled: true, WithImm: true}})
	if err != nil {
		t.Fatal(err)
	}
	c := lp.wait(t, lp.a)
	if c.Status != wcRemAccessErr {
		t.Fatalf("write with a wrong rkey: completion %+v, want REM_ACCESS_ERR", c)
	}
	msg := (&CompletionError{Status: c.Status, VendorErr: c.VendorErr, Op: "rdma write"}).Error()
	for _, want := range []string{"REM_ACCESS_ERR", "wrong rkey"} {
		if !strings.Contains(msg, want) {
			t.Errorf("%q does not say %q", msg, want)
		}
	}
	if transport.StatusName(fmt.Errorf("wrapped: %w", &CompletionError{Status: c.Status})) != "REM_ACCESS_ERR" {
		t.Error("StatusName does not find the status through wrapping")
	}
	if !isZero(lp.bbuf) {
		t.Error("a refused write changed the peer's memory")
	}
}

func isZero(b []byte) bool { return bytes.Count(b, []byte{0}) == len(b) }

// overTCP is the daemon's TCP fallback: transport/tcp on the port. The
// tests' pairs never use it (both peers have RDMA), but a transport
// needs one, and its Close closes the port.
func overTCP(p *peer.Port) Fallback { return tcp.Over(p) }
