package transporttest

import (
	"bytes"
	"context"
	"errors"
	"math/rand/v2"
	"net"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ferry-project/ferry/transport"
)

// Factory makes a transport listening on loopback that delivers incoming
// writes into sink, and closes it when t ends (t.Cleanup). Close may also
// be called earlier by the suite.
type Factory func(t *testing.T, sink transport.Sink) transport.Transport

// Run runs the conformance suite against the transports f makes.
func Run(t *testing.T, f Factory) {
	t.Run("Sizes", func(t *testing.T) { testSizes(t, f) })
	t.Run("Refusals", func(t *testing.T) { testRefusals(t, f) })
	t.Run("Concurrent", func(t *testing.T) { testConcurrent(t, f) })
	t.Run("NoHeadOfLineBlocking", func(t *testing.T) { testNoHeadOfLineBlocking(t, f) })
	t.Run("PeerClosedMidWrite", func(t *testing.T) { testPeerClosedMidWrite(t, f) })
	t.Run("StalledPeer", func(t *testing.T) { testStalledPeer(t, f) })
	t.Run("Cancel", func(t *testing.T) { testCancel(t, f) })
	t.Run("SilentListener", func(t *testing.T) { testSilentListener(t, f) })
	t.Run("DialNothingListening", func(t *testing.T) { testDialNothingListening(t, f) })
	t.Run("PeerInstance", func(t *testing.T) { testPeerInstance(t, f) })
	t.Run("SessionClosed", func(t *testing.T) { testSessionClosed(t, f) })
	t.Run("TransportClosed", func(t *testing.T) { testTransportClosed(t, f) })
}

// patience bounds any step that should be quick, generously enough for a
// loaded machine running the race detector.
const patience = 30 * time.Second

const mib = 1 << 20

// data is the fixed-seed random source of every write; writes take
// different offsets so a misplaced byte shows.
var data = sync.OnceValue(func() []byte {
	b := make([]byte, 65*mib)
	rand.NewChaCha8([32]byte{'f', 'e', 'r', 'r', 'y'}).Read(b)
	return b
})

// bulk bounds a step that moves n bytes: patience plus n at a floor rate
// far below any real transport, and below soft-RoCE under QEMU's TCG with
// the race detector on a loaded machine (a few MB/s at worst).
func bulk(n int) time.Duration {
	const floor = 1 << 20 // bytes per second
	return patience + time.Duration(n/floor)*time.Second
}

func timeout(t *testing.T, d time.Duration) context.Context {
	ctx, cancel := context.WithTimeout(t.Context(), d)
	t.Cleanup(cancel)
	return ctx
}

// newSlots makes a Slots whose contract breaches fail t.
func newSlots(t *testing.T, size int) *Slots {
	s := NewSlots(size)
	t.Cleanup(func() {
		if err := s.Err(); err != nil {
			t.Error(err)
		}
	})
	return s
}

func dial(t *testing.T, from, to transport.Transport) transport.Session {
	t.Helper()
	s, err := from.Dial(timeout(t, patience), to.Addr().String())
	if err != nil {
		t.Fatalf("dial: %v", err)
	}
	t.Cleanup(func() { s.Close() })
	return s
}

// pair makes a receiver over sink and a session to it from another
// transport.
func pair(t *testing.T, f Factory, sink transport.Sink) (rx transport.Transport, s transport.Session) {
	t.Helper()
	tx := f(t, NewSlots(0))
	rx = f(t, sink)
	return rx, dial(t, tx, rx)
}

// landed checks that the write tagged tag completed exactly once with
// Mem[addr:] holding src.
func landed(t *testing.T, slots *Slots, tag uint32, addr uint64, src []byte) {
	t.Helper()
	if err := slots.Wait(timeout(t, patience), tag); err != nil {
		t.Fatal(err)
	}
	if n := slots.Delivered(tag); n != 1 {
		t.Errorf("tag %d delivered %d times", tag, n)
	}
	if got := slots.Mem[addr : addr+uint64(len(src))]; !bytes.Equal(got, src) {
		i := 0
		for got[i] == src[i] {
			i++
		}
		t.Errorf("tag %d: %d-byte write at %#x differs from its source at byte %d", tag, len(src), addr, i)
	}
}

// flipped is k with its last bit changed: the key of no slot, though its
// tag (the first 32 bits) is still a live slot's.
func flipped(k transport.Key) transport.Key {
	k[transport.KeySize-1] ^= 0x80
	return k
}

func zero(b []byte) bool {
	return bytes.Count(b, []byte{0}) == len(b)
}

func testSizes(t *testing.T, f Factory) {
	sizes := []int{1, 255, 4 << 10, mib + 7, 16 * mib, 64 * mib}
	const gap = 4096 // left untouched between slots, so an overrun shows
	total := 0
	for _, n := range sizes {
		total += n + gap
	}
	slots := newSlots(t, total)
	_, s := pair(t, f, slots)
	addr := uint64(0)
	for i, n := range sizes {
		src := data()[i*4099:][:n]
		key := slots.Add(addr, uint64(n))
		tag := uint32(100 + i)
		if _, err := s.Write(timeout(t, bulk(n)), transport.Write{Src: src, Remote: addr, Key: key, Tag: tag}); err != nil {
			t.Fatalf("%d-byte write: %v", n, err)
		}
		landed(t, slots, tag, addr, src)
		if !zero(slots.Mem[addr+uint64(n):][:gap]) {
			t.Errorf("%d-byte write at %#x ran past its end", n, addr)
		}
		addr += uint64(n + gap)
	}
}

func testRefusals(t *testing.T, f Factory) {
	slots := newSlots(t, 4*mib)
	const addr = 0x1000
	key := slots.Add(addr, mib)
	_, s := pair(t, f, slots)
	for _, c := range []struct {
		name string
		w    transport.Write
		want transport.Code
	}{
		// Bodies of several sizes, so the receiver has to keep the
		// stream in step past each refused one.
		{"NoSlot", transport.Write{Src: data()[:mib], Remote: addr + 2*mib, Key: key, Tag: 1}, transport.NoSlot},
		{"WrongKey", transport.Write{Src: data()[:64<<10], Remote: addr, Key: flipped(key), Tag: 2}, transport.NoSlot},
		{"OutOfBounds", transport.Write{Src: data()[:4096], Remote: addr + mib - 100, Key: key, Tag: 3}, transport.OutOfBounds},
		{"OutOfBoundsWhole", transport.Write{Src: data()[:mib+1], Remote: addr, Key: key, Tag: 4}, transport.OutOfBounds},
	} {
		_, err := s.Write(timeout(t, patience), c.w)
		var r *transport.Refusal
		if !errors.As(err, &r) || r.Code != c.want {
			t.Errorf("%s: got %v, want a %s refusal", c.name, err, c.want)
		}
		if !zero(slots.Mem) {
			t.Fatalf("%s: refused write changed memory", c.name)
		}
		if n := slots.Delivered(c.w.Tag); n != 0 {
			t.Errorf("%s: refused write delivered %d times", c.name, n)
		}
	}
	src := data()[7:][:mib]
	if _, err := s.Write(timeout(t, patience), transport.Write{Src: src, Remote: addr, Key: key, Tag: 5}); err != nil {
		t.Fatalf("write after refusals: %v", err)
	}
	landed(t, slots, 5, addr, src)
}

func testConcurrent(t *testing.T, f Factory) {
	const n = 256
	const stride = 64 << 10
	slots := newSlots(t, n*stride)
	_, s := pair(t, f, slots)
	rng := rand.New(rand.NewPCG(1, 2))
	writes := make([]transport.Write, n)
	for i := range writes {
		addr := uint64(i * stride)
		writes[i] = transport.Write{
			Src:    data()[i*4099:][:1+rng.IntN(stride)],
			Remote: addr,
			Key:    slots.Add(addr, stride),
			Tag:    uint32(1000 + i),
		}
	}
	ctx := timeout(t, bulk(n*stride))
	errs := make(chan error, n)
	for _, w := range writes {
		go func() {
			_, err := s.Write(ctx, w)
			errs <- err
		}()
	}
	for range n {
		if err := <-errs; err != nil {
			t.Error(err)
		}
	}
	for _, w := range writes {
		landed(t, slots, w.Tag, w.Remote, w.Src)
	}
}

// gate is a Sink that holds writes with chosen tags in Accept until
// released, keeping them in flight for as long as a test needs.
type gate struct {
	*Slots
	held     map[uint32]bool
	accepted chan uint32 // each held write, as it arrives
	open     chan struct{}
	once     sync.Once
}

// gated makes a receiver over a gate holding tags, and a session to it.
func gated(t *testing.T, f Factory, slots *Slots, tags ...uint32) (*gate, transport.Transport, transport.Session) {
	t.Helper()
	g := &gate{Slots: slots, held: make(map[uint32]bool), accepted: make(chan uint32, len(tags)), open: make(chan struct{})}
	for _, tag := range tags {
		g.held[tag] = true
	}
	rx, s := pair(t, f, g)
	// Registered after the receiver, so this runs before its Close, which
	// may wait for the writes held here.
	t.Cleanup(g.release)
	return g, rx, s
}

func (g *gate) Accept(addr, n uint64, key transport.Key, tag uint32) ([]byte, func(error), error) {
	if g.held[tag] {
		g.accepted <- tag
		<-g.open
	}
	return g.Slots.Accept(addr, n, key, tag)
}

func (g *gate) release() { g.once.Do(func() { close(g.open) }) }

// arrived waits for a held write to reach the receiver.
func (g *gate) arrived(t *testing.T) {
	t.Helper()
	select {
	case <-g.accepted:
	case <-time.After(patience):
		t.Fatal("held write never reached the receiver")
	}
}

func testNoHeadOfLineBlocking(t *testing.T, f Factory) {
	slots := newSlots(t, 128*mib+4096)
	g, _, s := gated(t, f, slots, 1, 2)
	big := []transport.Write{
		{Src: data()[:64*mib], Remote: 0, Key: slots.Add(0, 64*mib), Tag: 1},
		{Src: data()[mib:][:64*mib], Remote: 64 * mib, Key: slots.Add(64*mib, 64*mib), Tag: 2},
	}
	small := transport.Write{Src: data()[3:][:4096], Remote: 128 * mib, Key: slots.Add(128*mib, 4096), Tag: 3}
	ctx := timeout(t, bulk(128*mib))
	bigErrs := make(chan error, len(big))
	for _, w := range big {
		go func() {
			_, err := s.Write(ctx, w)
			bigErrs <- err
		}()
	}
	g.arrived(t)
	g.arrived(t)
	if _, err := s.Write(ctx, small); err != nil {
		t.Fatalf("small write behind two big ones: %v", err)
	}
	landed(t, slots, small.Tag, small.Remote, small.Src)
	select {
	case err := <-bigErrs:
		t.Fatalf("a write still held by its receiver returned: %v", err)
	default:
	}
	g.release()
	for range big {
		if err := <-bigErrs; err != nil {
			t.Fatalf("big write: %v", err)
		}
	}
	for _, w := range big {
		landed(t, slots, w.Tag, w.Remote, w.Src)
	}
}

func testPeerClosedMidWrite(t *testing.T, f Factory) {
	slots := newSlots(t, 64*mib+4096)
	g, rx, s := gated(t, f, slots, 1)
	w := transport.Write{Src: data()[:64*mib], Remote: 0, Key: slots.Add(0, 64*mib), Tag: 1}
	after := transport.Write{Src: data()[:4096], Remote: 64 * mib, Key: slots.Add(64*mib, 4096), Tag: 2}
	res := make(chan error, 1)
	go func() {
		_, err := s.Write(timeout(t, patience), w)
		res <- err
	}()
	g.arrived(t)
	closed := make(chan error, 1)
	go func() { closed <- rx.Close() }()
	select {
	case err := <-res:
		if err == nil || transport.IsRefusal(err) {
			t.Errorf("write to a peer closed mid-write: got %v, want a broken-path error", err)
		}
	case <-time.After(5 * time.Second):
		t.Error("write still running 5 s after its peer closed")
	}
	g.release()
	select {
	case err := <-closed:
		if err != nil {
			t.Errorf("receiver Close: %v", err)
		}
	case <-time.After(patience):
		t.Fatal("receiver Close did not return")
	}
	if err := slots.WaitIdle(timeout(t, patience)); err != nil {
		t.Errorf("after the receiver closed: %v", err)
	}
	if n := slots.Delivered(w.Tag); n != 0 {
		t.Errorf("interrupted write delivered %d times", n)
	}
	if _, err := s.Write(timeout(t, 5*time.Second), after); err == nil || transport.IsRefusal(err) {
		t.Errorf("write to a closed peer: got %v, want a broken-path error", err)
	}
}

func testStalledPeer(t *testing.T, f Factory) {
	slots := newSlots(t, mib)
	_, _, s := gated(t, f, slots, 1)
	w := transport.Write{Src: data()[:mib], Remote: 0, Key: slots.Add(0, mib), Tag: 1}
	const limit = 500 * time.Millisecond
	start := time.Now()
	_, err := s.Write(timeout(t, limit), w)
	if took := time.Since(start); took > limit+5*time.Second {
		t.Errorf("write to a stalled peer took %s with a %s deadline", took, limit)
	}
	if !errors.Is(err, context.DeadlineExceeded) || transport.IsRefusal(err) {
		t.Errorf("write to a stalled peer: got %v, want one naming context.DeadlineExceeded", err)
	}
}

func testCancel(t *testing.T, f Factory) {
	slots := newSlots(t, mib)
	g, _, s := gated(t, f, slots, 1)
	w := transport.Write{Src: data()[:mib], Remote: 0, Key: slots.Add(0, mib), Tag: 1}
	ctx, cancel := context.WithCancel(t.Context())
	res := make(chan error, 1)
	go func() {
		_, err := s.Write(ctx, w)
		res <- err
	}()
	g.arrived(t)
	cancel()
	select {
	case err := <-res:
		if !errors.Is(err, context.Canceled) {
			t.Errorf("cancelled write: got %v, want one naming context.Canceled", err)
		}
	case <-time.After(5 * time.Second):
		t.Error("write still running 5 s after its context was cancelled")
	}
}

func testSilentListener(t *testing.T, f Factory) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	// Accept and hold connections, never reading or writing a byte.
	var held []net.Conn
	accepting := make(chan struct{})
	go func() {
		defer close(accepting)
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			held = append(held, c)
		}
	}()
	t.Cleanup(func() {
		ln.Close()
		<-accepting
		for _, c := range held {
			c.Close()
		}
	})
	tx := f(t, NewSlots(0))
	const limit = 500 * time.Millisecond
	start := time.Now()
	_, err = tx.Dial(timeout(t, limit), ln.Addr().String())
	if took := time.Since(start); took > limit+5*time.Second {
		t.Errorf("dial to a silent listener took %s with a %s deadline", took, limit)
	}
	if !errors.Is(err, context.DeadlineExceeded) {
		t.Errorf("dial to a silent listener: got %v, want one naming context.DeadlineExceeded", err)
	}
}

func testDialNothingListening(t *testing.T, f Factory) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	ln.Close()
	tx := f(t, NewSlots(0))
	_, err = tx.Dial(timeout(t, patience), addr)
	if err == nil || !strings.Contains(err.Error(), addr) {
		t.Errorf("dial to %s where nothing listens: got %v, want an error naming the address", addr, err)
	}
}

func testPeerInstance(t *testing.T, f Factory) {
	tx := f(t, NewSlots(0))
	a, b := f(t, NewSlots(0)), f(t, NewSlots(0))
	a1, a2, b1 := dial(t, tx, a), dial(t, tx, a), dial(t, tx, b)
	if a1.PeerInstance() != a2.PeerInstance() {
		t.Errorf("two sessions to one peer see instances %#x and %#x", a1.PeerInstance(), a2.PeerInstance())
	}
	if a1.PeerInstance() == b1.PeerInstance() {
		t.Errorf("two peers share instance %#x", a1.PeerInstance())
	}
	if a1.Peer() != a.Addr().String() {
		t.Errorf("Peer() = %q, want %q", a1.Peer(), a.Addr())
	}
	if a1.Transport() != tx.Name() {
		t.Errorf("a session between two %s transports runs on %q", tx.Name(), a1.Transport())
	}
}

func testSessionClosed(t *testing.T, f Factory) {
	slots := newSlots(t, 4096)
	_, s := pair(t, f, slots)
	w := transport.Write{Src: data()[:4096], Remote: 0, Key: slots.Add(0, 4096), Tag: 1}
	if _, err := s.Write(timeout(t, patience), w); err != nil {
		t.Fatal(err)
	}
	if err := s.Close(); err != nil {
		t.Errorf("Close: %v", err)
	}
	if _, err := s.Write(timeout(t, patience), w); !errors.Is(err, transport.ErrClosed) {
		t.Errorf("write after Close: got %v, want ErrClosed", err)
	}
	if err := s.Close(); err != nil {
		t.Errorf("second Close: %v", err)
	}
}

func testTransportClosed(t *testing.T, f Factory) {
	tx := f(t, NewSlots(0))
	slots := newSlots(t, 4096)
	rx := f(t, slots)
	s := dial(t, tx, rx)
	if err := tx.Close(); err != nil {
		t.Errorf("Close: %v", err)
	}
	w := transport.Write{Src: data()[:4096], Remote: 0, Key: slots.Add(0, 4096), Tag: 1}
	if _, err := s.Write(timeout(t, patience), w); !errors.Is(err, transport.ErrClosed) {
		t.Errorf("write on a closed transport's session: got %v, want ErrClosed", err)
	}
	if _, err := tx.Dial(timeout(t, patience), rx.Addr().String()); !errors.Is(err, transport.ErrClosed) {
		t.Errorf("dial on a closed transport: got %v, want ErrClosed", err)
	}
	if err := tx.Close(); err != nil {
		t.Errorf("second Close: %v", err)
	}
}
