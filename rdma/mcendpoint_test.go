package rdma

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net"
	"strings"
	"testing"
	"time"

	"github.com/ferry-project/ferry/internal/connlimit"
	"github.com/ferry-project/ferry/mooncake"
)

// The Mooncake endpoint table's rules, on the fake fabric: its QPs are
// routed by GID and its keys are its NIC's own, so a write over QPs
// connected to the wrong NIC fails as on a real one (on the soft-RoCE VM's
// one device every segment has the same GID). The wire exchange with real
// verbs runs in the VM (mooncake_test.go), and so does
// TestMooncakeQPRefusesRead.

// mcSegment is a Mooncake RDMA segment on n: a transport whose Memory
// is its one buffer, and a handshake port that answers metadata and
// connection requests over it.
type mcSegment struct {
	tr   *Transport
	name string
	mem  []byte
	qps  int // QPs offered when it dials (0: Mooncake's default)
	// mayFetch is the segments it may fetch an initiator's descriptor
	// from (nil: none), as a daemon's are those it sent to.
	mayFetch func(segment string) bool
}

func startFakeSegment(t *testing.T, f *fabric, id byte, cfg Config) *mcSegment {
	t.Helper()
	return startSegment(t, f.nic(id), cfg)
}

func startSegment(t *testing.T, n nic, cfg Config) *mcSegment {
	t.Helper()
	cfg.Memory = mapT(t, 1<<16)
	tr, err := listen(testConfig(t, cfg), n)
	if err != nil {
		t.Fatal(err)
	}
	closeAtEnd(t, tr)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	s := &mcSegment{tr: tr, name: ln.Addr().String(), mem: cfg.Memory}
	srv := mooncake.Serve(ln, mooncake.Handlers{
		Segment: s.segment,
		Connect: func(ctx context.Context, from net.Addr, req mooncake.HandshakeDesc) (mooncake.HandshakeDesc, func()) {
			return tr.AcceptMooncake(ctx, MooncakeHandshake{Self: s.name, From: from, MayFetch: s.mayFetch}, req)
		},
	}, mooncake.ServerConfig{Logf: t.Logf})
	t.Cleanup(func() { srv.Close() }) // before the transport closes
	return s
}

func (s *mcSegment) device() mooncake.Device {
	d, err := s.tr.MooncakeDevice()
	if err != nil {
		panic(err)
	}
	return d
}

func (s *mcSegment) nicPath() string { return mooncake.NICPath(s.name, s.device().Name) }

func (s *mcSegment) segment() *mooncake.Segment {
	d := s.device()
	rk, lk, _ := s.tr.MooncakeKeys()
	return &mooncake.Segment{Name: s.name, Protocol: "rdma", Devices: []mooncake.Device{d},
		Buffers:        []mooncake.Buffer{{Name: "cpu:0", Addr: addrOf(s.mem), Length: uint64(len(s.mem)), RKey: []uint32{rk}, LKey: []uint32{lk}}},
		PriorityMatrix: mooncake.Priority{"cpu:0": {{d.Name}, {}}}}
}

// write writes data at off in dst's buffer, as a ferry session does: the
// target from dst's descriptor, fetched over its handshake port.
func (s *mcSegment) write(t *testing.T, dst *mcSegment, off int, data []byte) error {
	t.Helper()
	ctx := ctxFor(t, 30*time.Second)
	seg, err := mooncake.FetchSegment(ctx, dst.name, &mooncake.Segment{Name: s.name, Buffers: []mooncake.Buffer{}})
	if err != nil {
		t.Fatal(err)
	}
	addr := seg.Buffers[0].Addr + uint64(off)
	tg, ok, err := seg.RDMATarget(addr, uint64(len(data)))
	if !ok || err != nil {
		t.Fatalf("target of %d bytes at %#x: %v %v", len(data), addr, ok, err)
	}
	src := s.mem[:len(data)]
	copy(src, data)
	return s.tr.WriteMooncake(ctx, mooncake.RDMAWrite{Self: s.name, RPC: dst.name, Target: tg, Remote: addr, Src: src, QPs: s.qps})
}

func (s *mcSegment) endpoint(peer string) *mcEndpoint {
	s.tr.mc.mu.Lock()
	defer s.tr.mc.mu.Unlock()
	return s.tr.mc.eps[peer]
}

// openOnNIC is how many registrations and QPs of s's NIC are open.
func (s *mcSegment) openOnNIC() int {
	n := s.tr.nic.(*fakeNIC)
	n.mu.Lock()
	defer n.mu.Unlock()
	return n.open
}

// TestMooncakeQPsTakeTheMTUCap: Mooncake exchanges no MTU, so the QPs
// of an endpoint are connected with the cap the operator configured (the
// peers' MC_MTU), whichever side dialed; the default is Mooncake's 4096.
func TestMooncakeQPsTakeTheMTUCap(t *testing.T) {
	f := newFabric()
	ferry := startFakeSegment(t, f, 1, Config{MooncakeMTU: 1024})
	out, in := startFakeSegment(t, f, 2, Config{}), startFakeSegment(t, f, 3, Config{})
	if err := ferry.write(t, out, 0, []byte("to a segment ferry dialed")); err != nil {
		t.Fatal(err)
	}
	if err := in.write(t, ferry, 0, []byte("from a segment that dialed ferry")); err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		side *mcSegment
		peer string
		want int
	}{
		{ferry, out.nicPath(), 1024}, // ferry dialed
		{ferry, in.nicPath(), 1024},  // ferry accepted
		{out, ferry.nicPath(), 4096}, // the default
	} {
		ep := c.side.endpoint(c.peer)
		if ep == nil {
			t.Fatalf("no endpoint to %s", c.peer)
		}
		for _, l := range ep.lanes {
			q := l.qp.(*fakeQP)
			q.mu.Lock()
			got := q.mcMTU.Bytes()
			q.mu.Unlock()
			if got != c.want {
				t.Errorf("a QP to %s was connected with an MTU cap of %d bytes, want %d", c.peer, got, c.want)
			}
		}
	}
}

// TestMooncakeQPsPerEndpoint: a segment ferry dials gets the QPs ferry
// is set to offer (the peers' MC_NUM_QP_PER_EP), and one that dials ferry
// gets as many as it offers.
func TestMooncakeQPsPerEndpoint(t *testing.T) {
	f := newFabric()
	ferry, out, in := startFakeSegment(t, f, 1, Config{}), startFakeSegment(t, f, 2, Config{}), startFakeSegment(t, f, 3, Config{})
	ferry.qps, in.qps = 3, 5
	if err := ferry.write(t, out, 0, []byte("three QPs")); err != nil {
		t.Fatal(err)
	}
	if err := in.write(t, ferry, 0, []byte("five QPs")); err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		a, b *mcSegment
		want int
	}{{ferry, out, 3}, {out, ferry, 3}, {ferry, in, 5}, {in, ferry, 5}} {
		if ep := c.a.endpoint(c.b.nicPath()); ep == nil || len(ep.lanes) != c.want {
			t.Errorf("%s's endpoint to %s: %v, want %d QPs", c.a.name, c.b.name, ep, c.want)
		}
	}
}

// TestMooncakeEndpointHijack: a handshake claiming another segment's NIC
// path installs an endpoint under that path, connected to the claimant's
// GID. ferry's next write to the real segment must not use it: it
// handshakes afresh with the segment and the bytes land there.
func TestMooncakeEndpointHijack(t *testing.T) {
	f := newFabric()
	ferry, victim, attacker := startFakeSegment(t, f, 1, Config{}), startFakeSegment(t, f, 2, Config{}), startFakeSegment(t, f, 3, Config{})
	ctx := ctxFor(t, 30*time.Second)
	lanes, err := attacker.tr.newMooncakeQPs(2)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { closeLanes(lanes) })
	r, err := mooncake.ConnectQPs(ctx, ferry.name, mooncake.HandshakeDesc{
		LocalNICPath: victim.nicPath(), PeerNICPath: ferry.nicPath(), QPNum: qpNums(lanes), LocalGID: attacker.device().GID,
	})
	if err != nil {
		t.Fatalf("the claimed handshake: %v", err)
	}
	if _, err := connectMooncake(ferry.nicPath(), lanes, ferry.tr.nic.Endpoint().GID, 0, r.QPNum, mtuOf(mooncake.DefaultMTU)); err != nil {
		t.Fatal(err)
	}
	hijacked := ferry.endpoint(victim.nicPath())
	if hijacked == nil || hijacked.gid != attacker.tr.nic.Endpoint().GID {
		t.Fatalf("the claimed endpoint is not in the table under %s with the claimant's GID", victim.nicPath())
	}

	data := bytes.Repeat([]byte("ferry→victim "), 300)
	if err := ferry.write(t, victim, 512, data); err != nil {
		t.Fatalf("the write to the victim: %v", err)
	}
	if !bytes.Equal(victim.mem[512:512+len(data)], data) {
		t.Fatal("the victim's buffer does not hold the bytes written to it")
	}
	ep := ferry.endpoint(victim.nicPath())
	if ep == nil || ep == hijacked || ep.gid != victim.tr.nic.Endpoint().GID {
		t.Fatal("ferry's endpoint to the victim is not a fresh one connected to the victim's GID")
	}
	select {
	case <-hijacked.lanes[0].quit:
	default:
		t.Error("the claimed endpoint was not closed when the real one replaced it")
	}
	// The endpoint is reused while its GID matches.
	if err := ferry.write(t, victim, 0, data[:100]); err != nil || ferry.endpoint(victim.nicPath()) != ep {
		t.Fatalf("a second write did not reuse the endpoint: %v", err)
	}
}

// TestMooncakeEndpointEviction: a full table evicts an endpoint (its QPs
// closed, an INFO line saying so) instead of refusing new initiators,
// one nobody has written through before one ferry wrote through; the
// evicted initiator's next write fails and the one after handshakes
// afresh.
func TestMooncakeEndpointEviction(t *testing.T) {
	f := newFabric()
	var info logLines
	ferry := startFakeSegment(t, f, 1, Config{Infof: info.logf})
	ferry.tr.mc.limits = connlimit.Limits{Total: 2}
	a, b, c := startFakeSegment(t, f, 2, Config{}), startFakeSegment(t, f, 3, Config{}), startFakeSegment(t, f, 4, Config{})
	data := []byte("into ferry")
	for _, s := range []*mcSegment{a, b} {
		if err := s.write(t, ferry, 0, data); err != nil {
			t.Fatal(err)
		}
	}
	// ferry writes back to a over a's endpoint: b's is the one nobody
	// proved legitimate.
	if err := ferry.write(t, a, 0, data); err != nil {
		t.Fatal(err)
	}
	open := ferry.openOnNIC()
	if err := c.write(t, ferry, 0, data); err != nil {
		t.Fatalf("a third initiator into a full table: %v", err)
	}
	info.wait(t, "2 Mooncake endpoints", "closed the one to", b.name, c.name)
	if ferry.endpoint(b.name+"@fake3") != nil || ferry.endpoint(a.name+"@fake2") == nil || ferry.endpoint(c.name+"@fake4") == nil {
		t.Fatal("the table does not hold a's and c's endpoints only")
	}
	if got := ferry.openOnNIC(); got != open {
		t.Errorf("%d registrations and QPs open on ferry's NIC after the eviction, want %d as before (b's 2 QPs closed, c's 2 opened)", got, open)
	}
	if err := b.write(t, ferry, 0, data); err == nil {
		t.Fatal("b wrote over QPs ferry closed")
	}
	if err := b.write(t, ferry, 0, data); err != nil {
		t.Fatalf("b's write after a fresh handshake: %v", err)
	}
}

// TestMooncakeAcceptLimitsAndUndo: an initiator offering more QPs than an
// endpoint may have is refused by a reply_msg naming the limit; undo
// takes an accepted endpoint back (its reply never went out).
func TestMooncakeAcceptLimitsAndUndo(t *testing.T) {
	f := newFabric()
	ferry, peer := startFakeSegment(t, f, 1, Config{}), startFakeSegment(t, f, 2, Config{})
	ctx := ctxFor(t, 30*time.Second)
	req := mooncake.HandshakeDesc{LocalNICPath: peer.nicPath(), PeerNICPath: ferry.nicPath(), LocalGID: peer.device().GID}
	req.QPNum = make([]uint32, mooncake.MaxQPs+1)
	_, err := mooncake.ConnectQPs(ctx, ferry.name, req)
	if err == nil || !strings.Contains(err.Error(), "17 QP numbers offered: want 1 to 16") || !strings.Contains(err.Error(), "MC_NUM_QP_PER_EP") {
		t.Fatalf("17 QPs: %v, want a refusal naming the limit", err)
	}
	open := ferry.openOnNIC()
	req.QPNum = []uint32{1, 2}
	reply, undo := ferry.tr.AcceptMooncake(ctx, MooncakeHandshake{Self: ferry.name, From: &net.TCPAddr{IP: net.IPv4(10, 0, 0, 9)}}, req)
	if reply.ReplyMsg != "" || undo == nil || ferry.endpoint(peer.nicPath()) == nil {
		t.Fatalf("accepting 2 QPs: %+v", reply)
	}
	undo()
	if ferry.endpoint(peer.nicPath()) != nil || ferry.openOnNIC() != open {
		t.Fatal("undo left the endpoint or its QPs behind")
	}
}

// TestMooncakeQPRefusesRead: a Mooncake peer that holds the arena's rkey
// (the descriptor hands it to anyone) and QPs connected to ferry's still
// cannot read the arena: the QP and the registration refuse RDMA READ.
func TestMooncakeQPRefusesRead(t *testing.T) {
	f := newFabric()
	peer, ferry := startSegment(t, testNIC(t, f, 1), Config{}), startSegment(t, testNIC(t, f, 2), Config{})
	if err := peer.write(t, ferry, 0, []byte("connects the QPs")); err != nil {
		t.Fatal(err)
	}
	for i := range ferry.mem {
		ferry.mem[i] = byte(i*7 + 1)
	}
	clear(peer.mem)
	ep := peer.endpoint(ferry.nicPath())
	if ep == nil {
		t.Fatal("no endpoint to ferry after the write")
	}
	l := <-ep.free
	defer func() { ep.free <- l }()
	rkey, _, _ := ferry.tr.MooncakeKeys()
	_, lkey, _ := peer.tr.MooncakeKeys()
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
			c, StatusName(&CompletionError{Status: c.Status}))
	}
	t.Logf("the read was refused with %s", StatusName(&CompletionError{Status: c.Status}))
	if !isZero(peer.mem[:4096]) {
		t.Error("a refused read brought ferry's bytes back")
	}
}

// TestMooncakeHandshakeUnreachablePeer: a handshake to a segment that
// accepts and never answers holds up only the writes to that NIC path: a
// write to a healthy segment handshakes meanwhile, a second write to the
// silent one waits for the first's handshake instead of dialing again and
// returns as soon as its context ends, and so does the first.
func TestMooncakeHandshakeUnreachablePeer(t *testing.T) {
	f := newFabric()
	// The silent handshake ends by its context or, at the latest, after
	// mooncake.HandshakeTimeout (5 s): the checks below are orderings
	// within that window.
	ferry := startFakeSegment(t, f, 1, Config{})
	healthy := startFakeSegment(t, f, 2, Config{})

	silent, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	accepted := make(chan net.Conn, 4)
	go func() {
		for {
			c, err := silent.Accept()
			if err != nil {
				return
			}
			accepted <- c
		}
	}()
	t.Cleanup(func() {
		silent.Close()
		for {
			select {
			case c := <-accepted:
				c.Close()
			default:
				return
			}
		}
	})
	// The silent segment's target: a healthy descriptor under its address.
	ctx := ctxFor(t, 30*time.Second)
	seg, err := mooncake.FetchSegment(ctx, healthy.name, &mooncake.Segment{Name: ferry.name, Buffers: []mooncake.Buffer{}})
	if err != nil {
		t.Fatal(err)
	}
	tg, _, err := seg.RDMATarget(seg.Buffers[0].Addr, 64)
	if err != nil {
		t.Fatal(err)
	}
	tg.NICPath = mooncake.NICPath(silent.Addr().String(), tg.Device.Name)
	toSilent := mooncake.RDMAWrite{Self: ferry.name, RPC: silent.Addr().String(), Target: tg, Remote: tg.Buffer.Addr, Src: ferry.mem[:64]}

	firstCtx, cancelFirst := context.WithCancel(ctx)
	defer cancelFirst()
	first := make(chan error, 1)
	go func() { first <- ferry.tr.WriteMooncake(firstCtx, toSilent) }()
	var conn net.Conn
	select {
	case conn = <-accepted:
		accepted <- conn // closed at cleanup
	case <-ctx.Done():
		t.Fatal("the silent segment saw no handshake connection")
	}

	healthyDone := make(chan error, 1)
	go func() { healthyDone <- ferry.write(t, healthy, 0, []byte("past the silent one")) }()
	select {
	case err := <-healthyDone:
		if err != nil {
			t.Fatalf("the write to the healthy segment: %v", err)
		}
	case err := <-first:
		t.Fatalf("the silent segment's handshake ended (%v) before the write to the healthy segment: that write waited on it", err)
	case <-ctx.Done():
		t.Fatal("the write to the healthy segment did not finish")
	}
	if string(healthy.mem[:19]) != "past the silent one" {
		t.Fatal("the healthy segment does not hold the bytes written to it")
	}

	canceled, cancel := context.WithCancel(ctx)
	cancel()
	if err := ferry.tr.WriteMooncake(canceled, toSilent); !errors.Is(err, context.Canceled) || !strings.Contains(err.Error(), "waiting for the handshake") {
		t.Fatalf("a second write to the silent segment with a canceled context: %v, want it to stop waiting for the first's handshake", err)
	}
	select {
	case err := <-first:
		t.Fatalf("the first write to the silent segment returned before its context ended: %v", err)
	default:
	}
	cancelFirst()
	select {
	case err := <-first:
		// Canceled while dialing or while reading the reply: either way
		// an error, not a write.
		if err == nil {
			t.Fatal("the first write to the silent segment succeeded after its context ended")
		}
	case <-ctx.Done():
		t.Fatal("the first write to the silent segment did not return when its context ended")
	}
	if n := len(accepted); n != 1 {
		t.Fatalf("the silent segment saw %d handshake connections, want 1 (the second write waits for the first's)", n)
	}
}

// TestMooncakeEvictionNotDrivenByStrangers: handshakes from strangers
// into a full endpoint table (as many as they like, from one address or
// many) take each other's places, never those of endpoints ferry dialed
// or whose address proved itself (a notify that completed a receive
// slot); one address gets no more than its cap, the rest refused with a
// reply_msg naming it.
func TestMooncakeEvictionNotDrivenByStrangers(t *testing.T) {
	f := newFabric()
	var info logLines
	ferry := startFakeSegment(t, f, 1, Config{Infof: info.logf})
	ferry.tr.mc.limits = connlimit.Limits{Total: 4, PerSource: 2}
	out := startFakeSegment(t, f, 2, Config{})
	if err := ferry.write(t, out, 0, []byte("ferry dials out")); err != nil {
		t.Fatal(err)
	}
	ctx := ctxFor(t, 30*time.Second)
	gid := out.device().GID
	accept := func(from string, path string) mooncake.HandshakeDesc {
		t.Helper()
		req := mooncake.HandshakeDesc{LocalNICPath: path, PeerNICPath: ferry.nicPath(), QPNum: []uint32{1}, LocalGID: gid}
		r, _ := ferry.tr.AcceptMooncake(ctx, MooncakeHandshake{Self: ferry.name, From: &net.TCPAddr{IP: net.ParseIP(from), Port: 40000}}, req)
		return r
	}
	legit := "10.0.0.1:15000@mlx5_0"
	if r := accept("10.0.0.1", legit); r.ReplyMsg != "" {
		t.Fatal(r.ReplyMsg)
	}
	ferry.tr.MooncakeProven(&net.TCPAddr{IP: net.ParseIP("10.0.0.1")})
	// One stranger address: two endpoints, then refusals.
	for i := range 4 {
		r := accept("10.0.0.9", fmt.Sprintf("10.0.0.9:%d@x", i))
		if i >= 2 && !strings.Contains(r.ReplyMsg, "10.0.0.9 already holds 2 Mooncake endpoints here, the most one address may") {
			t.Fatalf("stranger handshake %d from one address: reply_msg %q, want a refusal naming the per-address cap", i, r.ReplyMsg)
		}
	}
	// Strangers from many addresses: each takes a stranger's place.
	for i := range 50 {
		if r := accept(fmt.Sprintf("10.1.%d.%d", i/200, i%200+1), fmt.Sprintf("stranger-%d@x", i)); r.ReplyMsg != "" {
			t.Fatalf("stranger %d: %s", i, r.ReplyMsg)
		}
	}
	for _, path := range []string{legit, out.nicPath()} {
		if ferry.endpoint(path) == nil {
			t.Fatalf("the endpoint to %s was evicted by strangers", path)
		}
	}
	if err := ferry.write(t, out, 64, []byte("still there")); err != nil {
		t.Fatalf("ferry's write over its own endpoint after the flood: %v", err)
	}
	st := ferry.tr.MooncakeEndpointStats()
	if st.Open != 4 || st.Evicted != 50 || st.RefusedPerSource != 2 {
		t.Fatalf("endpoint stats %+v: want 4 open, 50 evicted, 2 refused", st)
	}
	info.wait(t, "rdma: suppressed", "more lines like the above")
}

// TestMooncakeDialBackOnlyWhereSent: a handshake without local_gid makes
// ferry fetch the initiator's descriptor only from a segment it may (one
// it has sent to); any other gets a reply_msg saying why, and ferry dials
// nothing.
func TestMooncakeDialBackOnlyWhereSent(t *testing.T) {
	f := newFabric()
	ferry, in := startFakeSegment(t, f, 1, Config{}), startFakeSegment(t, f, 2, Config{})
	named, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer named.Close()
	dialed := make(chan struct{}, 1)
	go func() {
		if c, err := named.Accept(); err == nil {
			c.Close()
			dialed <- struct{}{}
		}
	}()
	ctx := ctxFor(t, 30*time.Second)
	req := func(seg string) mooncake.HandshakeDesc {
		return mooncake.HandshakeDesc{LocalNICPath: mooncake.NICPath(seg, in.device().Name), PeerNICPath: ferry.nicPath(), QPNum: []uint32{1, 2}}
	}
	_, err = mooncake.ConnectQPs(ctx, ferry.name, req(named.Addr().String()))
	if err == nil || !strings.Contains(err.Error(), "fetches an initiator's descriptor only from a Mooncake segment it has sent to") {
		t.Fatalf("a handshake without local_gid naming a segment ferry never sent to: %v, want a refusal saying why", err)
	}
	select {
	case <-dialed:
		t.Fatal("ferry dialed the segment a stranger named")
	default:
	}
	ferry.mayFetch = func(seg string) bool { return seg == in.name }
	if _, err := mooncake.ConnectQPs(ctx, ferry.name, req(in.name)); err != nil {
		t.Fatalf("a handshake without local_gid from a segment ferry sent to: %v", err)
	}
}
