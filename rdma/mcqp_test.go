package rdma

import (
	"bytes"
	"context"
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

// postRaw posts o alone on q, as a peer's own verbs would, its
// completion routed to the waiter returned (q.l.completion takes it).
func postRaw(t *testing.T, q *MooncakeQP, o op) *waiter {
	t.Helper()
	seq := q.seq.Add(1)
	o.WRID = uint64(seq) << 32
	w := &waiter{wcs: make(chan completion, 3)}
	q.l.route(seq, w)
	t.Cleanup(func() { q.l.unroute(seq) })
	if err := q.l.qp.Post([]op{o}); err != nil {
		t.Fatal(err)
	}
	return w
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
	w := postRaw(t, peer.qp, op{Local: addrOf(peer.mem), Remote: addrOf(ferry.mem), Len: 4096, LKey: lkey, RKey: rkey, Signaled: true, Read: true})
	c, err := peer.qp.l.completion(w, time.Now().Add(30*time.Second), nil)
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

// TestMooncakeQPCallsShareIt: calls on one Mooncake QP run side by side,
// their work requests in flight together, the send queue's depth shared
// between them. The simulated NIC executes none of the QP's work
// requests until a send queue's worth (sendDepth) were posted on it, so
// calls one at a time would each wait out their deadline; twice as many
// calls as that, writes and reads, all land byte-exact, the reads
// counted, and the NIC never holds more than sendDepth of them. On the
// real port the calls run side by side all the same.
func TestMooncakeQPCallsShareIt(t *testing.T) {
	f := newFabric()
	f.gather = sendDepth
	a, b := mcPair(t, f, 0)
	mem := mapT(t, 1<<16)
	fill(mem, 3)
	er, err := b.tr.RegisterEngineRegion(mem, engineAddr)
	if err != nil {
		t.Fatal(err)
	}
	defer er.Close()
	rkey, _, _ := b.tr.SharedKeys()
	fill(a.mem[:1<<15], 9)
	const piece = 512
	before := a.tr.Stats().WorkRequests
	ctx := ctxFor(t, 20*time.Second)
	errs := make(chan error, 2*sendDepth)
	for i := range sendDepth {
		go func() {
			_, err := a.qp.Write(ctx, a.mem[i*piece:(i+1)*piece], addrOf(b.mem)+uint64(i*piece), rkey)
			errs <- err
		}()
		go func() {
			_, err := a.qp.Read(ctx, a.mem[1<<15+i*piece:1<<15+(i+1)*piece], engineAddr+uint64(i*piece), er.RKey)
			errs <- err
		}()
	}
	for range 2 * sendDepth {
		if err := <-errs; err != nil { // each call ends by ctx's deadline
			t.Fatalf("a call among %d on one QP: %v", 2*sendDepth, err)
		}
	}
	if !bytes.Equal(b.mem[:1<<15], a.mem[:1<<15]) {
		t.Error("the writes did not land byte-exact")
	}
	if !bytes.Equal(a.mem[1<<15:], mem[:1<<15]) {
		t.Error("the reads did not land byte-exact")
	}
	if got := a.tr.Stats().WorkRequests - before; got != sendDepth {
		t.Errorf("%d work requests counted, want the %d reads'", got, sendDepth)
	}
	if q, ok := a.qp.l.qp.(*fakeQP); ok {
		q.mu.Lock()
		most := q.most
		q.mu.Unlock()
		if most != sendDepth {
			t.Errorf("at most %d work requests were queued on the QP at once, want its send queue full, %d", most, sendDepth)
		}
	}
	if a.qp.Closed() {
		t.Fatal("the QP closed")
	}
	if _, err := a.qp.Write(ctx, a.mem[:piece], addrOf(b.mem), rkey); err != nil {
		t.Fatalf("a write after them: %v", err)
	}
}

// TestMooncakeQPBreaksForAll: an error completion of one call fails every
// call sharing the QP promptly, each naming the NIC's status, and the QP
// is destroyed once the last lets go (each returns after that: the NIC
// is then done with its memory). The bad write goes first, and the NIC
// executes nothing until every call has posted.
func TestMooncakeQPBreaksForAll(t *testing.T) {
	if onDevice(t) {
		t.Skip("the simulated NIC holds the work requests until all are posted")
	}
	const calls = 8
	f := newFabric()
	f.gather = calls
	f.posted = make(chan struct{}, 1)
	a, b := mcPair(t, f, 0)
	rkey, _, _ := b.tr.SharedKeys()
	fq := a.qp.l.qp.(*fakeQP)
	ctx := ctxFor(t, 20*time.Second)
	type result struct {
		err  error
		gone bool // the QP was destroyed when the call returned
	}
	results := make(chan result, calls)
	call := func(rkey uint32) {
		_, err := a.qp.Write(ctx, a.mem[:64], addrOf(b.mem), rkey)
		fq.mu.Lock()
		results <- result{err, fq.state == qpGone}
		fq.mu.Unlock()
	}
	go call(rkey + 1)
	select {
	case <-f.posted:
	case <-ctx.Done():
		t.Fatal("the bad write was never posted")
	}
	for range calls - 1 {
		go call(rkey)
	}
	for i := range calls {
		var r result
		select {
		case r = <-results:
		case <-ctx.Done():
			t.Fatalf("%d of %d calls returned: the others hang", i, calls)
		}
		if r.err == nil || !strings.Contains(r.err.Error(), "REM_ACCESS_ERR") || transport.StatusName(r.err) != "REM_ACCESS_ERR" {
			t.Errorf("a call on the QP the bad write broke: %v; want it failed naming REM_ACCESS_ERR", r.err)
		}
		if !r.gone {
			t.Error("a call returned before the QP was destroyed")
		}
	}
	if st := a.tr.MooncakeQPStats(); st.Open != 0 {
		t.Errorf("%d Mooncake QPs open after the break, want none", st.Open)
	}
}

// TestMooncakeQPCancelLeavesItOpen: a call canceled with its work request
// in flight returns once it completed (a cancel the call saw before its
// completion; one it did not returns nil), the QP open for the next.
func TestMooncakeQPCancelLeavesItOpen(t *testing.T) {
	if onDevice(t) {
		t.Skip("the simulated NIC holds the work request in flight")
	}
	f := newFabric()
	f.hold = make(chan struct{})
	f.posted = make(chan struct{}, 1)
	a, b := mcPair(t, f, 0)
	rkey, _, _ := b.tr.SharedKeys()
	ctx := ctxFor(t, 20*time.Second)
	cctx, cancel := context.WithCancel(ctx)
	canceled := make(chan error, 1)
	go func() {
		_, err := a.qp.Write(cctx, a.mem[:64], addrOf(b.mem), rkey)
		canceled <- err
	}()
	select {
	case <-f.posted:
	case <-ctx.Done():
		t.Fatal("the write was never posted")
	}
	cancel()
	close(f.hold) // within drainWait of the cancel
	select {
	case err := <-canceled:
		if err != nil && !errors.Is(err, context.Canceled) {
			t.Fatalf("the canceled write: %v, want context.Canceled", err)
		}
	case <-ctx.Done():
		t.Fatal("the canceled write never returned")
	}
	if a.qp.Closed() {
		t.Fatal("a canceled call whose work completed closed the QP")
	}
	if _, err := a.qp.Write(ctx, a.mem[64:128], addrOf(b.mem)+64, rkey); err != nil {
		t.Fatalf("the write after the canceled one: %v", err)
	}
}
