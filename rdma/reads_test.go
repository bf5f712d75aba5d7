package rdma

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ferry-project/ferry/transport"
	"github.com/ferry-project/ferry/transport/peer"
	"github.com/ferry-project/ferry/transport/transporttest"
)

// engineSink serves reads of one engine region under key, as the
// daemon serves an engine segment's memory: GrantRead grants its
// registration for peers at the engine's addresses, counting the pins
// it holds; memory past it is out of bounds, another key no_slot. With
// noGrant it grants nothing (memory without a registration for peers),
// and ReadKeyed serves the bytes over TCP.
type engineSink struct {
	*transporttest.Slots
	key     transport.Key
	mem     []byte
	er      *EngineRegion
	noGrant bool
	pins    atomic.Int32
}

func (s *engineSink) check(addr, n uint64, key transport.Key) error {
	switch {
	case key != s.key:
		return &transport.Refusal{Code: transport.NoSlot, Message: "no engine segment has this key"}
	case addr < engineAddr || addr-engineAddr > uint64(len(s.mem)) || n > uint64(len(s.mem))-(addr-engineAddr):
		return &transport.Refusal{Code: transport.OutOfBounds, Message: fmt.Sprintf("[%#x, +%d) does not fit the memory registered", addr, n)}
	}
	return nil
}

func (s *engineSink) ReadKeyed(addr, n uint64, key transport.Key) ([]byte, func(), error) {
	if err := s.check(addr, n, key); err != nil {
		return nil, nil, err
	}
	off := addr - engineAddr
	return s.mem[off : off+n], func() {}, nil
}

func (s *engineSink) GrantRead(addr, n uint64, key transport.Key) (uint64, uint32, func(), error) {
	if err := s.check(addr, n, key); err != nil {
		return 0, 0, nil, err
	}
	if s.noGrant {
		return 0, 0, nil, ErrNoGrant
	}
	s.pins.Add(1)
	return addr, s.er.RKey, func() { s.pins.Add(-1) }, nil
}

// TestEngineRegionFerryReads: a daemon reads a peer's engine region by
// RDMA READ, granted per read at the engine's addresses under the
// region's registration for peers: byte for byte, into its registered
// memory with no CPU copy, into other memory through its bounce ring;
// the peer keeps the region pinned until the reader is done. A range
// past the region or under another key is refused before any READ, and
// memory without a registration for peers is read over TCP.
func TestEngineRegionFerryReads(t *testing.T) {
	f := newFabric()
	sink := &engineSink{Slots: transporttest.NewSlots(0), key: transport.NewKey(), mem: mapT(t, 3<<20)}
	rx, err := listen(testConfig(t, Config{Memory: mapT(t, 1<<16), Peer: peer.Config{Sink: sink}}), testNIC(t, f, 1))
	if err != nil {
		t.Fatal(err)
	}
	closeAtEnd(t, rx)
	fill(sink.mem, 11)
	if sink.er, err = rx.RegisterEngineRegion(sink.mem, engineAddr); err != nil {
		t.Fatal(err)
	}
	defer sink.er.Close()
	txMem := mapT(t, 4<<20)
	tx, err := listen(testConfig(t, Config{Memory: txMem}), testNIC(t, f, 2))
	if err != nil {
		t.Fatal(err)
	}
	closeAtEnd(t, tx)
	s := dialT(t, tx, rx).(transport.Reader)
	ctx := ctxFor(t, 60*time.Second)

	// Into the reader's registered memory, 2 MiB and 5 bytes from an odd
	// offset (three READs), and into memory of its own (bounced).
	const n = 2<<20 + 5
	heap := make([]byte, 4096)
	before := tx.Stats()
	if err := s.Read(ctx, []transport.Read{
		{Addr: engineAddr + 7, Key: sink.key, Dst: txMem[:n]},
		{Addr: engineAddr + uint64(len(sink.mem)) - 4096, Key: sink.key, Dst: heap},
	}); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(txMem[:n], sink.mem[7:7+n]) || !bytes.Equal(heap, sink.mem[len(sink.mem)-4096:]) {
		t.Fatal("the bytes read differ from the engine region's")
	}
	after := tx.Stats()
	if wrs, copied := after.WorkRequests-before.WorkRequests, after.CopiedBytes-before.CopiedBytes; wrs != 4 || copied != uint64(len(heap)) {
		t.Errorf("the reads took %d work requests and copied %d bytes: want 4 READs (3 of 1 MiB at most, then 1) and only the %d bounced bytes copied",
			wrs, copied, len(heap))
	}
	waitFor(t, "the region unpinned once the reader closed", func() bool { return sink.pins.Load() == 0 })

	for _, c := range []struct {
		name string
		r    transport.Read
		code transport.Code
	}{
		{"PastTheRegion", transport.Read{Addr: engineAddr + uint64(len(sink.mem)) - 8, Key: sink.key, Dst: make([]byte, 16)}, transport.OutOfBounds},
		{"OtherKey", transport.Read{Addr: engineAddr, Key: transport.NewKey(), Dst: make([]byte, 16)}, transport.NoSlot},
	} {
		var rf *transport.Refusal
		if err := s.Read(ctx, []transport.Read{c.r}); !errors.As(err, &rf) || rf.Code != c.code {
			t.Errorf("%s: %v, want a %s refusal", c.name, err, c.code)
		}
		if !isZero(c.r.Dst) {
			t.Errorf("%s: a refused read brought bytes", c.name)
		}
	}

	sink.noGrant = true
	clear(heap)
	before = tx.Stats()
	if err := s.Read(ctx, []transport.Read{{Addr: engineAddr + 64, Key: sink.key, Dst: heap}}); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(heap, sink.mem[64:64+len(heap)]) || tx.Stats().WorkRequests != before.WorkRequests {
		t.Error("memory with no registration for peers: want it read over TCP, byte for byte, with no READ posted")
	}
}

// tcpSource serves reads over TCP only: no GrantRead.
type tcpSource struct{ s *engineSink }

func (s tcpSource) ReadKeyed(addr, n uint64, key transport.Key) ([]byte, func(), error) {
	return s.s.ReadKeyed(addr, n, key)
}

// TestFerryReadsFromAPeerWithoutRDMAReads: a peer whose daemon grants
// no RDMA READs (its port answers "no RDMA here" to the control
// connection of reads) is read over a read connection, byte for byte.
func TestFerryReadsFromAPeerWithoutRDMAReads(t *testing.T) {
	f := newFabric()
	sink := &engineSink{Slots: transporttest.NewSlots(0), key: transport.NewKey(), mem: mapT(t, 1<<16)}
	fill(sink.mem, 12)
	rx, err := listen(testConfig(t, Config{Memory: mapT(t, 1<<16), Peer: peer.Config{Sink: struct {
		*transporttest.Slots
		tcpSource
	}{sink.Slots, tcpSource{sink}}}}), testNIC(t, f, 1))
	if err != nil {
		t.Fatal(err)
	}
	closeAtEnd(t, rx)
	tx, err := listen(testConfig(t, Config{Memory: mapT(t, 1<<16)}), testNIC(t, f, 2))
	if err != nil {
		t.Fatal(err)
	}
	closeAtEnd(t, tx)
	dst := make([]byte, 1000)
	if err := dialT(t, tx, rx).(transport.Reader).Read(ctxFor(t, 30*time.Second), []transport.Read{{Addr: engineAddr + 5, Key: sink.key, Dst: dst}}); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(dst, sink.mem[5:1005]) {
		t.Fatal("the bytes read differ from the peer's memory")
	}
}

// readRig is a serving transport with one engine region (sink's, bytes
// filled with seed) and a reading transport with a region of its own
// to READ into or WRITE from (own, over src): both on fabric f, or on
// the real port.
type readRig struct {
	sink   *engineSink
	rx, tx *Transport
	src    []byte
	own    *EngineRegion
	ctx    context.Context
}

// newReadRig: rx serves an engine region under cfg (its memory and
// sink filled in), tx reads it.
func newReadRig(t *testing.T, seed int, cfg Config) *readRig {
	f := newFabric()
	r := &readRig{sink: &engineSink{Slots: transporttest.NewSlots(0), key: transport.NewKey(), mem: mapT(t, 1<<16)}}
	cfg.Memory, cfg.Peer.Sink = mapT(t, 1<<16), r.sink
	var err error
	if r.rx, err = listen(testConfig(t, cfg), testNIC(t, f, 1)); err != nil {
		t.Fatal(err)
	}
	closeAtEnd(t, r.rx)
	fill(r.sink.mem, seed)
	if r.sink.er, err = r.rx.RegisterEngineRegion(r.sink.mem, engineAddr); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { r.sink.er.Close() })
	if r.tx, err = listen(testConfig(t, Config{Memory: mapT(t, 1<<16)}), testNIC(t, f, 2)); err != nil {
		t.Fatal(err)
	}
	closeAtEnd(t, r.tx)
	r.src = mapT(t, 4096)
	if r.own, err = r.tx.RegisterEngineRegion(r.src, addrOf(r.src)); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { r.own.Close() })
	r.ctx = ctxFor(t, 60*time.Second)
	return r
}

// open takes the first steps of session.Read by hand: a control
// connection of reads, the connect, and the reader's queue pair
// connected to the one the server answered with.
func (r *readRig) open(t *testing.T) (net.Conn, *MooncakeQP) {
	c, q, rep := r.connect(t)
	if rep.Code != transport.OK {
		t.Fatalf("the connect reply: %s %q", rep.Code, rep.Msg)
	}
	return c, q
}

// connect opens a control connection of reads and sends the connect:
// the server's reply, and once it is OK the reader's queue pair
// connected to the server's.
func (r *readRig) connect(t *testing.T) (net.Conn, *MooncakeQP, peer.Reply) {
	c, _, err := r.tx.port.Dial(r.ctx, r.rx.Addr().String(), peer.KindRDMARead)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	q, err := r.tx.newReadQP()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { q.Close() })
	e := r.tx.nic.Endpoint()
	e.QPN, e.PSN = q.QPN(), 0
	var b [endpointSize]byte
	e.encode(b[:])
	c.SetDeadline(time.Now().Add(30 * time.Second))
	if _, err := c.Write(b[:]); err != nil {
		t.Fatal(err)
	}
	rep, err := readReply(c, b[:])
	if err != nil {
		t.Fatalf("the connect reply: %v", err)
	}
	if rep.Code != transport.OK {
		return c, q, rep
	}
	var remote endpoint
	remote.decode(b[:])
	if err := q.l.qp.(mooncakeQP).connectMooncake(remote, 0); err != nil {
		t.Fatal(err)
	}
	return c, q, rep
}

// ask sends a read's header on c and returns the reply and its grant.
func (r *readRig) ask(t *testing.T, c net.Conn, key transport.Key) (peer.Reply, grant) {
	var hb [peer.HeaderSize]byte
	h := peer.Header{Addr: engineAddr, Len: 4096, Key: key}
	h.Encode(&hb)
	if _, err := c.Write(hb[:]); err != nil {
		t.Fatal(err)
	}
	var gb [grantSize]byte
	rep, err := readReply(c, gb[:])
	if err != nil {
		t.Fatal(err)
	}
	var g grant
	g.decode(&gb)
	return rep, g
}

// post posts one signaled READ (or WRITE) of the 4096 bytes at the
// engine's address under the engine region's rkey through q, and
// returns its completion's status. With unanswered set, the peer may
// never answer: rxe retries a request no QP takes for ever under
// Mooncake's retry count (7), where a NIC gives up within about a
// second (RETRY_EXC_ERR). So after 5 s without a completion (a READ
// that succeeds completes within milliseconds), q is broken and the
// READ flushed (WR_FLUSH_ERR).
func (r *readRig) post(t *testing.T, q *MooncakeQP, read, unanswered bool) wcStatus {
	l := q.l
	w := postRaw(t, q, op{Local: addrOf(r.src), Remote: engineAddr, Len: 4096, LKey: r.own.LKey, RKey: r.sink.er.RKey, Read: read, Signaled: true})
	var wc completion
	var err error
	if unanswered {
		if wc, err = l.completion(w, time.Now().Add(5*time.Second), nil); err == errNoProgress {
			l.qp.Break()
			wc, err = l.completion(w, time.Now().Add(30*time.Second), nil)
		}
	} else {
		wc, err = l.completion(w, time.Now().Add(30*time.Second), nil)
	}
	if err != nil {
		t.Fatalf("waiting for the completion: %v", err)
	}
	return wc.Status
}

// TestReadConnectionsTakeNoWrites: the queue pair a read connection
// gets answers RDMA READs only. A peer that holds a key (so the queue
// pair is up) and WRITEs through it, under an rkey that takes peers'
// writes (an engine region's), is refused by the responder
// (REM_INV_REQ_ERR), and the memory stays as it was.
func TestReadConnectionsTakeNoWrites(t *testing.T) {
	r := newReadRig(t, 13, Config{})
	want := bytes.Clone(r.sink.mem)
	fill(r.src, 99)
	c, q := r.open(t)
	if rep, _ := r.ask(t, c, r.sink.key); rep.Code != transport.OK {
		t.Fatalf("a read under the segment's key: %s %q, want a grant", rep.Code, rep.Msg)
	}
	if st := r.post(t, q, false, false); st != wcRemInvReqErr && st != wcRemAccessErr {
		t.Fatalf("a WRITE through a read connection's queue pair: completion %s, want REM_INV_REQ_ERR", st.String())
	}
	if !bytes.Equal(r.sink.mem, want) {
		t.Fatal("a WRITE through a read connection's queue pair changed the engine's memory")
	}
}

// TestReadConnectionsReadNothingWithoutAKey: a stranger that opens a
// read connection (no key needed for that), connects its queue pair to
// the one the server answered with and READs an engine region under
// the region's rkey, without a key (first none, then a wrong one:
// no_slot) READs nothing: the server's queue pair is not up, the READ
// is never answered (RETRY_EXC_ERR, or on rxe flushed) and nothing
// lands. The holder of
// the segment's key then READs the region on a connection of its own.
func TestReadConnectionsReadNothingWithoutAKey(t *testing.T) {
	r := newReadRig(t, 14, Config{})
	c, q := r.open(t)
	if st := r.post(t, q, true, true); st == wcSuccess || !isZero(r.src) {
		t.Fatalf("a READ before any key: completion %s, want the READ refused and nothing read", st.String())
	}
	c2, q2 := r.open(t)
	if rep, _ := r.ask(t, c2, transport.NewKey()); rep.Code != transport.NoSlot {
		t.Fatalf("a read under a wrong key: %s %q, want no_slot", rep.Code, rep.Msg)
	}
	if st := r.post(t, q2, true, true); st == wcSuccess || !isZero(r.src) {
		t.Fatalf("a READ after a wrong key: completion %s, want the READ refused and nothing read", st.String())
	}
	c.Close()
	c3, q3 := r.open(t)
	rep, g := r.ask(t, c3, r.sink.key)
	if rep.Code != transport.OK || g.Addr != engineAddr || g.RKey != r.sink.er.RKey {
		t.Fatalf("a read under the segment's key: %s %q, grant %+v: want a grant of the region", rep.Code, rep.Msg, g)
	}
	if st := r.post(t, q3, true, false); st != wcSuccess || !bytes.Equal(r.src, r.sink.mem[:4096]) {
		t.Fatalf("a granted READ: completion %s, want the region's bytes", st.String())
	}
}

// TestReadGrantHeldPastItsDeadline: a reader that holds a grant without
// sending its next header past the answer's deadline (peer.AnswerTimeout,
// here a second and a little) loses the connection and the region's pin:
// it cannot keep an engine's memory pinned for the idle timeout.
func TestReadGrantHeldPastItsDeadline(t *testing.T) {
	r := newReadRig(t, 16, Config{Peer: peer.Config{IOTimeout: time.Second, IdleTimeout: time.Hour}})
	c, _ := r.open(t)
	if rep, _ := r.ask(t, c, r.sink.key); rep.Code != transport.OK {
		t.Fatalf("a read under the segment's key: %s %q, want a grant", rep.Code, rep.Msg)
	}
	if n := r.sink.pins.Load(); n != 1 {
		t.Fatalf("%d pins after the grant, want its 1", n)
	}
	waitFor(t, "the pin of a grant held past its deadline given back", func() bool { return r.sink.pins.Load() == 0 })
	c.SetReadDeadline(time.Now().Add(30 * time.Second))
	if _, err := c.Read(make([]byte, 1)); err == nil || errors.Is(err, os.ErrDeadlineExceeded) {
		t.Fatalf("the connection after its grant's deadline: %v, want it closed by the server", err)
	}
}

// TestReadQPsCapped: the queue pairs of read connections a daemon
// serves count against a cap of their own (Config.ReadQPs), not the
// Mooncake one: past it a read connection is refused, naming the cap,
// and counted; a connection closing gives its queue pair back.
func TestReadQPsCapped(t *testing.T) {
	const limit = 2
	r := newReadRig(t, 15, Config{ReadQPs: limit})
	var conns []net.Conn
	for range limit {
		c, _ := r.open(t)
		conns = append(conns, c)
	}
	_, _, rep := r.connect(t)
	if rep.Code != transport.Internal || !strings.Contains(rep.Msg, "holds 2 queue pairs of RDMA read connections") {
		t.Fatalf("a read connection past the cap: %s %q, want the cap named", rep.Code, rep.Msg)
	}
	if st := r.rx.ReadQPStats(); st.Open != limit || st.Limit != limit || st.Refused != 1 {
		t.Fatalf("stats %+v: want %d open, the limit %d, 1 refused", st, limit, limit)
	}
	if st := r.rx.MooncakeQPStats(); st.Open != 0 || st.Refused != 0 {
		t.Fatalf("Mooncake's queue pairs %+v: want read connections' counted apart", st)
	}
	conns[0].Close()
	waitFor(t, "a closed read connection's queue pair given back", func() bool { return r.rx.ReadQPStats().Open < limit })
	r.open(t) // taken, or the test fails
}
