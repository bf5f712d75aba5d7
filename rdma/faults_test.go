package rdma

import (
	"bytes"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ferry-project/ferry/transport"
	"github.com/ferry-project/ferry/transport/peer"
	"github.com/ferry-project/ferry/transport/transporttest"
)

// Faults of the verbs path under a real write (session.Write on the
// sender, the receiver's grant and completion check): the peer's queue
// pair failing or going away mid-stream, and a write under an rkey the
// receiver never granted. A hook beneath the nic seam picks the moment;
// the NIC underneath (rxe in the soft-RoCE VM, else the fake) does the
// rest.

// hook changes what a transport's queue pairs do, for one fault at a time.
type hook struct {
	mu sync.Mutex
	// split, when set, is taken by the next post of more than one work
	// request: the first half goes to the NIC, split runs, then the rest.
	split func(first []op)
	// edit, when set, changes every work request of the next post: a
	// write under a key the receiver never granted, say.
	edit func(o *op)
	// gate, when set, holds every poll that found completions until it
	// is closed: the lane learns of them only then.
	gate chan struct{}
}

// arm sets h's fields under its lock: the lanes' goroutines read them.
func (h *hook) arm(set func(h *hook)) {
	h.mu.Lock()
	defer h.mu.Unlock()
	set(h)
}

func (h *hook) take() (split func([]op), edit func(o *op)) {
	h.mu.Lock()
	defer h.mu.Unlock()
	split, edit = h.split, h.edit
	h.split, h.edit = nil, nil
	return split, edit
}

type hookNIC struct {
	nic
	h *hook
}

func (n hookNIC) NewQP(sendDepth, recvDepth int) (queuePair, error) {
	q, err := n.nic.NewQP(sendDepth, recvDepth)
	if err != nil {
		return nil, err
	}
	return hookQP{q, n.h}, nil
}

type hookQP struct {
	queuePair
	h *hook
}

func (q hookQP) Post(ops []op) error {
	split, edit := q.h.take()
	if edit != nil {
		ops = slices.Clone(ops)
		for i := range ops {
			edit(&ops[i])
		}
	}
	if split != nil && len(ops) > 1 {
		half := len(ops) / 2
		if err := q.queuePair.Post(ops[:half]); err != nil {
			return err
		}
		split(ops[:half])
		ops = ops[half:]
	}
	return q.queuePair.Post(ops)
}

func (q hookQP) Poll(into []completion) (int, error) {
	n, err := q.queuePair.Poll(into)
	q.h.mu.Lock()
	gate := q.h.gate
	q.h.mu.Unlock()
	if n > 0 && gate != nil {
		select {
		case <-gate:
		case <-time.After(30 * time.Second): // a test that forgot its gate
		}
	}
	return n, err
}

// listenHooked is listenT over a NIC whose queue pairs h steers.
func listenHooked(t *testing.T, f *fabric, cfg Config, h *hook) *Transport {
	t.Helper()
	n := testNIC(t, f, 1)
	tr, err := listen(testConfig(t, cfg), hookNIC{n, h})
	if err != nil {
		n.Close()
		t.Fatal(err)
	}
	closeAtEnd(t, tr)
	return tr
}

// faultPair is a sender over a hooked NIC, a receiver over slots with its
// own hook and log, and a session between them.
type faultPair struct {
	f        *fabric
	src      []byte
	slots    *transporttest.Slots
	tx, rx   *Transport
	txh, rxh *hook
	logs     *transporttest.Logs
	s        transport.Session
	nextAddr uint64
	tags     uint32
}

func newFaultPair(t *testing.T, size int) *faultPair {
	t.Helper()
	p := &faultPair{f: newFabric(), src: mapT(t, size), slots: mappedSlots(t, 4*size), txh: &hook{}, rxh: &hook{}, logs: &transporttest.Logs{}}
	// Every byte non-zero: a landed byte shows.
	for i := range p.src {
		p.src[i] = byte(i%251) + 1
	}
	p.tx = listenHooked(t, p.f, Config{Memory: p.src}, p.txh)
	p.rx = listenHooked(t, p.f, Config{Peer: peer.Config{Sink: p.slots, Logf: p.logs.Logf}, Memory: p.slots.Mem}, p.rxh)
	p.dial(t)
	return p
}

// dial replaces the session, as the daemon's teardown and re-dial does.
func (p *faultPair) dial(t *testing.T) {
	t.Helper()
	if p.s != nil {
		p.s.Close()
	}
	p.s = dialT(t, p.tx, p.rx)
}

// slot makes a receive slot of n bytes and a write of src[:n] to it.
func (p *faultPair) slot(n int) transport.Write {
	addr := p.nextAddr
	p.nextAddr += uint64(n+4095) &^ 4095
	p.tags++
	return transport.Write{Src: p.src[:n], Remote: addr, Key: p.slots.Add(addr, uint64(n)), Tag: 0x7000 + p.tags}
}

func (p *faultPair) write(t *testing.T, w transport.Write) error {
	_, err := p.s.Write(ctxFor(t, 60*time.Second), w)
	return err
}

// landed checks that w was delivered once, byte-exact.
func (p *faultPair) landed(t *testing.T, w transport.Write) {
	t.Helper()
	if err := p.slots.Wait(ctxFor(t, 30*time.Second), w.Tag); err != nil {
		t.Fatal(err)
	}
	if n := p.slots.Delivered(w.Tag); n != 1 {
		t.Errorf("the write tagged %#x was delivered %d times", w.Tag, n)
	}
	if !bytes.Equal(p.slots.Mem[w.Remote:w.Remote+uint64(len(w.Src))], w.Src) {
		t.Errorf("the write tagged %#x landed wrong", w.Tag)
	}
}

// undelivered checks that the receiver let go of w's slot without
// delivering it.
func (p *faultPair) undelivered(t *testing.T, w transport.Write) {
	t.Helper()
	if err := p.slots.WaitIdle(ctxFor(t, 30*time.Second)); err != nil {
		t.Fatal(err)
	}
	if n := p.slots.Delivered(w.Tag); n != 0 {
		t.Errorf("the failed write tagged %#x was delivered %d times", w.Tag, n)
	}
}

// acceptedLanes is the receiver's lanes being served.
func (p *faultPair) acceptedLanes() []*lane {
	p.rx.mu.Lock()
	defer p.rx.mu.Unlock()
	var ls []*lane
	for l := range p.rx.accepted {
		ls = append(ls, l)
	}
	return ls
}

// waitAccepted waits (30 s at most) until the receiver serves n lanes.
func (p *faultPair) waitAccepted(t *testing.T, n int) {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	tick := time.NewTicker(time.Millisecond) // a poll: a lane's end signals nobody
	defer tick.Stop()
	for ; len(p.acceptedLanes()) != n; <-tick.C {
		if time.Now().After(deadline) {
			t.Fatalf("the receiver serves %d lanes, want %d", len(p.acceptedLanes()), n)
		}
	}
}

// waitLanded waits (30 s at most) until the receiver's memory at addr
// holds want: the NIC placed it. Unsignaled writes tell nobody, so this
// polls, under the fake fabric's lock (its NIC copies under it).
func (p *faultPair) waitLanded(t *testing.T, addr uint64, want []byte) {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	tick := time.NewTicker(time.Millisecond)
	defer tick.Stop()
	for ; ; <-tick.C {
		p.f.mu.Lock()
		ok := bytes.Equal(p.slots.Mem[addr:addr+uint64(len(want))], want)
		p.f.mu.Unlock()
		if ok {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("the first %d bytes of the write never landed", len(want))
		}
	}
}

// logEach logs what the receiver logged so far.
func logEach(t *testing.T, l *transporttest.Logs) {
	for _, line := range l.Lines() {
		t.Logf("receiver: %s", line)
	}
}

// statusIn is the first ibv_wc_status name (other than SUCCESS) in msg.
func statusIn(msg string) string {
	for s, i := range wcStatusInfo {
		if s != wcSuccess && strings.Contains(msg, i.name) {
			return i.name
		}
	}
	return ""
}

// TestPeerQPFailsMidStream: with the first half of a write's messages
// placed in the receiver's slot, the receiver's queue pair goes to the
// error state (ToError) or is destroyed with its lane (Destroyed), and
// the rest of the write goes to it. The write fails, naming the verbs
// status or the control connection that broke, without a refusal and
// within its deadline; the slot is let go undelivered; the retry to the
// same slot over a re-dialed session, as the daemon makes, lands
// byte-exact, and so does a later write.
func TestPeerQPFailsMidStream(t *testing.T) {
	for _, c := range []struct {
		name string
		// logs: the receiver logs why its lane ended, naming the write
		// (it ended the lane itself, on its flushed receive).
		logs  bool
		fault func(p *faultPair)
	}{
		{"ToError", true, func(p *faultPair) {
			for _, l := range p.acceptedLanes() {
				l.qp.Break()
			}
		}},
		{"Destroyed", false, func(p *faultPair) {
			// As the receiver ends a lane: its QP to the error state,
			// the control connection closed, the QP destroyed once the
			// receiver's goroutine lets go.
			for _, l := range p.acceptedLanes() {
				l.close()
			}
		}},
	} {
		t.Run(c.name, func(t *testing.T) {
			const size = 8<<20 + 5 // nine messages
			p := newFaultPair(t, size)
			w := p.slot(size)
			var half int
			p.txh.arm(func(h *hook) {
				h.split = func(first []op) {
					half = len(first) * chunk
					p.waitLanded(t, w.Remote, w.Src[:half])
					c.fault(p)
				}
			})
			start := time.Now()
			err := p.write(t, w)
			took := time.Since(start)
			if half == 0 {
				t.Fatal("the write was never split: its messages went in one post of one")
			}
			switch {
			case err == nil:
				t.Fatalf("a write whose peer QP failed after %d of its %d bytes succeeded", half, size)
			case transport.IsRefusal(err):
				t.Fatalf("got a refusal: %v", err)
			case c.name == "ToError" && statusIn(err.Error()) == "":
				t.Fatalf("%v; want the verbs status that broke the write", err)
			case c.name == "Destroyed" && statusIn(err.Error()) == "" && !strings.Contains(err.Error(), "closed the control connection"):
				t.Fatalf("%v; want the verbs status or the closed control connection", err)
			}
			t.Logf("after %d bytes placed, in %s: %v (ret %q)", half, took.Round(time.Millisecond), err, transport.StatusName(err))
			p.undelivered(t, w)
			if c.logs {
				p.logs.Wait(t, "rdma: lane from", "tagged", "WR_FLUSH_ERR")
			}
			logEach(t, p.logs)
			p.waitAccepted(t, 0)
			if st := p.rx.Stats(); st.Failed != 1 {
				t.Errorf("receiver stats %+v, want the failed write counted", st)
			}

			// The daemon's retry: a fresh session, the same slot.
			p.dial(t)
			if err := p.write(t, w); err != nil {
				t.Fatalf("the retry to the same slot: %v", err)
			}
			p.landed(t, w)
			later := p.slot(1 << 20)
			if err := p.write(t, later); err != nil {
				t.Fatalf("a later write: %v", err)
			}
			p.landed(t, later)
		})
	}
}

// TestInvalidRKey: a sender writes under an rkey the receiver never
// granted. Its NIC reports REM_ACCESS_ERR, by the name the daemon reports
// as ret; its lane is torn down. The receiver's queue pair fails (the
// peer's NIC moves it to the error state, or ferry does when the sender's
// control connection closes), its lane ends with a logged reason,
// nothing is delivered and the slot is let go untouched. Both sides then
// carry writes on new lanes, to that slot and another. The receiver
// learns of its failed queue pair only once the sender's write has
// returned, so that the sender's report is its own NIC's.
func TestInvalidRKey(t *testing.T) {
	const size = 1<<20 + 7 // two messages
	p := newFaultPair(t, size)
	warm := p.slot(4096)
	if err := p.write(t, warm); err != nil {
		t.Fatal(err)
	}
	p.landed(t, warm)

	w := p.slot(size)
	p.txh.arm(func(h *hook) { h.edit = func(o *op) { o.RKey ^= 0x5a5a00 } })
	gate := make(chan struct{})
	p.rxh.arm(func(h *hook) { h.gate = gate })
	t.Cleanup(func() {
		select {
		case <-gate:
		default:
			close(gate)
		}
	})
	err := p.write(t, w)
	close(gate)
	if name := transport.StatusName(err); name != "REM_ACCESS_ERR" {
		t.Fatalf("write under a wrong rkey: %v (ret %q); want REM_ACCESS_ERR", err, name)
	}
	t.Logf("write under a wrong rkey: %v", err)
	p.undelivered(t, w)
	if !isZero(p.slots.Mem[w.Remote : w.Remote+size]) {
		t.Error("a write the receiver's NIC refused changed the slot")
	}
	p.logs.Wait(t, "rdma: lane from", "receive completed with", "tagged")
	p.waitAccepted(t, 0)
	if st := p.rx.Stats(); st.Failed != 1 || st.Rejected != 0 {
		t.Errorf("receiver stats %+v, want the failed write counted, and no completion rejected", st)
	}
	logEach(t, p.logs)

	// Both sides go on, on new lanes of the same session.
	if err := p.write(t, w); err != nil {
		t.Fatalf("the write to the same slot with the granted rkey: %v", err)
	}
	p.landed(t, w)
	later := p.slot(4096)
	if err := p.write(t, later); err != nil {
		t.Fatalf("a later write: %v", err)
	}
	p.landed(t, later)
	p.waitAccepted(t, 1)
}
