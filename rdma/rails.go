package rdma

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"

	"github.com/ferry-project/ferry/internal/pool"
	"github.com/ferry-project/ferry/transport"
	"github.com/ferry-project/ferry/transport/peer"
)

// Rails: a transport drives one or more RDMA NICs (--rdma-device a,b or
// all), each a rail with its own protection domain, its own registration
// of the arena and its own lanes. Rail 0 is the first NIC. A session
// opens lanes per rail pair (a local rail and one of the peer's), each
// pair's when a write first needs it. A write that is not striped goes
// over one pair: out of the rail nearest its source (a region's home
// rail, regions.go: a device arena's NIC from the affinity table; rail 0
// for the first arena and anything else) into the peer's rail its key
// names (transport.Key.Rail: the NIC nearest the receiving slot's
// device, where its window is bound, windows.go; rail 0 when the peer
// has no such rail), directly where it may (wire.go). A write of at least
// Config.StripeMin bytes from the arena is striped: cut into pieces of
// stripePiece bytes, dealt round-robin over the rail pairs, each piece a
// granted write of its range (wire.go), so the receiving Sink delivers
// the slot once, when the pieces have covered all of it, whichever lanes
// they came by. A rail whose piece fails (its NIC down, its lane broken)
// gives its pieces left to the others, and the send fails only when no
// rail is left or the receiver refuses. A striped write goes over the
// pairs i to i, as many as both sides have rails; a granted write from
// a region registered on rails other than 0 goes in pieces over those
// of its rails the peer has too (i to i), with rail 0 to take over.
// Unstriped writes keep the zero control message of direct writes; a
// striped one costs a header and a grant per piece. docs/rdma.md,
// "Rails", says what it costs.

// stripePiece is the size of a striped write's pieces.
const stripePiece = 1 << 20

// maxRails bounds the NICs one transport drives (the wire carries the
// count in a byte).
const maxRails = 16

// rail is one RDMA NIC the transport drives and the arena's registration
// on it. Rail 0's nic and shared are the Transport's own nic and shared.
type rail struct {
	name   string
	nic    nic
	shared region // the host arena registered on this NIC; nil: none
	// What left through this NIC as sender: writes and striped pieces
	// completed, and their bytes; and what came in through it as
	// receiver: writes and pieces delivered, and their bytes.
	sends, bytes            atomic.Uint64
	received, receivedBytes atomic.Uint64
	// windows are the windows over the slots whose home is this rail, on
	// rails other than 0 (rail 0's are the transport's own), made when a
	// slot first needs them, or noWindows says why they could not be;
	// under the transport's winMu.
	windows   *windows
	noWindows error
}

// RailStats is one NIC's share of the work, sending and receiving.
type RailStats struct {
	NIC   string `json:"nic"`
	Sends uint64 `json:"sends"` // writes and striped pieces completed out of it
	Bytes uint64 `json:"bytes"` // their bytes
	// Received is the writes and pieces that completed in through
	// it (a granted piece, or a direct write into a window), ReceivedBytes their bytes.
	Received      uint64 `json:"received"`
	ReceivedBytes uint64 `json:"received_bytes"`
}

// nicName is n's device name (mlx5_0, rxe1), or fallback.
func nicName(n nic, fallback string) string {
	if m, ok := n.(mooncakeNIC); ok {
		return m.deviceName()
	}
	return fallback
}

// ListenRails is Listen over several NICs: the first is rail 0, the
// others carry striped writes and sends from regions registered on them
// (see above). Each choice is opened and the host arena registered on
// each; a GPU arena is registered with the first NIC only, and its
// sends are not striped.
func ListenRails(cfg Config, choices []Choice) (*Transport, error) {
	if len(choices) == 0 {
		return nil, errors.New("rdma: no RDMA device chosen")
	}
	if len(choices) > maxRails {
		return nil, fmt.Errorf("rdma: %d RDMA devices chosen, at most %d: name fewer in --rdma-device", len(choices), maxRails)
	}
	nics := make([]nic, 0, len(choices))
	closeAll := func() {
		for _, n := range nics {
			n.Close()
		}
	}
	for _, c := range choices {
		n, err := openNIC(c)
		if err != nil {
			closeAll()
			return nil, fmt.Errorf("rdma: opening %s port %d: %w", c.Device, c.Port, err)
		}
		nics = append(nics, n)
	}
	t, err := listen(cfg, nics[0], nics[1:]...)
	if err != nil {
		closeAll()
		return nil, err
	}
	return t, nil
}

// openRails makes the rails over t.nic and more, registering the host
// arena on each of more: for local reads only in windows mode (a peer
// writes a piece arriving on such a rail under a registration of the
// piece's bytes alone, made for its write), else as rail 0's is. With
// a GPU arena the rails beyond 0 hold no registration of it: they carry
// sends from regions registered on them (RegisterDeviceRegionOn). A host
// arena with no shared registration on rail 0 takes no more rails.
func (t *Transport) openRails(more []nic) error {
	t.rails = []*rail{{name: nicName(t.nic, "nic0"), nic: t.nic, shared: t.shared}}
	if t.cfg.Device != nil {
		for i, n := range more {
			t.rails = append(t.rails, &rail{name: nicName(n, fmt.Sprint("nic", i+1)), nic: n})
		}
		return nil
	}
	if len(more) == 0 {
		return nil
	}
	if t.shared == nil {
		return fmt.Errorf("%d RDMA devices asked for, but sends are striped over several only from a host arena registered once, and this one's registration is %s (%v): name one device in --rdma-device, or fix what registration.reason says", len(more)+1, t.reg.Mode, t.reg.Err)
	}
	u := peerWrites
	if t.windows != nil {
		u = localUse
	}
	for i, n := range more {
		reg, err := n.Register(t.mem, u)
		if err != nil {
			t.closeRails(false) // the caller closes the NICs of a listen that failed
			t.rails = t.rails[:1]
			return fmt.Errorf("registering the arena with RDMA device %s: %w", nicName(n, fmt.Sprint("nic", i+1)), memlockAdvice(err, len(t.mem)))
		}
		t.rails = append(t.rails, &rail{name: nicName(n, fmt.Sprint("nic", i+1)), nic: n, shared: reg})
	}
	return nil
}

// closeRails drops the arena's registrations on rails 1 and on (rail
// 0's is the Transport's own shared), and with nics their NICs too.
func (t *Transport) closeRails(nics bool) error {
	var errs []error
	for _, r := range t.rails[min(1, len(t.rails)):] {
		if r.shared != nil {
			errs = append(errs, r.shared.Close())
		}
		if nics {
			errs = append(errs, r.nic.Close())
		}
	}
	return errors.Join(errs...)
}

// Rails is each NIC's share of what this transport sent and received,
// in rails order.
func (t *Transport) Rails() []RailStats {
	out := make([]RailStats, len(t.rails))
	for i, r := range t.rails {
		out[i] = RailStats{NIC: r.name, Sends: r.sends.Load(), Bytes: r.bytes.Load(), Received: r.received.Load(), ReceivedBytes: r.receivedBytes.Load()}
	}
	return out
}

// RailNames are the NICs this transport drives, rail 0 first.
func (t *Transport) RailNames() []string {
	out := make([]string, len(t.rails))
	for i, r := range t.rails {
		out[i] = r.name
	}
	return out
}

// sent counts a write or piece of n bytes completed out of rail i.
func (t *Transport) sent(i int, n int) {
	r := t.rails[i]
	r.sends.Add(1)
	r.bytes.Add(uint64(n))
}

// received counts a write or piece of n bytes completed in through
// rail i (a direct write the Sink then counts for nothing too).
func (t *Transport) received(i int, n uint64) {
	r := t.rails[i]
	r.received.Add(1)
	r.receivedBytes.Add(n)
}

// slotWindows is the transport.Windows a windowed Sink gets: each
// slot's window goes on the rail nearest its memory (windows.go), or on
// rail 0 when that rail binds none, which is logged.
type slotWindows struct{ t *Transport }

func (s slotWindows) Open(addr, n uint64) (transport.Window, error) {
	t := s.t
	if r := t.lent.homeRail(addr, n); r > 0 {
		w, err := t.windowsOn(r)
		if err == nil {
			var rkey uint32
			if rkey, err = w.Open(addr, n); err == nil {
				return transport.Window{Rail: uint8(r), RKey: rkey}, nil
			}
		}
		t.logf("rdma: no memory window on %s over a receive slot in memory registered there (%v): its window goes on %s, where writes to it arrive",
			t.rails[r].name, err, t.rails[0].name)
	}
	rkey, err := t.windows.Open(addr, n)
	return transport.Window{RKey: rkey}, err
}

func (s slotWindows) Close(w transport.Window) error {
	if w.Rail == 0 {
		return s.t.windows.Close(w.RKey)
	}
	t := s.t
	t.winMu.Lock()
	var ws *windows
	if int(w.Rail) < len(t.rails) {
		ws = t.rails[w.Rail].windows
	}
	t.winMu.Unlock()
	if ws == nil {
		return fmt.Errorf("no memory windows on rail %d", w.Rail)
	}
	return ws.Close(w.RKey)
}

// windowsOn is rail r's windows (r > 0), made on first use: they bind
// over the regions registered on r's NIC only.
func (t *Transport) windowsOn(r int) (*windows, error) {
	t.winMu.Lock()
	defer t.winMu.Unlock()
	rl := t.rails[r]
	switch {
	case t.isClosing():
		return nil, fmt.Errorf("memory windows: %w", transport.ErrClosed)
	case rl.windows != nil || rl.noWindows != nil:
		return rl.windows, rl.noWindows
	}
	if rl.noWindows = rl.nic.Windows(); rl.noWindows == nil {
		rl.windows, rl.noWindows = newWindows(rl.nic, r, nil, 0, 0, &t.lent, &t.stats)
	}
	return rl.windows, rl.noWindows
}

// closeRailWindows drops the windows of rails other than 0, before the
// regions' registrations under them.
func (t *Transport) closeRailWindows() error {
	t.winMu.Lock()
	defer t.winMu.Unlock()
	var errs []error
	for _, r := range t.rails[min(1, len(t.rails)):] {
		if r.windows != nil {
			errs = append(errs, r.windows.close())
		}
	}
	return errors.Join(errs...)
}

// pair is a lane's two ends: the local rail its QP is on, and the
// peer's rail its peer QP is on.
type pair struct{ local, peer int }

// poolOn is the pool of pr's lanes, opened on first use; each pool but
// rail 0's (which may hold MaxConnsPerPeer) may hold its share of it.
// Once the session closed it is rail 0's, closed.
func (s *session) poolOn(pr pair) *pool.Pool[*lane] {
	s.poolMu.Lock()
	defer s.poolMu.Unlock()
	if p := s.pools[pr]; p != nil {
		return p
	}
	if s.poolsClosed {
		return s.pool
	}
	per := max(1, s.t.cfg.Peer.MaxConnsPerPeer/max(1, s.pairs()))
	p := pool.New(per, func(ctx context.Context) (*lane, error) { return s.openOn(ctx, pr) }, func(l *lane) { l.close() })
	s.pools[pr] = p
	return p
}

// pairs is how many rails both sides have: the pairs i to i a striped
// write goes over.
func (s *session) pairs() int { return min(len(s.t.rails), s.region.Rails) }

// pairFor is the rail pair a write that is not striped goes over: out
// of the rail nearest its source (a region's home rail; else rail 0),
// into the peer's rail its key names, or the peer's rail 0 when it has
// no such rail (a key its receiver did not make: it is refused there).
// A source going out of a rail other than 0 goes under its registration
// there (p).
func (s *session) pairFor(w *transport.Write, p *plan) pair {
	var pr pair
	if k := int(w.Key.Rail()); k < s.region.Rails {
		pr.peer = k
	}
	if g := s.t.lent.source(w); g != nil && g.home != 0 && w.Len() > 0 {
		pr.local = g.home
		p.lkey, p.railKey = g.lkeyOn(g.home), true
	}
	return pr
}

// stripes reports whether w goes striped: the peer and this transport
// pair two rails or more, w is long enough, and its source lies in the
// host arena, which every rail registered (a GPU arena's rails beyond 0
// hold none).
func (s *session) stripes(w *transport.Write, p *plan) bool {
	return s.pairs() > 1 && s.t.rails[1].shared != nil && s.t.cfg.StripeMin > 0 && w.Len() >= s.t.cfg.StripeMin &&
		w.Src != nil && p.kind == fromShared && within(s.t.mem, w.Src)
}

// railSet is the rail pairs a write goes over in pieces, and the
// registration its source lies in on each local rail.
type railSet struct {
	pairs []pair
	// spare is the index in pairs of the pair that takes the pieces left
	// once every other one failed, and carries none before; -1: none,
	// the write fails.
	spare int
	lkey  func(local int) uint32
}

// arenaRails is every rail pair i to i, over the host arena's
// registration on each: a striped write.
func (s *session) arenaRails() railSet {
	on := railSet{spare: -1, lkey: func(r int) uint32 { return s.t.rails[r].shared.LKey() }}
	for i := range s.pairs() {
		on.pairs = append(on.pairs, pair{i, i})
	}
	return on
}

// regionRails is the rail pairs a granted send from w's source goes
// over when that lies in a region registered on rails other than 0
// (RegisterRegionOn): those of its rails i the peer has too, to the
// peer's rail i, with rail 0 to rail 0 to take over if they all fail.
// false: w goes as any other write, out of its home rail (pairFor).
func (s *session) regionRails(w *transport.Write) (railSet, bool) {
	if len(s.t.rails) < 2 {
		return railSet{}, false
	}
	g := s.t.lent.source(w)
	if g == nil || len(g.rails) == 0 || w.Len() == 0 {
		return railSet{}, false
	}
	on := railSet{lkey: g.lkeyOn}
	for _, rr := range g.rails {
		if rr.rail < s.region.Rails {
			on.pairs = append(on.pairs, pair{rr.rail, rr.rail})
		}
	}
	if len(on.pairs) == 0 {
		return railSet{}, false
	}
	on.spare = len(on.pairs)
	on.pairs = append(on.pairs, pair{})
	return on, true
}

// sendOnRails writes w over on's rails in granted pieces: a striped
// write over every rail pair, or a region's send through its own NICs.
// kind counts it (striped, railed).
func (s *session) sendOnRails(ctx context.Context, w *transport.Write, p *plan, on railSet, kind *atomic.Uint64) (transport.Report, error) {
	if err := s.stripe(ctx, w, on); err != nil {
		return transport.Report{}, err
	}
	s.t.stats.sends.Add(1)
	kind.Add(1)
	rep := p.kind.report(w.Len())
	rep.Messages = peer.Messages * ((w.Len() + stripePiece - 1) / stripePiece) // a header and a grant per piece
	return rep, nil
}

// piece is one stripe piece: a range of the write.
type piece struct{ off, n int }

// stripe writes w as pieces over on's rails. Pieces are dealt
// round-robin, so each rail carries an even share; a rail whose write
// fails for any reason but a refusal or the caller giving up is out of
// the stripe, and its pieces left (the failed one too: it may have
// landed, and a resent range counts once) go round-robin to the rails
// still in, or to on's spare once none is. The receiver delivers the
// slot once, when its pieces have covered it.
func (s *session) stripe(ctx context.Context, w *transport.Write, on railSet) error {
	n := w.Len()
	out := make([]bool, len(on.pairs)) // pairs out of this stripe, by index in on.pairs
	var first []int                    // the pairs the pieces are dealt to
	for i := range out {
		out[i] = i == on.spare
		if !out[i] {
			first = append(first, i)
		}
	}
	queues := make([][]piece, len(on.pairs))
	for i, off := 0, 0; off < n; i, off = i+1, off+stripePiece {
		q := &queues[first[i%len(first)]]
		*q = append(*q, piece{off, min(stripePiece, n-off)})
	}
	var failures []error
	for {
		left, errs, fatal := s.stripeRound(ctx, w, on, queues, out)
		if fatal != nil {
			return fatal
		}
		failures = append(failures, errs...)
		if len(left) == 0 {
			return nil
		}
		var in []int
		for i, o := range out {
			if !o {
				in = append(in, i)
			}
		}
		if len(in) == 0 && on.spare >= 0 {
			in, on.spare = []int{on.spare}, -1
			out[in[0]] = false
		}
		if len(in) == 0 {
			return fmt.Errorf("rdma striped write to %s: every rail failed: %w", s.Peer(), errors.Join(failures...))
		}
		// The failed rails' lanes are broken and idle: shut them now,
		// so their receivers let go of the grants they hold.
		for _, pr := range on.pairs {
			s.poolOn(pr).Sweep(func(l *lane) bool { return l.broken.Load() || l.ended() })
		}
		s.t.stats.failovers.Add(uint64(len(errs)))
		s.t.logf("rdma: a striped %d-byte write to %s lost %d rail(s) (%v): their %d pieces left go over the %d rail(s) still up",
			n, s.Peer(), len(errs), errors.Join(errs...), len(left), len(in))
		queues = make([][]piece, len(on.pairs))
		for j, pc := range left {
			queues[in[j%len(in)]] = append(queues[in[j%len(in)]], pc)
		}
	}
}

// stripeWorkers is how many pieces each rail keeps in flight.
const stripeWorkers = 4

// stripeRound sends each pair's queue (by index in on.pairs) over it,
// stripeWorkers pieces at a time. It returns the pieces of the pairs
// that failed in this round (marked in out) and why each failed, or the
// error that ends the stripe: a refusal, the caller giving up, the
// session closing.
func (s *session) stripeRound(ctx context.Context, w *transport.Write, on railSet, queues [][]piece, out []bool) (left []piece, errs []error, fatal error) {
	var mu sync.Mutex
	var wg sync.WaitGroup
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	for r, q := range queues {
		if len(q) == 0 {
			continue
		}
		next := 0
		failed := false
		take := func() (piece, bool) {
			mu.Lock()
			defer mu.Unlock()
			if failed || fatal != nil || next == len(q) {
				return piece{}, false
			}
			next++
			return q[next-1], true
		}
		for range min(stripeWorkers, len(q)) {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for {
					pc, ok := take()
					if !ok {
						return
					}
					pr := on.pairs[r]
					err := s.writePiece(ctx, pr, w, pc, on.lkey(pr.local))
					if err == nil {
						continue
					}
					mu.Lock()
					switch {
					case fatal != nil:
					case isFatal(ctx, err):
						fatal = err
						cancel()
					case !failed:
						failed, out[r] = true, true
						errs = append(errs, fmt.Errorf("rail %s: %w", s.t.rails[on.pairs[r].local].name, err))
						left = append(left, q[next:]...)
						fallthrough
					default:
						left = append(left, pc)
					}
					mu.Unlock()
					return
				}
			}()
		}
	}
	wg.Wait()
	return left, errs, fatal
}

// isFatal reports an error a piece met that another rail would meet
// too: the receiver refused it, the caller gave up, or the session or
// transport closed.
func isFatal(ctx context.Context, err error) bool {
	var refused *transport.Refusal
	return errors.As(err, &refused) || transport.ContextErr(ctx) != nil || errors.Is(err, transport.ErrClosed)
}

// writePiece writes pc of w over pr: a granted write of its range from
// its source's registration on pr's local rail (lkey).
func (s *session) writePiece(ctx context.Context, pr pair, w *transport.Write, pc piece, lkey uint32) error {
	pw := transport.Write{Remote: w.Remote + uint64(pc.off), Key: w.Key, Tag: w.Tag}
	if w.Src != nil {
		pw.Src = w.Src[pc.off : pc.off+pc.n]
	} else {
		pw.Device = transport.Range{Addr: w.Device.Addr + uint64(pc.off), Len: uint64(pc.n)}
	}
	p := plan{kind: fromShared, lkey: lkey, railKey: true}
	if err := s.writeOn(ctx, pr, &pw, &p); err != nil {
		return err
	}
	s.t.sent(pr.local, pc.n)
	return nil
}
