package rdma

import (
	"bufio"
	"net"
	"runtime"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ferry-project/ferry/transport"
	"github.com/ferry-project/ferry/transport/peer"
)

// busyPoll is how long a CQ is polled before its completion channel is
// armed and slept on: on an accepted lane after its last completion (the
// chunks of one write and the next write follow closely), on a dialed one
// by a write after posting (see completion). Completions taken so cost no
// interrupt and no wake-up.
const busyPoll = 50 * time.Microsecond

// lane is one RC queue pair and the TCP control connection it was set up
// over. A session pools the lanes it dialed: a write holds its lane from
// its header until its last work request is posted, and may then let go
// of it before its completion (see session.write), so that the next
// write's grant round trip overlaps its transfer. A receiving transport
// serves each lane it accepted, several granted writes at a time.
type lane struct {
	qp   queuePair
	ctrl *net.TCPConn

	wcs     chan completion // from the poller, in CQ order (accepted lanes)
	quit    chan struct{}   // closed by close: the poller and any waiter stop
	polled  chan struct{}   // closed when the poller has returned
	pollMu  sync.Mutex
	pollErr error
	reapMu  sync.Mutex // one reaper at a time: completions leave in CQ order
	// reaped is reap's buffer, under reapMu: a local one escapes to the
	// heap through the queuePair interface, an allocation per poll.
	reaped [16]completion
	// announced is set on an accepted lane whose every write is granted
	// (its transport takes no direct writes): nothing arrives there
	// unless granted counts it, so its poller busy-polls only then.
	// granted is the receiver's writes granted and not yet completed.
	announced bool
	granted   atomic.Int32

	// use is held shared by whoever works the lane (the writes on it, a
	// receive loop); close takes it to wait them out before destroying
	// the QP.
	use       sync.RWMutex
	closeOnce sync.Once
	closeErr  error

	// The rest is a dialed lane's, nil or zero on an accepted one.

	seq uint32 // the sender's writes, for work request ids; under the lane's hold

	// routes takes the completions reaped from the CQ to the write whose
	// sequence number their work request id carries. Writes reap for
	// themselves (see completion), one at a time (reapMu, which the
	// poller takes too), so each gets its own in CQ order; the poller
	// reaps for them while sleepers (writes that polled for busyPoll in
	// vain, or wait for a flush) count any, and a token on wake calls it.
	routeMu  sync.Mutex
	routes   map[uint32]chan completion
	sleepers atomic.Int32
	wake     chan struct{}
	// flying counts the writes that let go of the lane and wait for their
	// completion (at most flyingMax); landed gets a token when it drops
	// to zero.
	flying atomic.Int32
	landed chan struct{}
	// broken is set when a write that had let go of the lane failed: the
	// QP is broken, and the next write to take the lane drops it.
	broken atomic.Bool
	// answered is set once the receiver answered a header on the lane;
	// unanswered, when the receiver closed the control connection before
	// answering the header of the write holding the lane (see
	// session.Write).
	answered, unanswered atomic.Bool
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
	replies  *atomic.Uint64 // the transport's control message count
	ansErr   error
	lastWord peer.Reply // a reply with flagFailed: why the receiver gave up

	// The sender's bounce buffer, mapped and registered on first use.
	bounce    []byte
	bounceReg region
}

// newLane makes a lane whose poller takes every completion to wcs (an
// accepted lane, a Mooncake endpoint's); announced as the field says.
func newLane(qp queuePair, ctrl *net.TCPConn, depth int, announced bool) *lane {
	l := &lane{
		qp: qp, ctrl: ctrl, announced: announced,
		wcs:    make(chan completion, depth),
		quit:   make(chan struct{}),
		polled: make(chan struct{}),
	}
	go l.poll()
	return l
}

// newDialedLane makes a session's lane, connected over ctrl: its writes
// reap their own completions, and its poller sleeps on the completion
// channel only for writes that wait longer (see completion).
func newDialedLane(qp queuePair, ctrl *net.TCPConn, replies *atomic.Uint64) *lane {
	l := &lane{
		qp: qp, ctrl: ctrl, replies: replies,
		quit:    make(chan struct{}),
		polled:  make(chan struct{}),
		routes:  make(map[uint32]chan completion),
		wake:    make(chan struct{}, 1),
		answers: make(chan answer, 1),
		landed:  make(chan struct{}, 1),
		dead:    make(chan struct{}),
	}
	go l.pollForSleepers()
	go l.readAnswers()
	return l
}

// poll moves completions from the CQ to wcs: busy-polling for a short
// while after each one, then sleeping on the completion channel. A lane
// whose writes are all announced sleeps at once when none is granted:
// spinning then only waits out the sender's next header and its grant.
func (l *lane) poll() {
	defer close(l.polled)
	last := time.Now()
	armed := false
	for {
		n, err := l.reap()
		if err != nil {
			l.setPollErr(err)
			return
		}
		switch {
		case n > 0:
			last, armed = time.Now(), false
		case time.Since(last) < busyPoll && (!l.announced || l.granted.Load() > 0):
			runtime.Gosched()
		case !armed:
			// Poll once more after arming: a completion that came in
			// between the last poll and the arming raises no event.
			if err := l.qp.Arm(); err != nil {
				l.setPollErr(err)
				return
			}
			armed = true
		default:
			if err := l.qp.Wait(); err != nil {
				if err != errStopped {
					l.setPollErr(err)
				}
				return
			}
			armed = false
		}
	}
}

// pollForSleepers is a dialed lane's poller: while a write sleeps (see
// completion) it arms the completion channel, reaps, and waits for the
// next event. A write whose completion its own polling found raises no
// event: soft-RoCE completes a loopback write inside ibv_post_send, and a
// NIC a small one within microseconds.
func (l *lane) pollForSleepers() {
	defer close(l.polled)
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

// completion waits until deadline for the next completion routed to wcs,
// or until the lane fails or cancel closes (see wait). It polls the CQ
// itself for busyPoll, then sleeps on the poller.
func (l *lane) completion(wcs chan completion, deadline time.Time, cancel <-chan struct{}) (completion, error) {
	for end := time.Now().Add(busyPoll); ; runtime.Gosched() {
		if _, err := l.reap(); err != nil {
			return completion{}, err
		}
		select {
		case c := <-wcs:
			return c, nil
		default:
		}
		if time.Now().After(end) {
			break
		}
	}
	defer l.sleep()()
	return wait(l, wcs, deadline, cancel)
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
	to := l.wcs
	if l.routes != nil {
		l.routeMu.Lock()
		to = l.routes[uint32(c.WRID>>32)]
		l.routeMu.Unlock()
		if to == nil {
			return true
		}
	}
	select {
	case to <- c:
		return true
	case <-l.quit:
		return false
	}
}

// route sends the completions of the write numbered seq to wcs until
// unroute.
func (l *lane) route(seq uint32, wcs chan completion) {
	l.routeMu.Lock()
	l.routes[seq] = wcs
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
// lane, and a failure report, which ends the lane for every write on it.
func (l *lane) readAnswers() {
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
		l.replies.Add(1)
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
// receiver gives up on the lane (dead), the lane closes, or cancel closes.
func wait[T any](l *lane, ch <-chan T, deadline time.Time, cancel <-chan struct{}) (T, error) {
	var zero T
	t := time.NewTimer(time.Until(deadline))
	defer t.Stop()
	select {
	case v := <-ch:
		return v, nil
	case <-l.dead:
		return zero, errDead
	case <-l.quit:
		return zero, errLaneClosed
	case <-l.polled:
		return zero, l.failure()
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
