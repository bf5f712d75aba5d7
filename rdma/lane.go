package rdma

import (
	"bufio"
	"net"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ferry-project/ferry/transport"
	"github.com/ferry-project/ferry/transport/peer"
)

// lane is one RC queue pair and the TCP control connection it was set up
// over. A session pools the lanes it dialed: a write holds its lane from
// its header until its last work request is posted, and may then let go
// of it before its completion (see session.write), so that the next
// write's grant round trip overlaps its transfer. A receiving transport
// serves each lane it accepted, several granted writes at a time.
type lane struct {
	qp   queuePair
	ctrl *net.TCPConn

	wcs    chan completion // from the poller, in CQ order (accepted lanes)
	quit   chan struct{}   // closed by close: the poller and any waiter stop
	polled chan struct{}   // closed when the poller has returned
	// down closes when quit, polled or dead does: waiters select on it
	// alone (see wait), and ask downErr which.
	down     chan struct{}
	downOnce sync.Once
	pollMu   sync.Mutex
	pollErr  error
	reapMu   sync.Mutex // one reaper at a time: completions leave in CQ order
	// reaped is reap's buffer, under reapMu: a local one escapes to the
	// heap through the queuePair interface, an allocation per poll.
	reaped [16]completion

	// use is held shared by whoever works the lane (the writes on it, a
	// receive loop); close takes it to wait them out before destroying
	// the QP.
	use       sync.RWMutex
	closeOnce sync.Once
	closeErr  error

	// The rest is a dialed lane's, nil or zero on an accepted one.

	seq uint32 // the sender's writes, for work request ids; under the lane's hold
	// ops is the work requests being posted, under the lane's hold: a
	// local slice escapes to the heap through the queuePair interface.
	ops []op

	// routes takes the completions reaped from the CQ to the write whose
	// sequence number their work request id carries. A write reaps once
	// itself after posting (see completion), one reaper at a time (reapMu,
	// which the poller takes too), so each gets its own in CQ order; the
	// poller reaps for them while sleepers (writes waiting for a
	// completion or a flush) count any, and a token on wake calls it.
	routeMu  sync.Mutex
	routes   map[uint32]*waiter
	sleepers atomic.Int32
	wake     chan struct{}
	// watch pokes the waiters whose deadline has passed (see
	// checkDeadlines): one timer per lane, not one per wait. watchAt is
	// when it fires, zero while stopped; both under routeMu.
	watch   *time.Timer
	watchAt time.Time
	// flying counts the writes that let go of the lane and wait for their
	// completion (at most flyingMax); landed gets a token when it drops
	// to zero.
	flying atomic.Int32
	landed chan struct{}
	// broken is set when a write that had let go of the lane failed: the
	// QP is broken, and the next write to take the lane drops it.
	broken atomic.Bool
	// stalled is set when a write's wait on the lane (a call's, on a
	// Mooncake QP) ran past the I/O timeout and broke its QP: the writes
	// flushed behind it stalled too.
	stalled atomic.Bool
	// fault is the first error completion reaped other than a flush. The
	// calls sharing a Mooncake QP name it when the break flushes theirs:
	// reaped in CQ order, it is set before any flush after it is handed
	// on (MooncakeQP.broken).
	fault atomic.Pointer[completion]
	// answered is set once the receiver answered a header on the lane;
	// unanswered, when the receiver closed the control connection before
	// answering the header of the write holding the lane (see
	// session.Write).
	answered, unanswered atomic.Bool
	// credits is the receives the receiver has posted for this lane's
	// WRITE WITH IMMs that no write has taken yet (wire.go, "Credits"):
	// the write holding the lane takes one, readAnswers adds those the
	// receiver returns, and credited gets a token when it does.
	credits  atomic.Int64
	credited chan struct{}
	// retiring is set by a write canceled while waiting for its answer,
	// which keeps the lane from the pool: out of step, it takes no more
	// writes, and closes once the writes flying on it are done
	// (session.closeIfRetired).
	retiring atomic.Bool

	// answers carries the receiver's replies to the write holding the
	// lane (readAnswers reads them). dead closes when the control
	// connection fails or the receiver failed the lane's writes, after
	// ansErr or lastWord is set.
	answers  chan answer
	dead     chan struct{}
	stats    *counters // the transport's: control messages and credits read
	ansErr   error
	lastWord peer.Reply // a reply with flagFailed: why the receiver gave up

	// rail is the index of the NIC the lane's QP is on (rails.go), and
	// peerRail, on a lane this side dialed, that of the peer's NIC its
	// QP is connected to.
	rail, peerRail int

	// The sender's bounce buffer, mapped and registered on first use.
	bounce    []byte
	bounceReg region
}

// pair is the rail pair of a lane this side dialed.
func (l *lane) pair() pair { return pair{l.rail, l.peerRail} }

// newLane makes a lane whose poller takes every completion to wcs (an
// accepted lane, a Mooncake endpoint's).
func newLane(qp queuePair, ctrl *net.TCPConn, depth int) *lane {
	l := &lane{
		qp: qp, ctrl: ctrl,
		wcs:    make(chan completion, depth),
		quit:   make(chan struct{}),
		polled: make(chan struct{}),
		down:   make(chan struct{}),
	}
	go l.poll()
	return l
}

// newDialedLane makes a session's lane, connected over ctrl: its writes
// reap their own completions, and its poller sleeps on the completion
// channel only for writes that wait longer (see completion).
func newDialedLane(qp queuePair, ctrl *net.TCPConn, stats *counters) *lane {
	l := routedLane(qp)
	l.ctrl, l.stats = ctrl, stats
	l.credited = make(chan struct{}, 1)
	l.ops = make([]op, 0, sendDepth)
	l.answers = make(chan answer, 1)
	l.landed = make(chan struct{}, 1)
	l.dead = make(chan struct{})
	l.credits.Store(recvPosted)
	go l.pollForSleepers()
	go l.readAnswers()
	return l
}

// routedLane is a lane whose completions go to the waiter their work
// request id names (see routes), its poller not yet started: a dialed
// lane's start, and a Mooncake QP's, on which several calls post at once
// (MooncakeQP.transfer).
func routedLane(qp queuePair) *lane {
	return &lane{
		qp:     qp,
		quit:   make(chan struct{}),
		polled: make(chan struct{}),
		down:   make(chan struct{}),
		routes: make(map[uint32]*waiter),
		wake:   make(chan struct{}, 1),
	}
}

// poll moves completions from the CQ to wcs, sleeping on the completion
// channel whenever the CQ is empty. It does not busy-poll: spinning costs
// a core's time whatever it finds, and a lane that takes direct writes
// cannot know when the next comes.
func (l *lane) poll() {
	defer l.stopPolling()
	for {
		if err := l.qp.Arm(); err != nil {
			l.setPollErr(err)
			return
		}
		// Reap after arming: a completion that came before it raises no
		// event.
		if _, err := l.reap(); err != nil {
			l.setPollErr(err)
			return
		}
		if err := l.qp.Wait(); err != nil {
			if err != errStopped {
				l.setPollErr(err)
			}
			return
		}
	}
}

// pollForSleepers is a dialed lane's poller: while a write sleeps (see
// completion) it arms the completion channel, reaps, and waits for the
// next event. A write whose completion its own polling found raises no
// event: soft-RoCE completes a loopback write inside ibv_post_send, and a
// NIC a small one within microseconds.
func (l *lane) pollForSleepers() {
	defer l.stopPolling()
	for {
		select {
		case <-l.wake:
		case <-l.quit:
			return
		}
		for l.sleepers.Load() > 0 {
			if err := l.qp.Arm(); err != nil {
				l.setPollErr(err)
				return
			}
			// Reap after arming: a completion that came before it raises
			// no event.
			if _, err := l.reap(); err != nil {
				l.setPollErr(err)
				return
			}
			if l.sleepers.Load() == 0 {
				break // armed: at most one event comes for nobody
			}
			if err := l.qp.Wait(); err != nil {
				if err != errStopped {
					l.setPollErr(err)
				}
				return
			}
		}
	}
}

// reap takes every completion the CQ holds to where it goes (see
// deliver) and says how many it took; errLaneClosed when the lane closes.
func (l *lane) reap() (int, error) {
	l.reapMu.Lock()
	defer l.reapMu.Unlock()
	buf := l.reaped[:]
	taken := 0
	for {
		n, err := l.qp.Poll(buf)
		if err != nil {
			return taken, err
		}
		for _, c := range buf[:n] {
			if !l.deliver(c) {
				return taken, errLaneClosed
			}
		}
		if taken += n; n < len(buf) {
			return taken, nil
		}
	}
}

// waiter is a write waiting for its completions on a dialed lane: the
// poller routes them to wcs, and deadline is when the write gives up on
// the peer (under routeMu).
type waiter struct {
	wcs      chan completion
	deadline time.Time
}

// poke is what checkDeadlines sends a waiter whose deadline has passed:
// no work request carries its id (a write's sequence number is never
// all ones with its last chunk's index).
var poke = completion{WRID: ^uint64(0)}

// completion waits until deadline for the next completion routed to w,
// or until the lane fails or cancel closes (errDead, errLaneClosed, the
// poller's error, errNoProgress, errCanceled). It reaps the CQ once
// itself (soft-RoCE completes a loopback write inside ibv_post_send),
// then sleeps on the poller. It does not busy-poll: a write spinning for
// its completion costs a core's time for as long as the NIC takes. Nor
// does it start a timer: the lane's watch pokes it at its deadline.
func (l *lane) completion(w *waiter, deadline time.Time, cancel <-chan struct{}) (completion, error) {
	if _, err := l.reap(); err != nil {
		return completion{}, err
	}
	if c, ok := w.ready(); ok {
		return c, nil
	}
	l.await(w, deadline)
	defer l.sleep()()
	for {
		select {
		case c := <-w.wcs:
			if c != poke {
				return c, nil
			}
			if !time.Now().Before(deadline) {
				return completion{}, errNoProgress
			}
			// A poke for an earlier wait of the same write.
		case <-l.down:
			err := l.downErr()
			if err == errDead {
				// A receiver whose QP a write failed (REM_ACCESS_ERR)
				// closes the control connection, which may overtake the
				// NAK: the write's completion says why better than the
				// close, and the NIC owes it shortly.
				if c, ok := l.owed(w, deadline, cancel); ok {
					return c, nil
				}
			}
			return completion{}, err
		case <-cancel:
			return completion{}, errCanceled
		}
	}
}

// deadGrace bounds how long a write whose receiver closed the control
// connection waits for the completion its NIC owes it.
const deadGrace = 200 * time.Millisecond

// owed waits, for at most deadGrace (and not past deadline), for w's
// completion after the receiver closed the control connection; the
// poller reaps for w meanwhile. It reports false when none came, the
// lane closed, or cancel closed.
func (l *lane) owed(w *waiter, deadline time.Time, cancel <-chan struct{}) (completion, bool) {
	if until := time.Until(deadline); until < deadGrace {
		deadline = time.Now().Add(max(until, 0))
	} else {
		deadline = time.Now().Add(deadGrace)
	}
	t := time.NewTimer(time.Until(deadline))
	defer t.Stop()
	for {
		select {
		case c := <-w.wcs:
			if c != poke {
				return c, true
			}
		case <-t.C:
			return completion{}, false
		case <-l.quit:
			return completion{}, false
		case <-l.polled:
			_, err := l.reap()
			c, ok := w.ready()
			return c, ok && err == nil
		case <-cancel:
			return completion{}, false
		}
	}
}

// ready takes a completion routed to w already, if there is one; a poke
// there is for an earlier wait, and goes.
func (w *waiter) ready() (completion, bool) {
	select {
	case c := <-w.wcs:
		return c, c != poke
	default:
		return completion{}, false
	}
}

// await sets w's deadline, moving the watch earlier if it must.
func (l *lane) await(w *waiter, deadline time.Time) {
	l.routeMu.Lock()
	defer l.routeMu.Unlock()
	w.deadline = deadline
	if l.watchAt.IsZero() || deadline.Before(l.watchAt) {
		l.setWatch(deadline)
	}
}

// setWatch has checkDeadlines run at at; routeMu is held.
func (l *lane) setWatch(at time.Time) {
	l.watchAt = at
	if l.watch == nil {
		l.watch = time.AfterFunc(time.Until(at), l.checkDeadlines)
		return
	}
	l.watch.Reset(time.Until(at))
}

// checkDeadlines pokes every waiter whose deadline has passed, unless a
// completion waits for it already, and sets the watch for the next
// deadline. Under steady traffic it runs about once per I/O timeout.
func (l *lane) checkDeadlines() {
	l.routeMu.Lock()
	defer l.routeMu.Unlock()
	now := time.Now()
	var next time.Time
	for _, w := range l.routes {
		switch {
		case w.deadline.IsZero():
		case !now.Before(w.deadline):
			select {
			case w.wcs <- poke:
				// One poke per wait: a write that is not reading its
				// channel (one settling its grant in land) must not
				// have it filled, which would block the poller's
				// delivery of its completions, and so the lane's.
				w.deadline = time.Time{}
			default: // full: the write has completions to take first
			}
		case next.IsZero() || w.deadline.Before(next):
			next = w.deadline
		}
	}
	l.watchAt = time.Time{}
	if !next.IsZero() {
		l.setWatch(next)
	}
}

// sleep has the poller reap for the caller until the returned func is
// called.
func (l *lane) sleep() (wakeUp func()) {
	l.sleepers.Add(1)
	select {
	case l.wake <- struct{}{}:
	default: // the poller has a call waiting already
	}
	return func() { l.sleepers.Add(-1) }
}

// stopPolling marks the poller returned.
func (l *lane) stopPolling() {
	close(l.polled)
	l.goDown()
}

// goDown closes down, once.
func (l *lane) goDown() { l.downOnce.Do(func() { close(l.down) }) }

// downErr says why down closed: the receiver gave up on the lane
// (errDead), the lane closed, or why its poller stopped.
func (l *lane) downErr() error {
	select {
	case <-l.dead: // nil on an accepted lane: never
		return errDead
	default:
	}
	select {
	case <-l.quit:
		return errLaneClosed
	default:
	}
	return l.failure()
}

func (l *lane) setPollErr(err error) {
	l.pollMu.Lock()
	l.pollErr = err
	l.pollMu.Unlock()
}

// failure says why the poller stopped.
func (l *lane) failure() error {
	l.pollMu.Lock()
	defer l.pollMu.Unlock()
	if l.pollErr != nil {
		return l.pollErr
	}
	return errLaneClosed
}

// deliver hands c to its write on a dialed lane (dropping it when that
// write has gone), or to wcs on an accepted one. It reports false when
// the lane is closing.
func (l *lane) deliver(c completion) bool {
	if c.Status != wcSuccess && c.Status != wcWRFlushErr && l.fault.Load() == nil {
		f := c // only a fault's escapes
		l.fault.CompareAndSwap(nil, &f)
	}
	to := l.wcs
	if l.routes != nil {
		l.routeMu.Lock()
		w := l.routes[uint32(c.WRID>>32)]
		l.routeMu.Unlock()
		if w == nil {
			return true
		}
		to = w.wcs
	}
	select {
	case to <- c: // the common case: there is room (see session.post)
		return true
	default:
	}
	select {
	case to <- c:
		return true
	case <-l.quit:
		return false
	}
}

// route sends the completions of the write numbered seq to w until
// unroute.
func (l *lane) route(seq uint32, w *waiter) {
	l.routeMu.Lock()
	l.routes[seq] = w
	l.routeMu.Unlock()
}

func (l *lane) unroute(seq uint32) {
	l.routeMu.Lock()
	delete(l.routes, seq)
	l.routeMu.Unlock()
}

// answer is a receiver's reply on a dialed lane, with its grant.
type answer struct {
	peer.Reply
	grant grant
}

// readAnswers reads the receiver's replies off a dialed lane's control
// connection: the one answer to each header, for the write holding the
// lane, credits, and a failure report, which ends the lane for every
// write on it.
func (l *lane) readAnswers() {
	defer l.goDown()
	defer close(l.dead)
	// Buffered: a reply and its grant usually come in one read.
	in := bufio.NewReaderSize(l.ctrl, peer.ReplySize+peer.MaxMessage+grantSize)
	for {
		var gb [grantSize]byte
		r, err := readReply(in, gb[:])
		if err != nil {
			l.ansErr = err
			return
		}
		if r.Flags&flagCredit != 0 {
			l.stats.credits.Add(1)
			l.credits.Add(int64(decodeCredit(&gb)))
			select {
			case l.credited <- struct{}{}:
			default: // a token is there already
			}
			continue
		}
		l.stats.control.Add(1)
		if r.Flags&flagFailed != 0 {
			l.lastWord = r
			return
		}
		a := answer{Reply: r}
		if r.Code == transport.OK {
			a.grant.decode(&gb)
		}
		select {
		case l.answers <- a:
		case <-l.quit:
			return
		}
	}
}

// ended reports whether a dialed lane's control connection has ended
// (its receiver closed it, or failed the lane's writes).
func (l *lane) ended() bool {
	select {
	case <-l.dead:
		return true
	default:
		return false
	}
}

// wait waits until deadline for a value from ch (nil: none), or until the
// receiver gives up on the lane (dead), the lane closes, its poller
// stops, or cancel closes. Those three are one channel, down: each case
// of a select costs a lock and a queue entry, twice.
func wait[T any](l *lane, ch <-chan T, deadline time.Time, cancel <-chan struct{}) (T, error) {
	var zero T
	t := time.NewTimer(time.Until(deadline))
	defer t.Stop()
	select {
	case v := <-ch:
		return v, nil
	case <-l.down:
		return zero, l.downErr()
	case <-cancel:
		return zero, errCanceled
	case <-t.C:
		return zero, errNoProgress
	}
}

// abort stops the lane's traffic without waiting for its user: the QP goes
// to the error state (the NIC stops and flushes), the control connection
// closes (blocked reads return), and waiters on completions return.
func (l *lane) abort() {
	l.qp.Break()
	if l.ctrl != nil { // a Mooncake endpoint's lanes have none
		l.ctrl.Close()
	}
}

// close aborts the lane, waits for its user to let go, and destroys it.
// It is safe to call more than once and from any goroutine.
func (l *lane) close() error {
	l.closeOnce.Do(func() {
		l.abort()
		close(l.quit)
		l.goDown()
		if l.routes != nil {
			l.routeMu.Lock()
			if l.watch != nil {
				l.watch.Stop()
			}
			l.routeMu.Unlock()
		}
		l.use.Lock()
		defer l.use.Unlock()
		l.qp.Stop()
		<-l.polled
		l.closeErr = l.qp.Close()
		if l.bounceReg != nil {
			l.bounceReg.Close()
			unmap(l.bounce)
		}
	})
	return l.closeErr
}
