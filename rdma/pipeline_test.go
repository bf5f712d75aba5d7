package rdma

import (
	"bytes"
	"context"
	"errors"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ferry-project/ferry/transport"
	"github.com/ferry-project/ferry/transport/peer"
	"github.com/ferry-project/ferry/transport/transporttest"
)

// TestLaneCarriesSeveralWrites: on a session limited to one lane,
// concurrent writes overlap: each lets go of the lane once posted, so the
// receiver grants the next while the earlier ones are still on the wire,
// and every write lands byte-exact and is delivered once, in order of
// its grant. On the fake NIC the work requests are held until
// flyingMax+1 writes have been granted, which proves the overlap; on a
// real one they run freely.
func TestLaneCarriesSeveralWrites(t *testing.T) {
	f := newFabric()
	const size, n = 64 << 10, flyingMax + 2
	src := mapT(t, n*size)
	slots := mappedSlots(t, n*size)
	accepted := make(chan struct{}, n)
	sink := &watch{Slots: slots, accepted: accepted}
	tx := listenT(t, f, Config{Peer: peer.Config{MaxConnsPerPeer: 1}, Memory: src})
	rx := listenT(t, f, Config{Peer: peer.Config{Sink: sink}, Memory: slots.Mem})
	s, err := tx.Dial(ctxFor(t, 30*time.Second), rx.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	hold := !onDevice(t)
	release := func() {}
	if hold {
		f.hold = make(chan struct{})
		release = sync.OnceFunc(func() { close(f.hold) })
		defer release() // a failing check lets the held work go first
	}
	res := make(chan error, n)
	for i := range n {
		part := src[i*size:][:size]
		for j := range part {
			part[j] = byte(j*7 + i)
		}
		w := transport.Write{Src: part, Remote: uint64(i * size), Key: slots.Add(uint64(i*size), size), Tag: uint32(100 + i)}
		go func() {
			_, err := s.Write(ctxFor(t, 60*time.Second), w)
			res <- err
		}()
	}
	if hold {
		for i := range flyingMax + 1 {
			select {
			case <-accepted:
			case <-time.After(30 * time.Second):
				t.Fatalf("%d writes granted on the one lane while none had completed; want %d", i, flyingMax+1)
			}
		}
		for i := range n {
			if d := slots.Delivered(uint32(100 + i)); d != 0 {
				t.Fatalf("write %d delivered while the NIC held every work request", i)
			}
		}
		release()
	}
	for range n {
		if err := <-res; err != nil {
			t.Fatal(err)
		}
	}
	for i := range n {
		tag := uint32(100 + i)
		if err := slots.Wait(ctxFor(t, 30*time.Second), tag); err != nil {
			t.Fatal(err)
		}
		if d := slots.Delivered(tag); d != 1 {
			t.Errorf("write %d delivered %d times", i, d)
		}
		if !bytes.Equal(slots.Mem[i*size:][:size], src[i*size:][:size]) {
			t.Errorf("write %d landed wrong", i)
		}
	}
	rx.mu.Lock()
	lanes := len(rx.accepted)
	rx.mu.Unlock()
	if lanes != 1 {
		t.Errorf("the receiver serves %d lanes, want the session's one", lanes)
	}
}

// TestWriteCompletedAtPostArmsNothing: a write whose completion is in the
// CQ when its post returns (soft-RoCE completes a loopback write inside
// ibv_post_send) finds it by polling: the sender arms no completion
// channel, so no write pays an event and a wake-up for its completion.
// The writes share one lane, so some of them let go of it and complete
// while another is posted. It counts the fake NIC's arming, on a device
// too.
func TestWriteCompletedAtPostArmsNothing(t *testing.T) {
	f := newFabric()
	f.inline = true
	const size, n = 4096, 32
	src := mapT(t, size)
	slots := mappedSlots(t, n*size)
	tx := listenFake(t, f, testConfig(t, Config{Peer: peer.Config{MaxConnsPerPeer: 1}, Memory: src}))
	rx := listenFake(t, f, testConfig(t, Config{Peer: peer.Config{Sink: slots}, Memory: slots.Mem}))
	s, err := tx.Dial(ctxFor(t, 30*time.Second), rx.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	res := make(chan error, n)
	for i := range n {
		w := transport.Write{Src: src, Remote: uint64(i * size), Key: slots.Add(uint64(i*size), size), Tag: uint32(100 + i)}
		go func() {
			_, err := s.Write(ctxFor(t, 60*time.Second), w)
			res <- err
		}()
	}
	for range n {
		if err := <-res; err != nil {
			t.Fatal(err)
		}
	}
	if armed := tx.nic.(*fakeNIC).arms.Load(); armed != 0 {
		t.Errorf("the sender armed a completion channel %d times for %d writes that completed as they were posted; want 0", armed, n)
	}
	for i := range n {
		if err := slots.Wait(ctxFor(t, 30*time.Second), uint32(100+i)); err != nil {
			t.Fatal(err)
		}
	}
}

// TestRejectsCompletionWithoutGrant: a sender that writes WITH IMM under
// the receiver's shared rkey without asking first (one granted a write
// before knows it: a grant names it) gets nothing delivered; the
// receiver counts and logs the rejection and ends the lane.
func TestRejectsCompletionWithoutGrant(t *testing.T) {
	f := newFabric()
	slots := mappedSlots(t, 1<<20)
	var logs transporttest.Logs
	src := mapT(t, 4096)
	tx := listenT(t, f, Config{Memory: src})
	rx := listenT(t, f, Config{Peer: peer.Config{Sink: slots, Logf: logs.Logf}, Memory: slots.Mem})
	l, _, _, err := tx.dialLane(ctxFor(t, 30*time.Second), rx.Addr().String(), pair{})
	if err != nil {
		t.Fatal(err)
	}
	defer l.close()
	slots.Add(0, 4096) // a live slot, never asked for
	err = l.qp.Post([]op{{WRID: 1, Local: addrOf(src), Remote: addrOf(slots.Mem), Len: 4096, LKey: tx.shared.LKey(), RKey: rx.shared.RKey(),
		Imm: 0x33, Signaled: true, WithImm: true}})
	if err != nil {
		t.Fatal(err)
	}
	logs.Wait(t, "rejected a completion with no write granted", "immediate 0x33")
	if got := rx.Stats().Rejected; got != 1 {
		t.Errorf("rejected completions counted: %d, want 1", got)
	}
	if n := slots.Delivered(0x33); n != 0 {
		t.Errorf("an unasked-for write was delivered %d times", n)
	}
	// The lane ends: the sender's control connection closes.
	if _, err := wait[answer](l, nil, time.Now().Add(30*time.Second), nil); err != errDead {
		t.Fatalf("waiting for the lane to end: %v", err)
	}
}

// heldLane is a session of one lane between two transports on the fake
// NIC, the sender logging to logf, the receiver taking writes into sink;
// its work requests are held on the wire until release, which the test's
// end calls too (a failing check lets the held work go first).
func heldLane(t *testing.T, f *fabric, src []byte, sink transport.Sink, mem []byte, logf func(string, ...any)) (s transport.Session, rx *Transport, release func()) {
	t.Helper()
	tx := listenFake(t, f, Config{Peer: peer.Config{MaxConnsPerPeer: 1, Logf: logf}, Memory: src})
	rx = listenFake(t, f, Config{Peer: peer.Config{Sink: sink, Logf: t.Logf}, Memory: mem})
	s, err := tx.Dial(ctxFor(t, 30*time.Second), rx.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	f.hold = make(chan struct{})
	release = sync.OnceFunc(func() { close(f.hold) })
	t.Cleanup(func() { release(); s.Close() })
	return s, rx, release
}

// TestCanceledWriteInFlightSparesItsLane: a write canceled after it let
// go of its lane waits (boundedly) for its own completion instead of
// breaking the QP under the lane's other writes: the caller gets the
// cancellation, the other write completes, and the lane carries the next.
func TestCanceledWriteInFlightSparesItsLane(t *testing.T) {
	// Holding writes on the wire needs the fake NIC, on any machine.
	f := newFabric()
	const size = 64 << 10
	src := mapT(t, size)
	slots := mappedSlots(t, 3*size)
	accepted := make(chan struct{}, 3)
	s, rx, release := heldLane(t, f, src, &watch{Slots: slots, accepted: accepted}, slots.Mem, t.Logf)
	write := func(ctx context.Context, i int) chan error {
		res := make(chan error, 1)
		w := transport.Write{Src: src, Remote: uint64(i * size), Key: slots.Add(uint64(i*size), size), Tag: uint32(i + 1)}
		go func() {
			_, err := s.Write(ctx, w)
			res <- err
		}()
		select {
		case <-accepted:
		case <-time.After(30 * time.Second):
			t.Fatalf("write %d never reached the receiver", i)
		}
		return res
	}
	ctx, cancel := context.WithCancel(ctxFor(t, 30*time.Second))
	first := write(ctx, 0)
	// The one lane carried the second header: the first write let go of
	// it, every work request posted.
	second := write(ctxFor(t, 30*time.Second), 1)
	cancel()
	release()
	canceledOrCompleted(t, <-first)
	if err := <-second; err != nil {
		t.Fatalf("the other write on the lane: %v", err)
	}
	if err := <-write(ctxFor(t, 30*time.Second), 2); err != nil {
		t.Fatalf("the next write on the lane: %v", err)
	}
	// The canceled write had been posted and completed: it landed.
	if err := slots.Wait(ctxFor(t, 30*time.Second), 1, 2, 3); err != nil {
		t.Fatal(err)
	}
	rx.mu.Lock()
	lanes := len(rx.accepted)
	rx.mu.Unlock()
	if lanes != 1 {
		t.Errorf("the receiver serves %d lanes, want the one the canceled write spared", lanes)
	}
}

// canceledOrCompleted checks what a write canceled with every message
// posted returns when the release of its completion follows the cancel at
// once: context.Canceled when the cancel reached its wait first, nil when
// both were there by the time it looked (select picks either). Its bytes
// land either way, which the callers check next.
func canceledOrCompleted(t *testing.T, err error) {
	t.Helper()
	if err != nil && !errors.Is(err, context.Canceled) {
		t.Fatalf("canceled write: %v, want context.Canceled (or nil, had its completion come first)", err)
	}
}

// TestCanceledWaitForGrantSparesFlyingWrites: a write canceled while it
// waits for its grant fails alone. It posted nothing; the write already
// flying on its lane completes and is delivered; the lane, out of step
// (the canceled write's answer still comes), closes after it, and the
// receiver lets go of the grant it made for the canceled write, so a
// resend of it is taken on a new lane.
func TestCanceledWaitForGrantSparesFlyingWrites(t *testing.T) {
	// Holding writes on the wire needs the fake NIC, on any machine.
	f := newFabric()
	const size = 64 << 10
	src := mapT(t, size)
	slots := mappedSlots(t, 2*size)
	accepted := make(chan struct{}, 2)
	sink := &gated{watch: watch{Slots: slots, accepted: accepted}, tag: 2, reached: make(chan struct{}, 1), open: make(chan struct{})}
	s, _, release := heldLane(t, f, src, sink, slots.Mem, t.Logf)
	answer := sync.OnceFunc(func() { close(sink.open) })
	defer answer()

	flying := make(chan error, 1)
	w1 := transport.Write{Src: src, Remote: 0, Key: slots.Add(0, size), Tag: 1}
	go func() {
		_, err := s.Write(ctxFor(t, 30*time.Second), w1)
		flying <- err
	}()
	select {
	case <-accepted:
	case <-time.After(30 * time.Second):
		t.Fatal("the first write never reached the receiver")
	}
	// The one lane carries the second header once the first let go of
	// it; the receiver holds its answer.
	ctx, cancel := context.WithCancel(ctxFor(t, 30*time.Second))
	defer cancel()
	canceled := make(chan error, 1)
	w2 := transport.Write{Src: src, Remote: size, Key: slots.Add(size, size), Tag: 2}
	go func() {
		_, err := s.Write(ctx, w2)
		canceled <- err
	}()
	select {
	case <-sink.reached:
	case <-time.After(30 * time.Second):
		t.Fatal("the second write's header never reached the receiver")
	}
	cancel()
	select {
	case err := <-canceled:
		if !errors.Is(err, context.Canceled) {
			t.Fatalf("canceled write: %v, want context.Canceled", err)
		}
	case err := <-flying:
		t.Fatalf("the write flying on the lane ended when a write waiting for its grant was canceled: %v", err)
	case <-time.After(30 * time.Second):
		t.Fatal("the canceled write did not return")
	}
	release()
	answer()
	// The grant made for the canceled write ends with its lane.
	onlyFlyingLanded(t, flying, slots, "which posted nothing")
	if _, err := s.Write(ctxFor(t, 30*time.Second), w2); err != nil {
		t.Fatalf("resending the canceled write: %v", err)
	}
	if err := slots.Wait(ctxFor(t, 30*time.Second), 2); err != nil {
		t.Fatal(err)
	}
	if d := slots.Delivered(1); d != 1 {
		t.Errorf("the flying write delivered %d times", d)
	}
}

// TestCanceledHeldWriteSparesItsLane: a write that holds its lane to
// its completion (here the one past flyingMax), canceled once all of it
// is posted, waits for that completion; when it comes the lane is in
// step, and stays in the pool for the writes flying on it and the next.
func TestCanceledHeldWriteSparesItsLane(t *testing.T) {
	// Holding writes on the wire needs the fake NIC, on any machine.
	f := newFabric()
	const size, n = 64 << 10, flyingMax + 1
	src := mapT(t, size)
	slots := mappedSlots(t, (n+1)*size)
	accepted := make(chan struct{}, n+1)
	s, _, release := heldLane(t, f, src, &watch{Slots: slots, accepted: accepted}, slots.Mem, t.Logf)
	sess := s.(*session)
	first, err := sess.pool.Get(ctxFor(t, 30*time.Second))
	if err != nil {
		t.Fatal(err)
	}
	sess.pool.Put(first)
	f.posted = make(chan struct{}, n+1)
	write := func(ctx context.Context, i int) chan error {
		res := make(chan error, 1)
		w := transport.Write{Src: src, Remote: uint64(i * size), Key: slots.Add(uint64(i*size), size), Tag: uint32(i + 1)}
		go func() {
			_, err := s.Write(ctx, w)
			res <- err
		}()
		for _, c := range []chan struct{}{accepted, f.posted} {
			select {
			case <-c:
			case <-time.After(30 * time.Second):
				t.Fatalf("write %d never reached the receiver and the NIC", i)
			}
		}
		return res
	}
	var flying []chan error
	for i := range flyingMax {
		flying = append(flying, write(ctxFor(t, 30*time.Second), i))
	}
	ctx, cancel := context.WithCancel(ctxFor(t, 30*time.Second))
	held := write(ctx, flyingMax)
	cancel()
	release()
	canceledOrCompleted(t, <-held)
	for i, res := range flying {
		if err := <-res; err != nil {
			t.Fatalf("write %d, flying on the lane: %v", i, err)
		}
	}
	if err := <-write(ctxFor(t, 30*time.Second), n); err != nil {
		t.Fatalf("the next write: %v", err)
	}
	tags := make([]uint32, n+1)
	for i := range tags {
		tags[i] = uint32(i + 1)
	}
	if err := slots.Wait(ctxFor(t, 30*time.Second), tags...); err != nil {
		t.Fatal(err)
	}
	l, err := sess.pool.Get(ctxFor(t, 30*time.Second))
	if err != nil {
		t.Fatal(err)
	}
	sess.pool.Put(l)
	if l != first {
		t.Error("the lane closed after the canceled write completed; want it kept")
	}
}

// TestCanceledPostingWriteSparesFlyingWrites: a write canceled while it
// still has messages to post breaks its lane (the receiver's grant waits
// for a last message that never comes), but only once the writes flying
// on the lane, posted before it, have completed: they succeed.
func TestCanceledPostingWriteSparesFlyingWrites(t *testing.T) {
	// Holding writes on the wire needs the fake NIC, on any machine.
	f := newFabric()
	const small, big = 64 << 10, (bounceSlots + 1) * chunk
	src := mapT(t, small)
	outside := mapT(t, big) // not the transport's memory: copied through the bounce ring, bounceSlots messages at a time
	slots := mappedSlots(t, small+big)
	accepted := make(chan struct{}, 2)
	var logs transporttest.Logs
	s, _, release := heldLane(t, f, src, &watch{Slots: slots, accepted: accepted}, slots.Mem, logs.Logf)
	f.posted = make(chan struct{}, 2)
	write := func(ctx context.Context, w transport.Write) chan error {
		res := make(chan error, 1)
		go func() {
			_, err := s.Write(ctx, w)
			res <- err
		}()
		for _, c := range []chan struct{}{accepted, f.posted} {
			select {
			case <-c:
			case <-time.After(30 * time.Second):
				t.Fatalf("the write tagged %d never reached the receiver and the NIC", w.Tag)
			}
		}
		return res
	}
	flying := write(ctxFor(t, 30*time.Second), transport.Write{Src: src, Remote: 0, Key: slots.Add(0, small), Tag: 1})
	ctx, cancel := context.WithCancel(ctxFor(t, 30*time.Second))
	posting := write(ctx, transport.Write{Src: outside, Remote: small, Key: slots.Add(small, big), Tag: 2})
	cancel()
	// Still on the wire, the flying write holds the lane together.
	logs.Wait(t, "canceled with 4 of its 5 messages posted", "once the writes flying on it (1) complete")
	release()
	if err := <-posting; !errors.Is(err, context.Canceled) {
		t.Fatalf("canceled write: %v, want context.Canceled", err)
	}
	// The canceled write's grant is let go, undelivered.
	onlyFlyingLanded(t, flying, slots, "never posted whole")
}

// onlyFlyingLanded checks how a cancel test ends: the write flying on the
// lane (tag 1) succeeds and lands, the receiver lets go of every grant,
// and the canceled write (tag 2, how far it got in what) never lands.
func onlyFlyingLanded(t *testing.T, flying chan error, slots *transporttest.Slots, what string) {
	t.Helper()
	if err := <-flying; err != nil {
		t.Fatalf("the write flying on the lane: %v", err)
	}
	if err := slots.Wait(ctxFor(t, 30*time.Second), 1); err != nil {
		t.Fatal(err)
	}
	if err := slots.WaitIdle(ctxFor(t, 30*time.Second)); err != nil {
		t.Fatal(err)
	}
	if d := slots.Delivered(2); d != 0 {
		t.Fatalf("the canceled write, %s, was delivered %d times", what, d)
	}
}

// gated is a Sink that holds its answer to the write tagged tag until
// open closes, having said so on reached.
type gated struct {
	watch
	tag     uint32
	reached chan struct{}
	open    chan struct{}
}

func (g *gated) Accept(addr, n uint64, key transport.Key, tag uint32) ([]byte, func(error), error) {
	if tag == g.tag {
		select {
		case g.reached <- struct{}{}:
		default:
		}
		<-g.open
	}
	return g.watch.Accept(addr, n, key, tag)
}

// Writes whose completions never come fail once the I/O timeout passes
// without progress: their lane's watch pokes each waiter at its
// deadline, and neither waits for the other.
func TestStalledWritesTimeOut(t *testing.T) {
	f := newFabric()
	if onDevice(t) {
		t.Skip("holds the fake NIC's work: a device's cannot be held")
	}
	const size, n = 64 << 10, 3
	src := mapT(t, n*size)
	slots := mappedSlots(t, n*size)
	tx := listenT(t, f, Config{Peer: peer.Config{MaxConnsPerPeer: 1, IOTimeout: 300 * time.Millisecond}, Memory: src})
	rx := listenT(t, f, Config{Peer: peer.Config{Sink: slots}, Memory: slots.Mem})
	s, err := tx.Dial(ctxFor(t, 30*time.Second), rx.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	f.hold = make(chan struct{})
	defer close(f.hold) // the held work goes at the end, into broken QPs
	res := make(chan error, n)
	start := time.Now()
	for i := range n {
		w := transport.Write{Src: src[i*size:][:size], Remote: uint64(i * size), Key: slots.Add(uint64(i*size), size), Tag: uint32(100 + i)}
		go func() {
			_, err := s.Write(ctxFor(t, 60*time.Second), w)
			res <- err
		}()
	}
	for range n {
		select {
		case err := <-res:
			if err == nil || !strings.Contains(err.Error(), "made no progress") {
				t.Fatalf("a stalled write: %v, want no progress", err)
			}
		case <-time.After(30 * time.Second):
			t.Fatal("a stalled write did not time out")
		}
	}
	// Each fails after the timeout, and after draining its broken lane
	// for drainWait at most.
	if d := time.Since(start); d < 300*time.Millisecond {
		t.Errorf("the writes failed after %v, before the I/O timeout", d)
	}
}
