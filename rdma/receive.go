package rdma

import (
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"os"
	"time"

	"github.com/ferry-project/ferry/internal/connlimit"
	"github.com/ferry-project/ferry/transport"
	"github.com/ferry-project/ferry/transport/peer"
)

// serveLane is the peer port's hook for RDMA control connections: it
// connects a QP to the dialer's and serves the lane's writes until the
// control connection ends, the lane idles for the idle timeout, the port
// closes the connection to make room, or the transport closes.
func (t *Transport) serveLane(c *connlimit.Conn, _ uint64) {
	from := c.RemoteAddr().String()
	quiet := func() bool { return c.Dropped() || t.isClosing() }
	l, err := t.acceptLane(c.TCPConn)
	if err != nil {
		if errors.Is(err, os.ErrDeadlineExceeded) {
			c.Closing(connlimit.ReasonTimeout)
		}
		if !quiet() {
			t.port.Warnf("rdma: lane from %s: %v", from, err)
		}
		return
	}
	t.mu.Lock()
	if t.closed {
		t.mu.Unlock()
		l.close()
		return
	}
	t.accepted[l] = struct{}{}
	t.mu.Unlock()
	c.Greeted() // the lane is connected; a peer's first write follows at once
	defer func() {
		t.mu.Lock()
		delete(t.accepted, l)
		t.mu.Unlock()
		l.close()
	}()
	r := receiver{t: t, l: l, c: c, gate: t.port.Gate("lane"), hdrs: make(chan peer.Header, 1), gone: make(chan struct{})}
	err = r.run()
	switch {
	case err == errIdle:
		c.Closing(connlimit.ReasonIdle)
		t.debugf("rdma: closed the lane from %s and its queue pair: no write for %s", from, t.cfg.Peer.IdleTimeout)
	case err != nil && !quiet():
		t.port.Warnf("rdma: lane from %s: %v", from, err)
	}
}

// errIdle ends a lane that carried no write for the idle timeout.
var errIdle = errors.New("idle")

// acceptLane answers a dialer's connect: a new QP, receives posted,
// connected to the dialer's QP, and described back.
func (t *Transport) acceptLane(c *net.TCPConn) (_ *lane, err error) {
	c.SetDeadline(time.Now().Add(t.cfg.Peer.HandshakeTimeout))
	var b [endpointSize]byte
	if n, err := io.ReadFull(c, b[:]); err != nil {
		return nil, fmt.Errorf("read %d of the %d-byte connect: %w", n, endpointSize, err)
	}
	var remote endpoint
	remote.decode(b[:])
	refuse := func(code transport.Code, err error) error {
		writeReply(c, code, 0, err.Error(), nil)
		return err
	}
	if t.isClosing() {
		return nil, refuse(transport.ShuttingDown, errors.New("the receiver is shutting down"))
	}
	ri := int(b[connectRail])
	if ri >= len(t.rails) {
		return nil, refuse(transport.Internal, fmt.Errorf("the dialer asked for a lane on rail %d, and this daemon drives %d RDMA device(s) (%v)", ri, len(t.rails), t.RailNames()))
	}
	rl := t.rails[ri]
	qp, err := rl.nic.NewQP(1, recvPosted)
	if err != nil {
		return nil, refuse(transport.Internal, fmt.Errorf("creating a queue pair: %w", err))
	}
	defer func() {
		if err != nil {
			qp.Close()
		}
	}()
	if err := qp.PostRecvs(recvPosted); err != nil {
		return nil, refuse(transport.Internal, fmt.Errorf("posting receives: %w", err))
	}
	psn := rand.Uint32() & 0xffffff
	if err := qp.Connect(psn, remote); err != nil {
		return nil, refuse(transport.Internal, fmt.Errorf("connecting to queue pair %#x: %w", remote.QPN, err))
	}
	a := accept{endpoint: rl.nic.Endpoint(), peerRegion: t.region(), Rail: ri}
	if ri != 0 {
		// Its lanes carry direct writes through windows on this rail, or
		// granted writes, which need nothing of it.
		a.peerRegion = peerRegion{Mode: a.Mode}
	}
	a.Direct = t.direct != nil && (ri == 0 || t.windows != nil)
	a.Rails = len(t.rails)
	a.QPN, a.PSN = qp.QPN(), psn
	var ab [acceptSize]byte
	a.encode(&ab)
	if err := writeReply(c, transport.OK, 0, "", ab[:]); err != nil {
		return nil, err
	}
	c.SetDeadline(time.Time{})
	l := newLane(qp, c, 1+recvPosted)
	l.rail = ri
	return l, nil
}

// region describes the shared registration to dialers. Where it lies
// and its rkey go only to a dialer that writes under that rkey directly
// (ModeArenaRKey, where every dialer proved the peer secret): with them,
// anyone reaching the peer port could write anywhere in it by plain
// RDMA WRITEs, which no receive completion reports. Any other dialer
// writes through a slot's window or under a grant, which carry what its
// write needs.
func (t *Transport) region() peerRegion {
	switch {
	case t.windows != nil:
		return peerRegion{Mode: modeWindows}
	case t.shared != nil && t.direct != nil:
		base, size := addrOf(t.mem), uint64(len(t.mem))
		if t.dev.Len > 0 {
			base, size = t.dev.Addr, t.dev.Len // the GPU arena, reached in place
		}
		return peerRegion{Base: base, Size: size, RKey: t.shared.RKey(), Mode: modeShared}
	case t.shared != nil:
		return peerRegion{Mode: modeShared}
	case len(t.mem) > 0:
		return peerRegion{Mode: modePerSend}
	}
	return peerRegion{Mode: modeNone}
}

// receiver serves the writes of one accepted lane. It grants each header
// its Sink accepts, up to recvDepth at a time, without waiting for the
// writes granted before it, and takes the receive completions in the
// order it granted: RC places a lane's messages in the order they were
// posted, and a sender posts in the order of its headers. Each completion
// must match the oldest grant outstanding, or nothing more is delivered.
type receiver struct {
	t       *Transport
	l       *lane
	c       *connlimit.Conn // l.ctrl, and its place on the peer port
	gate    *peer.Gate
	hdrs    chan peer.Header // from read
	gone    chan struct{}    // closed by read when the control connection ends
	readErr error            // why, set before gone closes; nil for a clean close
	granted []granted        // outstanding, oldest first
	taken   int              // receives taken and not yet posted again (see replenish)
}

// granted is a write granted and not yet completed.
type granted struct {
	h    peer.Header
	tg   *target
	done func(error)
}

// run serves headers and completions until the control connection ends,
// the transport closes, or the lane idles with nothing granted for the
// idle timeout (errIdle). When either of the first two happens with
// writes granted, the QP is broken and its completions drained: writes
// that completed before are still delivered, anything later is flushed.
func (r *receiver) run() error {
	l, t := r.l, r.t
	l.use.RLock()
	defer l.use.RUnlock()
	go r.read()
	gone, closing := r.gone, t.closing
	var drained <-chan time.Time
	idle := time.NewTimer(t.cfg.Peer.IdleTimeout)
	defer idle.Stop()
	for {
		hdrs, stopping, idled := r.hdrs, closing, idle.C
		if len(r.granted) == recvDepth || drained != nil {
			hdrs = nil // every posted receive is spoken for
		}
		if len(r.granted) == 0 {
			stopping = nil // Close ends the lane, and read sees it
		} else {
			idled = nil
		}
		select {
		case h := <-hdrs:
			if len(r.granted) == 0 && !r.c.Busy() {
				// The port took this idle lane's place a moment ago, and
				// closed it: the header goes unanswered, as if it came
				// after the close.
				return nil
			}
			if err := r.serve(h); err != nil {
				return r.fail(err)
			}
			if len(r.granted) == 0 {
				r.c.Idle() // refused: still idle
			}
		case c := <-l.wcs:
			// The poller hands them over in batches: take every one
			// there, then select again.
			for more := true; more; {
				if err := r.complete(c, drained != nil); err != nil {
					return r.fail(err)
				}
				if drained != nil && len(r.granted) == 0 {
					<-r.gone
					return r.readErr
				}
				select {
				case c = <-l.wcs:
				default:
					more = false
				}
			}
			if len(r.granted) == 0 {
				r.c.Idle()
			}
		case <-idled:
			return errIdle
		case <-gone:
			if len(r.granted) == 0 {
				return r.readErr
			}
			gone, closing = nil, nil
			l.qp.Break()
			drained = time.After(drainWait)
		case <-stopping:
			gone, closing = nil, nil
			l.qp.Break()
			drained = time.After(drainWait)
		case <-drained:
			h := r.granted[0].h
			return r.fail(fmt.Errorf("the %d-byte write tagged %d (and %d granted after it) did not complete before its lane closed", h.Len, h.Tag, len(r.granted)-1))
		case <-l.polled:
			l.qp.Break()
			return r.fail(l.failure())
		}
		if len(r.granted) == 0 {
			idle.Reset(t.cfg.Peer.IdleTimeout)
		}
	}
}

// read takes headers off the control connection. A sender sends the next
// header while its earlier writes are in flight; run takes it when it
// may grant another.
func (r *receiver) read() {
	defer close(r.gone)
	var b [peer.HeaderSize]byte
	for {
		if n, err := io.ReadFull(r.l.ctrl, b[:]); err != nil {
			if n > 0 || err != io.EOF {
				r.readErr = fmt.Errorf("read %d of a %d-byte write header: %w", n, peer.HeaderSize, err)
			}
			return
		}
		r.t.stats.control.Add(1)
		var h peer.Header
		h.Decode(&b)
		select {
		case r.hdrs <- h:
		case <-r.l.quit:
			return
		}
	}
}

func (r *receiver) reply(code transport.Code, flags uint16, msg string, body []byte) error {
	r.l.ctrl.SetWriteDeadline(time.Now().Add(r.t.cfg.Peer.IOTimeout))
	r.t.stats.control.Add(1)
	return writeReply(r.l.ctrl, code, flags, msg, body)
}

// serve answers one header: a refusal, or a grant. An error ends the
// lane.
func (r *receiver) serve(h peer.Header) error {
	t := r.t
	var tg *target
	var done func(error)
	var no *peer.Refused
	var err error
	var mr region
	sink, inPlaceSink := t.cfg.Peer.Sink.(transport.InPlaceSink)
	engine := false // into GPU memory an engine registered, at the engine's address
	if es, ok := sink.(transport.EngineSink); ok && t.engines.hasDevice() {
		var at uint64
		if at, done, engine, no = r.gate.AdmitEngine(&h, es); engine && no == nil {
			tg, err = t.engineDeviceTarget(at, h.Len, r.l.rail)
		}
	}
	if inPlaceSink && !engine && no == nil {
		mr = t.inPlace(h.Addr, h.Len)
	}
	switch {
	case engine || no != nil:
		// Granted or refused above.
	case mr != nil:
		// Into device memory the NIC reaches (the GPU arena, a CUDA
		// region): straight to the slot. A slot admitted pins its memory,
		// so mr outlives the grant.
		if done, no = r.gate.AdmitInPlace(&h, sink); no == nil {
			tg = &target{addr: h.Addr}
			rl := t.rails[r.l.rail]
			register := func() (region, error) { return rl.nic.RegisterDevice(h.Addr, h.Len, h.Addr, peerWrites) }
			if t.viaKeyRail(h.Key, r.l.rail) {
				err = t.reach(tg, h.Key.Window(), mr, register)
			} else {
				// mr and the slot's window are another rail's NIC's (memory.go, target).
				err = t.registerFor(tg, register)
			}
		}
	default:
		var dst []byte
		if dst, done, no = r.gate.Admit(&h); no == nil {
			tg, err = t.target(dst, h.Key, r.l.rail)
		}
	}
	if err != nil {
		done(err)
		return r.reply(transport.Internal, 0, fmt.Sprintf("the receiver could not make its memory reachable: %v", err), nil)
	}
	if no != nil {
		if no.End != nil {
			r.reply(no.Code, no.Flags(), no.Msg, nil)
			return no.End
		}
		return r.reply(no.Code, 0, no.Msg, nil)
	}
	// Outstanding before the reply goes out: if part of it does, fail
	// breaks the QP before letting go of the memory.
	r.granted = append(r.granted, granted{h: h, tg: tg, done: done})
	var gb [grantSize]byte
	g := grant{Addr: tg.addr, RKey: tg.rkey}
	g.encode(&gb)
	return r.reply(transport.OK, 0, "", gb[:])
}

// complete takes one receive completion: the oldest grant's write when it
// matches it, delivered; else, on a lane that takes them, a direct
// write's (see arrived). draining says the QP is broken: no receives are
// replenished.
func (r *receiver) complete(c completion, draining bool) error {
	t := r.t
	isImm := c.Status == wcSuccess && c.Opcode == opcodeRecvRDMAWithImm && c.HasImm
	if len(r.granted) == 0 {
		if c.Status != wcSuccess {
			return fmt.Errorf("a receive completed with no write granted: %w", &CompletionError{Status: c.Status, VendorErr: c.VendorErr, Op: "receive"})
		}
		if isImm && t.direct != nil {
			return r.arrived(c, draining)
		}
		t.stats.rejected.Add(1)
		return fmt.Errorf("rejected a completion with no write granted (opcode %d, immediate %#x, %d bytes): nothing was delivered", c.Opcode, c.Imm, c.ByteLen)
	}
	g := r.granted[0]
	h := g.h
	if c.Status != wcSuccess {
		return fmt.Errorf("waiting for the %d-byte write tagged %d: %w", h.Len, h.Tag,
			&CompletionError{Status: c.Status, VendorErr: c.VendorErr, Op: "receive"})
	}
	matches := isImm && c.Imm == h.Tag && uint64(c.ByteLen) == lastChunk(h.Len)
	if !matches && isImm && t.direct != nil {
		return r.arrived(c, draining)
	}
	if !matches {
		t.stats.rejected.Add(1)
		return fmt.Errorf("rejected a completion that does not match its grant (opcode %d, immediate %#x, last message of %d bytes; granted tag %#x, %d bytes at %#x, whose last message is %d bytes): nothing was delivered",
			c.Opcode, c.Imm, c.ByteLen, h.Tag, h.Len, h.Addr, lastChunk(h.Len))
	}
	r.granted = r.granted[1:]
	t.received(r.l.rail, h.Len) // before done: whoever sees the slot arrive sees it counted
	g.tg.finish(true)
	g.done(nil)
	r.c.Prove() // it held a live slot's key
	if draining {
		return nil
	}
	return r.replenish()
}

// replenish counts a receive taken, and posts them back recvBatch at a
// time (one call, not one per completion), then returns them to the
// sender as credits (wire.go): one message per recvBatch writes.
func (r *receiver) replenish() error {
	if r.taken++; r.taken < recvBatch {
		return nil
	}
	r.taken = 0
	if err := r.l.qp.PostRecvs(recvBatch); err != nil {
		return fmt.Errorf("replenishing receives: %w", err)
	}
	r.t.stats.credits.Add(1)
	body := encodeCredit(recvBatch)
	r.l.ctrl.SetWriteDeadline(time.Now().Add(r.t.cfg.Peer.IOTimeout))
	if err := writeReply(r.l.ctrl, transport.OK, flagCredit, "", body[:]); err != nil {
		return fmt.Errorf("returning %d receive credits: %w", recvBatch, err)
	}
	return nil
}

// arrived takes a direct write's completion: its bytes are in place
// already, so the Sink takes them as the content of the slot the
// immediate names, or says why they count for nothing, which is counted
// and logged (a remote party can cause it: rate-limited). The lane
// carries on, unless its direct writes keep naming no live slot: a
// sender guessing tags (the gate's limit, as for announced writes).
func (r *receiver) arrived(c completion, draining bool) error {
	t := r.t
	t.stats.directCompletions.Add(1)
	// Counted before the Sink takes it, as a granted write is: whoever
	// sees the slot arrive sees it counted.
	t.received(r.l.rail, uint64(c.ByteLen))
	if err := t.direct.Arrived(c.Imm, uint64(c.ByteLen)); err != nil {
		t.stats.directRefused.Add(1)
		t.port.Warnf("rdma: lane from %s: a direct write of %d bytes tagged %#x counted for nothing: %v", r.c.RemoteAddr(), c.ByteLen, c.Imm, err)
		if end := r.gate.Unmatched(err); end != nil {
			return end
		}
	} else {
		r.c.Prove() // it wrote into a live slot
	}
	if draining {
		return nil
	}
	return r.replenish()
}

// fail ends the lane on err: the QP broken (the NIC stops placing
// bytes), every outstanding grant's memory let go undelivered, and the
// sender told why when it has writes granted.
func (r *receiver) fail(err error) error {
	if len(r.granted) == 0 {
		return err
	}
	r.l.qp.Break()
	for _, g := range r.granted {
		r.t.stats.failed.Add(1)
		g.tg.finish(false)
		g.done(err)
	}
	r.granted = nil
	code := transport.Internal
	if r.t.isClosing() {
		code = transport.ShuttingDown
	}
	r.reply(code, peer.FlagClose|flagFailed, err.Error(), nil)
	return err
}
