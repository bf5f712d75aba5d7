package rdma

import (
	"errors"
	"fmt"
	"io"
	"slices"
	"sort"
	"strings"
	"sync"

	"github.com/ferry-project/ferry/transport"
)

// Regions: memory a client lent the daemon (daemon/regions.go: a memfd
// it mapped, or a CUDA allocation it opened by IPC handle), registered
// with the NIC once when the client registers it, as the arena is at
// start. A write whose source lies in one goes from its registration,
// and a granted write into a slot in one lands in place, neither copied.
//
// What a peer may write: a region's own rkey never lets a peer write,
// since a region is its client's own memory. In windows mode it is
// registered like the arena, for local access and window binding, and a
// slot in it gets a window over its bytes; otherwise it is registered
// for local access only, and each granted write into one of its slots
// goes under a registration of that slot's bytes made for the write
// (reach, in memory.go), closed once the write is done.

// lentRegion is one region's registration: size bytes at addr, host
// memory the daemon mapped or device memory (a CUDA region, at its
// device pointer).
type lentRegion struct {
	addr, size uint64
	device     bool
	iova       uint64 // an engine region's (engines.go): its first byte's address in work requests
	mr         region // on rail 0
	// rails are its registrations on rails other than 0, in the order
	// they were named (RegisterRegionOn): a send from it goes out
	// through them (rails.go). They close before mr.
	rails []railRegion
	// closed counts the registrations close dropped, rails' first and
	// mr's last: a close that failed on one (a window still bound over
	// it) tries again from there.
	closed int
	// home is the rail nearest its memory: that of the first NIC named
	// that registered it (0 when that is rail 0's, or none did). Its
	// slots' windows go on it (windows.go), and its direct writes leave
	// through it (rails.go).
	home int
}

// railRegion is a region's registration on one rail.
type railRegion struct {
	rail int
	mr   region
}

// mrOn is the region's registration on rail r, or nil.
func (g *lentRegion) mrOn(r int) region {
	if r == 0 {
		return g.mr
	}
	for _, rr := range g.rails {
		if rr.rail == r {
			return rr.mr
		}
	}
	return nil
}

// lkeyOn is the region's lkey on rail r.
func (g *lentRegion) lkeyOn(r int) uint32 {
	for _, rr := range g.rails {
		if rr.rail == r {
			return rr.mr.LKey()
		}
	}
	return g.mr.LKey()
}

// close drops the region's registrations, rail 0's last, each once: a
// close that failed on one is tried again from it.
func (g *lentRegion) close() error {
	for ; g.closed <= len(g.rails); g.closed++ {
		mr := g.mr
		if g.closed < len(g.rails) {
			mr = g.rails[g.closed].mr
		}
		if err := mr.Close(); err != nil {
			return err
		}
	}
	return nil
}

func (g *lentRegion) holds(addr, n uint64) bool {
	return n > 0 && spans(g.addr, g.size, addr, n)
}

// lentRegions is the regions registered, host and device, sorted by
// address. Regions are mappings of their own (device pointers share the
// host's address space: unified addressing): none overlaps another or
// the arena.
type lentRegions struct {
	mu      sync.RWMutex
	by      []*lentRegion
	devices int  // how many of by are device memory
	closed  bool // the transport closed: it deregistered them all
}

// hasDevice reports whether device memory is listed.
func (rs *lentRegions) hasDevice() bool {
	rs.mu.RLock()
	defer rs.mu.RUnlock()
	return rs.devices > 0
}

// list puts g in by at i; mu is held.
func (rs *lentRegions) list(i int, g *lentRegion) {
	rs.by = slices.Insert(rs.by, i, g)
	if g.device {
		rs.devices++
	}
}

// holding is the region holding [addr, addr+n), or nil.
func (rs *lentRegions) holding(addr, n uint64) *lentRegion {
	rs.mu.RLock()
	defer rs.mu.RUnlock()
	i := rs.after(addr)
	if i > 0 && rs.by[i-1].holds(addr, n) {
		return rs.by[i-1]
	}
	return nil
}

// mrHolding is holding's registration on rail r, or nil: windows bind
// over it.
func (rs *lentRegions) mrHolding(addr, n uint64, r int) region {
	if g := rs.holding(addr, n); g != nil {
		return g.mrOn(r)
	}
	return nil
}

// homeRail is the home rail of the region holding [addr, addr+n): 0
// when none does.
func (rs *lentRegions) homeRail(addr, n uint64) int {
	if g := rs.holding(addr, n); g != nil {
		return g.home
	}
	return 0
}

// holdingBytes is the host region holding the memory of b, or nil.
func (rs *lentRegions) holdingBytes(b []byte) *lentRegion {
	if len(b) == 0 {
		return nil
	}
	if g := rs.holding(addrOf(b), uint64(len(b))); g != nil && !g.device {
		return g
	}
	return nil
}

// source is the region w's source lies in, host or device, or nil.
func (rs *lentRegions) source(w *transport.Write) *lentRegion {
	if w.Src == nil && w.Device.Len > 0 {
		return rs.holdingDevice(w.Device.Addr, w.Device.Len)
	}
	return rs.holdingBytes(w.Src)
}

// holdingDevice is the device region holding [addr, addr+n), or nil.
func (rs *lentRegions) holdingDevice(addr, n uint64) *lentRegion {
	if g := rs.holding(addr, n); g != nil && g.device {
		return g
	}
	return nil
}

var _ transport.RegionRegistrar = (*Transport)(nil)

// RegisterRegion implements transport.RegionRegistrar: it registers mem
// (mmap'd by the daemon, never Go memory) with the NIC, for windows in
// windows mode, else for local access only. Closing the handle deregisters
// it; the caller closes it only once no write from or into mem is in
// flight and every window over it is closed (a NIC refuses to drop a
// registration with windows bound over it).
func (t *Transport) RegisterRegion(mem []byte) (io.Closer, error) {
	c, _, err := t.RegisterRegionOn(mem, nil)
	return c, err
}

// RegionRails says which NICs a region registered by RegisterRegionOn
// or RegisterDeviceRegionOn sends through.
type RegionRails struct {
	// NICs are the NICs its sends go out through: those named that
	// registered it, or rail 0's alone.
	NICs []string `json:"nics"`
	// Why names the NICs named that it is not on, and why: not driven
	// by the transport, or the registration failed.
	Why string `json:"why,omitempty"`
	// Home is the rail nearest it (the first NIC named that registered
	// it; 0 when none did): its slots' windows go on it, and a slot's key
	// names it (transport.Key.Rail), windows or not.
	Home int `json:"-"`
}

// RegisterRegionOn is RegisterRegion, registering mem also on the rails
// of the NICs named (a device's nearest, from the affinity table): sends
// from it then go out through them (rails.go). It is always registered
// on rail 0, whose registration writes into its slots and a send's
// fallback use. A NIC the transport does not drive, or whose
// registration fails, leaves that rail out, with the reason in Why.
func (t *Transport) RegisterRegionOn(mem []byte, nics []string) (io.Closer, RegionRails, error) {
	if len(mem) == 0 {
		return nil, RegionRails{}, errors.New("rdma: registering a region of no bytes")
	}
	base, n := addrOf(mem), uint64(len(mem))
	if len(t.mem) > 0 && base < addrOf(t.mem)+uint64(len(t.mem)) && addrOf(t.mem) < base+n {
		return nil, RegionRails{}, fmt.Errorf("rdma: a region of %d bytes at %#x overlaps the arena", n, base)
	}
	u, how := t.regionUse()
	mr, err := t.nic.Register(mem, u)
	if err != nil {
		return nil, RegionRails{}, fmt.Errorf("rdma: registering a region of %d bytes %s with the NIC failed with %s (%w); %s; until then its writes are copied through bounce and staging buffers",
			n, how, errnoName(err), err, memlockLimit())
	}
	return t.addOnRails(&lentRegion{addr: base, size: n, mr: mr}, nics, func(n nic) (region, error) { return n.Register(mem, u) })
}

// addOnRails registers g also on the rails of nics by register, and
// lists it.
func (t *Transport) addOnRails(g *lentRegion, nics []string, register func(nic) (region, error)) (io.Closer, RegionRails, error) {
	var on RegionRails
	var why []string
	homed := false // g.home is set: the first NIC named that registered it
	for _, name := range nics {
		r := slices.IndexFunc(t.rails, func(r *rail) bool { return r.name == name })
		switch {
		case r < 0:
			why = append(why, fmt.Sprintf("%s is not one of the RDMA devices this daemon drives (%v): add it to --rdma-device", name, t.RailNames()))
		case r == 0 || slices.ContainsFunc(g.rails, func(rr railRegion) bool { return rr.rail == r }):
			homed = homed || r == 0
		default:
			mr, err := register(t.rails[r].nic)
			if err != nil {
				why = append(why, fmt.Sprintf("registering it with %s failed with %s (%v)", name, errnoName(err), err))
				continue
			}
			g.rails = append(g.rails, railRegion{rail: r, mr: mr})
			if !homed {
				g.home, homed = r, true
			}
		}
	}
	for _, rr := range g.rails {
		on.NICs = append(on.NICs, t.rails[rr.rail].name)
	}
	on.Home = g.home
	if len(on.NICs) == 0 {
		on.NICs = []string{t.rails[0].name}
	}
	if len(why) > 0 {
		on.Why = strings.Join(why, "; ") + fmt.Sprintf("; its sends go through %s", strings.Join(on.NICs, ", "))
	}
	c, err := t.lent.add(g)
	return c, on, err
}

// RegisterDeviceRegion implements transport.RegionRegistrar for device
// memory the GPU arena's device holds (a CUDA region, at its device
// pointer in this process): by its device pointer (ibv_reg_mr, which
// needs nvidia-peermem), for windows in windows mode, else for local
// access only. Only where the NIC reaches the GPU arena itself (its dmabuf
// or peer-memory path): on the bounce path the NIC reaches no device
// memory, and the region's bytes go through the bounce area as the
// arena's do. There is no dmabuf path for a region: an IPC-opened
// range would need its own export. Closing the handle deregisters it,
// as for RegisterRegion.
func (t *Transport) RegisterDeviceRegion(r transport.Range) (io.Closer, error) {
	c, _, err := t.RegisterDeviceRegionOn(r, nil)
	return c, err
}

// RegisterDeviceRegionOn is RegisterDeviceRegion, registering r also on
// the rails of the NICs named, as RegisterRegionOn does.
func (t *Transport) RegisterDeviceRegionOn(r transport.Range, nics []string) (io.Closer, RegionRails, error) {
	switch {
	case r.Len == 0:
		return nil, RegionRails{}, errors.New("rdma: registering a CUDA region of no bytes")
	case t.deviceUnreached() != nil:
		return nil, RegionRails{}, fmt.Errorf("rdma: a CUDA region is registered with the NIC only where the NIC reaches the GPU arena itself (dmabuf or peermem), and %v: its bytes go through the pinned bounce area", t.deviceUnreached())
	case r.Addr < t.dev.Addr+t.dev.Len && t.dev.Addr < r.Addr+r.Len:
		return nil, RegionRails{}, fmt.Errorf("rdma: a CUDA region of %d bytes at %#x overlaps the GPU arena", r.Len, r.Addr)
	}
	u, how := t.regionUse()
	mr, err := t.nic.RegisterDevice(r.Addr, r.Len, r.Addr, u)
	if err != nil {
		return nil, RegionRails{}, fmt.Errorf("rdma: registering a CUDA region of %d bytes at %#x %s with the NIC by its device pointer (peermem; a region has no dmabuf path) failed with %s (%w): check that nvidia-peermem is loaded (modprobe nvidia-peermem; lsmod | grep nvidia_peermem) and the kernel log; until then its bytes go through the pinned bounce area",
			r.Len, r.Addr, how, errnoName(err), err)
	}
	return t.addOnRails(&lentRegion{addr: r.Addr, size: r.Len, device: true, mr: mr}, nics, func(n nic) (region, error) { return n.RegisterDevice(r.Addr, r.Len, r.Addr, u) })
}

// deviceUnreached says why the NIC reaches no GPU memory itself (the
// GPU arena's dmabuf or peer-memory path), or nil when it does.
func (t *Transport) deviceUnreached() error {
	if t.dev.Len > 0 {
		return nil
	}
	switch g := t.reg.GPU; {
	case g != nil && g.Path != "":
		return fmt.Errorf("the GPU arena went by the %s path (--gpu-registration %s)", g.Path, g.Asked)
	case g != nil:
		return errors.New("no path registered the GPU arena")
	}
	return errors.New("the transport has no GPU arena")
}

// regionUse is how a region is registered, and that in words.
func (t *Transport) regionUse() (use, string) {
	if t.windows != nil {
		return windowBinding, "for windows (IBV_ACCESS_MW_BIND)"
	}
	return localUse, "for local access"
}

// add lists g, whose registration it closes when g cannot be listed.
func (rs *lentRegions) add(g *lentRegion) (io.Closer, error) {
	rs.mu.Lock()
	defer rs.mu.Unlock()
	i := rs.after(g.addr)
	overlaps := i > 0 && rs.by[i-1].addr+rs.by[i-1].size > g.addr || i < len(rs.by) && rs.by[i].addr < g.addr+g.size
	switch {
	case rs.closed:
		g.close()
		return nil, fmt.Errorf("rdma: registering a region: %w", transport.ErrClosed)
	case overlaps:
		g.close()
		return nil, fmt.Errorf("rdma: a region of %d bytes at %#x overlaps one registered already", g.size, g.addr)
	}
	rs.list(i, g)
	return lentHandle{rs, g}, nil
}

// after is the index of the first region listed past addr; mu is held.
func (rs *lentRegions) after(addr uint64) int {
	return sort.Search(len(rs.by), func(i int) bool { return rs.by[i].addr > addr })
}

// lentHandle deregisters its region on Close.
type lentHandle struct {
	rs *lentRegions
	g  *lentRegion
}

// Close unlists the region, then deregisters it outside the lock that
// every arriving write's lookup takes: deregistering unpins every page,
// which for a large region takes a while.
func (h lentHandle) Close() error {
	if !h.rs.remove(h.g) {
		return nil // deregistered already, by this or by the transport's Close
	}
	if err := h.g.close(); err != nil {
		err = fmt.Errorf("rdma: deregistering a region of %d bytes: %w", h.g.size, err)
		return errors.Join(err, h.rs.putBack(h.g))
	}
	return nil
}

// remove unlists g; false when it was not listed.
func (rs *lentRegions) remove(g *lentRegion) bool {
	rs.mu.Lock()
	defer rs.mu.Unlock()
	i := rs.after(g.addr) - 1
	if i < 0 || rs.by[i] != g {
		return false
	}
	rs.by = slices.Delete(rs.by, i, i+1)
	if g.device {
		rs.devices--
	}
	return true
}

// putBack lists again a region whose registration the NIC would not
// drop (a window still bound over it): the transport's Close tries
// again once its windows are gone. If that Close has run meanwhile, the
// windows are gone now, and it tries here.
func (rs *lentRegions) putBack(g *lentRegion) error {
	rs.mu.Lock()
	defer rs.mu.Unlock()
	if rs.closed {
		return g.close()
	}
	rs.list(rs.after(g.addr), g)
	return nil
}

// close deregisters the regions left registered, once the transport's
// writes and windows are gone; no region registers after.
func (rs *lentRegions) close() error {
	rs.mu.Lock()
	defer rs.mu.Unlock()
	var errs []error
	for _, g := range rs.by {
		errs = append(errs, g.close())
	}
	rs.by, rs.devices, rs.closed = nil, 0, true
	return errors.Join(errs...)
}
