package rdma

import (
	"context"
	"errors"
	"fmt"
	"net"
	"sync"
	"time"

	"github.com/ferry-project/ferry/internal/connlimit"
	"github.com/ferry-project/ferry/internal/loglimit"
	"github.com/ferry-project/ferry/mooncake"
	"github.com/ferry-project/ferry/transport"
)

// Mooncake's RDMA transport (package mooncake has the handshake). Its
// connections have no control channel, no grant and no immediate: a
// connection handshake (type 0) on the segment's RPC port exchanges QP
// numbers, GID and LID for a number of QPs per endpoint (Mooncake's
// MC_NUM_QP_PER_EP, 2 by default, equal on both ends); the QPs connect
// with PSN 0 (mcverbs.go); the initiator posts plain RDMA WRITEs with the
// rkey the target's descriptor lists, and its own signaled completion is
// the end of the transfer. The target posts no receives and sees nothing.
//
// One endpoint per peer NIC path carries both directions, as in Mooncake:
// ferry reuses QPs a Mooncake initiator connected when it writes back to
// that NIC, and a new handshake from the same NIC path replaces them.

// mcEndpoint is the QPs connected to one peer NIC.
type mcEndpoint struct {
	peer  string   // the peer's NIC path, the endpoint table's key
	gid   [16]byte // the GID and LID the QPs are connected to
	lid   uint16
	lanes []*lane // one per QP; ctrl is nil (no control connection)
	free  chan *lane
	once  sync.Once
	m     *connlimit.Member[*mcEndpoint] // its place in mcTable.lim
}

// DefaultMooncakeLimits bounds the endpoint table: each peer NIC that
// connects costs up to mooncake.MaxQPs QPs and their CQs, and anyone who
// reaches the RPC port may connect. One address may hold 64 (a host's 8
// engines each connecting from 8 NICs); 1024 in all. The table is full
// only with 16 such hosts, or with strangers; then the quiet go first:
// endpoints nobody proved legitimate (ferry wrote through it, or a notify
// from its address completed a receive slot), then those of the address
// holding the most, then the least recently used (connlimit). Endpoints
// ferry dialed itself are proven from the start and bound by no
// per-address cap.
var DefaultMooncakeLimits = connlimit.Limits{Total: 1024, PerSource: 64}

// mcTable is the transport's Mooncake endpoints.
type mcTable struct {
	mu     sync.Mutex
	eps    map[string]*mcEndpoint
	lim    *connlimit.Table[*mcEndpoint] // made on first use with limits
	limits connlimit.Limits              // zero: DefaultMooncakeLimits
	closed bool
	log    *loglimit.Limiter // hears evictions; nil: none
	// dials is the handshakes in flight, by peer NIC path: concurrent
	// writes to a new peer NIC make one endpoint, while an unreachable
	// peer holds up only the writes to it.
	dials map[string]chan struct{} // closed when the handshake ends
}

var errEndpointsClosed = errors.New("the transport is closing")

// table is the endpoints' caps, made on first use. m.mu is held.
func (m *mcTable) table() *connlimit.Table[*mcEndpoint] {
	if m.lim == nil {
		lim := m.limits
		if lim.Total <= 0 {
			lim.Total = DefaultMooncakeLimits.Total
		}
		if lim.PerSource <= 0 {
			lim.PerSource = DefaultMooncakeLimits.PerSource
		}
		m.lim = connlimit.NewTable[*mcEndpoint](lim)
	}
	return m.lim
}

// get returns the endpoint to peer if its QPs are connected to gid and
// lid. An endpoint is stored under the NIC path its initiator claimed, so
// one connected to another address is someone else's: the caller
// handshakes afresh, replacing it. m.mu is held.
func (m *mcTable) get(peer string, gid [16]byte, lid uint16) *mcEndpoint {
	ep := m.eps[peer]
	if ep == nil || ep.gid != gid || ep.lid != lid {
		return nil
	}
	return ep
}

// claim returns the endpoint to peer as get does or, when there is none,
// either done (closed when another caller's handshake to peer ends: wait
// and claim again) or, with both nil, the right to handshake, which the
// caller gives back by unclaim.
func (m *mcTable) claim(peer string, gid [16]byte, lid uint16) (ep *mcEndpoint, done <-chan struct{}) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if ep := m.get(peer, gid, lid); ep != nil {
		return ep, nil
	}
	if d, ok := m.dials[peer]; ok {
		return nil, d
	}
	if m.dials == nil {
		m.dials = make(map[string]chan struct{})
	}
	m.dials[peer] = make(chan struct{})
	return nil, nil
}

// unclaim ends the caller's handshake to peer, waking its waiters.
func (m *mcTable) unclaim(peer string) {
	m.mu.Lock()
	close(m.dials[peer])
	delete(m.dials, peer)
	m.mu.Unlock()
}

// put installs ep, connected for source (connlimit.Source of the
// handshake's address; "" for an endpoint ferry dialed, which starts
// proven), closing the endpoint of the same NIC path it replaces and, in
// a full table, the one connlimit picks. A closing transport refuses it,
// and so does the table when source holds its most.
func (m *mcTable) put(ep *mcEndpoint, source string) error {
	m.mu.Lock()
	if m.closed {
		m.mu.Unlock()
		return errEndpointsClosed
	}
	if m.eps == nil {
		m.eps = make(map[string]*mcEndpoint)
	}
	// A second handshake from a NIC path replaces its endpoint, whether
	// or not the new one gets a place.
	old := m.eps[ep.peer]
	if old != nil {
		delete(m.eps, old.peer)
		old.m.Release()
	}
	mem, evicted, err := m.table().Admit(source, ep)
	if err == nil {
		ep.m = mem
		if source == "" {
			mem.Prove()
		}
		m.eps[ep.peer] = ep
		if evicted != nil {
			delete(m.eps, evicted.Value.peer)
		}
	}
	lim := m.lim.Limits()
	m.mu.Unlock()
	if old != nil {
		old.close()
	}
	if err != nil {
		return fmt.Errorf("%s already holds %d Mooncake endpoints here, the most one address may: this one is refused, its others stay", source, lim.PerSource)
	}
	if evicted != nil {
		evicted.Value.close()
		if m.log != nil {
			m.log.Printf("rdma: %d Mooncake endpoints, the most kept: closed the one to %s, for %s", lim.Total, loglimit.Quote(evicted.Value.peer), loglimit.Quote(ep.peer))
		}
	}
	return nil
}

// proven marks ep as carrying legitimate traffic: ferry wrote through it.
func (m *mcTable) proven(ep *mcEndpoint) {
	if ep.m != nil {
		ep.m.Prove()
	}
}

// drop removes ep if it is still the table's, and closes it.
func (m *mcTable) drop(ep *mcEndpoint) {
	m.mu.Lock()
	if m.eps[ep.peer] == ep {
		delete(m.eps, ep.peer)
		ep.m.Release()
	}
	m.mu.Unlock()
	ep.close()
}

func (m *mcTable) closeAll() {
	m.mu.Lock()
	eps := m.eps
	m.eps, m.closed = nil, true
	m.mu.Unlock()
	for _, ep := range eps {
		ep.close()
	}
	if m.log != nil {
		m.log.Stop()
	}
}

// stats is what the table's caps did.
func (m *mcTable) stats() connlimit.Stats {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.table().Stats()
}

// close destroys the endpoint's QPs, waiting out writers on them.
func (ep *mcEndpoint) close() {
	ep.once.Do(func() {
		for _, l := range ep.lanes {
			l.close()
		}
	})
}

// mooncakeNIC is a NIC that can name itself as Mooncake's descriptors
// do; its queue pairs are mooncakeQPs.
type mooncakeNIC interface {
	nic
	deviceName() string
}

// MooncakeDevice is this transport's NIC as a Mooncake descriptor lists
// it: device name, LID and GID in Mooncake's text form.
func (t *Transport) MooncakeDevice() (mooncake.Device, error) {
	n, ok := t.nic.(mooncakeNIC)
	if !ok {
		return mooncake.Device{}, errors.New("Mooncake's RDMA transport needs a verbs device")
	}
	e := n.Endpoint()
	return mooncake.Device{Name: n.deviceName(), LID: e.LID, GID: mooncake.FormatGID(e.GID)}, nil
}

// MooncakeKeys are the shared registration's keys, which a descriptor
// advertises for the whole of Memory; ok is false without one (per-send
// mode), when Mooncake peers cannot write into Memory over RDMA.
func (t *Transport) MooncakeKeys() (rkey, lkey uint32, ok bool) {
	if t.shared == nil {
		return 0, 0, false
	}
	return t.shared.RKey(), t.shared.LKey(), true
}

// mooncakeMTU is the MTU Mooncake peers are taken to use, Config's
// MooncakeMTU (their MC_MTU): a Mooncake QP's path MTU is the smaller of
// it and this port's active MTU.
func (t *Transport) mooncakeMTU() mtu {
	if m := mtuOf(t.cfg.MooncakeMTU); m != 0 {
		return m
	}
	return mtuOf(mooncake.DefaultMTU) // 0, or no MTU verbs know
}

// newMooncakeQPs makes n QPs for a Mooncake endpoint, in INIT.
func (t *Transport) newMooncakeQPs(n int) ([]*lane, error) {
	var lanes []*lane
	for range n {
		qp, err := t.nic.NewQP(sendDepth, 1)
		if err != nil {
			closeLanes(lanes)
			return nil, fmt.Errorf("creating queue pair %d of %d: %w", len(lanes)+1, n, err)
		}
		if _, ok := qp.(mooncakeQP); !ok {
			qp.Close()
			closeLanes(lanes)
			return nil, errors.New("Mooncake's RDMA transport needs a verbs device")
		}
		lanes = append(lanes, newLane(qp, nil, sendDepth))
	}
	return lanes, nil
}

func closeLanes(lanes []*lane) {
	for _, l := range lanes {
		l.close()
	}
}

// connectMooncake connects lanes[i] to the peer's qpns[i] and makes them
// an endpoint.
func connectMooncake(peer string, lanes []*lane, gid [16]byte, lid uint16, qpns []uint32, m mtu) (*mcEndpoint, error) {
	for i, l := range lanes {
		if err := l.qp.(mooncakeQP).connectMooncake(endpoint{GID: gid, LID: lid, QPN: qpns[i], MTU: m}); err != nil {
			return nil, err
		}
	}
	return newMCEndpoint(peer, gid, lid, lanes), nil
}

func newMCEndpoint(peer string, gid [16]byte, lid uint16, lanes []*lane) *mcEndpoint {
	ep := &mcEndpoint{peer: peer, gid: gid, lid: lid, lanes: lanes, free: make(chan *lane, len(lanes))}
	for _, l := range lanes {
		ep.free <- l
	}
	return ep
}

func qpNums(lanes []*lane) []uint32 {
	q := make([]uint32, len(lanes))
	for i, l := range lanes {
		q[i] = l.qp.QPN()
	}
	return q
}

// MooncakeHandshake is what the passive side of a Mooncake connection
// handshake knows besides the request.
type MooncakeHandshake struct {
	Self string   // this side's segment name
	From net.Addr // where the request came from, whose per-address cap it counts against
	// MayFetch says whether this side may dial segment (an RPC port,
	// "host:port") to fetch the initiator's descriptor, for a request
	// without local_gid: a stranger must not make the daemon dial any
	// address it names. Nil: none may be.
	MayFetch func(segment string) bool
}

// MooncakeEndpointStats is what the Mooncake endpoint table's caps did.
func (t *Transport) MooncakeEndpointStats() connlimit.Stats { return t.mc.stats() }

// MooncakeProven marks the endpoints connected from addr's source as
// legitimate (see DefaultMooncakeLimits): a notify from there completed
// a receive slot, which takes a slot's address.
func (t *Transport) MooncakeProven(addr net.Addr) {
	t.mc.mu.Lock()
	lim := t.mc.table()
	t.mc.mu.Unlock()
	lim.ProveSource(connlimit.Source(addr))
}

// AcceptMooncake answers a Mooncake connection handshake as its passive
// side, within ctx. It connects as many QPs as the initiator offers (at
// most mooncake.MaxQPs) to them before replying, replacing any endpoint
// of the same initiator NIC path. A refusal is a reply with reply_msg
// set, which every Mooncake initiator takes as one (the handshake server
// logs it, rate-limited). undo, nil for a refusal, drops the endpoint:
// for when the reply cannot be sent.
func (t *Transport) AcceptMooncake(ctx context.Context, h MooncakeHandshake, req mooncake.HandshakeDesc) (reply mooncake.HandshakeDesc, undo func()) {
	reply = mooncake.HandshakeDesc{LocalNICPath: req.PeerNICPath, PeerNICPath: req.LocalNICPath}
	refuse := func(format string, args ...any) (mooncake.HandshakeDesc, func()) {
		reply.ReplyMsg = fmt.Sprintf(format, args...)
		return reply, nil
	}
	dev, err := t.MooncakeDevice()
	if err != nil {
		return refuse("%v", err)
	}
	mine := mooncake.NICPath(h.Self, dev.Name)
	switch {
	case req.PeerNICPath != mine:
		return refuse("peer_nic_path %q names no NIC of this segment: its one NIC is %s", req.PeerNICPath, mine)
	case len(req.QPNum) == 0 || len(req.QPNum) > mooncake.MaxQPs:
		return refuse("%d QP numbers offered: want 1 to %d, the most this ferryd connects per endpoint (set the initiator's MC_NUM_QP_PER_EP to at most %d)", len(req.QPNum), mooncake.MaxQPs, mooncake.MaxQPs)
	}
	gid, lid, err := initiatorAddress(ctx, h, req)
	if err != nil {
		return refuse("%v", err)
	}
	lanes, err := t.newMooncakeQPs(len(req.QPNum))
	if err != nil {
		return refuse("%v", err)
	}
	ep, err := connectMooncake(req.LocalNICPath, lanes, gid, lid, req.QPNum, t.mooncakeMTU())
	if err == nil {
		err = t.mc.put(ep, connlimit.Source(h.From))
	}
	if err != nil {
		closeLanes(lanes)
		return refuse("%v", err)
	}
	reply.QPNum, reply.LocalLID, reply.LocalGID = qpNums(lanes), dev.LID, dev.GID
	return reply, func() { t.mc.drop(ep) }
}

// initiatorAddress is the GID and LID of a connection's initiator: from
// its request when it sends them (newer Mooncakes), else from the devices
// of its segment descriptor, fetched from the segment its NIC path names
// (older ones, which expect exactly that), if h allows dialing it.
func initiatorAddress(ctx context.Context, h MooncakeHandshake, req mooncake.HandshakeDesc) ([16]byte, uint16, error) {
	if req.LocalGID != "" {
		gid, err := mooncake.ParseGID(req.LocalGID)
		return gid, req.LocalLID, err
	}
	seg, dev, ok := mooncake.SplitNICPath(req.LocalNICPath)
	if !ok {
		return [16]byte{}, 0, fmt.Errorf("local_nic_path %q is not <segment>@<device>, and no local_gid came with it", req.LocalNICPath)
	}
	if h.MayFetch == nil || !h.MayFetch(seg) {
		return [16]byte{}, 0, fmt.Errorf("no local_gid in the request, and this ferryd fetches an initiator's descriptor only from a Mooncake segment it has sent to or was told to trust, which %q is not: send local_gid and local_lid in the handshake (newer Mooncake releases do), or send to that segment from this ferryd first", seg)
	}
	desc, err := mooncake.FetchSegment(ctx, seg, &mooncake.Segment{Name: h.Self, Protocol: "rdma", Buffers: []mooncake.Buffer{}})
	if err != nil {
		return [16]byte{}, 0, fmt.Errorf("no local_gid in the request, and the initiator's descriptor: %w", err)
	}
	for _, d := range desc.Devices {
		if d.Name == dev {
			gid, err := mooncake.ParseGID(d.GID)
			return gid, d.LID, err
		}
	}
	return [16]byte{}, 0, fmt.Errorf("no local_gid in the request, and the initiator's descriptor lists no device %q", dev)
}

// mooncakeEndpoint returns the endpoint to w's target NIC, connecting one
// by a handshake with the segment's RPC port when there is none connected
// to the GID the target's descriptor lists. An endpoint is not dropped on
// a new descriptor of the peer (Mooncake's newer releases refuse a second
// handshake while their endpoint lives); only a failed write drops it,
// and the retry handshakes afresh.
func (t *Transport) mooncakeEndpoint(ctx context.Context, w mooncake.RDMAWrite) (*mcEndpoint, error) {
	tg := w.Target
	want, err := mooncake.ParseGID(tg.Device.GID)
	if err != nil {
		return nil, fmt.Errorf("segment device %s: %w", tg.Device.Name, err)
	}
	for {
		ep, done := t.mc.claim(tg.NICPath, want, tg.Device.LID)
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
	defer t.mc.unclaim(tg.NICPath)
	self, rpc, qps := w.Self, w.RPC, w.QPs
	dev, err := t.MooncakeDevice()
	if err != nil {
		return nil, err
	}
	lanes, err := t.newMooncakeQPs(qps)
	if err != nil {
		return nil, err
	}
	hctx, cancel := context.WithTimeout(ctx, t.cfg.Peer.HandshakeTimeout)
	defer cancel()
	r, err := mooncake.ConnectQPs(hctx, rpc, mooncake.HandshakeDesc{
		LocalNICPath: mooncake.NICPath(self, dev.Name), PeerNICPath: tg.NICPath,
		QPNum: qpNums(lanes), LocalLID: dev.LID, LocalGID: dev.GID,
	})
	if err != nil {
		closeLanes(lanes)
		return nil, err
	}
	// The QPs go to the GID and LID the descriptor lists, which is what
	// makes the endpoint reusable for the next write; a reply naming
	// another address is not the segment's NIC.
	if r.LocalGID != "" {
		if got, err := mooncake.ParseGID(r.LocalGID); err != nil || got != want || r.LocalLID != tg.Device.LID {
			closeLanes(lanes)
			return nil, fmt.Errorf("connecting to %s: the handshake reply's local_gid %q and local_lid %d are not the descriptor's GID %s and LID %d of device %s",
				tg.NICPath, r.LocalGID, r.LocalLID, tg.Device.GID, tg.Device.LID, tg.Device.Name)
		}
	}
	ep, err := connectMooncake(tg.NICPath, lanes, want, tg.Device.LID, r.QPNum, t.mooncakeMTU())
	if err == nil {
		if err = t.mc.put(ep, ""); err == nil {
			return ep, nil
		}
	}
	closeLanes(lanes)
	return nil, fmt.Errorf("connecting to %s: %w", tg.NICPath, err)
}

var _ mooncake.RDMAWriter = (*Transport)(nil)

// WriteMooncake writes w.Src to w.Remote with plain RDMA WRITEs on one of
// the endpoint's QPs, and returns once its signaled completions say the
// peer's NIC has placed every byte. A failed write (an error completion,
// no progress within the I/O timeout) drops the endpoint, so the next
// write handshakes afresh.
func (t *Transport) WriteMooncake(ctx context.Context, w mooncake.RDMAWrite) error {
	if t.isClosing() {
		return fmt.Errorf("rdma write to %s: %w", w.Target.NICPath, transport.ErrClosed)
	}
	if len(w.Src) == 0 {
		return nil
	}
	if w.QPs <= 0 {
		w.QPs = mooncake.DefaultQPs
	}
	ep, err := t.mooncakeEndpoint(ctx, w)
	if err != nil {
		return err
	}
	var l *lane
	select {
	case l = <-ep.free:
	case <-ctx.Done():
		return fmt.Errorf("waiting for a queue pair to %s: %w", ep.peer, transport.ContextErr(ctx))
	}
	src, err := t.source(w.Src)
	if err != nil {
		ep.free <- l
		return err
	}
	l.use.Lock()
	select {
	case <-l.quit: // the endpoint was dropped meanwhile
		l.use.Unlock()
		src.release()
		return fmt.Errorf("the endpoint to %s was torn down: %w", ep.peer, errLaneClosed)
	default:
	}
	err = t.mooncakePost(ctx, l, w, src)
	l.use.Unlock()
	if err != nil {
		// The QPs are destroyed before the source's registration goes:
		// until then the NIC may still read it.
		t.mc.drop(ep)
		src.release()
		return fmt.Errorf("rdma write of %d bytes to %#x on %s (rkey %#x): %w", len(w.Src), w.Remote, ep.peer, w.Target.RKey, err)
	}
	t.mc.proven(ep)
	ep.free <- l
	src.release()
	return nil
}

// mooncakePost posts the write in chunks, every one signaled, at most
// sendDepth (bounceSlots from a bounce ring) in flight, and waits for
// them all.
func (t *Transport) mooncakePost(ctx context.Context, l *lane, w mooncake.RDMAWrite, src source) error {
	n := len(w.Src)
	window := sendDepth
	var ring []byte
	var ringKey uint32
	if src.kind == fromBounce {
		window = bounceSlots
		var err error
		if ring, ringKey, err = l.bounceBuffer(t.nic); err != nil {
			return err
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
			off := posted * chunk
			m := min(chunk, n-off)
			o := op{WRID: base | uint64(posted), Remote: w.Remote + uint64(off), Len: uint32(m), RKey: w.Target.RKey, Signaled: true}
			if ring != nil {
				slot := ring[(posted%bounceSlots)*chunk:][:m]
				copy(slot, w.Src[off:off+m])
				o.Local, o.LKey = addrOf(slot), ringKey
			} else {
				o.Local, o.LKey = addrOf(w.Src)+uint64(off), src.lkey
			}
			ops = append(ops, o)
			posted++
		}
		if len(ops) > 0 {
			if err := l.qp.Post(ops); err != nil {
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
		case wc.Status != wcSuccess:
			return &CompletionError{Status: wc.Status, VendorErr: wc.VendorErr, Op: "rdma write"}
		}
		retired++
	}
	return nil
}
