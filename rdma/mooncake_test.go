package rdma_test

import (
	"bytes"
	"context"
	"math/rand/v2"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/ferry-project/ferry/mooncake"
	"github.com/ferry-project/ferry/mooncake/mooncaketest"
	"github.com/ferry-project/ferry/rdma"
	"github.com/ferry-project/ferry/transport"
)

// These run where an RDMA device exists (the soft-RoCE VM): two Mooncake
// RDMA test peers, each a segment served by package rdma's passive side
// and an initiator using its active side.

func rdmaPeer(t *testing.T) *mooncaketest.Peer {
	t.Helper()
	inv, err := rdma.Discover()
	if err == nil {
		_, err = rdma.Choose(inv, rdma.Want{GIDIndex: -1})
	}
	if err != nil {
		if os.Getenv("FERRY_RDMA_REQUIRED") == "1" {
			t.Fatalf("FERRY_RDMA_REQUIRED=1 but there is no usable RDMA port: %v", err)
		}
		t.Skipf("no RDMA port (%v): Mooncake's RDMA exchange needs a real device (make test-rdma runs it)", err)
	}
	p, err := mooncaketest.Start(mooncaketest.Config{RDMA: true, BufferSize: 8 << 20})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(p.Close)
	return p
}

func random(n int) []byte {
	b := make([]byte, n)
	for i := range b {
		b[i] = byte(rand.Uint32())
	}
	return b
}

// TestMooncakeRDMABothWays: A writes into B through the connection
// handshake (B's QPs are the passive side), then B writes back into A
// over the same endpoint, as Mooncake reuses one endpoint per NIC pair.
func TestMooncakeRDMABothWays(t *testing.T) {
	a, b := rdmaPeer(t), rdmaPeer(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	for _, n := range []int{1, 4096, 3<<20 + 17} {
		data := random(n)
		at := b.Base() + 4096
		seg, err := a.WriteRDMA(ctx, b.Name(), at, data, "")
		if err != nil {
			t.Fatalf("A → B, %d bytes: %v", n, err)
		}
		if seg.Protocol != "rdma" || len(seg.Devices) != 1 {
			t.Fatalf("B's descriptor: protocol %q, %d devices", seg.Protocol, len(seg.Devices))
		}
		if got := b.Bytes(at, n); !bytes.Equal(got, data) {
			t.Fatalf("A → B, %d bytes: B holds different bytes", n)
		}
		back := random(n)
		at = a.Base() + 1<<20
		if _, err := b.WriteRDMA(ctx, a.Name(), at, back, "slot 7"); err != nil {
			t.Fatalf("B → A, %d bytes: %v", n, err)
		}
		if got := a.Bytes(at, n); !bytes.Equal(got, back) {
			t.Fatalf("B → A, %d bytes: A holds different bytes", n)
		}
	}
	if nt := a.Notifies(); len(nt) != 3 || nt[0].Name != b.Name() || nt[0].NotifyMsg != "slot 7" {
		t.Fatalf("A's notifies: %+v", nt)
	}
}

// TestMooncakeRDMARemoteAccessError: a write the target's NIC refuses
// (beyond its registration) fails with the completion's status, tears the
// endpoint down, and the next write handshakes afresh and lands.
func TestMooncakeRDMARemoteAccessError(t *testing.T) {
	a, b := rdmaPeer(t), rdmaPeer(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	seg, err := mooncake.FetchSegment(ctx, b.Name(), a.Segment())
	if err != nil {
		t.Fatal(err)
	}
	tg, ok, err := seg.RDMATarget(b.Base(), 1)
	if !ok || err != nil {
		t.Fatalf("target for B's base: %v, %v", ok, err)
	}
	end := tg.Buffer.Addr + tg.Buffer.Length
	err = a.WriteRawRDMA(ctx, b.Name(), tg, end-100, random(4096))
	if transport.StatusName(err) != "REM_ACCESS_ERR" {
		t.Fatalf("a write across the end of B's registration: %v, want REM_ACCESS_ERR", err)
	}
	if !strings.Contains(err.Error(), "4096 bytes") || !strings.Contains(err.Error(), "@") {
		t.Fatalf("the error does not name the write and the NIC path: %v", err)
	}
	data := random(64 << 10)
	if _, err := a.WriteRDMA(ctx, b.Name(), b.Base(), data, ""); err != nil {
		t.Fatalf("the write after the failure: %v", err)
	}
	if !bytes.Equal(b.Bytes(b.Base(), len(data)), data) {
		t.Fatal("the write after the failure: B holds different bytes")
	}
}

// TestMooncakeRDMARefusals: handshakes the passive side must refuse with
// a reply_msg (never a silent close): a NIC path that is not its own, and
// a QP count of 0.
func TestMooncakeRDMARefusals(t *testing.T) {
	b := rdmaPeer(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	seg, err := mooncake.FetchSegment(ctx, b.Name(), &mooncake.Segment{Name: "x", Buffers: []mooncake.Buffer{}})
	if err != nil {
		t.Fatal(err)
	}
	gid := seg.Devices[0].GID
	for _, c := range []struct {
		req  mooncake.HandshakeDesc
		want string
	}{
		{mooncake.HandshakeDesc{LocalNICPath: "127.0.0.1:1@rxe9", PeerNICPath: b.Name() + "@nosuchdev", QPNum: []uint32{1, 2}, LocalGID: gid}, "names no NIC"},
		{mooncake.HandshakeDesc{LocalNICPath: "127.0.0.1:1@rxe9", PeerNICPath: mooncake.NICPath(b.Name(), seg.Devices[0].Name), LocalGID: gid}, "0 QP numbers"},
		{mooncake.HandshakeDesc{LocalNICPath: "127.0.0.1:1@rxe9", PeerNICPath: mooncake.NICPath(b.Name(), seg.Devices[0].Name), QPNum: []uint32{1}, LocalGID: "fe80::1"}, "GID"},
	} {
		_, err := mooncake.ConnectQPs(ctx, b.Name(), c.req)
		if err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%+v: %v, want a refusal saying %q", c.req, err, c.want)
		}
	}
}

// TestMooncakeRDMAOldInitiator: a request without local_gid (Mooncake
// releases before it was sent) makes the passive side fetch the
// initiator's descriptor from the segment its NIC path names and take
// the GID of the device named there; a segment that cannot be reached
// is a refusal saying so.
func TestMooncakeRDMAOldInitiator(t *testing.T) {
	a, b := rdmaPeer(t), rdmaPeer(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	seg, err := mooncake.FetchSegment(ctx, b.Name(), a.Segment())
	if err != nil {
		t.Fatal(err)
	}
	dev := seg.Devices[0].Name
	req := mooncake.HandshakeDesc{
		LocalNICPath: mooncake.NICPath(a.Name(), dev), PeerNICPath: mooncake.NICPath(b.Name(), dev), QPNum: []uint32{1, 2},
	}
	r, err := mooncake.ConnectQPs(ctx, b.Name(), req)
	if err != nil {
		t.Fatalf("a four-key request from a reachable initiator segment: %v", err)
	}
	if r.LocalGID != seg.Devices[0].GID || len(r.QPNum) != 2 {
		t.Fatalf("reply %+v", r)
	}
	a.Close()
	if _, err := mooncake.ConnectQPs(ctx, b.Name(), req); err == nil || !strings.Contains(err.Error(), "the initiator's descriptor") {
		t.Fatalf("a four-key request from an initiator whose segment is gone: %v", err)
	}
}
