package rdma

import (
	"context"
	"errors"
	"fmt"
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
// read connection (reads.go), which connects as Mooncake's do. The
// transport closes those still open when it closes.
type MooncakeQP struct {
	t   *Transport
	l   *lane  // ctrl is nil: Mooncake has no control connection
	cap *qpCap // the cap it counts against
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
	return &MooncakeQP{t: t, l: newLane(qp, nil, sendDepth)}, nil
}

func (q *MooncakeQP) QPN() uint32 { return q.l.qp.QPN() }

// Connect connects the QP to the peer's queue pair qpn at gid and lid
// with Mooncake's attributes, its path MTU at most mtu bytes (0, or a
// size no MTU enum has: the port's).
func (q *MooncakeQP) Connect(gid [16]byte, lid uint16, qpn uint32, mtu int) error {
	return q.l.qp.(mooncakeQP).connectMooncake(endpoint{GID: gid, LID: lid, QPN: qpn, MTU: mtuOf(mtu)}, qpWrites|qpReads)
}

// Write writes src to remote under rkey in chunks, every one signaled, at
// most sendDepth (bounceSlots from a bounce ring) in flight, and returns
// once their completions say the peer's NIC has placed every byte, or
// none came for the I/O timeout. A write that failed once its source was
// on its way to the NIC closes the QP.
func (q *MooncakeQP) Write(ctx context.Context, src []byte, remote uint64, rkey uint32) (transport.Report, error) {
	return q.move(ctx, src, remote, rkey, false)
}

// Read reads len(dst) bytes at remote under rkey into dst by RDMA READs,
// as Write writes: in place where dst lies in memory registered here
// (the arena's shared registration, a region's), else through the
// bounce ring. A read that failed once posted closes the QP.
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
	l.use.Lock()
	select {
	case <-l.quit: // closed meanwhile
		l.use.Unlock()
		return transport.Report{}, errLaneClosed
	default:
	}
	err = t.mooncakePost(ctx, l, buf, remote, rkey, s, read)
	l.use.Unlock()
	if err != nil {
		// The QP goes before the registration (deferred): until then
		// the NIC may still use it.
		q.Close()
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

// Close destroys the QP, waiting out a write on it.
func (q *MooncakeQP) Close() error {
	q.t.mu.Lock()
	delete(q.cap.open, q)
	q.t.mu.Unlock()
	return q.l.close()
}

// mooncakePost posts the write of buf (or, read, the RDMA READ into
// it) and waits for every completion. Through the bounce ring a write's
// chunk is copied in before its post, a read's out once it completed
// (completions come in the order of the posts).
func (t *Transport) mooncakePost(ctx context.Context, l *lane, buf []byte, remote uint64, rkey uint32, s source, read bool) error {
	n := len(buf)
	window := sendDepth
	var ring []byte
	var ringKey uint32
	if s.kind == fromBounce {
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
	l.seq++
	base := uint64(l.seq) << 32
	ops := make([]op, 0, min(count, window))
	posted, retired := 0, 0
	for retired < count {
		ops = ops[:0]
		for posted < count && posted-retired < window {
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
				return err
			}
		}
		deadline := time.Now().Add(t.cfg.Peer.IOTimeout)
		if cd, ok := ctx.Deadline(); ok && cd.Before(deadline) {
			deadline = cd
		}
		wc, err := wait(l, l.wcs, deadline, ctx.Done())
		switch {
		case err == errNoProgress:
			return fmt.Errorf("the peer made no progress for %s with %d work requests in flight", t.cfg.Peer.IOTimeout, posted-retired)
		case err == errCanceled:
			return transport.ContextErr(ctx)
		case err != nil:
			return err
		case wc.WRID>>32 != base>>32:
			continue // a stale completion; none are expected
		case wc.Status != wcSuccess && read:
			return &CompletionError{Status: wc.Status, VendorErr: wc.VendorErr, Op: "rdma read"}
		case wc.Status != wcSuccess:
			return &CompletionError{Status: wc.Status, VendorErr: wc.VendorErr, Op: "rdma write"}
		}
		if ring != nil && read {
			off := retired * chunk
			m := min(chunk, n-off)
			t.stats.copied.Add(uint64(copy(buf[off:off+m], ring[(retired%bounceSlots)*chunk:][:m])))
		}
		retired++
	}
	return nil
}
