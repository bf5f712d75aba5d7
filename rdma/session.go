package rdma

import (
	"context"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"os"
	"syscall"
	"time"

	"github.com/ferry-project/ferry/internal/pool"
	"github.com/ferry-project/ferry/transport"
	"github.com/ferry-project/ferry/transport/tcp"
)

// Dial opens a session to the peer daemon at addr with one lane. A peer
// that serves no RDMA gets a TCP session instead, and the fallback is
// logged.
func (t *Transport) Dial(ctx context.Context, addr string) (transport.Session, error) {
	if t.isClosing() {
		return nil, fmt.Errorf("rdma dial %s: %w", addr, transport.ErrClosed)
	}
	l, instance, region, err := t.dialLane(ctx, addr)
	if errors.Is(err, tcp.ErrNoRDMA) {
		t.logf("rdma: %s serves no RDMA (it runs --transport tcp, or has no usable RDMA port): this session falls back to TCP", addr)
		return t.tcp.Dial(ctx, addr)
	}
	if err != nil {
		return nil, fmt.Errorf("rdma dial %s: %w", addr, err)
	}
	s := &session{t: t, peer: addr, instance: instance, region: region}
	s.pool = pool.New(t.cfg.TCP.MaxConnsPerPeer, s.open, func(l *lane) { l.close() })
	s.pool.Add(l)
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.closed {
		s.pool.Close()
		return nil, fmt.Errorf("rdma dial %s: %w", addr, transport.ErrClosed)
	}
	t.sessions[s] = struct{}{}
	return s, nil
}

// dialLane opens a control connection to addr and connects a new QP over
// it. It returns the peer's instance and what it says of its memory.
func (t *Transport) dialLane(ctx context.Context, addr string) (_ *lane, instance uint64, _ peerRegion, err error) {
	c, instance, err := t.tcp.DialRDMA(ctx, addr)
	if err != nil {
		return nil, 0, peerRegion{}, err
	}
	qp, err := t.nic.NewQP(sendDepth, 1)
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
	hctx, cancel := context.WithTimeout(ctx, t.cfg.TCP.HandshakeTimeout)
	defer cancel()
	stop := context.AfterFunc(hctx, func() { c.Close() })
	deadline, _ := hctx.Deadline()
	c.SetDeadline(deadline)

	psn := rand.Uint32() & 0xffffff
	local := t.nic.Endpoint()
	local.QPN, local.PSN = qp.QPN(), psn
	var b [endpointSize]byte
	local.encode(b[:])
	var ab [acceptSize]byte
	var r reply
	if _, err = c.Write(b[:]); err == nil {
		r, err = readReply(c, ab[:])
	}
	if err != nil {
		if cerr := ctxErr(ctx); cerr != nil {
			return nil, 0, peerRegion{}, fmt.Errorf("connecting a queue pair: %w: %w", cerr, err)
		}
		if ctxErr(hctx) != nil {
			return nil, 0, peerRegion{}, fmt.Errorf("connecting a queue pair: no answer within %s: %w", t.cfg.TCP.HandshakeTimeout, err)
		}
		return nil, 0, peerRegion{}, fmt.Errorf("connecting a queue pair: %w", err)
	}
	if r.code != transport.OK {
		return nil, 0, peerRegion{}, fmt.Errorf("the peer could not open a lane (%s): %s", r.code, r.msg)
	}
	var a accept
	a.decode(&ab)
	if err = qp.Connect(psn, a.endpoint); err != nil {
		return nil, 0, peerRegion{}, fmt.Errorf("connecting to the peer's queue pair %#x: %w", a.QPN, err)
	}
	if !stop() {
		return nil, 0, peerRegion{}, fmt.Errorf("connecting a queue pair: %w", ctxErr(hctx))
	}
	c.SetDeadline(time.Time{})
	l := newLane(qp, c, sendDepth+1)
	l.answers = make(chan answer, 1)
	go l.readAnswers()
	return l, instance, a.peerRegion, nil
}

// ctxErr is ctx.Err(), but also DeadlineExceeded once the deadline has
// passed: a connection deadline set from ctx can fire before ctx's own
// timer does.
func ctxErr(ctx context.Context) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	if d, ok := ctx.Deadline(); ok && !time.Now().Before(d) {
		return context.DeadlineExceeded
	}
	return nil
}

// session is a pool of lanes to one peer. A write holds a lane for its
// whole exchange, so concurrent writes travel on separate queue pairs.
type session struct {
	t        *Transport
	peer     string
	instance uint64
	region   peerRegion // the peer's shared registration, from the connect
	pool     *pool.Pool[*lane]
}

func (s *session) Transport() string { return "rdma" }

func (s *session) Peer() string { return s.peer }

func (s *session) PeerInstance() uint64 { return s.instance }

// Close destroys every lane of the session; writes in flight fail.
func (s *session) Close() error {
	s.pool.Close()
	s.t.mu.Lock()
	delete(s.t.sessions, s)
	s.t.mu.Unlock()
	return nil
}

// open dials one more lane, to the same peer process as the first.
func (s *session) open(ctx context.Context) (*lane, error) {
	l, instance, _, err := s.t.dialLane(ctx, s.peer)
	if err == nil && instance != s.instance {
		l.close()
		err = fmt.Errorf("peer restarted (instance %#x, session opened with %#x); open a new session", instance, s.instance)
	}
	return l, err
}

func (s *session) Write(ctx context.Context, w transport.Write) error {
	if s.pool.Closed() {
		return fmt.Errorf("rdma write to %s: %w", s.peer, transport.ErrClosed)
	}
	if err := ctx.Err(); err != nil {
		return fmt.Errorf("rdma write to %s: %w", s.peer, err)
	}
	l, err := s.pool.Get(ctx)
	switch {
	case err == pool.ErrClosed:
		return fmt.Errorf("rdma write to %s: %w", s.peer, transport.ErrClosed)
	case errors.Is(err, pool.ErrClosed):
		return fmt.Errorf("rdma write to %s: opening a lane: %w: %w", s.peer, transport.ErrClosed, err)
	case err != nil && err == ctx.Err():
		return fmt.Errorf("rdma write to %s: waiting for a lane: %w", s.peer, err)
	case err != nil:
		return fmt.Errorf("rdma write to %s: opening a lane: %w", s.peer, err)
	}
	reuse, err := s.write(ctx, l, &w)
	if reuse {
		s.pool.Put(l)
	} else {
		s.pool.Drop(l)
	}
	return err
}

// write runs one write on l: the header out, the grant (or a refusal) in,
// then the body by RDMA. reuse reports whether l may carry another write.
func (s *session) write(ctx context.Context, l *lane, w *transport.Write) (reuse bool, err error) {
	src, err := s.t.source(w.Src)
	if err != nil {
		return true, fmt.Errorf("rdma write to %s: %w", s.peer, err)
	}
	l.use.Lock()
	defer l.use.Unlock()
	// The NIC is done with src when write returns: the last work request
	// completed, or the QP was broken and drained.
	defer src.release()

	h := tcp.Header{Addr: w.Remote, Len: uint64(len(w.Src)), Key: w.Key, Tag: w.Tag}
	var hb [tcp.HeaderSize]byte
	h.Encode(&hb)
	l.ctrl.SetWriteDeadline(s.deadline(ctx))
	if _, err := l.ctrl.Write(hb[:]); err != nil {
		return false, s.fail(ctx, err, fmt.Sprintf("sending the header of %d bytes", len(w.Src)))
	}
	ev, err := l.next(s.deadline(ctx), ctx.Done())
	switch {
	case err != nil:
		return false, s.broken(ctx, err, fmt.Sprintf("waiting for the receiver to take %d bytes", len(w.Src)))
	case !ev.isAnswer:
		return false, fmt.Errorf("rdma write to %s: a completion (%+v) came before the receiver's answer", s.peer, ev.wc)
	case !ev.ok:
		return false, s.fail(ctx, l.ansErr, fmt.Sprintf("waiting for the receiver to take %d bytes", len(w.Src)))
	case ev.answer.flags&flagFailed != 0:
		// The receiver gave up on the lane after an earlier write: a
		// broken path, not a refusal of this one.
		return false, fmt.Errorf("rdma write to %s: the receiver closed the lane (%s): %s", s.peer, ev.answer.code, ev.answer.msg)
	case ev.answer.code != transport.OK:
		return ev.answer.flags&tcp.FlagClose == 0, &transport.Refusal{Code: ev.answer.code, Message: ev.answer.msg}
	}
	if err := s.region.check(ev.answer.grant, uint64(len(w.Src))); err != nil {
		return false, fmt.Errorf("rdma write to %s: %w", s.peer, err)
	}
	if err := s.transfer(ctx, l, ev.answer.grant, w, src); err != nil {
		return false, err
	}
	return true, nil
}

// chunks is how many messages carry n bytes.
func chunks(n int) int { return max(1, (n+chunk-1)/chunk) }

// lastChunk is the length of the last message of an n-byte write, the
// one WITH IMM, as its receive completion reports it.
func lastChunk(n uint64) uint64 { return n - uint64(chunks(int(n))-1)*chunk }

// transfer posts w's body to the grant in chunks, the last WITH IMM, and
// waits for the last completion. Only every signalEvery-th chunk (every
// chunk through a bounce buffer, whose slots it frees) is signaled.
func (s *session) transfer(ctx context.Context, l *lane, g grant, w *transport.Write, src source) error {
	n := len(w.Src)
	every, window := signalEvery, sendDepth
	var ring []byte
	var ringKey uint32
	if src.kind == fromBounce {
		every, window = 1, bounceSlots
		var err error
		if ring, ringKey, err = l.bounceBuffer(s.t.nic); err != nil {
			return fmt.Errorf("rdma write to %s: %w", s.peer, err)
		}
	}
	count := chunks(n)
	l.seq++
	base := uint64(l.seq) << 32
	ops := make([]op, 0, min(count, window))
	posted, retired := 0, 0
	for retired < count {
		ops = ops[:0]
		for posted < count && posted-retired < window {
			i := posted
			off := i * chunk
			m := min(chunk, n-off)
			o := op{WRID: base | uint64(i), Remote: g.Addr + uint64(off), Len: uint32(m), RKey: g.RKey, Imm: w.Tag}
			if ring != nil {
				slot := ring[(i%bounceSlots)*chunk:][:m]
				copy(slot, w.Src[off:off+m])
				o.Local, o.LKey = addrOf(slot), ringKey
			} else {
				o.Local, o.LKey = addrOf(w.Src)+uint64(off), src.lkey
			}
			last := i == count-1
			o.Signaled, o.WithImm = last || (i+1)%every == 0, last
			ops = append(ops, o)
			posted++
		}
		if len(ops) > 0 {
			if err := l.qp.Post(ops); err != nil {
				s.drain(l, base, posted-len(ops))
				return fmt.Errorf("rdma write to %s: %w", s.peer, err)
			}
		}
		ev, err := l.next(s.deadline(ctx), ctx.Done())
		inFlight := fmt.Sprintf("with %d of a %d-byte write's %d work requests in flight", posted-retired, n, count)
		switch {
		case err != nil:
			s.drain(l, base, posted)
			return s.broken(ctx, err, inFlight)
		case ev.isAnswer:
			// The receiver gave up on the write (its QP failed, it is
			// stopping) and says why, or its end of the lane went away.
			s.drain(l, base, posted)
			if !ev.ok {
				return s.fail(ctx, l.ansErr, inFlight)
			}
			return fmt.Errorf("rdma write to %s: the receiver failed the write %s (%s): %s", s.peer, inFlight, ev.answer.code, ev.answer.msg)
		case ev.wc.WRID>>32 != base>>32:
			continue // a stale completion; none are expected
		case ev.wc.Status != wcSuccess:
			return fmt.Errorf("rdma write to %s (%d bytes to %#x, rkey %#x): %w", s.peer, n, g.Addr, g.RKey,
				&CompletionError{Status: ev.wc.Status, VendorErr: ev.wc.VendorErr, Op: "rdma write"})
		}
		retired = int(ev.wc.WRID&0xffffffff) + 1
	}
	return nil
}

// drain breaks l's QP after a failed wait and waits, for a bounded time,
// for the flush of the last work request posted: until it comes the NIC
// may still read the source.
func (s *session) drain(l *lane, base uint64, posted int) {
	l.qp.Break()
	if posted == 0 {
		return
	}
	last := base | uint64(posted-1)
	deadline := time.Now().Add(drainWait)
	for {
		ev, err := l.next(deadline, nil)
		if err != nil || (!ev.isAnswer && ev.wc.WRID == last) {
			return
		}
	}
}

// broken explains a wait on l that ended without an event.
func (s *session) broken(ctx context.Context, err error, where string) error {
	switch {
	case err == errLaneClosed || s.pool.Closed():
		return fmt.Errorf("rdma write to %s: %w %s", s.peer, transport.ErrClosed, where)
	case ctxErr(ctx) != nil:
		return fmt.Errorf("rdma write to %s: %w %s", s.peer, ctxErr(ctx), where)
	case err == errNoProgress:
		return fmt.Errorf("rdma write to %s: the peer made no progress for %s %s", s.peer, s.t.cfg.TCP.IOTimeout, where)
	}
	return fmt.Errorf("rdma write to %s: polling the completion queue %s: %w", s.peer, where, err)
}

// deadline is IOTimeout from now, or ctx's deadline if sooner.
func (s *session) deadline(ctx context.Context) time.Time {
	d := time.Now().Add(s.t.cfg.TCP.IOTimeout)
	if cd, ok := ctx.Deadline(); ok && cd.Before(d) {
		return cd
	}
	return d
}

// fail explains a broken control connection: whose doing it was.
func (s *session) fail(ctx context.Context, err error, where string) error {
	switch {
	case s.pool.Closed():
		return fmt.Errorf("rdma write to %s: %w %s: %w", s.peer, transport.ErrClosed, where, err)
	case ctxErr(ctx) != nil:
		return fmt.Errorf("rdma write to %s: %w %s", s.peer, ctxErr(ctx), where)
	case errors.Is(err, os.ErrDeadlineExceeded):
		return fmt.Errorf("rdma write to %s: peer made no progress for %s %s: %w", s.peer, s.t.cfg.TCP.IOTimeout, where, err)
	case errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) || errors.Is(err, syscall.ECONNRESET) ||
		errors.Is(err, syscall.EPIPE) || errors.Is(err, net.ErrClosed):
		return fmt.Errorf("rdma write to %s: peer closed the control connection %s: %w", s.peer, where, err)
	}
	return fmt.Errorf("rdma write to %s: failed %s: %w", s.peer, where, err)
}
