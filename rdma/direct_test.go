package rdma

import (
	"bytes"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ferry-project/ferry/transport"
	"github.com/ferry-project/ferry/transport/peer"
	"github.com/ferry-project/ferry/transport/transporttest"
)

// testSecret is the peer secret of the tests whose peers authenticate.
var testSecret = []byte("direct-writes-test-secret-0123456789")

// directPair is a sender over src and a receiver whose DirectSink is
// slots, both holding the peer secret (secret) or not, and a session
// between them. The slots' addresses are their bytes', as a DirectSink's
// must be.
type directPair struct {
	tx, rx *Transport
	s      transport.Session
	slots  *transporttest.Slots
	src    []byte
	logs   *transporttest.Logs
	next   uint64 // the next free offset in slots.Mem
}

func newDirectPair(t *testing.T, f *fabric, srcSize, memSize int, secret []byte, lanes int) *directPair {
	return newPair(t, f, srcSize, memSize, secret, lanes, false)
}

// newPair is newDirectPair whose receiver puts a window over each slot
// when windows is set (its NIC has them: the fake's are turned on), and
// whose sender's configuration each of tx may change.
func newPair(t *testing.T, f *fabric, srcSize, memSize int, secret []byte, lanes int, windows bool, tx ...func(*Config)) *directPair {
	t.Helper()
	p := &directPair{src: mapT(t, srcSize), slots: mappedSlots(t, memSize), logs: &transporttest.Logs{}}
	p.slots.Base = addrOf(p.slots.Mem)
	var sink transport.Sink = p.slots
	if windows {
		f.windows = true
		sink = transporttest.WindowSlots{Slots: p.slots}
	}
	txc := Config{Peer: peer.Config{Secret: secret, MaxConnsPerPeer: lanes}, Memory: p.src}
	for _, tune := range tx {
		tune(&txc)
	}
	p.tx = listenT(t, f, txc)
	p.rx = listenT(t, f, Config{Peer: peer.Config{Sink: sink, Secret: secret, Logf: p.logs.Logf}, Memory: p.slots.Mem})
	p.s = dialT(t, p.tx, p.rx)
	return p
}

// slot makes an n-byte slot and the write of src[:n] into it, whole and
// tagged with its key's tag, as the daemon sends.
func (p *directPair) slot(n int) transport.Write {
	off := p.next
	p.next += uint64(n+4095) &^ 4095
	key := p.slots.Add(off, uint64(n))
	return transport.Write{Src: p.src[:n], Remote: p.slots.Base + off, Key: key, Tag: key.Tag(), Whole: true}
}

// landed checks that w arrived whole.
func (p *directPair) landed(t *testing.T, w transport.Write) {
	t.Helper()
	if err := p.slots.Wait(ctxFor(t, 30*time.Second), w.Tag); err != nil {
		t.Fatal(err)
	}
	off := w.Remote - p.slots.Base
	if !bytes.Equal(p.slots.Mem[off:off+uint64(len(w.Src))], w.Src) {
		t.Fatalf("the %d-byte write tagged %#x landed wrong", len(w.Src), w.Tag)
	}
}

func fill(b []byte, seed int) {
	for i := range b {
		b[i] = byte(i*31 + seed)
	}
}

// TestDirectWrites: between authenticated peers, a write from the shared
// registration that fills a slot, tagged with its key's tag, goes as one
// RDMA WRITE WITH IMM in one post, with no message on the control
// connection, and its slot arrives when the receiver sees the
// completion.
func TestDirectWrites(t *testing.T) {
	f := newFabric()
	p := newDirectPair(t, f, 16<<20, 24<<20, testSecret, 2)
	for _, tr := range []*Transport{p.tx, p.rx} {
		if m := tr.Mode(); m != ModeArenaRKey {
			t.Fatalf("mode %q, want %q", m, ModeArenaRKey)
		}
	}
	sizes := []int{1, 4 << 10, 1<<20 + 7, 16 << 20}
	for i, n := range sizes {
		fill(p.src[:n], i)
		w := p.slot(n)
		rep, err := p.s.Write(ctxFor(t, 60*time.Second), w)
		if err != nil {
			t.Fatalf("%d-byte write: %v", n, err)
		}
		if want := (transport.Report{Registration: transport.RegisteredShared}); rep != want {
			t.Errorf("%d-byte write reported %+v, want %+v (no messages)", n, rep, want)
		}
		p.landed(t, w)
	}
	n := uint64(len(sizes))
	tx, rx := p.tx.Stats(), p.rx.Stats()
	if tx.Sends != n || tx.Direct != n || tx.ControlMessages != 0 || tx.Posts != n || tx.WorkRequests != n || tx.Signaled != n || tx.CopiedBytes != 0 {
		t.Errorf("sender stats %+v, want %d direct sends of one post, one signaled work request each, and no control message", tx, n)
	}
	if rx.ControlMessages != 0 || rx.DirectCompletions != n || rx.DirectRefused != 0 || rx.Rejected != 0 {
		t.Errorf("receiver stats %+v, want %d direct completions and no control message", rx, n)
	}
}

// TestDirectWritesConcurrently: many direct writes at once share the
// lanes, and each slot arrives whole.
func TestDirectWritesConcurrently(t *testing.T) {
	f := newFabric()
	const writes, size = 48, 64 << 10
	p := newDirectPair(t, f, size, writes*size, testSecret, 2)
	fill(p.src, 7)
	ws := make([]transport.Write, writes)
	for i := range ws {
		ws[i] = p.slot(size)
	}
	var wg sync.WaitGroup
	errs := make(chan error, writes)
	for _, w := range ws {
		wg.Go(func() {
			if _, err := p.s.Write(ctxFor(t, 60*time.Second), w); err != nil {
				errs <- err
			}
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	for _, w := range ws {
		p.landed(t, w)
	}
	if st := p.tx.Stats(); st.Direct != writes || st.ControlMessages != 0 {
		t.Errorf("sender stats %+v, want %d direct writes and no control message", st, writes)
	}
}

// TestDirectWritesAskWhenTheyMust: writes a direct write cannot carry
// still go, each after a header and its grant: pieces of a slot (a
// resent piece must count once, which takes its range), one whose tag is
// not its key's (the receiver finds a direct write's slot by that tag),
// one from memory outside the shared registration (copied through the
// bounce buffer a chunk at a time), one whose peer did not authenticate.
func TestDirectWritesAskWhenTheyMust(t *testing.T) {
	f := newFabric()
	p := newDirectPair(t, f, 1<<20, 4<<20, testSecret, 1)
	fill(p.src, 3)
	w := p.slot(8192)
	for _, piece := range []transport.Write{
		{Src: w.Src[:4096], Remote: w.Remote, Key: w.Key, Tag: w.Tag},
		{Src: w.Src[4096:], Remote: w.Remote + 4096, Key: w.Key, Tag: w.Tag},
	} {
		if rep, err := p.s.Write(ctxFor(t, 60*time.Second), piece); err != nil || rep.Messages != 2 {
			t.Fatalf("a piece of a slot: %+v, %v; want it granted (2 messages)", rep, err)
		}
		// Slots takes one write at a time per slot, and the receiver's
		// part of a write may end after the sender's.
		if err := p.slots.WaitIdle(ctxFor(t, 30*time.Second)); err != nil {
			t.Fatal(err)
		}
	}
	p.landed(t, w)
	w = p.slot(1 << 20)
	w.Tag++
	if rep, err := p.s.Write(ctxFor(t, 60*time.Second), w); err != nil || rep.Messages != 2 {
		t.Fatalf("a write tagged apart from its key: %+v, %v; want it granted (2 messages)", rep, err)
	}
	if err := p.slots.Wait(ctxFor(t, 30*time.Second), w.Tag); err != nil {
		t.Fatal(err)
	}
	w = p.slot(4096)
	w.Src = bytes.Repeat([]byte{9}, 4096) // Go memory
	if rep, err := p.s.Write(ctxFor(t, 60*time.Second), w); err != nil || rep.Messages != 2 || rep.Copied != 4096 {
		t.Fatalf("a write from Go memory: %+v, %v; want it granted and copied", rep, err)
	}
	p.landed(t, w)
	if st := p.tx.Stats(); st.Direct != 0 || st.Sends != 4 || st.ControlMessages != 8 || st.CopiedBytes != 4096 {
		t.Errorf("sender stats %+v, want 4 granted sends, 8 control messages, 4096 bytes copied", st)
	}

	q := newDirectPair(t, f, 1<<20, 1<<20, nil, 1)
	for _, tr := range []*Transport{q.tx, q.rx} {
		if m := tr.Mode(); m != ModeGrant {
			t.Errorf("mode %q without a peer secret, want %q", m, ModeGrant)
		}
	}
	w = q.slot(1 << 20)
	if rep, err := q.s.Write(ctxFor(t, 60*time.Second), w); err != nil || rep.Messages != 2 {
		t.Fatalf("a write between unauthenticated peers: %+v, %v; want it granted", rep, err)
	}
	q.landed(t, w)
}

// TestTheArenaRKeyGoesOnlyToAuthenticatedPeers: a lane's connect
// answer tells where the shared registration lies, and its rkey, only to
// a dialer that proved the peer secret; without a secret (grant mode) or
// with windows, a stranger learns neither, and its writes still land
// under their grants or windows.
func TestTheArenaRKeyGoesOnlyToAuthenticatedPeers(t *testing.T) {
	for _, c := range []struct {
		name     string
		secret   []byte
		windows  bool
		wantRKey bool
	}{
		{"authenticated", testSecret, false, true},
		{"no secret", nil, false, false},
		{"windows", nil, true, false},
	} {
		t.Run(c.name, func(t *testing.T) {
			p := newPair(t, newFabric(), 1<<20, 1<<20, c.secret, 1, c.windows)
			r := p.s.(*session).region
			if got := r.RKey != 0 || r.Base != 0 || r.Size != 0; got != c.wantRKey {
				t.Errorf("the connect answer gave the dialer %+v; want the arena's place and rkey given: %t", r, c.wantRKey)
			}
			fill(p.src, 7)
			w := p.slot(64 << 10)
			if _, err := p.s.Write(ctxFor(t, 30*time.Second), w); err != nil {
				t.Fatal(err)
			}
			p.landed(t, w)
		})
	}
}

// TestDirectWritesTheSinkDoesNotCredit: the receiver cannot refuse a
// direct write before it lands, and its sender's write succeeds (its NIC
// placed the bytes); the receiver counts and logs one that names no live
// slot, or is longer than its slot, and delivers nothing for it. The lane
// carries on. A write past its slot's end is where the arena's rkey
// protects nothing: its bytes land beyond the slot.
func TestDirectWritesTheSinkDoesNotCredit(t *testing.T) {
	f := newFabric()
	p := newDirectPair(t, f, 64<<10, 1<<20, testSecret, 1)
	fill(p.src, 5)
	stray := p.slot(4096)
	stray.Key = transport.NewKey()
	stray.Tag = stray.Key.Tag()
	if _, err := p.s.Write(ctxFor(t, 30*time.Second), stray); err != nil {
		t.Fatalf("a direct write with a tag no slot has: %v; want its sender told it completed", err)
	}
	p.logs.Wait(t, "rdma: lane from", "direct write of 4096 bytes", fmt.Sprintf("tagged %#x", stray.Tag), "counted for nothing", "no receive slot has tag")

	over := p.slot(4096)
	over.Src = p.src[:8192]
	next := p.slot(4096)
	if _, err := p.s.Write(ctxFor(t, 30*time.Second), over); err != nil {
		t.Fatalf("a direct write past its slot: %v; want its sender told it completed", err)
	}
	p.logs.Wait(t, "direct write of 8192 bytes", fmt.Sprintf("tagged %#x", over.Tag), "counted for nothing", "not the whole of the slot")
	if got := p.slots.Delivered(over.Tag); got != 0 {
		t.Errorf("the overrun slot was delivered %d times, want none", got)
	}
	off := next.Remote - p.slots.Base
	if !bytes.Equal(p.slots.Mem[off:off+4096], p.src[4096:8192]) {
		t.Errorf("the overrun's bytes did not reach the next slot: the fake NIC checks only the arena's bounds, as a NIC does under the arena's rkey")
	}
	if st := p.rx.Stats(); st.DirectRefused != 2 || st.DirectCompletions != 2 {
		t.Errorf("receiver stats %+v, want 2 direct completions, both refused", st)
	}

	// The lane carries on.
	w := p.slot(64 << 10)
	if _, err := p.s.Write(ctxFor(t, 30*time.Second), w); err != nil {
		t.Fatal(err)
	}
	p.landed(t, w)
}

// TestDirectWritesGuessingTagsCloseTheLane: a lane whose direct writes
// keep naming no live slot (a sender guessing tags) is closed at the
// gate's limit, peer.MaxUnmatched, as a connection guessing keys is:
// each guess counted and logged (rate-limited), and a lane per
// MaxUnmatched guesses.
func TestDirectWritesGuessingTagsCloseTheLane(t *testing.T) {
	p := newDirectPair(t, newFabric(), 64<<10, 1<<20, testSecret, 1)
	for range peer.MaxUnmatched {
		stray := p.slot(4096)
		stray.Key = transport.NewKey()
		stray.Tag = stray.Key.Tag()
		if _, err := p.s.Write(ctxFor(t, 30*time.Second), stray); err != nil {
			t.Fatalf("a direct write with a tag no slot has: %v; want its sender told it completed", err)
		}
	}
	// The sender's completions can come before the receiver has taken
	// the lane in: its refusals first, then the lane's end.
	waitFor(t, "the receiver's refusals", func() bool { return p.rx.Stats().DirectRefused == peer.MaxUnmatched })
	waitFor(t, "the guessing lane's end", func() bool {
		p.rx.mu.Lock()
		defer p.rx.mu.Unlock()
		return len(p.rx.accepted) == 0
	})
	if st := p.rx.Stats(); st.DirectRefused != peer.MaxUnmatched {
		t.Errorf("receiver stats %+v, want %d direct writes refused", st, peer.MaxUnmatched)
	}
}

// TestDataplaneCounters is the data plane's account per send, after the
// lanes are up, on a host arena: through windows between peers without
// a secret, and under the arena's rkey between authenticated peers, no
// control message, one ibv_post_send, one signaled work request, no
// per-send registration, no CPU copy. test/rxevm prints its DATAPLANE
// lines from the soft-RoCE VM. A granted write's figures are checked
// beside them.
func TestDataplaneCounters(t *testing.T) {
	const sends, size, lanes = 64, 64 << 10, 4
	for _, c := range []struct {
		secret  []byte
		windows bool
		mode    string
	}{{nil, true, ModeWindows}, {testSecret, false, ModeArenaRKey}} {
		p := newPair(t, newFabric(), size, (sends+lanes)*size, c.secret, lanes, c.windows)
		line, per := dataplane(t, p, sends, size, lanes)
		fmt.Printf("== DATAPLANE %s\n", line)
		// The credits come back asynchronously, one per recvBatch writes
		// a lane carried, and none was short: no write waits.
		if want := "arena=host mode=" + c.mode + " control_msgs_per_send=0.00 posts_per_send=1.00 signaled_per_send=1.00 reg_mr_per_send=0.00 cpu_copy_bytes_per_send=0 credit_msgs_per_send="; !strings.HasPrefix(line, want) ||
			per.credits > 1.0/recvBatch || per.stalls != 0 {
			t.Errorf("DATAPLANE %s\nwant      %s(at most %.2f) credit_stalls=0", line, want, 1.0/recvBatch)
		}
	}

	// The same sends asking first: a header and a grant each.
	f := newFabric()
	q := newDirectPair(t, f, size, (sends+1)*size, nil, 1)
	fill(q.src, 2)
	if _, err := q.s.Write(ctxFor(t, 60*time.Second), q.slot(size)); err != nil {
		t.Fatal(err)
	}
	before := q.tx.Stats()
	for range sends {
		if _, err := q.s.Write(ctxFor(t, 60*time.Second), q.slot(size)); err != nil {
			t.Fatal(err)
		}
	}
	g := perSend(before, q.tx.Stats())
	t.Logf("mode=%s %s", q.rx.Mode(), g)
	if want := "control_msgs_per_send=2.00 posts_per_send=1.00 signaled_per_send=1.00 reg_mr_per_send=0.00 cpu_copy_bytes_per_send=0 credit_msgs_per_send="; !strings.HasPrefix(g.String(), want) {
		t.Errorf("granted sends: %s\nwant                 %s", g, want)
	}
}

// dataplane sends size-byte slots over p, first one per lane so the
// session has dialed them all, then sends more, and returns the sender's
// figures per send of those, as a line and in numbers.
func dataplane(t *testing.T, p *directPair, sends, size, lanes int) (string, sendCosts) {
	t.Helper()
	fill(p.src, 1)
	// Warm-up: one write per lane, so the session has dialed them all.
	var wg sync.WaitGroup
	for range lanes {
		w := p.slot(size)
		wg.Go(func() {
			if _, err := p.s.Write(ctxFor(t, 60*time.Second), w); err != nil {
				t.Error(err)
			}
		})
	}
	wg.Wait()
	if t.Failed() {
		t.FailNow()
	}
	before := p.tx.Stats()
	ws := make([]transport.Write, sends)
	for i := range ws {
		ws[i] = p.slot(size)
	}
	for _, w := range ws {
		if _, err := p.s.Write(ctxFor(t, 60*time.Second), w); err != nil {
			t.Fatal(err)
		}
	}
	for _, w := range ws {
		p.landed(t, w)
	}
	per := perSend(before, p.tx.Stats())
	return fmt.Sprintf("arena=host mode=%s %s", p.rx.Mode(), per), per
}

// sendCosts is what each send cost between two readings of a sender's
// Stats.
type sendCosts struct {
	control, posts, signaled, regs, copied float64
	credits                                float64 // credit messages read, per send
	stalls                                 uint64  // writes that waited for a credit, in all
}

func perSend(a, b Stats) sendCosts {
	n := float64(b.Sends - a.Sends)
	if n == 0 {
		n = 1
	}
	return sendCosts{
		control:  float64(b.ControlMessages-a.ControlMessages) / n,
		posts:    float64(b.Posts-a.Posts) / n,
		signaled: float64(b.Signaled-a.Signaled) / n,
		regs:     float64(b.PerSend-a.PerSend) / n,
		copied:   float64(b.CopiedBytes-a.CopiedBytes) / n,
		credits:  float64(b.CreditMessages-a.CreditMessages) / n,
		stalls:   b.CreditStalls - a.CreditStalls,
	}
}

func (c sendCosts) String() string {
	return fmt.Sprintf("control_msgs_per_send=%.2f posts_per_send=%.2f signaled_per_send=%.2f reg_mr_per_send=%.2f cpu_copy_bytes_per_send=%.0f credit_msgs_per_send=%.2f credit_stalls=%d",
		c.control, c.posts, c.signaled, c.regs, c.copied, c.credits, c.stalls)
}
