package mooncake

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ferry-project/ferry/internal/connlimit"
	"github.com/ferry-project/ferry/transport"
	"github.com/ferry-project/ferry/transport/transporttest"
)

// The endpoint table's rules, over fake verbs: QPs routed by GID, each
// NIC's memory behind its own rkey, so a write over QPs connected to the
// wrong NIC fails as on a real one. Package rdma tests its queue pairs on
// its fake NIC and the real port, and the soft-RoCE VM runs the whole
// exchange on real verbs (rdma/mooncake_test.go).

// fabric joins the fake NICs of one test: QPs by number.
type fabric struct {
	mu   sync.Mutex
	qps  map[uint32]*fakeQP
	next uint32
}

func newFabric() *fabric { return &fabric{qps: make(map[uint32]*fakeQP), next: 0x100} }

// fakeVerbs is one NIC with 64 KiB of memory registered under its rkey.
type fakeVerbs struct {
	f    *fabric
	id   byte
	mem  []byte
	open int // QPs not yet closed; under f.mu
	// readsMeet, set before its QPs read, holds each of their READs
	// until as many are in flight at once as it counts.
	readsMeet *meeting
}

// meeting lets no one through until n have come, or their context ends.
type meeting struct {
	mu   sync.Mutex
	n    int
	full chan struct{}
}

func newMeeting(n int) *meeting { return &meeting{n: n, full: make(chan struct{})} }

func (m *meeting) wait(ctx context.Context) error {
	m.mu.Lock()
	if m.n--; m.n == 0 {
		close(m.full)
	}
	m.mu.Unlock()
	select {
	case <-m.full:
		return nil
	case <-ctx.Done():
		return fmt.Errorf("no other read came alongside: %w", ctx.Err())
	}
}

func (f *fabric) nic(id byte) *fakeVerbs { return &fakeVerbs{f: f, id: id, mem: make([]byte, 1<<16)} }

func (v *fakeVerbs) gid() [16]byte { return [16]byte{10: 0xff, 11: 0xff, 12: 10, 15: v.id} }
func (v *fakeVerbs) base() uint64  { return uint64(v.id) << 32 }
func (v *fakeVerbs) rkey() uint32  { return 0x1000 + uint32(v.id) }

func (v *fakeVerbs) MooncakeNIC() (string, uint16, [16]byte, error) {
	return fmt.Sprintf("fake%d", v.id), 0, v.gid(), nil
}

func (v *fakeVerbs) SharedKeys() (uint32, uint32, bool) { return v.rkey(), v.rkey(), true }

func (v *fakeVerbs) NewMooncakeQP() (*fakeQP, error) {
	v.f.mu.Lock()
	defer v.f.mu.Unlock()
	v.f.next++
	q := &fakeQP{v: v, num: v.f.next}
	v.f.qps[q.num] = q
	v.open++
	return q, nil
}

func (v *fakeVerbs) openQPs() int {
	v.f.mu.Lock()
	defer v.f.mu.Unlock()
	return v.open
}

type fakeQP struct {
	v   *fakeVerbs
	num uint32
	// Under the fabric's lock.
	dgid   [16]byte
	dqpn   uint32
	mtu    int
	closed bool
}

func (q *fakeQP) QPN() uint32 { return q.num }

func (q *fakeQP) Connect(gid [16]byte, _ uint16, qpn uint32, mtu int) error {
	q.v.f.mu.Lock()
	defer q.v.f.mu.Unlock()
	q.dgid, q.dqpn, q.mtu = gid, qpn, mtu
	return nil
}

// Write lands src when the QP's peer is a live QP at the GID it was
// connected to, connected back to it, and rkey and range are that NIC's;
// else it fails as a NIC does, closing the QP.
func (q *fakeQP) Write(_ context.Context, src []byte, remote uint64, rkey uint32) (transport.Report, error) {
	return q.move(src, remote, rkey, func(mem []byte) { copy(mem, src) })
}

// Read fills dst as Write lands src.
func (q *fakeQP) Read(ctx context.Context, dst []byte, remote uint64, rkey uint32) (transport.Report, error) {
	if m := q.v.readsMeet; m != nil {
		if err := m.wait(ctx); err != nil {
			return transport.Report{}, err
		}
	}
	return q.move(dst, remote, rkey, func(mem []byte) { copy(dst, mem) })
}

func (q *fakeQP) move(buf []byte, remote uint64, rkey uint32, do func(mem []byte)) (transport.Report, error) {
	f := q.v.f
	f.mu.Lock()
	defer f.mu.Unlock()
	if q.closed {
		return transport.Report{}, errors.New("lane closed")
	}
	p := f.qps[q.dqpn]
	if p == nil || p.v.gid() != q.dgid || p.dqpn != q.num {
		q.close()
		return transport.Report{}, errors.New("RETRY_EXC_ERR: no queue pair answers")
	}
	m := p.v
	off := remote - m.base()
	if rkey != m.rkey() || remote < m.base() || off > uint64(len(m.mem)) || uint64(len(buf)) > uint64(len(m.mem))-off {
		q.close()
		return transport.Report{}, errors.New("REM_ACCESS_ERR")
	}
	do(m.mem[off : off+uint64(len(buf))])
	return transport.Report{Registration: transport.RegisteredShared}, nil
}

func (q *fakeQP) Closed() bool {
	q.v.f.mu.Lock()
	defer q.v.f.mu.Unlock()
	return q.closed
}

func (q *fakeQP) Close() error {
	q.v.f.mu.Lock()
	defer q.v.f.mu.Unlock()
	q.close()
	return nil
}

// close closes q; the fabric's lock is held.
func (q *fakeQP) close() {
	if !q.closed {
		q.closed = true
		delete(q.v.f.qps, q.num)
		q.v.open--
	}
}

// segment is a Mooncake RDMA segment on a fake NIC: its endpoint table,
// and a handshake port that answers metadata and connection requests.
type segment struct {
	eps  *Endpoints[*fakeQP]
	v    *fakeVerbs
	name string
	qps  int // QPs offered when it dials (0: Mooncake's default)
	// mayFetch is the segments it may fetch an initiator's descriptor
	// from (nil: none), as a daemon's are those it sent to.
	mayFetch func(segment string) bool
}

func startSegment(t *testing.T, f *fabric, id byte, cfg EndpointConfig) *segment {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	v := f.nic(id)
	s := &segment{eps: NewEndpoints(v, cfg), v: v, name: ln.Addr().String()}
	srv := Serve(ln, Handlers{
		Segment: s.segment,
		Connect: func(ctx context.Context, from net.Addr, req HandshakeDesc) (HandshakeDesc, func()) {
			return s.eps.Accept(ctx, Handshake{Self: s.name, From: from, MayFetch: s.mayFetch}, req)
		},
	}, ServerConfig{Logf: t.Logf})
	t.Cleanup(func() {
		srv.Close()
		s.eps.Close()
		if n := v.openQPs(); n != 0 {
			t.Errorf("%d queue pairs of %s still open after Close", n, s.name)
		}
	})
	return s
}

func (s *segment) device() Device {
	d, err := s.eps.Device()
	if err != nil {
		panic(err)
	}
	return d
}

func (s *segment) nicPath() string { return NICPath(s.name, s.device().Name) }

func (s *segment) segment() *Segment {
	d := s.device()
	rk, lk, _ := s.eps.Keys()
	return &Segment{Name: s.name, Protocol: "rdma", Devices: []Device{d},
		Buffers:        []Buffer{{Name: "cpu:0", Addr: s.v.base(), Length: uint64(len(s.v.mem)), RKey: []uint32{rk}, LKey: []uint32{lk}}},
		PriorityMatrix: Priority{"cpu:0": {{d.Name}, {}}}}
}

func ctxFor(t *testing.T, d time.Duration) context.Context {
	ctx, cancel := context.WithTimeout(t.Context(), d)
	t.Cleanup(cancel)
	return ctx
}

// write writes data at off in dst's buffer, as a ferry session does: the
// target from dst's descriptor, fetched over its handshake port.
func (s *segment) write(t *testing.T, dst *segment, off int, data []byte) error {
	t.Helper()
	ctx := ctxFor(t, 30*time.Second)
	seg, err := FetchSegment(ctx, dst.name, &Segment{Name: s.name, Buffers: []Buffer{}})
	if err != nil {
		t.Fatal(err)
	}
	addr := seg.Buffers[0].Addr + uint64(off)
	tg, ok, err := seg.RDMATarget(addr, uint64(len(data)))
	if !ok || err != nil {
		t.Fatalf("target of %d bytes at %#x: %v %v", len(data), addr, ok, err)
	}
	_, err = s.eps.WriteRDMA(ctx, RDMAWrite{Self: s.name, RPC: dst.name, Target: tg, Remote: addr, Src: data, QPs: s.qps})
	return err
}

func (s *segment) endpoint(peer string) *endpoint[*fakeQP] {
	s.eps.mu.Lock()
	defer s.eps.mu.Unlock()
	return s.eps.eps[peer]
}

// TestEndpointsTakeTheMTUCap: Mooncake exchanges no MTU, so the QPs of
// an endpoint are connected with the cap the operator configured (the
// peers' MC_MTU), whichever side dialed; the default is Mooncake's 4096.
func TestEndpointsTakeTheMTUCap(t *testing.T) {
	f := newFabric()
	ferry := startSegment(t, f, 1, EndpointConfig{MTU: 1024})
	out, in := startSegment(t, f, 2, EndpointConfig{}), startSegment(t, f, 3, EndpointConfig{})
	if err := ferry.write(t, out, 0, []byte("to a segment ferry dialed")); err != nil {
		t.Fatal(err)
	}
	if err := in.write(t, ferry, 0, []byte("from a segment that dialed ferry")); err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		side *segment
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
		f.mu.Lock()
		for _, q := range ep.qps {
			if q.mtu != c.want {
				t.Errorf("a QP to %s was connected with an MTU cap of %d bytes, want %d", c.peer, q.mtu, c.want)
			}
		}
		f.mu.Unlock()
	}
}

// TestEndpointQPs: a segment ferry dials gets the QPs ferry is set to
// offer (the peers' MC_NUM_QP_PER_EP), and one that dials ferry gets as
// many as it offers.
func TestEndpointQPs(t *testing.T) {
	f := newFabric()
	ferry, out, in := startSegment(t, f, 1, EndpointConfig{}), startSegment(t, f, 2, EndpointConfig{}), startSegment(t, f, 3, EndpointConfig{})
	ferry.qps, in.qps = 3, 5
	if err := ferry.write(t, out, 0, []byte("three QPs")); err != nil {
		t.Fatal(err)
	}
	if err := in.write(t, ferry, 0, []byte("five QPs")); err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		a, b *segment
		want int
	}{{ferry, out, 3}, {out, ferry, 3}, {ferry, in, 5}, {in, ferry, 5}} {
		if ep := c.a.endpoint(c.b.nicPath()); ep == nil || len(ep.qps) != c.want {
			t.Errorf("%s's endpoint to %s: %v, want %d QPs", c.a.name, c.b.name, ep, c.want)
		}
	}
}

// TestEndpointHijack: a handshake claiming another segment's NIC path
// installs an endpoint under that path, connected to the claimant's GID.
// ferry's next write to the real segment must not use it: it handshakes
// afresh with the segment and the bytes land there.
func TestEndpointHijack(t *testing.T) {
	f := newFabric()
	ferry, victim, attacker := startSegment(t, f, 1, EndpointConfig{}), startSegment(t, f, 2, EndpointConfig{}), startSegment(t, f, 3, EndpointConfig{})
	ctx := ctxFor(t, 30*time.Second)
	qps, err := attacker.eps.newQPs(2)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { closeQPs(qps) })
	r, err := ConnectQPs(ctx, ferry.name, HandshakeDesc{
		LocalNICPath: victim.nicPath(), PeerNICPath: ferry.nicPath(), QPNum: qpNums(qps), LocalGID: attacker.device().GID,
	})
	if err != nil {
		t.Fatalf("the claimed handshake: %v", err)
	}
	if _, err := attacker.eps.connect(ferry.nicPath(), "", qps, ferry.v.gid(), 0, r.QPNum); err != nil {
		t.Fatal(err)
	}
	hijacked := ferry.endpoint(victim.nicPath())
	if hijacked == nil || hijacked.gid != attacker.v.gid() {
		t.Fatalf("the claimed endpoint is not in the table under %s with the claimant's GID", victim.nicPath())
	}

	data := bytes.Repeat([]byte("ferry→victim "), 300)
	if err := ferry.write(t, victim, 512, data); err != nil {
		t.Fatalf("the write to the victim: %v", err)
	}
	if !bytes.Equal(victim.v.mem[512:512+len(data)], data) {
		t.Fatal("the victim's buffer does not hold the bytes written to it")
	}
	ep := ferry.endpoint(victim.nicPath())
	if ep == nil || ep == hijacked || ep.gid != victim.v.gid() {
		t.Fatal("ferry's endpoint to the victim is not a fresh one connected to the victim's GID")
	}
	if !hijacked.isClosed() {
		t.Error("the claimed endpoint was not closed when the real one replaced it")
	}
	// The endpoint is reused while its GID matches.
	if err := ferry.write(t, victim, 0, data[:100]); err != nil || ferry.endpoint(victim.nicPath()) != ep {
		t.Fatalf("a second write did not reuse the endpoint: %v", err)
	}
}

// TestEndpointNotReplacedByStrangers: a handshake naming the NIC path of
// an endpoint another address set up, or of one ferry dialed, is refused
// (whatever GID it gives), and that endpoint stays open and carries
// writes; the address that set it up (an initiator that restarted, the
// dialed segment's own host) replaces it, at its per-address cap too.
func TestEndpointNotReplacedByStrangers(t *testing.T) {
	f := newFabric()
	ferry := startSegment(t, f, 1, EndpointConfig{Limits: connlimit.Limits{PerSource: 1}})
	out := startSegment(t, f, 2, EndpointConfig{})
	ctx := ctxFor(t, 30*time.Second)
	accept := func(from, path string, gid [16]byte) HandshakeDesc {
		t.Helper()
		req := HandshakeDesc{LocalNICPath: path, PeerNICPath: ferry.nicPath(), QPNum: []uint32{1}, LocalGID: FormatGID(gid)}
		r, _ := ferry.eps.Accept(ctx, Handshake{Self: ferry.name, From: &net.TCPAddr{IP: net.ParseIP(from), Port: 40000}}, req)
		return r
	}
	stranger := f.nic(9).gid()

	victim := "10.0.0.1:15000@mlx5_0"
	if r := accept("10.0.0.1", victim, out.v.gid()); r.ReplyMsg != "" {
		t.Fatal(r.ReplyMsg)
	}
	ep := ferry.endpoint(victim)
	for _, gid := range [][16]byte{stranger, out.v.gid()} {
		if r := accept("10.0.0.66", victim, gid); !strings.Contains(r.ReplyMsg, "was set up from another address") {
			t.Fatalf("a stranger naming another's NIC path: reply_msg %q, want a refusal saying why", r.ReplyMsg)
		}
	}
	if ferry.endpoint(victim) != ep || ep.isClosed() {
		t.Fatal("a stranger's handshake took the victim's endpoint down")
	}
	if r := accept("10.0.0.1", victim, out.v.gid()); r.ReplyMsg != "" {
		t.Fatalf("the victim's own handshake again, at its address's cap: %s", r.ReplyMsg)
	}
	if ferry.endpoint(victim) == ep || !ep.isClosed() {
		t.Fatal("the victim's second handshake did not replace its endpoint")
	}

	data := []byte("over ferry's own endpoint")
	if err := ferry.write(t, out, 0, data); err != nil {
		t.Fatal(err)
	}
	dialed := ferry.endpoint(out.nicPath())
	if r := accept("10.0.0.66", out.nicPath(), stranger); !strings.Contains(r.ReplyMsg, "was set up from another address") {
		t.Fatalf("a stranger naming a NIC path ferry dialed: reply_msg %q, want a refusal", r.ReplyMsg)
	}
	if err := ferry.write(t, out, 64, data); err != nil || ferry.endpoint(out.nicPath()) != dialed {
		t.Fatalf("ferry's write after a stranger named its endpoint's NIC path: %v, want it over the same endpoint", err)
	}
	// out's host (loopback here) connecting back, as a restarted segment.
	if r := accept("127.0.0.1", out.nicPath(), out.v.gid()); r.ReplyMsg != "" {
		t.Fatalf("the dialed segment's own host: %s", r.ReplyMsg)
	}
	if !dialed.isClosed() {
		t.Fatal("the dialed segment's own handshake did not replace ferry's endpoint")
	}
}

// TestEndpointEviction: a full table evicts an endpoint (its QPs closed,
// an INFO line saying so) instead of refusing new initiators, one nobody
// has written through before one ferry wrote through; the evicted
// initiator's next write fails and the one after handshakes afresh.
func TestEndpointEviction(t *testing.T) {
	f := newFabric()
	var info transporttest.Logs
	ferry := startSegment(t, f, 1, EndpointConfig{Infof: info.Logf, Limits: connlimit.Limits{Total: 2}})
	a, b, c := startSegment(t, f, 2, EndpointConfig{}), startSegment(t, f, 3, EndpointConfig{}), startSegment(t, f, 4, EndpointConfig{})
	data := []byte("into ferry")
	for _, s := range []*segment{a, b} {
		if err := s.write(t, ferry, 0, data); err != nil {
			t.Fatal(err)
		}
	}
	// ferry writes back to a over a's endpoint: b's is the one nobody
	// proved legitimate.
	if err := ferry.write(t, a, 0, data); err != nil {
		t.Fatal(err)
	}
	open := ferry.v.openQPs()
	if err := c.write(t, ferry, 0, data); err != nil {
		t.Fatalf("a third initiator into a full table: %v", err)
	}
	info.Wait(t, "2 Mooncake endpoints", "closed the one to", b.name, c.name)
	if ferry.endpoint(b.nicPath()) != nil || ferry.endpoint(a.nicPath()) == nil || ferry.endpoint(c.nicPath()) == nil {
		t.Fatal("the table does not hold a's and c's endpoints only")
	}
	if got := ferry.v.openQPs(); got != open {
		t.Errorf("%d QPs open on ferry's NIC after the eviction, want %d as before (b's 2 closed, c's 2 opened)", got, open)
	}
	if err := b.write(t, ferry, 0, data); err == nil {
		t.Fatal("b wrote over QPs ferry closed")
	}
	if err := b.write(t, ferry, 0, data); err != nil {
		t.Fatalf("b's write after a fresh handshake: %v", err)
	}
}

// TestAcceptLimitsAndUndo: an initiator offering more QPs than an
// endpoint may have is refused by a reply_msg naming the limit; undo
// takes an accepted endpoint back (its reply never went out).
func TestAcceptLimitsAndUndo(t *testing.T) {
	f := newFabric()
	ferry, peer := startSegment(t, f, 1, EndpointConfig{}), startSegment(t, f, 2, EndpointConfig{})
	ctx := ctxFor(t, 30*time.Second)
	req := HandshakeDesc{LocalNICPath: peer.nicPath(), PeerNICPath: ferry.nicPath(), LocalGID: peer.device().GID}
	req.QPNum = make([]uint32, MaxQPs+1)
	_, err := ConnectQPs(ctx, ferry.name, req)
	if err == nil || !strings.Contains(err.Error(), "17 QP numbers offered: want 1 to 16") || !strings.Contains(err.Error(), "MC_NUM_QP_PER_EP") {
		t.Fatalf("17 QPs: %v, want a refusal naming the limit", err)
	}
	open := ferry.v.openQPs()
	req.QPNum = []uint32{1, 2}
	reply, undo := ferry.eps.Accept(ctx, Handshake{Self: ferry.name, From: &net.TCPAddr{IP: net.IPv4(10, 0, 0, 9)}}, req)
	if reply.ReplyMsg != "" || undo == nil || ferry.endpoint(peer.nicPath()) == nil {
		t.Fatalf("accepting 2 QPs: %+v", reply)
	}
	undo()
	if ferry.endpoint(peer.nicPath()) != nil || ferry.v.openQPs() != open {
		t.Fatal("undo left the endpoint or its QPs behind")
	}
}

// TestHandshakeUnreachablePeer: a handshake to a segment that accepts
// and never answers holds up only the writes to that NIC path: a write to
// a healthy segment handshakes meanwhile, a second write to the silent
// one waits for the first's handshake instead of dialing again and
// returns as soon as its context ends, and so does the first.
func TestHandshakeUnreachablePeer(t *testing.T) {
	f := newFabric()
	// The silent handshake ends by its context or, at the latest, after
	// HandshakeTimeout (5 s): the checks below are orderings within that
	// window.
	ferry := startSegment(t, f, 1, EndpointConfig{})
	healthy := startSegment(t, f, 2, EndpointConfig{})

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
	seg, err := FetchSegment(ctx, healthy.name, &Segment{Name: ferry.name, Buffers: []Buffer{}})
	if err != nil {
		t.Fatal(err)
	}
	tg, _, err := seg.RDMATarget(seg.Buffers[0].Addr, 64)
	if err != nil {
		t.Fatal(err)
	}
	tg.NICPath = NICPath(silent.Addr().String(), tg.Device.Name)
	toSilent := RDMAWrite{Self: ferry.name, RPC: silent.Addr().String(), Target: tg, Remote: tg.Buffer.Addr, Src: make([]byte, 64)}

	firstCtx, cancelFirst := context.WithCancel(ctx)
	defer cancelFirst()
	first := make(chan error, 1)
	go func() {
		_, err := ferry.eps.WriteRDMA(firstCtx, toSilent)
		first <- err
	}()
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
	if string(healthy.v.mem[:19]) != "past the silent one" {
		t.Fatal("the healthy segment does not hold the bytes written to it")
	}

	canceled, cancel := context.WithCancel(ctx)
	cancel()
	if _, err := ferry.eps.WriteRDMA(canceled, toSilent); !errors.Is(err, context.Canceled) || !strings.Contains(err.Error(), "waiting for the handshake") {
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

// TestEvictionNotDrivenByStrangers: handshakes from strangers into a full
// endpoint table (as many as they like, from one address or many) take
// each other's places, never those of endpoints ferry dialed or whose
// address proved itself (a notify that completed a receive slot); one
// address gets no more than its cap, its newcomers taking its own
// unproven endpoints' places.
func TestEvictionNotDrivenByStrangers(t *testing.T) {
	f := newFabric()
	var info transporttest.Logs
	ferry := startSegment(t, f, 1, EndpointConfig{Infof: info.Logf, Limits: connlimit.Limits{Total: 4, PerSource: 2}})
	out := startSegment(t, f, 2, EndpointConfig{})
	if err := ferry.write(t, out, 0, []byte("ferry dials out")); err != nil {
		t.Fatal(err)
	}
	ctx := ctxFor(t, 30*time.Second)
	gid := out.device().GID
	accept := func(from string, path string) HandshakeDesc {
		t.Helper()
		req := HandshakeDesc{LocalNICPath: path, PeerNICPath: ferry.nicPath(), QPNum: []uint32{1}, LocalGID: gid}
		r, _ := ferry.eps.Accept(ctx, Handshake{Self: ferry.name, From: &net.TCPAddr{IP: net.ParseIP(from), Port: 40000}}, req)
		return r
	}
	legit := "10.0.0.1:15000@mlx5_0"
	if r := accept("10.0.0.1", legit); r.ReplyMsg != "" {
		t.Fatal(r.ReplyMsg)
	}
	ferry.eps.Proven(&net.TCPAddr{IP: net.ParseIP("10.0.0.1")})
	// One stranger address: two endpoints, each newcomer in the place of
	// its oldest.
	for i := range 4 {
		if r := accept("10.0.0.9", fmt.Sprintf("10.0.0.9:%d@x", i)); r.ReplyMsg != "" {
			t.Fatalf("stranger handshake %d from one address: %s", i, r.ReplyMsg)
		}
	}
	for i := range 4 {
		if kept := ferry.endpoint(fmt.Sprintf("10.0.0.9:%d@x", i)) != nil; kept != (i >= 2) {
			t.Fatalf("stranger endpoint %d of 4 from one address capped at 2: kept %t", i, kept)
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
	st := ferry.eps.Stats()
	if st.Open != 4 || st.Evicted != 52 || st.RefusedPerSource != 0 {
		t.Fatalf("endpoint stats %+v: want 4 open, 52 evicted, none refused", st)
	}
	info.Wait(t, "rdma: suppressed", "more lines like the above")
}

// TestDialBackOnlyWhereSent: a handshake without local_gid makes ferry
// fetch the initiator's descriptor only from a segment it may (one it
// has sent to); any other gets a reply_msg saying why, and ferry dials
// nothing.
func TestDialBackOnlyWhereSent(t *testing.T) {
	f := newFabric()
	ferry, in := startSegment(t, f, 1, EndpointConfig{}), startSegment(t, f, 2, EndpointConfig{})
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
	req := func(seg string) HandshakeDesc {
		return HandshakeDesc{LocalNICPath: NICPath(seg, in.device().Name), PeerNICPath: ferry.nicPath(), QPNum: []uint32{1, 2}}
	}
	_, err = ConnectQPs(ctx, ferry.name, req(named.Addr().String()))
	if err == nil || !strings.Contains(err.Error(), "fetches an initiator's descriptor only from a Mooncake segment it has sent to") {
		t.Fatalf("a handshake without local_gid naming a segment ferry never sent to: %v, want a refusal saying why", err)
	}
	select {
	case <-dialed:
		t.Fatal("ferry dialed the segment a stranger named")
	default:
	}
	ferry.mayFetch = func(seg string) bool { return seg == in.name }
	if _, err := ConnectQPs(ctx, ferry.name, req(in.name)); err != nil {
		t.Fatalf("a handshake without local_gid from a segment ferry sent to: %v", err)
	}
}

// TestSessionReadsAnRDMASegment: a session reads an rdma segment's buffer
// by RDMA READs on the endpoint its writes took (no second handshake),
// each piece byte-exact; a piece outside the buffers is refused naming
// it and the segment before anything is read; a read the NIC fails (an
// rkey it does not know) drops the endpoint, and the next read fetches
// the descriptor again and handshakes afresh.
func TestSessionReadsAnRDMASegment(t *testing.T) {
	ctx := ctxFor(t, 30*time.Second)
	ferry, peer, s := readingSession(t, ctx)
	var err error
	data := bytes.Repeat([]byte("mooncake segment "), 3000)
	base := peer.v.base()
	if _, err := s.Write(ctx, transport.Write{Src: data, Remote: base + 7}); err != nil {
		t.Fatal(err)
	}
	ep := ferry.endpoint(peer.nicPath())
	dst := make([]byte, 40000)
	if err := s.Read(ctx, []transport.Read{{Addr: base + 1007, Dst: dst[:30000]}, {Addr: base + 7, Dst: dst[30000:]}}); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(dst[:30000], data[1000:31000]) || !bytes.Equal(dst[30000:], data[:10000]) {
		t.Fatal("the pieces read hold other bytes than the segment's buffer")
	}
	if got := ferry.endpoint(peer.nicPath()); got != ep {
		t.Fatal("the reads did not go over the endpoint the write connected")
	}

	clear(dst)
	err = s.Read(ctx, []transport.Read{{Addr: base, Dst: dst[:8]}, {Addr: base + 1<<16 - 4, Dst: dst[8:16]}})
	var rf *transport.Refusal
	if !errors.As(err, &rf) || rf.Code != transport.OutOfBounds {
		t.Fatalf("a piece past the buffer: %v, want an out_of_bounds refusal", err)
	}
	for _, want := range []string{"piece 1", "lies in none of the buffers", peer.name} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("the refusal does not say %q: %v", want, err)
		}
	}
	if !bytes.Equal(dst[:8], make([]byte, 8)) {
		t.Error("piece 0 was read though piece 1 was refused")
	}

	// The NIC refuses a READ under an rkey it does not know.
	s.mu.Lock()
	s.seg.Buffers[0].RKey = []uint32{peer.v.rkey() + 1}
	s.mu.Unlock()
	err = s.Read(ctx, []transport.Read{{Addr: base + 7, Dst: dst[:64]}})
	if err == nil || !strings.Contains(err.Error(), "REM_ACCESS_ERR") || !strings.Contains(err.Error(), "rdma read of 64 bytes") {
		t.Fatalf("a READ under a wrong rkey: %v, want the NIC's REM_ACCESS_ERR", err)
	}
	if ferry.endpoint(peer.nicPath()) != nil {
		t.Fatal("the failed read left its endpoint in the table")
	}
	if err := s.Read(ctx, []transport.Read{{Addr: base + 7, Dst: dst[:64]}}); err != nil || !bytes.Equal(dst[:64], data[:64]) {
		t.Fatalf("the read after a failed one: %v, want the bytes (the descriptor fetched again, a new endpoint)", err)
	}
	if got := ferry.endpoint(peer.nicPath()); got == nil || got == ep {
		t.Fatal("the read after a failed one took no new endpoint")
	}
}

// readingSession is a session of segment ferry's to segment peer, each on
// a fake NIC of one fabric, as a daemon's reads take it; closed when the
// test ends.
func readingSession(t *testing.T, ctx context.Context) (ferry, peer *segment, s *Session) {
	return readingSessionOver(t, ctx, 0)
}

// readingSessionOver is readingSession with qps queue pairs per
// endpoint (0: DefaultQPs).
func readingSessionOver(t *testing.T, ctx context.Context, qps int) (ferry, peer *segment, s *Session) {
	t.Helper()
	f := newFabric()
	ferry, peer = startSegment(t, f, 1, EndpointConfig{}), startSegment(t, f, 2, EndpointConfig{})
	d := &Dialer{Self: &Segment{Name: ferry.name, Protocol: "rdma", Buffers: []Buffer{}}, RDMA: ferry.eps, QPs: qps}
	ts, err := d.Dial(ctx, Scheme+peer.name)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ts.Close() })
	return ferry, peer, ts.(*Session)
}

// TestSessionReadsPiecesSideBySide: a read's pieces go on the endpoint's
// queue pairs at once (the fake NIC lets no READ through until two are in
// flight, so one at a time would time out), each byte-exact; a piece the
// NIC fails among many ends the read with that failure, and the read
// returns with no piece left running.
func TestSessionReadsPiecesSideBySide(t *testing.T) {
	ctx := ctxFor(t, 30*time.Second)
	ferry, peer, s := readingSession(t, ctx)
	var err error
	data := make([]byte, 1<<16)
	for i := range data {
		data[i] = byte(i*7 + i>>8) // differs from page to page
	}
	base := peer.v.base()
	if _, err := s.Write(ctx, transport.Write{Src: data, Remote: base}); err != nil {
		t.Fatal(err)
	}
	const pieces, page = 16, 4096
	dst := make([]byte, pieces*page)
	reads := make([]transport.Read, pieces)
	for i := range reads { // page i of dst from page pieces-1-i of the buffer
		reads[i] = transport.Read{Addr: base + uint64((pieces-1-i)*page), Dst: dst[i*page : (i+1)*page]}
	}
	ferry.v.readsMeet = newMeeting(DefaultQPs)
	rctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	if err := s.Read(rctx, reads); err != nil {
		t.Fatalf("reading %d pieces: %v (one at a time meets no other read)", pieces, err)
	}
	for i := range pieces {
		if !bytes.Equal(dst[i*page:(i+1)*page], data[(pieces-1-i)*page:(pieces-i)*page]) {
			t.Fatalf("piece %d holds other bytes than the segment's buffer", i)
		}
	}

	ferry.v.readsMeet = nil
	s.mu.Lock()
	s.seg.Buffers[0].RKey = []uint32{peer.v.rkey() + 1}
	s.mu.Unlock()
	err = s.Read(ctx, reads)
	if err == nil || !strings.Contains(err.Error(), "REM_ACCESS_ERR") {
		t.Fatalf("%d pieces under a wrong rkey: %v, want the NIC's REM_ACCESS_ERR", pieces, err)
	}
	if ferry.endpoint(peer.nicPath()) != nil {
		t.Fatal("the failed read left its endpoint in the table")
	}
}

// TestSessionReadsManyPiecesPerQP: with one queue pair per endpoint, a
// read's pieces still go side by side, several calls on the one QP at
// once (the fake NIC lets no READ through until 8 are in flight, so one
// piece per QP would time out), each byte-exact.
func TestSessionReadsManyPiecesPerQP(t *testing.T) {
	ctx := ctxFor(t, 30*time.Second)
	ferry, peer, s := readingSessionOver(t, ctx, 1)
	data := make([]byte, 1<<16)
	for i := range data {
		data[i] = byte(i*5 + i>>8)
	}
	base := peer.v.base()
	if _, err := s.Write(ctx, transport.Write{Src: data, Remote: base}); err != nil {
		t.Fatal(err)
	}
	if n := len(ferry.endpoint(peer.nicPath()).qps); n != 1 {
		t.Fatalf("the endpoint has %d QPs, want 1", n)
	}
	const pieces, page = 64, 1024
	dst := make([]byte, pieces*page)
	reads := make([]transport.Read, pieces)
	for i := range reads {
		reads[i] = transport.Read{Addr: base + uint64((pieces-1-i)*page), Dst: dst[i*page : (i+1)*page]}
	}
	ferry.v.readsMeet = newMeeting(8)
	rctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	if err := s.Read(rctx, reads); err != nil {
		t.Fatalf("reading %d pieces over one QP: %v (one piece at a time meets no other)", pieces, err)
	}
	for i := range pieces {
		if !bytes.Equal(dst[i*page:(i+1)*page], data[(pieces-1-i)*page:(pieces-i)*page]) {
			t.Fatalf("piece %d holds other bytes than the segment's buffer", i)
		}
	}
}

// TestEndpointPicksTheLeastLoadedQP: a call takes the QP with the fewest
// bytes of calls on it, so pages go beside a long write, not behind it.
func TestEndpointPicksTheLeastLoadedQP(t *testing.T) {
	ep := &endpoint[*fakeQP]{qps: make([]*fakeQP, 3), load: make([]int, 3)}
	for _, c := range []struct{ n, want int }{{1 << 30, 0}, {16 << 10, 1}, {16 << 10, 2}, {16 << 10, 1}, {16 << 10, 2}} {
		if got := ep.pick(c.n); got != c.want {
			t.Fatalf("a call of %d bytes took QP %d (loads %v after it), want %d", c.n, got, ep.load, c.want)
		}
	}
	ep.done(0, 1<<30)
	if got := ep.pick(16 << 10); got != 0 {
		t.Fatalf("after the long write ended a call took QP %d (loads %v), want 0", got, ep.load)
	}
}
