package rdma

import (
	"errors"
	"sync"
	"sync/atomic"
)

// poller reaps one completion queue and hands each completion to the
// lane of the queue pair it belongs to (lane.deliver): an accepted lane's
// own CQ (or a Mooncake endpoint's), whose poller takes everything, or a
// session's, which every lane the session dialed reports to, so that one
// poller reaps the completions of all its writes, as many as have come
// at each wake-up (see pollForSleepers).
type poller struct {
	cq     completions
	shared sharedCQ // a session's, closed with the last reference; nil for a lane's own

	reapMu sync.Mutex // one reaper at a time: completions leave in CQ order
	// reaped is reap's buffer, under reapMu: a local one escapes to the
	// heap through the completions interface, an allocation per poll.
	reaped [16]completion

	polled chan struct{} // closed when the poller has returned
	quit   chan struct{} // a session's: closed with its last reference
	// sleepers counts the writes waiting for a completion on a session's
	// CQ; a token on wake has the poller reap for them.
	sleepers atomic.Int32
	wake     chan struct{}

	mu      sync.Mutex
	err     error            // why the poller stopped, once polled is closed
	stopped bool             // polled is closed
	lanes   map[uint32]*lane // by QPN
	refs    int              // a session's: the session and its lanes' QPs
}

// newLanePoller polls cq, l's own, for l until it is stopped. l is
// added first: its QP is connected, and its peer may have written.
func newLanePoller(cq completions, l *lane) *poller {
	p := &poller{cq: cq, polled: make(chan struct{}), lanes: map[uint32]*lane{l.qp.QPN(): l}}
	go p.poll()
	return p
}

// newSessionPoller polls cq for the writes of a session's lanes, which
// it holds a reference for (release).
func newSessionPoller(cq sharedCQ) *poller {
	p := &poller{
		cq: cq, shared: cq, refs: 1,
		polled: make(chan struct{}), quit: make(chan struct{}), wake: make(chan struct{}, 1),
		lanes: make(map[uint32]*lane),
	}
	go p.pollForSleepers()
	return p
}

// errSessionClosed is acquire's: the session's CQ is gone.
var errSessionClosed = errors.New("the session closed")

// acquire takes a reference for a queue pair about to be made on a
// session's CQ: the CQ stays until it is released.
func (p *poller) acquire() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.refs == 0 {
		return errSessionClosed
	}
	p.refs++
	return nil
}

// release lets go of a reference; the last stops the poller and
// destroys the CQ, whose error it returns.
func (p *poller) release() error {
	p.mu.Lock()
	p.refs--
	last := p.refs == 0
	p.mu.Unlock()
	if !last {
		return nil
	}
	close(p.quit)
	p.cq.Stop()
	<-p.polled
	return p.shared.Close()
}

// add hands the completions of l's queue pair to l from now on.
func (p *poller) add(l *lane) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.lanes[l.qp.QPN()] = l
	if p.stopped {
		l.goDown()
	}
}

// remove forgets l, whose queue pair is destroyed: what the CQ still
// holds of it is dropped.
func (p *poller) remove(l *lane) {
	p.mu.Lock()
	defer p.mu.Unlock()
	delete(p.lanes, l.qp.QPN())
}

// poll moves completions from a lane's own CQ to the lane, sleeping on
// the completion channel whenever the CQ is empty. It does not
// busy-poll: spinning costs a core's time whatever it finds, and a lane
// that takes direct writes cannot know when the next comes.
func (p *poller) poll() {
	for {
		if err := p.cq.Arm(); err != nil {
			p.stop(err)
			return
		}
		// Reap after arming: a completion that came before it raises no
		// event.
		if err := p.reap(); err != nil {
			p.stop(err)
			return
		}
		if err := p.cq.Wait(); err != nil {
			p.stop(err)
			return
		}
	}
}

// pollForSleepers is a session's poller: while a write sleeps (see
// lane.completion) it arms the completion channel, reaps, and waits for
// the next event. A write whose completion its own polling found raises
// no event: soft-RoCE completes a loopback write inside ibv_post_send,
// and a NIC a small one within microseconds.
func (p *poller) pollForSleepers() {
	for {
		select {
		case <-p.wake:
		case <-p.quit:
			p.stop(errStopped)
			return
		}
		for p.sleepers.Load() > 0 {
			if err := p.cq.Arm(); err != nil {
				p.stop(err)
				return
			}
			// Reap after arming: a completion that came before it raises
			// no event.
			if err := p.reap(); err != nil {
				p.stop(err)
				return
			}
			if p.sleepers.Load() == 0 {
				break // armed: at most one event comes for nobody
			}
			if err := p.cq.Wait(); err != nil {
				p.stop(err)
				return
			}
		}
	}
}

// stop records why the poller returns (errStopped: it was stopped),
// and takes every lane down.
func (p *poller) stop(err error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if err != errStopped {
		p.err = err
	}
	p.stopped = true
	close(p.polled)
	for _, l := range p.lanes {
		l.goDown()
	}
}

// failure says why the poller stopped.
func (p *poller) failure() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.err != nil {
		return p.err
	}
	return errLaneClosed
}

// reap takes every completion the CQ holds to its lane (see
// lane.deliver), dropping those of queue pairs gone.
func (p *poller) reap() error {
	p.reapMu.Lock()
	defer p.reapMu.Unlock()
	buf := p.reaped[:]
	for {
		n, err := p.cq.Poll(buf)
		if err != nil {
			return err
		}
		for _, c := range buf[:n] {
			p.mu.Lock()
			l := p.lanes[c.QPN]
			p.mu.Unlock()
			if l != nil {
				l.deliver(c)
			}
		}
		if n < len(buf) {
			return nil
		}
	}
}

// sleep has the poller reap for the caller until the returned func is
// called.
func (p *poller) sleep() (wakeUp func()) {
	p.sleepers.Add(1)
	select {
	case p.wake <- struct{}{}:
	default: // the poller has a call waiting already
	}
	return func() { p.sleepers.Add(-1) }
}
