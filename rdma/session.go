package rdma

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"sync"
	"time"

	"github.com/ferry-project/ferry/internal/pool"
	"github.com/ferry-project/ferry/transport"
	"github.com/ferry-project/ferry/transport/peer"
)

// Dial opens a session to the peer daemon at addr with one lane. A peer
// that serves no RDMA gets a TCP session instead, and the fallback is
// logged.
func (t *Transport) Dial(ctx context.Context, addr string) (transport.Session, error) {
	if t.isClosing() {
		return nil, fmt.Errorf("rdma dial %s: %w", addr, transport.ErrClosed)
	}
	l, instance, region, err := t.dialLane(ctx, addr, pair{})
	if errors.Is(err, peer.ErrNoRDMA) {
		t.logf("rdma: %s serves no RDMA (it runs the tcp transport, or has no usable RDMA port): this session falls back to TCP", addr)
		return t.tcp.Dial(ctx, addr)
	}
	if err != nil {
		return nil, fmt.Errorf("rdma dial %s: %w", addr, err)
	}
	s := &session{Session: peer.NewSession("rdma", "control connection", addr, instance, t.cfg.Peer.IOTimeout), t: t, region: region}
	// Through windows any peer writes directly, the NIC bounding each
	// write to its slot; under the arena's rkey only between peers that
	// proved the peer secret in the handshake (else it failed).
	s.direct = region.Direct && (region.Mode == modeWindows || t.cfg.Peer.Secret != nil)
	s.pool = pool.New(t.cfg.Peer.MaxConnsPerPeer, func(ctx context.Context) (*lane, error) { return s.openOn(ctx, pair{}) }, func(l *lane) { l.close() })
	s.pool.Add(l)
	s.pools = map[pair]*pool.Pool[*lane]{{}: s.pool}
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.closed {
		s.closePools()
		return nil, fmt.Errorf("rdma dial %s: %w", addr, transport.ErrClosed)
	}
	t.sessions[s] = struct{}{}
	return s, nil
}

// dialLane opens a control connection to addr and connects a new QP on
// the NIC of pr's local rail over it to a QP on the peer's rail pr.peer.
// It returns the peer's instance and what it says of its memory.
func (t *Transport) dialLane(ctx context.Context, addr string, pr pair) (_ *lane, instance uint64, _ peerRegion, err error) {
	c, instance, err := t.port.Dial(ctx, addr, peer.KindRDMA)
	if err != nil {
		return nil, 0, peerRegion{}, err
	}
	n := t.rails[pr.local].nic
	qp, err := n.NewQP(sendDepth+flyingMax*flyingChunks, 1)
	if err != nil {
		c.Close()
		return nil, 0, peerRegion{}, fmt.Errorf("creating a queue pair: %w", err)
	}
	defer func() {
		if err != nil {
			qp.Close()
			c.Close()
		}
	}()
	hctx, cancel := context.WithTimeout(ctx, t.cfg.Peer.HandshakeTimeout)
	defer cancel()
	stop := context.AfterFunc(hctx, func() { c.Close() })
	deadline, _ := hctx.Deadline()
	c.SetDeadline(deadline)

	psn := rand.Uint32() & 0xffffff
	local := n.Endpoint()
	local.QPN, local.PSN = qp.QPN(), psn
	var b [endpointSize]byte
	local.encode(b[:])
	b[connectRail], b[connectRails] = byte(pr.peer), byte(len(t.rails))
	var ab [acceptSize]byte
	var r peer.Reply
	if _, err = c.Write(b[:]); err == nil {
		r, err = readReply(c, ab[:])
	}
	if err != nil {
		return nil, 0, peerRegion{}, t.port.DialErr(ctx, hctx, "connecting a queue pair", err)
	}
	if r.Code != transport.OK {
		return nil, 0, peerRegion{}, fmt.Errorf("the peer could not open a lane (%s): %s", r.Code, r.Msg)
	}
	var a accept
	a.decode(&ab)
	if err = a.check(pr.peer); err != nil {
		return nil, 0, peerRegion{}, err
	}
	if err = qp.Connect(psn, a.endpoint); err != nil {
		return nil, 0, peerRegion{}, fmt.Errorf("connecting to the peer's queue pair %#x: %w", a.QPN, err)
	}
	if !stop() {
		return nil, 0, peerRegion{}, fmt.Errorf("connecting a queue pair: %w", transport.ContextErr(hctx))
	}
	c.SetDeadline(time.Time{})
	l := newDialedLane(qp, c, &t.stats)
	l.rail, l.peerRail = pr.local, pr.peer
	return l, instance, a.peerRegion, nil
}

// session is a pool of lanes to one peer. A write holds a lane from its
// header to its last post; concurrent writes take separate lanes while
// the pool may open more, and share them (one posting, several waiting
// for their completions) once it is full.
type session struct {
	peer.Session
	t      *Transport
	region peerRegion        // the peer's shared registration, from the connect
	direct bool              // the peer takes direct writes from this daemon
	pool   *pool.Pool[*lane] // the lanes of rail 0 to the peer's rail 0: pools[pair{}]
	// pools holds the lanes of each rail pair opened (rails.go), under
	// poolMu; once poolsClosed, no more open.
	poolMu      sync.Mutex
	pools       map[pair]*pool.Pool[*lane]
	poolsClosed bool
}

// Close destroys every lane of the session; writes in flight fail.
func (s *session) Close() error {
	s.closePools()
	s.t.mu.Lock()
	delete(s.t.sessions, s)
	s.t.mu.Unlock()
	return nil
}

func (s *session) closePools() {
	s.poolMu.Lock()
	s.poolsClosed = true
	pools := make([]*pool.Pool[*lane], 0, len(s.pools))
	for _, p := range s.pools {
		pools = append(pools, p)
	}
	s.poolMu.Unlock()
	for _, p := range pools {
		p.Close()
	}
}

// openOn dials one more lane over rail pair pr, to the same peer process
// as the first.
func (s *session) openOn(ctx context.Context, pr pair) (*lane, error) {
	l, instance, _, err := s.t.dialLane(ctx, s.Peer(), pr)
	if err != nil {
		return nil, err
	}
	if err := s.Restarted(instance); err != nil {
		l.close()
		return nil, err
	}
	return l, nil
}

// Write carries w on a lane; its report says how the source reached the
// NIC (memory.go).
func (s *session) Write(ctx context.Context, w transport.Write) (transport.Report, error) {
	if err := s.Begin(ctx, s.pool.Closed()); err != nil {
		return transport.Report{}, err
	}
	var p plan
	p.kind, p.lkey = s.t.kindOf(&w)
	if s.stripes(&w, &p) {
		return s.sendOnRails(ctx, &w, &p, s.arenaRails(), &s.t.stats.striped)
	}
	if g, ok := s.directGrant(&w, p.kind); ok {
		p.dg = &g
	} else if on, ok := s.regionRails(&w); ok {
		return s.sendOnRails(ctx, &w, &p, on, &s.t.stats.railed)
	}
	pr := s.pairFor(&w, &p)
	if err := s.writeOn(ctx, pr, &w, &p); err != nil {
		return transport.Report{}, err
	}
	s.t.sent(pr.local, w.Len())
	rep := p.kind.report(w.Len())
	s.t.stats.sends.Add(1)
	if pr.local != 0 {
		s.t.stats.railed.Add(1)
	}
	if p.dg != nil {
		s.t.stats.direct.Add(1)
	} else {
		rep.Messages = peer.Messages
	}
	return rep, nil
}

// writeOn carries w on a lane of rail pair pr.
func (s *session) writeOn(ctx context.Context, pr pair, w *transport.Write, p *plan) error {
	for {
		l, err := s.lane(ctx, pr)
		if err != nil {
			return s.Take(ctx, err, "lane")
		}
		stale := l.answered.Load()
		err = s.write(ctx, l, w, p)
		// A receiver closes a lane it finds idle (or needs the room for)
		// without a word, and the close can cross a header just sent:
		// that write was never granted, nothing of it was posted, so it
		// goes again on another lane rather than fail. Each retry drops a
		// pooled lane, so a freshly opened one ends the loop.
		if err != nil && stale && l.unanswered.Load() {
			continue
		}
		return err
	}
}

// plan is what Write works out once for a write and its every attempt:
// how its source reaches the NIC, and where a direct write goes.
type plan struct {
	kind sourceKind
	lkey uint32 // a host source's registration made once (fromShared)
	// railKey: lkey is the source's registration on the lane's rail,
	// for a device source too (a piece, rails.go).
	railKey bool
	dg      *grant // nil: the write asks for a grant
}

// directGrant is where w goes as a direct write (see wire.go), or false
// when it must ask first: the peer does not take direct writes, w is not
// its slot's whole content (a piece resent must count once: the grant
// path tracks ranges), its key names no window in windows mode, w's tag
// is not its key's (the receiver finds the slot by that tag), w is too
// long for one work request, its source is
// copied through the bounce buffer (one chunk at a time), or it falls
// outside the peer's shared registration (the peer's refusal then says
// what is wrong).
func (s *session) directGrant(w *transport.Write, kind sourceKind) (grant, bool) {
	n := w.Len()
	if !s.direct || !w.Whole || w.Tag != w.Key.Tag() || n > directMax || kind == fromBounce {
		return grant{}, false
	}
	return s.region.direct(w.Remote, uint64(n), w.Key.Window())
}

// lane takes a lane from the pool, dropping those that a write which
// had let go of them found broken, and those whose receiver has closed
// their control connection meanwhile.
func (s *session) lane(ctx context.Context, pr pair) (*lane, error) {
	p := s.poolOn(pr)
	for {
		l, err := p.Get(ctx)
		if err != nil || !l.broken.Load() && !l.ended() {
			return l, err
		}
		p.Drop(l)
	}
}

// write runs one write on l, which it holds from the pool: the header
// out, the grant (or a refusal) in, then the body by RDMA. Once every
// work request is posted it gives l back and waits for the completion
// without it, when the write is small enough and few others wait on l
// (flyingMax): the next write's header and grant then overlap this one's
// transfer. The receiver grants in the order the headers came, and RC
// delivers the writes in the order they were posted, which is that order
// too, since a write holds the lane until its last post.
//
// A write canceled while waiting for its answer leaves l out of step (the
// answer still comes) but not broken: the writes flying on l may still
// complete, so l retires, taking no more writes, and closes after them.
func (s *session) write(ctx context.Context, l *lane, w *transport.Write, p *plan) error {
	held, reuse, err := s.run(ctx, l, w, p)
	switch {
	case !held:
		if l.flying.Add(-1) == 0 {
			select {
			case l.landed <- struct{}{}:
			default: // a token is there already
			}
		}
		s.closeIfRetired(l)
	case l.retiring.Load():
		s.closeIfRetired(l)
	case reuse && !l.broken.Load():
		s.poolOn(l.pair()).Put(l)
	default:
		s.poolOn(l.pair()).Drop(l)
	}
	return err
}

// closeIfRetired closes l once it is retiring and no write flies on it.
// The write that retired l and the last write flying on it each set their
// part (retiring, the count down) before looking at the other's, so at
// least one of them finds both; the CompareAndSwap lets one through. It
// first waits, for drainWait at most, for the canceled write's answer:
// the receiver has then sent it (closing the control connection under
// the reply would fail every grant outstanding on the lane, those of
// completed writes too), and on seeing the lane end it lets go of the
// grant the canceled write never used.
func (s *session) closeIfRetired(l *lane) {
	if l.flying.Load() != 0 || !l.retiring.CompareAndSwap(true, false) {
		return
	}
	wait(l, l.answers, time.Now().Add(drainWait), nil)
	s.poolOn(l.pair()).Drop(l)
}

// run is write under l.use (close waits for it). held reports whether
// the write still holds l from the pool, reuse whether l may carry
// another write as far as this one knows (a broken QP marks l broken:
// a write that failed in transfer, canceled, whose completion came all
// the same, leaves l fit).
func (s *session) run(ctx context.Context, l *lane, w *transport.Write, p *plan) (held, reuse bool, err error) {
	l.use.RLock()
	defer l.use.RUnlock()
	f, reuse, err := s.start(ctx, l, w, p)
	if err != nil {
		return true, reuse, err
	}
	// The NIC is done with the source when the write returns: the last
	// work request completed, or the QP was broken and drained.
	defer func() {
		l.unroute(f.seq)
		f.src.release()
		if err == nil {
			recycle(f)
		}
	}()
	if f.src.kind == fromBounce || f.count > flyingChunks {
		// The bounce ring is the lane's, and a long write would keep
		// others' completions waiting behind it: hold on.
		err = s.transfer(ctx, l, f, true)
		return true, true, err
	}
	if l.flying.Add(1) > flyingMax {
		l.flying.Add(-1)
		err = s.transfer(ctx, l, f, true)
		return true, true, err
	}
	// Others may take l now; if this write breaks its QP it marks l
	// broken, and the next to take it drops it. write counts it down.
	s.poolOn(l.pair()).Put(l)
	return false, false, s.transfer(ctx, l, f, true)
}

// flights keeps the flights of completed writes for the next ones: a
// send then allocates none (ferrybench rdma-cpu counts the CPU).
var flights = sync.Pool{New: func() any { return new(flight) }}

// newFlight is a flight with nothing set but, maybe, a channel for its
// completions.
func newFlight() *flight { return flights.Get().(*flight) }

// recycle gives back the flight of a write that took its last
// completion and was unrouted: every completion of its work requests
// came before that one, so none can be on its way to wcs; a poke its
// deadline sent before the unroute may be, and is dropped. A write
// that failed keeps its flight: a late flush may still be delivered.
func recycle(f *flight) {
	wcs := f.wcs
	*f = flight{}
	for len(wcs) > 0 {
		<-wcs
	}
	f.wcs = wcs
	flights.Put(f)
}

// flight is a write whose body is being posted or awaited.
type flight struct {
	seq             uint32
	n, count        int // bytes, work requests
	wr              int // bytes per work request (the last one shorter)
	posted, retired int
	every, window   int
	g               grant
	w               transport.Write // a copy: the caller's stays on its stack
	src             source
	ring            []byte // fromBounce: the lane's bounce buffer
	ringKey         uint32
	waiter          // its completions, from the lane's poller
}

// start takes a credit for w's WRITE WITH IMM, sends w's header on l,
// takes the receiver's answer, and posts the body (waiting for
// completions while it needs the window); a direct write (p.dg) goes
// without the header, in one work request. With an error, reuse reports
// whether l may carry another write.
func (s *session) start(ctx context.Context, l *lane, w *transport.Write, p *plan) (_ *flight, reuse bool, err error) {
	src, err := s.t.writeSource(w, p)
	if err != nil {
		return nil, true, fmt.Errorf("rdma write to %s: %w", s.Peer(), err)
	}
	defer func() {
		if err != nil {
			src.release()
		}
	}()
	if err := s.credit(ctx, l); err != nil {
		return nil, !l.broken.Load(), err
	}
	defer func() {
		if err != nil && reuse {
			l.credits.Add(1) // nothing was posted: the receive is still there
		}
	}()
	if p.dg != nil {
		f := newFlight()
		f.n, f.count, f.wr, f.every, f.window, f.g, f.w, f.src = w.Len(), 1, max(1, w.Len()), 1, 1, *p.dg, *w, src
		if err = s.post(ctx, l, f); err != nil {
			return nil, false, err
		}
		return f, true, nil
	}
	g, reuse, err := s.ask(ctx, l, w)
	if err != nil {
		return nil, reuse, err
	}
	f := newFlight()
	f.n, f.count, f.wr, f.every, f.window, f.g, f.w, f.src = w.Len(), chunks(w.Len()), chunk, signalEvery, sendDepth, g, *w, src
	// A write the window holds whole needs no completion before its last.
	if f.count <= f.window {
		f.every = f.count
	}
	if src.kind == fromBounce {
		f.every, f.window = 1, bounceSlots
		if f.ring, f.ringKey, err = l.bounceBuffer(s.t.rails[l.rail].nic); err != nil {
			return nil, false, fmt.Errorf("rdma write to %s: %w", s.Peer(), err)
		}
	}
	if err = s.post(ctx, l, f); err != nil {
		return nil, false, err
	}
	return f, true, nil
}

// credit takes one of l's credits (wire.go, "Credits"), waiting while
// there is none: the receiving daemon has not yet taken the completions
// of the writes before (it is descheduled, stopped, or busy), and posting
// now would run its receive queue dry and fail the lane. The wait is a
// stall, counted with its time; it fails after io_timeout with no credit
// returned, with nothing posted, so l carries on once the receiver does.
func (s *session) credit(ctx context.Context, l *lane) error {
	if l.credits.Load() > 0 { // only the write holding l takes one
		l.credits.Add(-1)
		return nil
	}
	start := time.Now()
	st := &s.t.stats
	st.creditStalls.Add(1)
	defer func() { st.creditWait.Add(uint64(time.Since(start))) }()
	for {
		// The deadline moves with each credit: only silence fails.
		_, err := wait(l, l.credited, s.Deadline(ctx), ctx.Done())
		if l.credits.Load() > 0 {
			l.credits.Add(-1)
			return nil
		}
		switch {
		case err == errNoProgress && transport.ContextErr(ctx) == nil:
			return fmt.Errorf("rdma write to %s: the receiver made no progress for %s: it took none of the writes posted on its lane (no receive credit came back; is the receiving ferryd stopped or starved of CPU?): %w: %w",
				s.Peer(), s.t.cfg.Peer.IOTimeout, transport.ErrStalled, os.ErrDeadlineExceeded)
		case gaveUp(ctx, err):
			return s.broken(ctx, l, err, "waiting for the receiver to take the writes before")
		case err != nil:
			l.broken.Store(true)
			return s.broken(ctx, l, err, "waiting for the receiver to take the writes before")
		}
	}
}

// ask sends w's header on l and takes the receiver's answer: its grant,
// or why not. With an error, reuse reports whether l may carry another
// write.
func (s *session) ask(ctx context.Context, l *lane, w *transport.Write) (_ grant, reuse bool, err error) {
	h := peer.Header{Addr: w.Remote, Len: uint64(w.Len()), Key: w.Key, Tag: w.Tag}
	var hb [peer.HeaderSize]byte
	h.Encode(&hb)
	l.ctrl.SetWriteDeadline(s.Deadline(ctx))
	if _, err := l.ctrl.Write(hb[:]); err != nil {
		return grant{}, false, s.fail(ctx, err, fmt.Sprintf("sending the header of %d bytes", w.Len()))
	}
	s.t.stats.control.Add(1)
	a, err := wait(l, l.answers, s.Deadline(ctx), ctx.Done())
	switch {
	case gaveUp(ctx, err):
		// The caller gave up, not the lane: nothing is posted, and the
		// writes flying on l carry on (see write).
		l.retiring.Store(true)
		return grant{}, false, s.broken(ctx, l, err, fmt.Sprintf("waiting for the receiver to take %d bytes", w.Len()))
	case err != nil:
		l.broken.Store(true)
		if err == errDead && l.lastWord.Flags&flagFailed == 0 && transport.PeerGone(l.ansErr) && transport.ContextErr(ctx) == nil {
			l.unanswered.Store(true)
		}
		return grant{}, false, s.broken(ctx, l, err, fmt.Sprintf("waiting for the receiver to take %d bytes", w.Len()))
	}
	l.answered.Store(true)
	switch {
	case a.Code != transport.OK:
		return grant{}, a.Flags&peer.FlagClose == 0, &transport.Refusal{Code: a.Code, Message: a.Msg}
	}
	if err := s.region.check(a.grant, uint64(w.Len())); err != nil {
		return grant{}, false, fmt.Errorf("rdma write to %s: %w", s.Peer(), err)
	}
	return a.grant, true, nil
}

// post routes f's completions and posts its body; with every work
// request posted it returns, the last completion to come.
func (s *session) post(ctx context.Context, l *lane, f *flight) error {
	l.seq++
	f.seq = l.seq
	// Room for every completion the write can have outstanding (flushes
	// included) and a poke, so the poller never waits on it.
	if room := min(f.window, f.count) + 2; cap(f.wcs) < room {
		f.wcs = make(chan completion, room)
	}
	l.route(f.seq, &f.waiter)
	if err := s.transfer(ctx, l, f, false); err != nil {
		l.unroute(f.seq)
		return err
	}
	return nil
}

// chunks is how many messages carry n bytes.
func chunks(n int) int { return max(1, (n+chunk-1)/chunk) }

// lastChunk is the length of the last message of an n-byte write, the
// one WITH IMM, as its receive completion reports it.
func lastChunk(n uint64) uint64 { return n - uint64(chunks(int(n))-1)*chunk }

// transfer posts f's body to its grant in chunks of f.wr bytes, the last
// WITH IMM, and waits for completions as the window needs, until every
// work request is posted, or with all, until the last completed. Only
// the last chunk and every every-th are signaled (every chunk through a
// bounce buffer, whose slots it frees). A write the window holds whole
// goes in one post.
func (s *session) transfer(ctx context.Context, l *lane, f *flight, all bool) error {
	base := uint64(f.seq) << 32
	ops := l.ops[:0] // f holds l whenever it has work requests left to post
	for f.retired < f.count {
		ops = ops[:0]
		for f.posted < f.count && f.posted-f.retired < f.window {
			i := f.posted
			off := i * f.wr
			m := min(f.wr, f.n-off)
			o := op{WRID: base | uint64(i), Remote: f.g.Addr + uint64(off), Len: uint32(m), RKey: f.g.RKey, Imm: f.w.Tag}
			if f.ring != nil {
				slot := f.ring[(i%bounceSlots)*chunk:][:m]
				s.t.stats.copied.Add(uint64(copy(slot, f.w.Src[off:off+m])))
				o.Local, o.LKey = addrOf(slot), f.ringKey
			} else {
				o.Local, o.LKey = f.src.addr+uint64(off), f.src.lkey
			}
			last := i == f.count-1
			o.Signaled, o.WithImm = last || (i+1)%f.every == 0, last
			ops = append(ops, o)
			f.posted++
		}
		if len(ops) > 0 {
			if err := s.t.post(l.qp, ops); err != nil {
				s.drain(l, f, f.posted-len(ops))
				return fmt.Errorf("rdma write to %s: %w", s.Peer(), err)
			}
		}
		if !all && f.posted == f.count {
			return nil
		}
		wc, err := l.completion(&f.waiter, s.Deadline(ctx), ctx.Done())
		if gaveUp(ctx, err) && f.posted == f.count && s.settle(l, f) {
			// Everything was posted and the write completed after all:
			// the lane and its other writes carry on.
			return s.broken(ctx, l, err, fmt.Sprintf("with a %d-byte write in flight (it completed)", f.n))
		}
		if gaveUp(ctx, err) && f.posted < f.count {
			// The receiver's grant waits for a last message that will not
			// come: the QP must break, but the writes flying on l were
			// posted before this one, and may complete first.
			s.land(l, f)
		}
		if err != nil {
			if err == errNoProgress {
				l.stalled.Store(true)
			}
			s.drain(l, f, f.posted)
			return s.broken(ctx, l, err, f.inFlight())
		}
		if wc.Status != wcSuccess {
			l.broken.Store(true)
			if wc.Status == wcWRFlushErr && l.stalled.Load() {
				// Flushed by the break of a write that timed out before
				// it, on the same QP: it waited on the same stalled peer.
				return s.broken(ctx, l, errNoProgress, "on its lane (another write on it timed out first and broke it) "+f.inFlight())
			}
			return fmt.Errorf("rdma write to %s (%d bytes to %#x, rkey %#x): %w", s.Peer(), f.n, f.g.Addr, f.g.RKey,
				&CompletionError{Status: wc.Status, VendorErr: wc.VendorErr, Op: "rdma write"})
		}
		f.retired = int(wc.WRID&0xffffffff) + 1
	}
	return nil
}

// inFlight says how much of f the NIC had, for errors.
func (f *flight) inFlight() string {
	return fmt.Sprintf("with %d of a %d-byte write's %d work requests in flight", f.posted-f.retired, f.n, f.count)
}

// drain breaks l's QP after a failed wait and waits, for a bounded time,
// for the flush of f's last work request posted: until it comes the NIC
// may still read the source.
func (s *session) drain(l *lane, f *flight, posted int) {
	l.broken.Store(true)
	l.qp.Break()
	if posted == 0 {
		return
	}
	last := uint64(f.seq)<<32 | uint64(posted-1)
	t := time.NewTimer(drainWait)
	defer t.Stop()
	defer l.sleep()()
	for {
		select {
		case wc := <-f.wcs:
			if wc.WRID == last {
				return
			}
		case <-l.quit:
			return
		case <-l.polled:
			return
		case <-t.C:
			return
		}
	}
}

// gaveUp reports whether a wait on a write's lane ended because the
// write's caller gave up (canceled, or its deadline passed), not the lane.
func gaveUp(ctx context.Context, err error) bool {
	return err == errCanceled || err == errNoProgress && transport.ContextErr(ctx) != nil
}

// land waits, for drainWait at most, until no write flies on l, before f,
// canceled while posting, breaks its QP.
func (s *session) land(l *lane, f *flight) {
	n := l.flying.Load()
	if n == 0 {
		return
	}
	s.t.logf("rdma: a %d-byte write to %s was canceled with %d of its %d messages posted: its lane breaks once the writes flying on it (%d) complete, or after %s",
		f.n, s.Peer(), f.posted, f.count, n, drainWait)
	deadline := time.Now().Add(drainWait)
	for l.flying.Load() != 0 {
		if _, err := wait(l, l.landed, deadline, nil); err != nil {
			return
		}
	}
}

// settle waits, for a bounded time, for the completion of f's last work
// request after its writer was canceled, so that a canceled write need
// not break the QP under the lane's other writes. It reports whether the
// write completed successfully.
func (s *session) settle(l *lane, f *flight) bool {
	last := uint64(f.seq)<<32 | uint64(f.count-1)
	deadline := time.Now().Add(drainWait)
	for {
		wc, err := l.completion(&f.waiter, deadline, nil)
		switch {
		case err != nil || wc.Status != wcSuccess:
			return false
		case wc.WRID == last:
			return true
		}
	}
}

// broken explains a wait on l that ended without what it waited for.
func (s *session) broken(ctx context.Context, l *lane, err error, where string) error {
	switch {
	case err == errDead && l.lastWord.Flags&flagFailed != 0:
		// The receiver gave up on the lane's writes (its QP failed, it is
		// stopping) and said why.
		return fmt.Errorf("rdma write to %s: the receiver failed the lane's writes %s (%s): %s", s.Peer(), where, l.lastWord.Code, l.lastWord.Msg)
	case err == errDead:
		return s.fail(ctx, l.ansErr, where)
	case err == errLaneClosed && !s.pool.Closed():
		// Another write on the lane failed and dropped it.
		return fmt.Errorf("rdma write to %s: the lane broke under another write and closed %s", s.Peer(), where)
	case err == errLaneClosed || s.pool.Closed():
		return fmt.Errorf("rdma write to %s: %w %s", s.Peer(), transport.ErrClosed, where)
	case transport.ContextErr(ctx) != nil:
		return fmt.Errorf("rdma write to %s: %w %s", s.Peer(), transport.ContextErr(ctx), where)
	case err == errNoProgress:
		return fmt.Errorf("rdma write to %s: the peer made no progress for %s %s", s.Peer(), s.t.cfg.Peer.IOTimeout, where)
	}
	return fmt.Errorf("rdma write to %s: polling the completion queue %s: %w", s.Peer(), where, err)
}

// fail explains a broken control connection: whose doing it was.
func (s *session) fail(ctx context.Context, err error, where string) error {
	return s.Fail(ctx, s.pool.Closed(), err, where)
}

// post hands ops to the NIC, counting the ibv_post_send calls (Post
// makes one per maxPost work requests) and the work requests, signaled
// and all.
func (t *Transport) post(qp queuePair, ops []op) error {
	signaled := 0
	for _, o := range ops {
		if o.Signaled {
			signaled++
		}
	}
	t.stats.posts.Add(uint64((len(ops) + maxPost - 1) / maxPost))
	t.stats.wrs.Add(uint64(len(ops)))
	t.stats.signaled.Add(uint64(signaled))
	return qp.Post(ops)
}
