package mooncake

import (
	"context"
	"errors"
	"fmt"
	"net"
	"sync"
	"time"

	"github.com/ferry-project/ferry/internal/connlimit"
	"github.com/ferry-project/ferry/internal/loglimit"
	"github.com/ferry-project/ferry/transport"
)

// Mooncake's RDMA transport, as ferry speaks it. Its connections have no
// control channel, no grant and no immediate: a connection handshake
// (type 0) on the segment's RPC port exchanges QP numbers, GID and LID
// for a number of QPs per endpoint (Mooncake's MC_NUM_QP_PER_EP, 2 by
// default, equal on both ends); the QPs connect with PSN 0; the initiator
// posts plain RDMA WRITEs, or READs, with the rkey the target's
// descriptor lists, and its own signaled completion is the end of the
// transfer. The target posts no receives and sees nothing.
//
// One endpoint per peer NIC path carries both directions, as in Mooncake:
// ferry reuses QPs a Mooncake initiator connected when it writes back to
// that NIC, and a new handshake naming the same NIC path replaces them,
// as Mooncake's passive side does (an initiator that restarted), but only
// one from the address that made them: a NIC path is no secret, and
// anyone naming it must not tear down another's endpoint.

// QP is one queue pair of an endpoint, as Verbs makes it.
type QP interface {
	QPN() uint32
	// Connect takes the QP to the peer's queue pair qpn at gid and lid as
	// Mooncake connects its QPs, with a path MTU of at most mtu bytes.
	Connect(gid [16]byte, lid uint16, qpn uint32, mtu int) error
	// Write writes src to remote under rkey with plain RDMA WRITEs and
	// returns once the peer's NIC has placed every byte, within ctx and
	// the NIC's I/O timeout, beside the other calls on the QP (many run
	// at once). A write that failed once anything went to the NIC has
	// closed the QP, failing the calls beside it.
	Write(ctx context.Context, src []byte, remote uint64, rkey uint32) (transport.Report, error)
	// Read fills dst from remote under rkey with plain RDMA READs, as
	// Write writes; a failed read closes the QP as a failed write does.
	Read(ctx context.Context, dst []byte, remote uint64, rkey uint32) (transport.Report, error)
	// Closed reports whether the QP was closed.
	Closed() bool
	// Close destroys the QP, waiting out the calls on it.
	Close() error
}

// Verbs is the NIC the endpoints are made on: package rdma's Transport.
type Verbs[Q QP] interface {
	// MooncakeNIC is the verbs device's name, and its port's LID and GID.
	MooncakeNIC() (device string, lid uint16, gid [16]byte, err error)
	// SharedKeys are the keys of a registration that covers the whole
	// of the transport's memory for peers' writes; ok is false without
	// one. A Mooncake engine lists its buffer so (the test peer,
	// mooncaketest); ferryd's segment lists its Mooncake pool instead.
	SharedKeys() (rkey, lkey uint32, ok bool)
	// NewMooncakeQP makes a queue pair for an endpoint, not yet connected.
	NewMooncakeQP() (Q, error)
}

// DefaultEndpointLimits bounds the endpoint table: each peer NIC that
// connects costs up to MaxQPs QPs and their CQs, and anyone who reaches
// the RPC port may connect. One address may hold 64 (a host's 8 engines
// each connecting from 8 NICs); 1024 in all. The table is full only with
// 16 such hosts, or with strangers; then the quiet go first: endpoints
// nobody proved legitimate (ferry wrote through it, or a notify from its
// address completed a receive slot), then those of the address holding
// the most, then the least recently used (connlimit). Endpoints ferry
// dialed itself are proven from the start and bound by no per-address
// cap.
var DefaultEndpointLimits = connlimit.Limits{Total: 1024, PerSource: 64}

// EndpointConfig configures Endpoints. Zero fields take the defaults
// noted.
type EndpointConfig struct {
	// MTU is the path MTU cap Mooncake peers use, in bytes (their MC_MTU);
	// default DefaultMTU.
	MTU int
	// Limits caps the table; zero fields take DefaultEndpointLimits'.
	Limits connlimit.Limits
	// HandshakeTimeout bounds a connection handshake ferry starts;
	// default HandshakeTimeout.
	HandshakeTimeout time.Duration
	// Infof hears routine events worth a line (an endpoint evicted from a
	// full table), at most loglimit.Burst a second.
	Infof func(format string, args ...any)
}

// Endpoints are the RDMA endpoints this daemon holds to Mooncake NICs,
// both those it connected and those Mooncake initiators connected to it,
// made of queue pairs on v.
type Endpoints[Q QP] struct {
	v   Verbs[Q]
	cfg EndpointConfig
	log *loglimit.Limiter // hears evictions; nil: none

	mu     sync.Mutex
	eps    map[string]*endpoint[Q]
	lim    *connlimit.Table[*endpoint[Q]]
	closed bool
	// dials is the handshakes in flight, by peer NIC path: concurrent
	// writes to a new peer NIC make one endpoint, while an unreachable
	// peer holds up only the writes to it.
	dials map[string]chan struct{} // closed when the handshake ends
}

var _ RDMAInitiator = (*Endpoints[QP])(nil)

// endpoint is the QPs connected to one peer NIC.
type endpoint[Q QP] struct {
	peer  string   // the peer's NIC path, the table's key
	owner string   // the source whose handshakes may replace it (see ownerOf)
	gid   [16]byte // the GID and LID the QPs are connected to
	lid   uint16
	qps   []Q
	// load is the bytes of the calls on each of qps, under mu: a call
	// takes the least loaded (pick), so pages do not queue behind a long
	// write while another QP idles.
	mu     sync.Mutex
	load   []int
	once   sync.Once
	closed chan struct{}                   // closed when close begins
	m      *connlimit.Member[*endpoint[Q]] // its place in the table's caps
}

var errEndpointsClosed = errors.New("the transport is closing")

// NewEndpoints makes the endpoint table over v. Close it before v.
func NewEndpoints[Q QP](v Verbs[Q], cfg EndpointConfig) *Endpoints[Q] {
	if cfg.MTU <= 0 {
		cfg.MTU = DefaultMTU
	}
	cfg.Limits = cfg.Limits.Or(DefaultEndpointLimits)
	if cfg.HandshakeTimeout <= 0 {
		cfg.HandshakeTimeout = HandshakeTimeout
	}
	e := &Endpoints[Q]{v: v, cfg: cfg, eps: make(map[string]*endpoint[Q]), lim: connlimit.NewTable[*endpoint[Q]](cfg.Limits)}
	if cfg.Infof != nil {
		e.log = loglimit.New("rdma", cfg.Infof)
	}
	return e
}

// Device is this daemon's NIC as a descriptor lists it: device name,
// LID and GID in Mooncake's text form.
func (e *Endpoints[Q]) Device() (Device, error) {
	name, lid, gid, err := e.v.MooncakeNIC()
	if err != nil {
		return Device{}, err
	}
	return Device{Name: name, LID: lid, GID: FormatGID(gid)}, nil
}

// Keys are the shared registration's keys, which a descriptor advertises
// for the whole of an engine's buffer (Verbs.SharedKeys); ok is false
// without one, when Mooncake peers cannot write into it over RDMA.
func (e *Endpoints[Q]) Keys() (rkey, lkey uint32, ok bool) { return e.v.SharedKeys() }

// Stats is what the table's caps did.
func (e *Endpoints[Q]) Stats() connlimit.Stats { return e.lim.Stats() }

// Proven marks the endpoints connected from addr's source as legitimate
// (see DefaultEndpointLimits): a notify from there completed a receive
// slot, which takes a slot's address.
func (e *Endpoints[Q]) Proven(addr net.Addr) { e.lim.ProveSource(connlimit.Source(addr)) }

// Close closes every endpoint; the table takes no more.
func (e *Endpoints[Q]) Close() {
	e.mu.Lock()
	eps := e.eps
	e.eps, e.closed = nil, true
	e.mu.Unlock()
	for _, ep := range eps {
		ep.close()
	}
	if e.log != nil {
		e.log.Stop()
	}
}

func (e *Endpoints[Q]) isClosed() bool {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.closed
}

// get returns the endpoint to peer if its QPs are connected to gid and
// lid. An endpoint is stored under the NIC path its initiator claimed, so
// one connected to another address is someone else's: the caller
// handshakes afresh, replacing it. e.mu is held.
func (e *Endpoints[Q]) get(peer string, gid [16]byte, lid uint16) *endpoint[Q] {
	ep := e.eps[peer]
	if ep == nil || ep.gid != gid || ep.lid != lid {
		return nil
	}
	return ep
}

// claim returns the endpoint to peer as get does or, when there is none,
// either done (closed when another caller's handshake to peer ends: wait
// and claim again) or, with both nil, the right to handshake, which the
// caller gives back by unclaim.
func (e *Endpoints[Q]) claim(peer string, gid [16]byte, lid uint16) (ep *endpoint[Q], done <-chan struct{}) {
	e.mu.Lock()
	defer e.mu.Unlock()
	if ep := e.get(peer, gid, lid); ep != nil {
		return ep, nil
	}
	if d, ok := e.dials[peer]; ok {
		return nil, d
	}
	if e.dials == nil {
		e.dials = make(map[string]chan struct{})
	}
	e.dials[peer] = make(chan struct{})
	return nil, nil
}

// unclaim ends the caller's handshake to peer, waking its waiters.
func (e *Endpoints[Q]) unclaim(peer string) {
	e.mu.Lock()
	close(e.dials[peer])
	delete(e.dials, peer)
	e.mu.Unlock()
}

// put installs ep, connected for source (connlimit.Source of the
// handshake's address; "" for an endpoint ferry dialed, which starts
// proven), closing the endpoint of the same NIC path it replaces and, in
// a full table, or source's oldest unproven one at its cap, the one
// connlimit picks. A closed table refuses it, and so does the table when
// source holds its most, all proven; a handshake (source not
// "") may replace only an endpoint its own source owns. A refused ep
// leaves the endpoint of its NIC path as it was.
func (e *Endpoints[Q]) put(ep *endpoint[Q], source string) error {
	e.mu.Lock()
	if e.closed {
		e.mu.Unlock()
		return errEndpointsClosed
	}
	old := e.eps[ep.peer]
	if old != nil && source != "" && old.owner != source {
		e.mu.Unlock()
		return fmt.Errorf("an endpoint to NIC path %q was set up from another address, and a handshake replaces only one its own address set up (or, for one this ferryd connected to, the segment's host): this one is refused, that one stays", ep.peer)
	}
	var oldm *connlimit.Member[*endpoint[Q]]
	if old != nil {
		oldm = old.m
	}
	mem, evicted, err := e.lim.Replace(oldm, source, ep)
	if err != nil {
		e.mu.Unlock()
		return fmt.Errorf("%s already holds %d Mooncake endpoints here, the most one address may, all proven or in use: this one is refused, its others stay", source, e.cfg.Limits.PerSource)
	}
	ep.m = mem
	if source == "" {
		mem.Prove()
	}
	e.eps[ep.peer] = ep
	if evicted != nil {
		delete(e.eps, evicted.Value.peer)
	}
	e.mu.Unlock()
	if old != nil {
		old.close()
	}
	if evicted != nil {
		evicted.Value.close()
		if e.log != nil {
			e.log.Printf("rdma: %d Mooncake endpoints, the most kept: closed the one to %s, for %s", e.cfg.Limits.Total, loglimit.Quote(evicted.Value.peer), loglimit.Quote(ep.peer))
		}
	}
	return nil
}

// drop removes ep if it is still the table's, and closes it.
func (e *Endpoints[Q]) drop(ep *endpoint[Q]) {
	e.mu.Lock()
	if e.eps[ep.peer] == ep {
		delete(e.eps, ep.peer)
		ep.m.Release()
	}
	e.mu.Unlock()
	ep.close()
}

// newQPs makes n QPs for an endpoint.
func (e *Endpoints[Q]) newQPs(n int) ([]Q, error) {
	var qps []Q
	for range n {
		q, err := e.v.NewMooncakeQP()
		if err != nil {
			closeQPs(qps)
			return nil, fmt.Errorf("creating queue pair %d of %d: %w", len(qps)+1, n, err)
		}
		qps = append(qps, q)
	}
	return qps, nil
}

func closeQPs[Q QP](qps []Q) {
	for _, q := range qps {
		q.Close()
	}
}

// connect connects qps[i] to the peer's qpns[i] and makes them an
// endpoint, which handshakes from owner may replace.
func (e *Endpoints[Q]) connect(peer, owner string, qps []Q, gid [16]byte, lid uint16, qpns []uint32) (*endpoint[Q], error) {
	for i, q := range qps {
		if err := q.Connect(gid, lid, qpns[i], e.cfg.MTU); err != nil {
			return nil, err
		}
	}
	return &endpoint[Q]{peer: peer, owner: owner, gid: gid, lid: lid, qps: qps, load: make([]int, len(qps)), closed: make(chan struct{})}, nil
}

// pick counts a call of n bytes on the QP with the fewest bytes of calls
// on it (the first of those), and says which; done uncounts it. A QP
// carries many calls at once (QP), so none waits for another to pick.
func (ep *endpoint[Q]) pick(n int) int {
	ep.mu.Lock()
	defer ep.mu.Unlock()
	i := 0
	for j, b := range ep.load {
		if b < ep.load[i] {
			i = j
		}
	}
	ep.load[i] += n
	return i
}

func (ep *endpoint[Q]) done(i, n int) {
	ep.mu.Lock()
	ep.load[i] -= n
	ep.mu.Unlock()
}

// close destroys the endpoint's QPs, waiting out the calls on them.
func (ep *endpoint[Q]) close() {
	ep.once.Do(func() {
		close(ep.closed)
		closeQPs(ep.qps)
	})
}

// ownerOf is the source whose handshakes may replace an endpoint ferry
// dialed: the address its handshake reached, the segment's host (which
// connects back from it when it rebuilds the endpoint), whether the
// segment's RPC address names it by address or by host name.
func ownerOf(reached net.Addr) string {
	if reached == nil {
		return ""
	}
	return connlimit.Source(reached)
}

func (ep *endpoint[Q]) isClosed() bool {
	select {
	case <-ep.closed:
		return true
	default:
		return false
	}
}

func qpNums[Q QP](qps []Q) []uint32 {
	n := make([]uint32, len(qps))
	for i, q := range qps {
		n[i] = q.QPN()
	}
	return n
}

// Handshake is what the passive side of a connection handshake knows
// besides the request.
type Handshake struct {
	Self string   // this side's segment name
	From net.Addr // where the request came from, whose per-address cap it counts against
	// MayFetch says whether this side may dial segment (an RPC port,
	// "host:port") to fetch the initiator's descriptor, for a request
	// without local_gid: a stranger must not make the daemon dial any
	// address it names. Nil: none may be.
	MayFetch func(segment string) bool
}

// Accept answers a connection handshake as its passive side, within ctx.
// It connects as many QPs as the initiator offers (at most MaxQPs) to
// them before replying, replacing the endpoint of the same initiator NIC
// path if h.From's address set it up (see put). A refusal is a reply
// with reply_msg set, which every Mooncake initiator takes as one (the
// handshake server logs it, rate-limited).
// undo, nil for a refusal, drops the endpoint: for when the reply cannot
// be sent.
func (e *Endpoints[Q]) Accept(ctx context.Context, h Handshake, req HandshakeDesc) (reply HandshakeDesc, undo func()) {
	reply = HandshakeDesc{LocalNICPath: req.PeerNICPath, PeerNICPath: req.LocalNICPath}
	refuse := func(format string, args ...any) (HandshakeDesc, func()) {
		reply.ReplyMsg = fmt.Sprintf(format, args...)
		return reply, nil
	}
	dev, err := e.Device()
	if err != nil {
		return refuse("%v", err)
	}
	mine := NICPath(h.Self, dev.Name)
	switch {
	case req.PeerNICPath != mine:
		return refuse("peer_nic_path %q names no NIC of this segment: its one NIC is %s", req.PeerNICPath, mine)
	case len(req.QPNum) == 0 || len(req.QPNum) > MaxQPs:
		return refuse("%d QP numbers offered: want 1 to %d, the most this ferryd connects per endpoint (set the initiator's MC_NUM_QP_PER_EP to at most %d)", len(req.QPNum), MaxQPs, MaxQPs)
	}
	gid, lid, err := initiatorAddress(ctx, h, req)
	if err != nil {
		return refuse("%v", err)
	}
	qps, err := e.newQPs(len(req.QPNum))
	if err != nil {
		return refuse("%v", err)
	}
	source := connlimit.Source(h.From)
	ep, err := e.connect(req.LocalNICPath, source, qps, gid, lid, req.QPNum)
	if err == nil {
		err = e.put(ep, source)
	}
	if err != nil {
		closeQPs(qps)
		return refuse("%v", err)
	}
	reply.QPNum, reply.LocalLID, reply.LocalGID = qpNums(qps), dev.LID, dev.GID
	return reply, func() { e.drop(ep) }
}

// initiatorAddress is the GID and LID of a connection's initiator: from
// its request when it sends them (newer Mooncakes), else from the devices
// of its segment descriptor, fetched from the segment its NIC path names
// (older ones, which expect exactly that), if h allows dialing it.
func initiatorAddress(ctx context.Context, h Handshake, req HandshakeDesc) ([16]byte, uint16, error) {
	if req.LocalGID != "" {
		gid, err := ParseGID(req.LocalGID)
		return gid, req.LocalLID, err
	}
	seg, dev, ok := SplitNICPath(req.LocalNICPath)
	if !ok {
		return [16]byte{}, 0, fmt.Errorf("local_nic_path %q is not <segment>@<device>, and no local_gid came with it", req.LocalNICPath)
	}
	if h.MayFetch == nil || !h.MayFetch(seg) {
		return [16]byte{}, 0, fmt.Errorf("no local_gid in the request, and this ferryd fetches an initiator's descriptor only from a Mooncake segment it has sent to or was told to trust, which %q is not: send local_gid and local_lid in the handshake (newer Mooncake releases do), or send to that segment from this ferryd first", seg)
	}
	desc, err := FetchSegment(ctx, seg, &Segment{Name: h.Self, Protocol: "rdma", Buffers: []Buffer{}})
	if err != nil {
		return [16]byte{}, 0, fmt.Errorf("no local_gid in the request, and the initiator's descriptor: %w", err)
	}
	for _, d := range desc.Devices {
		if d.Name == dev {
			gid, err := ParseGID(d.GID)
			return gid, d.LID, err
		}
	}
	return [16]byte{}, 0, fmt.Errorf("no local_gid in the request, and the initiator's descriptor lists no device %q", dev)
}

// endpoint returns the endpoint to tg's NIC, connecting one by a
// handshake with the segment's RPC port rpc (self naming this side's
// segment, qps QPs) when there is none connected to the GID the
// target's descriptor lists. An endpoint is not dropped on a
// new descriptor of the peer (Mooncake's newer releases refuse a second
// handshake while their endpoint lives); only a failed write drops it,
// and the retry handshakes afresh.
func (e *Endpoints[Q]) endpoint(ctx context.Context, self, rpc string, tg RDMATarget, qps int) (*endpoint[Q], error) {
	want, err := ParseGID(tg.Device.GID)
	if err != nil {
		return nil, fmt.Errorf("segment device %s: %w", tg.Device.Name, err)
	}
	for {
		ep, done := e.claim(tg.NICPath, want, tg.Device.LID)
		if ep != nil {
			return ep, nil
		}
		if done == nil {
			break
		}
		select {
		case <-done: // its endpoint, or our turn to handshake
		case <-ctx.Done():
			return nil, fmt.Errorf("waiting for the handshake with %s: %w", tg.NICPath, transport.ContextErr(ctx))
		}
	}
	defer e.unclaim(tg.NICPath)
	dev, err := e.Device()
	if err != nil {
		return nil, err
	}
	if qps <= 0 {
		qps = DefaultQPs
	}
	qs, err := e.newQPs(qps)
	if err != nil {
		return nil, err
	}
	hctx, cancel := context.WithTimeout(ctx, e.cfg.HandshakeTimeout)
	defer cancel()
	r, reached, err := connectQPs(hctx, rpc, HandshakeDesc{
		LocalNICPath: NICPath(self, dev.Name), PeerNICPath: tg.NICPath,
		QPNum: qpNums(qs), LocalLID: dev.LID, LocalGID: dev.GID,
	})
	if err != nil {
		closeQPs(qs)
		return nil, err
	}
	// The QPs go to the GID and LID the descriptor lists, which is what
	// makes the endpoint reusable for the next write; a reply naming
	// another address is not the segment's NIC.
	if r.LocalGID != "" {
		if got, err := ParseGID(r.LocalGID); err != nil || got != want || r.LocalLID != tg.Device.LID {
			closeQPs(qs)
			return nil, fmt.Errorf("connecting to %s: the handshake reply's local_gid %q and local_lid %d are not the descriptor's GID %s and LID %d of device %s",
				tg.NICPath, r.LocalGID, r.LocalLID, tg.Device.GID, tg.Device.LID, tg.Device.Name)
		}
	}
	ep, err := e.connect(tg.NICPath, ownerOf(reached), qs, want, tg.Device.LID, r.QPNum)
	if err == nil {
		if err = e.put(ep, ""); err == nil {
			return ep, nil
		}
	}
	closeQPs(qs)
	return nil, fmt.Errorf("connecting to %s: %w", tg.NICPath, err)
}

// WriteRDMA writes w.Src to w.Remote on one of the QPs of the endpoint to
// w's target NIC, and returns once the peer's NIC has placed every byte.
// A failed write (an error completion, no progress within the I/O
// timeout) drops the endpoint, so the next write handshakes afresh.
func (e *Endpoints[Q]) WriteRDMA(ctx context.Context, w RDMAWrite) (transport.Report, error) {
	return e.onQP(ctx, "write", w.Self, w.RPC, w.Target, w.QPs, w.Remote, len(w.Src), func(q Q) (transport.Report, error) {
		return q.Write(ctx, w.Src, w.Remote, w.Target.RKey)
	})
}

// ReadRDMA fills r.Dst from r.Remote on one of the QPs of the endpoint to
// r's target NIC (the one a write there would take), and returns once
// every byte is in r.Dst. A failed read drops the endpoint as a failed
// write does.
func (e *Endpoints[Q]) ReadRDMA(ctx context.Context, r RDMARead) (transport.Report, error) {
	return e.onQP(ctx, "read", r.Self, r.RPC, r.Target, r.QPs, r.Remote, len(r.Dst), func(q Q) (transport.Report, error) {
		return q.Read(ctx, r.Dst, r.Remote, r.Target.RKey)
	})
}

// onQP runs op, a write or read (what) of n bytes at remote in tg's
// buffer, on the least loaded QP of the endpoint to tg's NIC, beside the
// calls already on it.
func (e *Endpoints[Q]) onQP(ctx context.Context, what, self, rpc string, tg RDMATarget, qps int, remote uint64, n int, op func(Q) (transport.Report, error)) (transport.Report, error) {
	if e.isClosed() {
		return transport.Report{}, fmt.Errorf("rdma %s of %s: %w", what, tg.NICPath, transport.ErrClosed)
	}
	if n == 0 {
		return transport.Report{}, nil
	}
	ep, err := e.endpoint(ctx, self, rpc, tg, qps)
	if err != nil {
		return transport.Report{}, err
	}
	i := ep.pick(n)
	q := ep.qps[i]
	rep, err := op(q)
	ep.done(i, n)
	switch {
	case err == nil:
		// ferry wrote or read through it: legitimate traffic.
		ep.m.Prove()
		return rep, nil
	case !q.Closed(): // nothing went to the NIC, or a canceled call's work completed
		return transport.Report{}, err
	case ep.isClosed(): // dropped under the transfer
		return transport.Report{}, fmt.Errorf("the endpoint to %s was torn down: %w", ep.peer, err)
	}
	e.drop(ep)
	return transport.Report{}, fmt.Errorf("rdma %s of %d bytes at %#x on %s (rkey %#x): %w", what, n, remote, ep.peer, tg.RKey, err)
}
