package rdma

import (
	"net"
	"runtime"
	"sync"
	"time"

	"github.com/ferry-project/ferry/transport"
)

// busyPoll is how long a lane's poller keeps polling its CQ after the last
// completion before it arms the completion channel and sleeps: completions
// that follow closely (the chunks of one write, the next write) are taken
// without an interrupt and a wake-up.
const busyPoll = 50 * time.Microsecond

// lane is one RC queue pair and the TCP control connection it was set up
// over, carrying one write at a time. A session pools the lanes it
// dialed; a receiving transport serves each lane it accepted.
type lane struct {
	qp   queuePair
	ctrl *net.TCPConn

	wcs     chan completion // from the poller, in CQ order
	quit    chan struct{}   // closed by close: the poller and any waiter stop
	polled  chan struct{}   // closed when the poller has returned
	pollMu  sync.Mutex
	pollErr error

	// use is held by whoever works the lane (a write, a receive loop);
	// close takes it to wait them out before destroying the QP.
	use       sync.Mutex
	closeOnce sync.Once
	closeErr  error

	seq uint32 // the sender's writes on this lane, for work request ids

	// answers carries the receiver's replies on a dialed lane (readAnswers
	// reads them); it closes when the control connection fails, after
	// ansErr is set. nil on an accepted lane.
	answers chan answer
	ansErr  error

	// The sender's bounce buffer, mapped and registered on first use.
	bounce    []byte
	bounceReg region
}

func newLane(qp queuePair, ctrl *net.TCPConn, depth int) *lane {
	l := &lane{
		qp: qp, ctrl: ctrl,
		wcs:    make(chan completion, depth),
		quit:   make(chan struct{}),
		polled: make(chan struct{}),
	}
	go l.poll()
	return l
}

// poll moves completions from the CQ to wcs: busy-polling for a short
// while after each one, then sleeping on the completion channel.
func (l *lane) poll() {
	defer close(l.polled)
	var buf [16]completion
	last := time.Now()
	armed := false
	for {
		n, err := l.qp.Poll(buf[:])
		if err != nil {
			l.setPollErr(err)
			return
		}
		for _, c := range buf[:n] {
			select {
			case l.wcs <- c:
			case <-l.quit:
				return
			}
		}
		switch {
		case n > 0:
			last, armed = time.Now(), false
		case time.Since(last) < busyPoll:
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

// answer is a receiver's reply on a dialed lane, with its grant.
type answer struct {
	reply
	grant grant
}

// readAnswers reads the receiver's replies off a dialed lane's control
// connection, so that a sender waiting for completions also hears of a
// receiver that gave up on the write or went away.
func (l *lane) readAnswers() {
	defer close(l.answers)
	for {
		var gb [grantSize]byte
		r, err := readReply(l.ctrl, gb[:])
		if err != nil {
			l.ansErr = err
			return
		}
		a := answer{reply: r}
		if r.code == transport.OK {
			a.grant.decode(&gb)
		}
		select {
		case l.answers <- a:
		case <-l.quit:
			return
		}
	}
}

// event is what a lane's user waits for: a completion or, on a dialed
// lane, an answer from the receiver (ok false: the connection failed).
type event struct {
	wc       completion
	answer   answer
	isAnswer bool
	ok       bool
}

// next waits until deadline for the next completion or answer, or until
// the lane is closing or cancel closes.
func (l *lane) next(deadline time.Time, cancel <-chan struct{}) (event, error) {
	t := time.NewTimer(time.Until(deadline))
	defer t.Stop()
	select {
	case c := <-l.wcs:
		return event{wc: c}, nil
	case a, ok := <-l.answers:
		return event{answer: a, isAnswer: true, ok: ok}, nil
	case <-l.quit:
		return event{}, errLaneClosed
	case <-l.polled:
		return event{}, l.failure()
	case <-cancel:
		return event{}, errCanceled
	case <-t.C:
		return event{}, errNoProgress
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
