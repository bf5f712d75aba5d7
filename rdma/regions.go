package rdma

import (
	"errors"
	"fmt"
	"io"
	"sort"
	"sync"

	"github.com/ferry-project/ferry/transport"
)

// Regions: memory a client lent the daemon (daemon/regions.go: a memfd
// it mapped), registered with the NIC once when the client registers
// it, as the arena is at start. A write whose source lies in one goes
// from its registration, and a granted write into a slot in one lands
// in place, neither copied.
//
// What a peer may write: in windows mode a region is registered like
// the arena, for local access and window binding only, so its own rkey
// lets no peer write and a slot in it gets a window over its bytes;
// otherwise it is registered for remote writes, and a grant into one of
// its slots names its rkey, which reaches the whole region as the
// arena's reaches the whole arena in the grant and arena-rkey modes.

// lentRegion is one region's registration.
type lentRegion struct {
	mem []byte
	mr  region
}

func (g *lentRegion) holds(addr, n uint64) bool {
	base := addrOf(g.mem)
	return n > 0 && addr >= base && n <= uint64(len(g.mem)) && addr-base <= uint64(len(g.mem))-n
}

// lentRegions is the regions registered, sorted by address. Regions are
// mappings of their own: none overlaps another or the arena.
type lentRegions struct {
	mu     sync.RWMutex
	by     []*lentRegion
	closed bool // the transport closed: it deregistered them all
}

// holding is the region holding [addr, addr+n), or nil.
func (rs *lentRegions) holding(addr, n uint64) *lentRegion {
	rs.mu.RLock()
	defer rs.mu.RUnlock()
	i := sort.Search(len(rs.by), func(i int) bool { return addrOf(rs.by[i].mem) > addr })
	if i > 0 && rs.by[i-1].holds(addr, n) {
		return rs.by[i-1]
	}
	return nil
}

// mrHolding is holding's registration, or nil: windows bind over it.
func (rs *lentRegions) mrHolding(addr, n uint64) region {
	if g := rs.holding(addr, n); g != nil {
		return g.mr
	}
	return nil
}

// holdingBytes is holding for the memory of b.
func (rs *lentRegions) holdingBytes(b []byte) *lentRegion {
	if len(b) == 0 {
		return nil
	}
	return rs.holding(addrOf(b), uint64(len(b)))
}

var _ transport.RegionRegistrar = (*Transport)(nil)

// RegisterRegion implements transport.RegionRegistrar: it registers mem
// (mmap'd by the daemon, never Go memory) with the NIC, for windows in
// windows mode, else for remote writes. Closing the handle deregisters
// it; the caller closes it only once no write from or into mem is in
// flight and every window over it is closed (a NIC refuses to drop a
// registration with windows bound over it).
func (t *Transport) RegisterRegion(mem []byte) (io.Closer, error) {
	if len(mem) == 0 {
		return nil, errors.New("rdma: registering a region of no bytes")
	}
	base, n := addrOf(mem), uint64(len(mem))
	if len(t.mem) > 0 && base < addrOf(t.mem)+uint64(len(t.mem)) && addrOf(t.mem) < base+n {
		return nil, fmt.Errorf("rdma: a region of %d bytes at %#x overlaps the arena", n, base)
	}
	register, how := t.nic.Register, "for remote writes"
	if t.windows != nil {
		register, how = t.nic.RegisterForWindows, "for windows (IBV_ACCESS_MW_BIND)"
	}
	mr, err := register(mem)
	if err != nil {
		return nil, fmt.Errorf("rdma: registering a region of %d bytes %s with the NIC failed with %s (%w); %s; until then its writes are copied through bounce and staging buffers",
			n, how, errnoName(err), err, memlockLimit())
	}
	g := &lentRegion{mem: mem, mr: mr}
	rs := &t.lent
	rs.mu.Lock()
	defer rs.mu.Unlock()
	i := sort.Search(len(rs.by), func(i int) bool { return addrOf(rs.by[i].mem) > base })
	overlaps := i > 0 && addrOf(rs.by[i-1].mem)+uint64(len(rs.by[i-1].mem)) > base || i < len(rs.by) && addrOf(rs.by[i].mem) < base+n
	switch {
	case rs.closed:
		mr.Close()
		return nil, fmt.Errorf("rdma: registering a region: %w", transport.ErrClosed)
	case overlaps:
		mr.Close()
		return nil, fmt.Errorf("rdma: a region of %d bytes at %#x overlaps one registered already", n, base)
	}
	rs.by = append(rs.by, nil)
	copy(rs.by[i+1:], rs.by[i:])
	rs.by[i] = g
	return lentHandle{rs, g}, nil
}

// lentHandle deregisters its region on Close.
type lentHandle struct {
	rs *lentRegions
	g  *lentRegion
}

func (h lentHandle) Close() error {
	h.rs.mu.Lock()
	defer h.rs.mu.Unlock()
	i := sort.Search(len(h.rs.by), func(i int) bool { return addrOf(h.rs.by[i].mem) >= addrOf(h.g.mem) })
	if i == len(h.rs.by) || h.rs.by[i] != h.g {
		return nil // deregistered already, by this or by the transport's Close
	}
	// A registration the NIC would not drop stays listed: the
	// transport's Close tries again once its windows are gone.
	if err := h.g.mr.Close(); err != nil {
		return fmt.Errorf("rdma: deregistering a region of %d bytes: %w", len(h.g.mem), err)
	}
	h.rs.by = append(h.rs.by[:i], h.rs.by[i+1:]...)
	return nil
}

// close deregisters the regions left registered, once the transport's
// writes and windows are gone; no region registers after.
func (rs *lentRegions) close() error {
	rs.mu.Lock()
	defer rs.mu.Unlock()
	var errs []error
	for _, g := range rs.by {
		errs = append(errs, g.mr.Close())
	}
	rs.by, rs.closed = nil, true
	return errors.Join(errs...)
}
