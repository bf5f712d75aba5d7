package rdma

import (
	"bufio"
	"net"
	"runtime"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ferry-project/ferry/transport"
	"github.com/ferry-project/ferry/transport/tcp"
)

// busyPoll is how long a lane's poller keeps polling its CQ after the last
// completion before it arms the completion channel and sleeps: completions
// that follow closely (the chunks of one write, the next write) are taken
// without an interrupt and a wake-up.
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

	// use is held shared by whoever works the lane (the writes on it, a
	// receive loop); close takes it to wait them out before destroying
	// the QP.
	use       sync.RWMutex
	closeOnce sync.Once
	closeErr  error

	// The rest is a dialed lane's, nil or zero on an accepted one.

	seq uint32 // the sender's writes, for work request ids; under the lane's hold

	// routes takes the poller's completions to the write whose sequence
	// number their work request id carries.
	routeMu sync.Mutex
	routes  map[uint32]chan completion
	// flying counts the writes that let go of the lane and wait for their
	// completion (at most flyingMax); landed gets a token when it drops
	// to zero.
	flying atomic.Int32
	landed chan struct{}
	// broken is set when a write that had let go of the lane failed: the
	// QP is broken, and the next write to take the lane drops it.
	broken atomic.Bool
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
	ansErr   error
	lastWord reply // a reply with flagFailed: why the receiver gave up

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
			if !l.deliver(c) {
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
	reply
	grant grant
}

// readAnswers reads the receiver's replies off a dialed lane's control
// connection: the one answer to each header, for the write holding the
// lane, and a failure report, which ends the lane for every write on it.
func (l *lane) readAnswers() {
	defer close(l.dead)
	// Buffered: a reply and its grant usually come in one read.
	in := bufio.NewReaderSize(l.ctrl, tcp.ReplySize+tcp.MaxMessage+grantSize)
	for {
		var gb [grantSize]byte
		r, err := readReply(in, gb[:])
		if err != nil {
			l.ansErr = err
			return
		}
		if r.flags&flagFailed != 0 {
			l.lastWord = r
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
