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
