package rdma

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ferry-project/ferry/transport"
)

// Queue pairs for Mooncake's RDMA transport. Package mooncake keeps the
// endpoints they make up and speaks the handshake; what it needs of the
// NIC is here: the device's address, the shared registration's keys, and
// queue pairs that connect as Mooncake's do (PSN 0, mcverbs.go) and carry
// plain RDMA WRITEs and READs, every one signaled, with no immediate and
// nothing posted on the target.

// mooncakeNIC is a NIC that can name itself as Mooncake's descriptors
// do; its queue pairs are mooncakeQPs.
type mooncakeNIC interface {
	nic
	deviceName() string
}

var errNoVerbsDevice = errors.New("Mooncake's RDMA transport needs a verbs device")

// MooncakeNIC is this transport's NIC as a Mooncake descriptor lists it:
// the verbs device's name, and the port's LID and GID.
func (t *Transport) MooncakeNIC() (device string, lid uint16, gid [16]byte, err error) {
	n, ok := t.nic.(mooncakeNIC)
	if !ok {
		return "", 0, [16]byte{}, errNoVerbsDevice
	}
	e := n.Endpoint()
	return n.deviceName(), e.LID, e.GID, nil
}

// SharedKeys are the keys of a registration that covers the whole of
// Memory and lets peers write it under its rkey; ok is false without
// one (per-send mode, or windows mode, whose shared registration lets
// no peer write). A Mooncake engine's own buffer is listed so (the test
// peer's, package mooncaketest); ferryd's segment lists its Mooncake
// pool only (MooncakePool), never these.
func (t *Transport) SharedKeys() (rkey, lkey uint32, ok bool) {
	if t.shared == nil || t.windows != nil {
		return 0, 0, false
	}
	return t.shared.RKey(), t.shared.LKey(), true
}

// MooncakePool registers the n bytes at offset off of the memory, once,
// for peers' writes (no reads) under an rkey of their own, at their own
// addresses: the Mooncake pool, the only memory a Mooncake peer writes
// into one-sidedly (Mooncake's descriptor lists one rkey per buffer, not
// one per slot, and its initiators cache the descriptor). A write
// outside it fails at the NIC (REM_ACCESS_ERR), whatever the rest of
// the arena holds. addr is its first byte's address, as the descriptor
// lists it. The transport drops it when it closes.
func (t *Transport) MooncakePool(off, n uint64) (addr uint64, rkey, lkey uint32, err error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	switch {
	case t.mooncakePool != nil:
		return 0, 0, 0, errors.New("rdma: the Mooncake pool is registered already")
	case t.shared == nil:
		return 0, 0, 0, fmt.Errorf("rdma: the arena has no shared RDMA registration (%s mode), so no part of it is registered for Mooncake peers", t.reg.Mode)
	case n == 0 || off+n < off:
		return 0, 0, 0, fmt.Errorf("rdma: a Mooncake pool of %d bytes at offset %d", n, off)
	}
	var reg region
	if g := t.reg.GPU; g != nil {
		addr = t.cfg.Device.Base + off
		reg, err = t.registerPathRange(g.Path, off, n, peerWrites)
	} else {
		if off+n > uint64(len(t.mem)) {
			return 0, 0, 0, fmt.Errorf("rdma: a Mooncake pool of %d bytes at offset %d passes the end of the %d-byte arena", n, off, len(t.mem))
		}
		mem := t.mem[off : off+n]
		addr = addrOf(mem)
		if reg, err = t.nic.Register(mem, peerWrites); err != nil {
			err = fmt.Errorf("%w (%s); %s", err, errnoName(err), memlockLimit())
		}
	}
	if err != nil {
		return 0, 0, 0, fmt.Errorf("rdma: registering the %d-byte Mooncake pool with the NIC for peers' writes: %w", n, err)
	}
	t.mooncakePool = reg
	return addr, reg.RKey(), reg.LKey(), nil
}

// MooncakeQP is a queue pair of a Mooncake endpoint, or of a ferry
// read connection (reads.go), which connects as Mooncake's do. Several
// calls (Write, Read) work it at once, as Mooncake's engine posts many
// work requests per QP: each posts its own, its completions routed to it
// by the sequence number in their work request ids (the lane's routes,
// as a dialed lane's writes), and the send queue's depth is shared
// between them as credits. The transport closes those still open when
// it closes.
type MooncakeQP struct {
	t   *Transport
	l   *lane  // ctrl is nil: Mooncake has no control connection
	cap *qpCap // the cap it counts against

	seq atomic.Uint32 // the calls', for work request ids
	// credits holds a token per work request the send queue has room
	// for: a call takes one per post and gives it back with its
	// completion, so the calls together keep at most sendDepth in flight
	// (the CQ's size too).
	credits chan struct{}
	// ring holds one token, the bounce ring's: it is the QP's, and a call
	// from memory outside every registration (fromBounce) holds it from
	// its first post to its last completion. Sharing its slots between
	// calls would need a ring allocator for a path that already copies
	// every byte; such calls take turns, beside the others.
	ring chan struct{}
	// broke closes when a call breaks the QP (an error completion, no
	// progress for the I/O timeout, a canceled call whose work requests
	// did not complete): every call on it fails, naming why (broken),
	// and the QP closes once they all let go.
	broke     chan struct{}
	breakOnce sync.Once
}

// DefaultMooncakeQPs caps the Mooncake queue pairs a transport holds at
// once, across every endpoint table on it: ferryd's own segment's and
// each engine segment's (up to 256), each bounded by itself too
// (mooncake.DefaultEndpointLimits). Each queue pair costs a CQ, a
// completion channel's descriptor and a poller goroutine, and any host
// on mooncake_allow can ask for 16 per handshake: without this cap the
// tables together could be made to hold 257 × 1024 × 16 of them. 16384
// is one table full at 16 QPs per endpoint, or 8192 endpoints at
// Mooncake's default 2; its descriptors fit under the unit's
// LimitNOFILE beside the ports' (docs/operations.md).
const DefaultMooncakeQPs = 16384

// DefaultReadQPs caps the queue pairs of RDMA read connections a
// transport holds at once, served and its own together: each costs
// what a Mooncake queue pair does, and anyone who reaches the peer port
// can open a read connection (its queue pair is made before any key is
// checked, though it answers nothing until one is). Those it serves are
// bounded first by the peer port's connections (peer.DefaultLimits:
// 1024, where a stranger's unproven connections are evicted first), so
// 2048 leaves as many again to this daemon's own reads (one per POST
// /v1/reads). Their own cap, not the Mooncake one: read connections
// need no place on mooncake_allow, and must not crowd Mooncake
// endpoints out.
const DefaultReadQPs = 2048

// qpCap caps the queue pairs of one kind a transport holds; t.mu
// guards it but for refused.
type qpCap struct {
	open    map[*MooncakeQP]struct{}
	making  int // being made: they count against limit
	limit   int
	refused atomic.Uint64
	full    string // the refusal at the cap; %d is the limit
}

// QPStats is what a cap on queue pairs did.
type QPStats struct {
	Open, Limit int
	Refused     uint64 // queue pairs refused at the cap
}

func (t *Transport) qpStats(c *qpCap) QPStats {
	t.mu.Lock()
	defer t.mu.Unlock()
	return QPStats{Open: len(c.open), Limit: c.limit, Refused: c.refused.Load()}
}

// MooncakeQPStats says how many Mooncake queue pairs are open, and how
// many the cap refused.
func (t *Transport) MooncakeQPStats() QPStats { return t.qpStats(&t.mcQPs) }

// ReadQPStats says how many queue pairs of RDMA read connections are
// open, served and this daemon's own, and how many their cap refused.
func (t *Transport) ReadQPStats() QPStats { return t.qpStats(&t.readQPs) }

// NewMooncakeQP makes a queue pair for a Mooncake endpoint, in INIT; past
// Config.MooncakeQPs open at once it refuses, saying so.
func (t *Transport) NewMooncakeQP() (*MooncakeQP, error) { return t.newQP(&t.mcQPs) }

// newReadQP makes a queue pair for a read connection, in INIT; past
// Config.ReadQPs open at once it refuses, saying so.
func (t *Transport) newReadQP() (*MooncakeQP, error) { return t.newQP(&t.readQPs) }

func (t *Transport) newQP(c *qpCap) (*MooncakeQP, error) {
	t.mu.Lock()
	switch {
	case t.closed:
		t.mu.Unlock()
		return nil, fmt.Errorf("a queue pair: %w", transport.ErrClosed)
	case len(c.open)+c.making >= c.limit:
		t.mu.Unlock()
		c.refused.Add(1)
		return nil, fmt.Errorf(c.full, c.limit)
	}
	c.making++
	t.mu.Unlock()
	q, err := t.makeMooncakeQP()
	t.mu.Lock()
	c.making--
	closed := t.closed
	if err == nil && !closed {
		q.cap = c
		c.open[q] = struct{}{}
	}
	t.mu.Unlock()
	switch {
	case err != nil:
		return nil, err
	case closed:
		q.l.close()
		return nil, fmt.Errorf("a queue pair: %w", transport.ErrClosed)
	}
	return q, nil
}

func (t *Transport) makeMooncakeQP() (*MooncakeQP, error) {
	qp, err := t.nic.NewQP(sendDepth, 1)
	if err != nil {
		return nil, err
	}
	if _, ok := qp.(mooncakeQP); !ok {
		qp.Close()
		return nil, errNoVerbsDevice
	}
	q := &MooncakeQP{t: t, l: routedLane(qp), credits: make(chan struct{}, sendDepth), ring: make(chan struct{}, 1), broke: make(chan struct{})}
	for range sendDepth {
		q.credits <- struct{}{}
	}
	q.ring <- struct{}{}
	go q.l.pollForSleepers()
	return q, nil
}

func (q *MooncakeQP) QPN() uint32 { return q.l.qp.QPN() }

// Connect connects the QP to the peer's queue pair qpn at gid and lid
// with Mooncake's attributes, its path MTU at most mtu bytes (0, or a
// size no MTU enum has: the port's).
func (q *MooncakeQP) Connect(gid [16]byte, lid uint16, qpn uint32, mtu int) error {
	return q.l.qp.(mooncakeQP).connectMooncake(endpoint{GID: gid, LID: lid, QPN: qpn, MTU: mtuOf(mtu)}, qpWrites|qpReads)
}

// Write writes src to remote under rkey in chunks, every one signaled,
// at most sendDepth (bounceSlots from a bounce ring) in flight, beside
// the other calls on the QP, and returns once their completions say the
// peer's NIC has placed every byte, or none came for the I/O timeout. A
// write that failed once its source was on its way to the NIC breaks the
// QP, failing every call on it, and returns once it closed (then the NIC
// is done with every call's memory). One canceled returns once its work
// requests completed (drainWait at most, else it breaks the QP), the QP
// open.
func (q *MooncakeQP) Write(ctx context.Context, src []byte, remote uint64, rkey uint32) (transport.Report, error) {
	return q.move(ctx, src, remote, rkey, false)
}

// Read reads len(dst) bytes at remote under rkey into dst by RDMA READs,
// as Write writes: in place where dst lies in memory registered here
// (the arena's shared registration, a region's), else through the
// bounce ring. A read that failed once posted breaks and closes the QP
// as a write does.
func (q *MooncakeQP) Read(ctx context.Context, dst []byte, remote uint64, rkey uint32) (transport.Report, error) {
	return q.move(ctx, dst, remote, rkey, true)
}

// move is Write, or with read Read.
func (q *MooncakeQP) move(ctx context.Context, buf []byte, remote uint64, rkey uint32, read bool) (transport.Report, error) {
	t, l := q.t, q.l
	s, err := t.source(buf)
	if err != nil {
		return transport.Report{}, err
	}
	defer s.release()
	l.use.RLock() // close waits for every call to let go
	select {
	case <-l.quit: // closed meanwhile
		l.use.RUnlock()
		return transport.Report{}, errLaneClosed
	default:
	}
	err = q.transfer(ctx, buf, remote, rkey, s, read)
	l.use.RUnlock()
	if err != nil {
		if q.isBroken() || q.Closed() {
			// The QP goes before the registration (deferred): until
			// then the NIC may still use it, for this call or another.
			q.Close()
		}
		return transport.Report{}, err
	}
	return s.kind.report(len(buf)), nil
}

// Closed reports whether the QP was closed.
func (q *MooncakeQP) Closed() bool {
	select {
	case <-q.l.quit:
		return true
	default:
		return false
	}
}

// Close destroys the QP, waiting out the calls on it.
func (q *MooncakeQP) Close() error {
	q.t.mu.Lock()
	delete(q.cap.open, q)
	q.t.mu.Unlock()
	return q.l.close()
}

// breakQP breaks the QP for every call on it: the NIC flushes their
// work requests, and calls waiting for a credit stop.
func (q *MooncakeQP) breakQP() {
	q.breakOnce.Do(func() { close(q.broke) })
	q.l.qp.Break()
}

func (q *MooncakeQP) isBroken() bool {
	select {
	case <-q.broke:
		return true
	default:
		return false
	}
}

// broken says why a call found the QP broken or closed under it: the
// first error completion on it, or a call that made no progress.
func (q *MooncakeQP) broken() error {
	l := q.l
	if c := l.fault.Load(); c != nil {
		return fmt.Errorf("the queue pair broke under another call on it: %w", &CompletionError{Status: c.Status, VendorErr: c.VendorErr, Op: "a work request"})
	}
	if l.stalled.Load() {
		return errors.New("another call on the queue pair waited past its deadline for a completion (the peer made no progress) and broke it")
	}
	return errLaneClosed
}

// credit takes one of the QP's credits, waiting until deadline for one
// when wait is set (the call has nothing in flight, so a credit is
// another call's to give back); without wait it reports false at once
// when there is none.
func (q *MooncakeQP) credit(ctx context.Context, deadline time.Time, wait bool) (bool, error) {
	select {
	case <-q.credits:
		return true, nil
	default:
		if !wait {
			return false, nil
		}
	}
	return true, q.take(ctx, q.credits, deadline, "place in its send queue")
}

// take takes a token from ch (the credits, the bounce ring), waiting
// until deadline (zero: none), or until ctx ends or the QP breaks or
// closes.
func (q *MooncakeQP) take(ctx context.Context, ch chan struct{}, deadline time.Time, what string) error {
	var expired <-chan time.Time
	if !deadline.IsZero() {
		t := time.NewTimer(time.Until(deadline))
		defer t.Stop()
		expired = t.C
	}
	select {
	case <-ch:
		return nil
	case <-ctx.Done():
		return transport.ContextErr(ctx)
	case <-q.broke:
		return q.broken()
	case <-q.l.down:
		return q.broken()
	case <-expired:
		return fmt.Errorf("no %s for %s: the calls on the queue pair before it made no progress", what, q.t.cfg.Peer.IOTimeout)
	}
}

// transfer posts the work requests of buf's write (or, read, the RDMA
// READs into it), each taking a credit, and waits for every completion.
// Through the bounce ring a write's chunk is copied in before its post,
// a read's out once it completed (a call's completions come in the order
// of its posts). An error with the QP broken (isBroken) means the NIC
// may still hold the call's work requests.
func (q *MooncakeQP) transfer(ctx context.Context, buf []byte, remote uint64, rkey uint32, s source, read bool) error {
	t, l := q.t, q.l
	timeout := t.cfg.Peer.IOTimeout
	deadline := func() time.Time {
		d := time.Now().Add(timeout)
		if cd, ok := ctx.Deadline(); ok && cd.Before(d) {
			d = cd
		}
		return d
	}
	n := len(buf)
	window := sendDepth
	var ring []byte
	var ringKey uint32
	if s.kind == fromBounce {
		// No deadline: the call holding the ring may take long, and
		// fails by its own if the peer stalls.
		if err := q.take(ctx, q.ring, time.Time{}, "turn at the bounce ring"); err != nil {
			return err
		}
		defer func() { q.ring <- struct{}{} }()
		window = bounceSlots
		var err error
		if ring, ringKey, err = l.bounceBuffer(t.nic); err != nil {
			return err
		}
	}
	post := l.qp.Post
	if read {
		post = func(ops []op) error { return t.post(l.qp, ops) } // counted: the DATAPLANE read line
	}
	count := chunks(n)
	seq := q.seq.Add(1)
	base := uint64(seq) << 32
	// Room for every completion the call can have outstanding (flushes
	// included) and a poke, so the poller never waits on it.
	w := &waiter{wcs: make(chan completion, min(count, window)+2)}
	l.route(seq, w)
	defer l.unroute(seq)
	posted, retired := 0, 0
	defer func() {
		for range posted - retired { // a broken QP's: nobody posts on it again
			q.credits <- struct{}{}
		}
	}()
	ops := make([]op, 0, min(count, window))
	for retired < count {
		ops = ops[:0]
		for posted < count && posted-retired < window {
			ok, err := q.credit(ctx, deadline(), posted == retired)
			if err != nil {
				return err // nothing of this call in flight
			}
			if !ok {
				break
			}
			off := posted * chunk
			m := min(chunk, n-off)
			o := op{WRID: base | uint64(posted), Remote: remote + uint64(off), Len: uint32(m), RKey: rkey, Signaled: true, Read: read}
			if ring != nil {
				slot := ring[(posted%bounceSlots)*chunk:][:m]
				if !read {
					copy(slot, buf[off:off+m])
				}
				o.Local, o.LKey = addrOf(slot), ringKey
			} else {
				o.Local, o.LKey = addrOf(buf)+uint64(off), s.lkey
			}
			ops = append(ops, o)
			posted++
		}
		if len(ops) > 0 {
			if err := post(ops); err != nil {
				q.breakQP() // how many of them went is unknown
				return err
			}
		}
		wc, err := l.completion(w, deadline(), ctx.Done())
		switch {
		case gaveUp(ctx, err):
			return q.settle(ctx, w, posted-retired, base|uint64(posted-1))
		case err == errNoProgress:
			l.stalled.Store(true)
			q.breakQP()
			return fmt.Errorf("the peer made no progress for %s with %d work requests in flight", timeout, posted-retired)
		case err != nil:
			q.breakQP()
			if err == errLaneClosed {
				return q.broken()
			}
			return err // the poller's
		case wc.Status == wcWRFlushErr:
			q.breakQP()
			return q.broken()
		case wc.Status != wcSuccess:
			q.breakQP()
			op := "rdma write"
			if read {
				op = "rdma read"
			}
			return &CompletionError{Status: wc.Status, VendorErr: wc.VendorErr, Op: op}
		}
		if ring != nil && read {
			off := retired * chunk
			m := min(chunk, n-off)
			t.stats.copied.Add(uint64(copy(buf[off:off+m], ring[(retired%bounceSlots)*chunk:][:m])))
		}
		retired++
		q.credits <- struct{}{}
	}
	return nil
}

// settle waits, for drainWait at most, for the completions of a canceled
// call's work requests (inFlight of them, the last numbered last), so
// that a cancel need not break the QP under the other calls on it. It
// returns the cancel's error, having broken the QP when they did not all
// complete: until then the NIC may use the call's memory.
func (q *MooncakeQP) settle(ctx context.Context, w *waiter, inFlight int, last uint64) error {
	deadline := time.Now().Add(drainWait)
	for inFlight > 0 {
		wc, err := q.l.completion(w, deadline, nil)
		switch {
		case err == nil && wc.Status == wcSuccess && wc.WRID != last:
			continue
		case err == errNoProgress:
			q.l.stalled.Store(true)
			q.breakQP()
		case err != nil || wc.Status != wcSuccess:
			q.breakQP()
		}
		break
	}
	return transport.ContextErr(ctx)
}
