package rdma

import (
	"bytes"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/ferry-project/ferry/transport"
)

// The queue pairs of Mooncake endpoints, on the fake fabric or the real
// port: package mooncake tests the endpoint table over a fake of its own,
// and the VM runs the whole exchange with real verbs (mooncake_test.go).

// mcSide is a transport whose Memory (registered once) a peer writes
// into, and a Mooncake QP on it.
type mcSide struct {
	tr  *Transport
	mem []byte
	qp  *MooncakeQP
}

// mcPair connects a Mooncake QP on a transport over f's NIC 1 (or the
// real port) to one on NIC 2's, capping a's path MTU at mtu bytes.
func mcPair(t *testing.T, f *fabric, mtu int) (a, b mcSide) {
	return mcPairTo(t, f, mtu, nil)
}

// mcPairTo is mcPair, b's transport made with bcfg when it is not nil
// (b.mem is then unused: bcfg says what b's memory is).
func mcPairTo(t *testing.T, f *fabric, mtu int, bcfg *Config) (a, b mcSide) {
	t.Helper()
	for i, s := range []*mcSide{&a, &b} {
		s.mem = mapT(t, 1<<16)
		cfg := Config{Memory: s.mem}
		if i == 1 && bcfg != nil {
			cfg = *bcfg
		}
		tr, err := listen(testConfig(t, cfg), testNIC(t, f, byte(i+1)))
		if err != nil {
			t.Fatal(err)
		}
		closeAtEnd(t, tr)
		if s.qp, err = tr.NewMooncakeQP(); err != nil {
			t.Fatal(err)
		}
		s.tr = tr
	}
	for _, c := range []struct {
		from, to mcSide
		mtu      int
	}{{a, b, mtu}, {b, a, 0}} {
		_, lid, gid, err := c.to.tr.MooncakeNIC()
		if err != nil {
			t.Fatal(err)
		}
		if err := c.from.qp.Connect(gid, lid, c.to.qp.QPN(), c.mtu); err != nil {
			t.Fatal(err)
		}
	}
	return a, b
}

// TestMooncakeQPWrite: a write lands where the peer's rkey says, the QP
// is connected with the MTU cap it was given, a write the peer's NIC
// refuses closes the QP, and the transport closes the QPs left open.
func TestMooncakeQPWrite(t *testing.T) {
	a, b := mcPair(t, newFabric(), 1024)
	if q, ok := a.qp.l.qp.(*fakeQP); ok {
		q.mu.Lock()
		got := q.mcMTU.Bytes()
		q.mu.Unlock()
		if got != 1024 {
			t.Errorf("the QP was connected with an MTU cap of %d bytes, want 1024", got)
		}
	}
	rkey, _, ok := b.tr.SharedKeys()
	if !ok {
		t.Fatal("no shared registration")
	}
	data := bytes.Repeat([]byte("mooncake "), 1000)
	copy(a.mem, data)
	ctx := ctxFor(t, 30*time.Second)
	rep, err := a.qp.Write(ctx, a.mem[:len(data)], addrOf(b.mem)+512, rkey)
	if want := (transport.Report{Registration: transport.RegisteredShared}); err != nil || rep != want {
		t.Fatalf("write: %+v, %v; want %+v", rep, err, want)
	}
	if !bytes.Equal(b.mem[512:512+len(data)], data) {
		t.Fatal("the peer's memory does not hold the bytes written")
	}
	if _, err := a.qp.Write(ctx, a.mem[:64], addrOf(b.mem), rkey+1); err == nil || !a.qp.Closed() || !strings.Contains(err.Error(), "REM_ACCESS_ERR") {
		t.Fatalf("a write under a wrong rkey: %v (QP closed: %v); want REM_ACCESS_ERR, the QP closed", err, a.qp.Closed())
	}
	if _, err := a.qp.Write(ctx, a.mem[:64], addrOf(b.mem), rkey); !errors.Is(err, errLaneClosed) {
		t.Fatalf("a write on the QP the failed one closed: %v", err)
	}
}

// TestMooncakeQPRefusesRead: a Mooncake peer that holds the arena's rkey
// (the descriptor hands it to anyone) and QPs connected to ferry's still
// cannot read the arena: its registration refuses RDMA READ (the QP
// answers READs of an engine region only: TestEngineRegionMooncakeReads).
func TestMooncakeQPRefusesRead(t *testing.T) {
	peer, ferry := mcPair(t, newFabric(), 0)
	for i := range ferry.mem {
		ferry.mem[i] = byte(i*7 + 1)
	}
	rkey, _, _ := ferry.tr.SharedKeys()
	_, lkey, _ := peer.tr.SharedKeys()
	l := peer.qp.l
	err := l.qp.Post([]op{{WRID: 9, Local: addrOf(peer.mem), Remote: addrOf(ferry.mem), Len: 4096, LKey: lkey, RKey: rkey, Signaled: true, Read: true}})
	if err != nil {
		t.Fatal(err)
	}
	c, err := wait(l, l.wcs, time.Now().Add(30*time.Second), nil)
	if err != nil {
		t.Fatalf("waiting for the read's completion: %v", err)
	}
	if c.Status != wcRemInvReqErr && c.Status != wcRemAccessErr {
		t.Fatalf("an RDMA READ of ferry's arena over a Mooncake QP: completion %+v (%s), want REM_INV_REQ_ERR or REM_ACCESS_ERR",
			c, c.Status.String())
	}
	t.Logf("the read was refused with %s", c.Status.String())
	if !isZero(peer.mem[:4096]) {
		t.Error("a refused read brought ferry's bytes back")
	}
}

// TestMooncakePoolIsAllPeersReach: the Mooncake pool is registered on
// its own, under an rkey that is not the arena's, at its own addresses:
// a Mooncake peer's write into it lands, and its write with that rkey
// anywhere else in the arena fails at the NIC (REM_ACCESS_ERR), leaving
// the bytes there as they were.
func TestMooncakePoolIsAllPeersReach(t *testing.T) {
	peer, ferry := mcPair(t, newFabric(), 0)
	const off, n = 16 << 10, 16 << 10
	addr, rkey, _, err := ferry.tr.MooncakePool(off, n)
	if err != nil {
		t.Fatal(err)
	}
	arenaRKey, _, _ := ferry.tr.SharedKeys()
	if addr != addrOf(ferry.mem)+off || rkey == arenaRKey {
		t.Fatalf("the pool at %#x under rkey %#x; want %#x, under an rkey other than the arena's (%#x)", addr, rkey, addrOf(ferry.mem)+off, arenaRKey)
	}
	if _, _, _, err := ferry.tr.MooncakePool(0, n); err == nil {
		t.Fatal("a second pool was registered")
	}
	data := bytes.Repeat([]byte("pool "), 800)
	copy(peer.mem, data)
	ctx := ctxFor(t, 30*time.Second)
	if _, err := peer.qp.Write(ctx, peer.mem[:len(data)], addr+n-uint64(len(data)), rkey); err != nil {
		t.Fatalf("a write into the pool: %v", err)
	}
	if !bytes.Equal(ferry.mem[off+n-len(data):off+n], data) {
		t.Fatal("the pool does not hold the bytes written")
	}
	// Just past the pool: the next slot of the arena, not made for
	// Mooncake peers.
	_, err = peer.qp.Write(ctx, peer.mem[:64], addr+n, rkey)
	if err == nil || !strings.Contains(err.Error(), "REM_ACCESS_ERR") {
		t.Fatalf("a write past the pool under its rkey: %v; want REM_ACCESS_ERR", err)
	}
	if !isZero(ferry.mem[off+n:]) || !isZero(ferry.mem[:off]) {
		t.Fatal("a refused write changed the arena outside the pool")
	}
}
