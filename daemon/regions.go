package daemon

import (
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"sort"
	"strings"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/ferry-project/ferry/api"
	"github.com/ferry-project/ferry/arena"
	"github.com/ferry-project/ferry/config"
	"github.com/ferry-project/ferry/cuda"
	"github.com/ferry-project/ferry/internal/memlimit"
	"github.com/ferry-project/ferry/internal/size"
	"github.com/ferry-project/ferry/rdma"
	"github.com/ferry-project/ferry/transport"
)

// maxRegions bounds the regions registered at once (each a mapping).
const maxRegions = 1024

// region is memory a client owns and lent ferryd once: a memfd passed
// over the control socket and mapped here, or a CUDA allocation opened by
// its IPC handle, so transfers read from it and receive slots land in it
// without a copy through the arena.
type region struct {
	name string
	mem  arena.Memory
	// nic is its registration with the RDMA NIC (nil when there is none:
	// TCP, a CUDA region where the NIC does not reach the GPU arena, or a
	// registration that failed, why in nicErr), dropped once the last use
	// ends, before the memory is unmapped.
	nic    io.Closer
	nicErr error
	since  time.Time
	slots  int // live receive slots in it
	// freed is its slots freed with writes still landing in them (or
	// their windows still open): their bytes are not a new slot's yet.
	freed   map[*slot]struct{}
	uses    int  // pins: slots (live or freed with writes landing) and transfers reading it
	closing bool // unregistered: no new use; ended once uses end
	// end is the teardown the last DELETE waits for: pending while uses
	// remain, then running, then done.
	end *regionEnd
	// dropErr says why the NIC kept nic when a teardown last tried to
	// drop it: the region stays, closing, mapped and counted, until a
	// DELETE tries again.
	dropErr error
	// alloc, for a device arena (arenas.go), places its slots and staged
	// entries; device names it. Both unset for a client's region.
	alloc  *arena.Arena
	device string
	// rail is the RDMA NIC nearest a device arena (its index in the
	// transport's rails: the first of the affinity table's NICs that
	// registered it), which its slots' keys name where no window does.
	rail uint8
	// lend: where Mooncake peers write into it, in which segment, lent
	// by which process (engines.go); the zero value: they do not.
	lend
}

// regionEnd is one try at ending a closing region: dropping its
// registration with the NIC, unmapping it and taking it out of the
// table. err, set before done closes, is nil when it went, else the
// answer to the DELETEs that waited (the NIC kept the registration).
type regionEnd struct {
	g    *region
	done chan struct{}
	err  error
}

func (g *region) addr() uint64 { return g.mem.Base() }
func (g *region) size() int64  { return g.mem.Size() }

// inPlace reports whether g is GPU memory the NIC reaches itself: a CUDA
// region rdma registered. Writes from it name device addresses, and
// writes into its slots land in place.
func (g *region) inPlace() bool { return g.nic != nil && g.mem.Host() == nil }

// hostRegion is a memfd mapped here, as an arena.Memory.
type hostRegion []byte

func (h hostRegion) Base() uint64 { return uint64(uintptr(unsafe.Pointer(unsafe.SliceData(h)))) }
func (h hostRegion) Size() int64  { return int64(len(h)) }
func (h hostRegion) Host() []byte { return h }
func (h hostRegion) Kind() string { return "host" }
func (h hostRegion) Close() error { return unix.Munmap(h) }

// mappedAt is a region lying at an offset in the pages mapped for it:
// the pages round it out, and only the region's bytes are its memory.
type mappedAt struct {
	hostRegion
	pages []byte
}

func (m mappedAt) Close() error { return unix.Munmap(m.pages) }

// mapRegion maps a client's memfd: it must be sealed against shrinking,
// for a file cut short under a mapping kills the process that touches
// the lost pages (SIGBUS), and hold at least off+n bytes. Only the pages
// holding [off, off+n) are mapped.
func mapRegion(fd int, name string, off, n int64) (arena.Memory, error) {
	seals, err := unix.FcntlInt(uintptr(fd), unix.F_GET_SEALS, 0)
	if err != nil {
		return nil, apiErr(api.CodeBadRequest,
			"region %s: the descriptor passed is not a memfd that allows sealing (F_GET_SEALS: %v): create it with memfd_create(name, MFD_ALLOW_SEALING) and seal it with F_SEAL_SHRINK", name, err)
	}
	if seals&(unix.F_SEAL_SHRINK|unix.F_SEAL_SEAL) == unix.F_SEAL_SEAL {
		// tmpfs answers F_GET_SEALS for any of its files, with F_SEAL_SEAL.
		return nil, apiErr(api.CodeBadRequest,
			"region %s: the descriptor passed allows no seals (a plain tmpfs file, or a memfd made without MFD_ALLOW_SEALING): create it with memfd_create(name, MFD_ALLOW_SEALING) and seal it with F_SEAL_SHRINK", name)
	}
	if seals&unix.F_SEAL_SHRINK == 0 {
		return nil, apiErr(api.CodeBadRequest,
			"region %s: the memfd is not sealed against shrinking: fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK) after sizing it, so no one can cut it short under ferryd's mapping", name)
	}
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		return nil, apiErr(api.CodeBadRequest, "region %s: fstat of the descriptor passed: %v", name, err)
	}
	if off < 0 || st.Size < n || off > st.Size-n {
		return nil, apiErr(api.CodeBadRequest, "region %s: fd_offset %d and nbytes %d: the memfd holds %d bytes; size it (ftruncate) before sealing, and name bytes inside it", name, off, n, st.Size)
	}
	page := int64(os.Getpagesize())
	first := off / page * page
	mem, err := unix.Mmap(fd, first, int((off+n-first+page-1)/page*page), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		return nil, apiErr(api.CodeBadRequest, "region %s: mapping %d bytes of the memfd read-write: %v (was it opened read-only, or sealed against writes?)", name, n, err)
	}
	if first == off && int64(len(mem)) == n {
		return hostRegion(mem), nil
	}
	return mappedAt{hostRegion(mem[off-first : off-first+n]), mem}, nil
}

// openCUDARegion opens a client's GPU allocation by its IPC handle, on
// the GPU of ferryd's arena on that device.
func (d *Daemon) openCUDARegion(req api.RegionRequest) (arena.Memory, error) {
	c := req.CUDA
	on, err := d.arenaOn(c.Device)
	switch {
	case c.Device == "" || err != nil || on.mem.dev == nil:
		return nil, apiErr(api.CodeBadRequest,
			"region %s: the memory is on %q, where this ferryd has no GPU arena (it has arenas on %s): lend memory of one of its GPUs, or start it with --device %s (or a list naming it)", req.Name, c.Device, strings.Join(d.devices(), ", "), c.Device)
	case len(c.IPCHandle) != len(cuda.IPCHandle{}):
		return nil, apiErr(api.CodeBadRequest,
			"region %s: ipc_handle has %d bytes, not the %d of a CUipcMemHandle (base64 in JSON): pass what cuIpcGetMemHandle gave", req.Name, len(c.IPCHandle), len(cuda.IPCHandle{}))
	case c.Offset < 0:
		return nil, apiErr(api.CodeBadRequest, "region %s: offset %d is negative", req.Name, c.Offset)
	}
	var h cuda.IPCHandle
	copy(h[:], c.IPCHandle)
	mem, err := cuda.OpenRegion(on.mem.dev, h, c.Offset, req.NBytes, on.mem.gpu)
	if err != nil {
		return nil, apiErr(api.CodeBadRequest, "region %s: %v", req.Name, err)
	}
	return mem, nil
}

// addRegion registers a mapped region under its name, with its
// registration with the NIC (nil, and why not). The claim its request
// made on the name ends here, the region added or refused.
func (r *registry) addRegion(name string, mem arena.Memory, nic io.Closer, nicErr error) (api.Region, error) {
	return r.addRegionAt(name, mem, nic, nicErr, lend{})
}

// addRegionAt is addRegion, the region lent for Mooncake peers' writes
// as l says (engines.go), unless l is the zero value.
func (r *registry) addRegionAt(name string, mem arena.Memory, nic io.Closer, nicErr error, l lend) (api.Region, error) {
	return r.addRegionOn(name, mem, nic, nicErr, 0, l)
}

// addRegionOn is addRegionAt for a region whose slots' windows are bound
// on rail (its device's nearest NIC that registered it).
func (r *registry) addRegionOn(name string, mem arena.Memory, nic io.Closer, nicErr error, rail uint8, l lend) (api.Region, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	delete(r.claims, name)
	if err := r.mayAddRegion(name, hostBytes(mem)); err != nil {
		return api.Region{}, err
	}
	if err := r.mayLend(name, uint64(mem.Size()), l); err != nil {
		return api.Region{}, err
	}
	g := &region{name: name, mem: mem, nic: nic, nicErr: nicErr, rail: rail, since: time.Now(), lend: l}
	r.regions[name] = g
	return r.describeRegion(g), nil
}

// regionClaim is a new region's place from before ferryd maps it until
// addRegion takes it or the request gives it up: its name taken, its
// host bytes counted against the limit, so that requests arriving
// together cannot between them map and pin past it.
type regionClaim struct {
	name string
	host int64
}

// claimRegion says whether a region named name, holding host bytes of
// host memory, could be added now, so that a request that would be
// refused maps and registers nothing, and holds its place until
// addRegion (which checks again) or unclaim.
func (r *registry) claimRegion(name string, host int64) (*regionClaim, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if err := r.mayAddRegion(name, host); err != nil {
		return nil, err
	}
	c := &regionClaim{name: name, host: host}
	r.claims[name] = c
	return c, nil
}

// unclaim gives up a claim addRegion did not take.
func (r *registry) unclaim(c *regionClaim) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.claims[c.name] == c {
		delete(r.claims, c.name)
	}
}

// mayAddRegion checks a new region's name against the table and the
// claims, and the region and its host bytes against the limits; callers
// hold mu.
func (r *registry) mayAddRegion(name string, host int64) error {
	if r.stopping {
		return errStopping
	}
	if n := len(r.regions) + len(r.claims); n >= maxRegions {
		return apiErr(api.CodeBusy, "%d regions are registered, this ferryd's limit: unregister some, or lend larger ones", n)
	}
	if g, ok := r.regions[name]; ok {
		switch {
		case g.dropErr != nil:
			return apiErr(api.CodeExists, "the region named %s is still closing: %v; or choose another name", name, g.dropErr)
		case g.closing:
			return apiErr(api.CodeExists, "the region named %s is still closing (transfers or writes use it, or ferryd is unmapping it): wait for DELETE /v1/regions/%s, or choose another name", name, name)
		}
		return apiErr(api.CodeExists, "a region named %s is registered already: unregister it first or choose another name", name)
	}
	if _, ok := r.claims[name]; ok {
		return apiErr(api.CodeExists, "a region named %s is being registered by another request: choose another name", name)
	}
	limit := r.hostLimit
	if host == 0 || limit.bytes == 0 {
		return nil
	}
	if host > limit.bytes {
		return apiErr(api.CodeTooLarge,
			"region %s: %s (%d bytes) of host memory is more than all regions together may hold: max_region_bytes is %s: lend a smaller region, or raise max_region_bytes (--max-region-bytes) if this host can spare that much pinned memory",
			name, size.Format(host), host, limit)
	}
	if held := r.hostRegionBytes(); host > limit.bytes-held {
		return apiErr(api.CodeBusy,
			"region %s: %s (%d bytes) of host memory would bring what regions hold to %s, past max_region_bytes %s: unregister regions no longer needed (GET /v1/regions lists them; one closing counts until it is unmapped), or raise max_region_bytes (--max-region-bytes)",
			name, size.Format(host), host, size.Format(held+host), limit)
	}
	return nil
}

// regionLimit reads max_region_bytes on this host. A share is of the
// smaller of its physical memory (MemTotal) and the memory limit of
// ferryd's cgroup (systemd's MemoryMax=, a container's): the pages of a
// region that its registration faults in (those its client never
// touched) are charged to that cgroup, and past its limit ferryd is
// killed. A cgroup limit that cannot be read is warned of, and the
// share is then of physical memory: an odd cgroup setup must not keep
// ferryd from starting.
func regionLimit(share config.Share, warn func(error)) (hostLimit, error) {
	if !strings.HasSuffix(string(share), "%") {
		return hostLimit{setting: string(share), bytes: share.Bytes(0)}, nil
	}
	var si unix.Sysinfo_t
	if err := unix.Sysinfo(&si); err != nil {
		return hostLimit{}, fmt.Errorf("max_region_bytes %s: reading this host's memory size: %v: give a size instead (e.g. 512GiB)", share, err)
	}
	cg, limited, err := memlimit.Host.Read()
	if err != nil {
		warn(fmt.Errorf("max_region_bytes %s: reading ferryd's cgroup memory limit: %v; the share is of physical memory instead (give a size to choose the bound yourself, e.g. 512GiB)", share, err))
		limited = false
	}
	return shareOf(share, int64(si.Totalram)*int64(si.Unit), cg, limited), nil
}

// shareOf is share of physical bytes of memory, or of the cgroup limit
// cg where there is one and it is less.
func shareOf(share config.Share, physical int64, cg memlimit.Limit, limited bool) hostLimit {
	base, of := physical, fmt.Sprintf("physical memory (%s)", size.Format(physical))
	if limited && cg.Bytes < physical {
		base, of = cg.Bytes, fmt.Sprintf("ferryd's cgroup memory limit (%s, %s)", size.Format(cg.Bytes), cg.File)
	}
	return hostLimit{setting: string(share), of: of, bytes: max(1, share.Bytes(base))} // a share is never "no bound"
}

// regionsStatus counts the regions and the host memory they hold.
func (r *registry) regionsStatus() api.RegionsStatus {
	r.mu.Lock()
	defer r.mu.Unlock()
	return api.RegionsStatus{Count: len(r.regions), HostBytes: r.hostRegionBytes(), HostLimit: r.hostLimit.bytes}
}

// hostBytes is the host memory a region's memory holds: a memfd's
// mapping. A CUDA region's is device memory, which its owner allocated
// and which registering with the NIC pins no host page of: it counts
// toward no host limit.
func hostBytes(mem arena.Memory) int64 {
	if mem.Host() == nil {
		return 0
	}
	return mem.Size()
}

// hostRegionBytes is the host memory the regions hold, closing ones
// until they are unmapped, and the claims about to be mapped; callers
// hold mu.
func (r *registry) hostRegionBytes() int64 {
	var n int64
	for _, g := range r.regions {
		n += hostBytes(g.mem)
	}
	for _, c := range r.claims {
		n += c.host
	}
	return n
}

// describeRegion describes g; callers hold mu.
func (r *registry) describeRegion(g *region) api.Region {
	d := api.Region{Name: g.name, NBytes: g.size(), Kind: g.mem.Kind(), Slots: g.slots, Uses: g.uses, Closing: g.closing, Since: g.since, MooncakeAddr: g.mooncakeAddr, MooncakeSegment: g.segment}
	if r.registrar != nil {
		d.NIC = &api.RegionNIC{Registered: g.nic != nil}
		switch {
		case g.nicErr != nil:
			d.NIC.Error = g.nicErr.Error()
		case g.dropErr != nil:
			d.NIC.Error = g.dropErr.Error()
		}
		d.NIC.Engine = g.engineNIC
	}
	return d
}

// useRegion pins a registered region for a transfer or a slot; callers
// hold mu.
func (r *registry) useRegion(name, what string) (*region, error) {
	g, ok := r.regions[name]
	if !ok || g.closing {
		return nil, apiErr(api.CodeNotFound, "%s: no region named %s is registered: POST /v1/regions first (GET /v1/regions lists them)", what, name)
	}
	g.uses++
	return g, nil
}

// unuseRegion drops a pin. A closing region's last one takes it out of
// use: unlock ends it once mu is released. Callers hold mu and release
// it with unlock.
func (r *registry) unuseRegion(g *region) {
	g.uses--
	if g.closing && g.uses == 0 {
		r.ended = append(r.ended, g)
	}
}

// unlock releases mu, then ends each region whose last use ended while
// it was held, each on a goroutine of its own: dropping a registration
// unpins every page of it, and unmapping a large region takes time too,
// which neither the write or transfer that dropped the last use (a
// lane's or receiver's goroutine) nor an arriving write or API call
// should wait behind. Callers that may drop a region's last use release
// mu with unlock, not mu.Unlock.
//
// Once the registry stops, the caller ends them itself: the transport's
// Close waits for its receivers, and so for these, before it closes the
// NIC, and a teardown started earlier is one waitEnds waits for.
func (r *registry) unlock() {
	ended, stopping := r.ended, r.stopping
	r.ended = nil
	if !stopping {
		r.ending.Add(len(ended))
	}
	r.mu.Unlock()
	for _, g := range ended {
		if stopping {
			r.endRegion(g)
			continue
		}
		go func() {
			defer r.ending.Done()
			r.endRegion(g)
		}()
	}
}

// waitEnds waits for the regions being ended on goroutines of their own;
// called once the registry has stopped, when no more start. A wait past
// slowEnd is told to stalled, once: the NIC closed under a running
// deregistration would fail it, so it waits on rather than abandon it,
// and an operator (or systemd's stop timeout) sees why.
func (r *registry) waitEnds(stalled func()) {
	done := make(chan struct{})
	go func() {
		r.ending.Wait()
		close(done)
	}()
	t := time.NewTimer(slowEnd)
	defer t.Stop()
	select {
	case <-done:
	case <-t.C:
		stalled()
		<-done
	}
}

// slowEnd is how long a region's teardown may hold up shutdown before
// the wait is logged.
const slowEnd = 5 * time.Second

// endRegion drops a region's registration with the NIC, then its
// mapping, then its place in the table, and only then ends g.end:
// DELETE /v1/regions answers 204 once the memory is its client's alone.
// Until then GET /v1/regions lists it (closing) and its name stays taken.
//
// A registration the NIC keeps keeps the rest: the region stays mapped
// (the NIC pins its pages whether mapped or not, and rdma still lists its
// addresses as registered, so no new mapping may take them), listed,
// named and counted against max_region_bytes, and the DELETEs waiting
// are told so; a DELETE tries again. Callers do not hold mu.
func (r *registry) endRegion(g *region) {
	// Its writes and windows are gone: the NIC may drop it.
	err := g.lend.closeNIC()
	if g.nic != nil {
		err = errors.Join(err, g.nic.Close())
	}
	if err == nil {
		_ = g.mem.Close()
	}
	r.mu.Lock()
	end, lost := g.end, r.regionNICLost
	if err != nil {
		held := "of GPU memory stay registered"
		if hostBytes(g.mem) > 0 {
			held = "stay pinned and count against max_region_bytes"
		}
		g.dropErr = fmt.Errorf("the NIC would not drop region %s's registration (%w): its %d bytes %s, and it stays listed (closing) under its name: DELETE /v1/regions/%s again to retry, or restart ferryd to free them",
			g.name, err, g.size(), held, g.name)
		end.err = apiErr(api.CodeInternal, "%v", g.dropErr)
	} else if r.regions[g.name] == g {
		delete(r.regions, g.name)
	}
	r.mu.Unlock()
	if end.err != nil && lost != nil {
		lost(g.name, end.err) // counted before the DELETEs waiting hear of it
	}
	close(end.done)
}

// pinRegion pins a registered region for a transfer reading it.
func (r *registry) pinRegion(name, what string) (*region, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.useRegion(name, what)
}

func (r *registry) unpinRegion(g *region) {
	r.mu.Lock()
	defer r.unlock()
	r.unuseRegion(g)
}

// removeRegion closes a region to new use: it is ended once the
// transfers reading it and the writes landing in it have ended, or at
// once when it is closing already because the NIC kept its registration.
// A region with live receive slots is refused: the client frees them
// first.
func (r *registry) removeRegion(name string) (*regionEnd, error) {
	r.mu.Lock()
	defer r.unlock()
	g, ok := r.regions[name]
	if !ok {
		return nil, apiErr(api.CodeNotFound, "no region named %s is registered (GET /v1/regions lists them)", name)
	}
	switch {
	case g.closing && g.end.err == nil:
		return g.end, nil // a second DELETE waits for the same end
	case g.closing:
		// The NIC kept its registration last time (no use is left): try again.
		g.end = newRegionEnd(g)
		r.ended = append(r.ended, g)
		return g.end, nil
	}
	if g.slots > 0 {
		var ids []string
		for _, s := range r.slots {
			if s.region == g {
				ids = append(ids, s.reqID)
			}
		}
		sort.Strings(ids)
		return nil, apiErr(api.CodeBusy, "region %s still holds %d receive slot(s) (%s): free them (DELETE /v1/receives/{req_id}) before unregistering it",
			name, len(ids), clipList(ids))
	}
	g.closing, g.end = true, newRegionEnd(g)
	r.unlend(g)
	g.uses++ // the removal's own pin, dropped at once so the last user ends it
	r.unuseRegion(g)
	return g.end, nil
}

func newRegionEnd(g *region) *regionEnd { return &regionEnd{g: g, done: make(chan struct{})} }

func (r *registry) listRegions() []api.Region {
	r.mu.Lock()
	defer r.mu.Unlock()
	out := make([]api.Region, 0, len(r.regions))
	for _, g := range r.regions {
		out = append(out, r.describeRegion(g))
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Name < out[j].Name })
	return out
}

// clipList names at most a few items of a list for a message.
func clipList(ids []string) string {
	if len(ids) > 5 {
		return fmt.Sprintf("%v and %d more", ids[:5], len(ids)-5)
	}
	return fmt.Sprint(ids)
}

// handleNewRegion registers client memory: POST /v1/regions, the memfd's
// descriptor passed beside the request.
func (d *Daemon) handleNewRegion(w http.ResponseWriter, r *http.Request) error {
	fd := passedFD(r.Context())
	if fd >= 0 {
		defer unix.Close(fd) // the mapping keeps the memory; the descriptor is not needed past it
	}
	var req api.RegionRequest
	if err := d.decodeJSON(r, &req); err != nil {
		return err
	}
	if err := api.CheckReqID(req.Name); err != nil {
		return apiErr(api.CodeBadRequest, "region name: %v", err)
	}
	if req.NBytes <= 0 {
		return apiErr(api.CodeBadRequest, "region %s: nbytes %d must be positive", req.Name, req.NBytes)
	}
	host := req.NBytes // a memfd's mapping
	if req.CUDA != nil {
		host = 0 // device memory: see hostBytes
	}
	l, err := d.lendFor(r.Context(), req)
	if err != nil {
		return err
	}
	claim, err := d.reg.claimRegion(req.Name, host)
	if err != nil {
		return err
	}
	defer d.reg.unclaim(claim) // a no-op once addRegion took it
	var mem arena.Memory
	switch {
	case req.CUDA != nil && fd >= 0:
		return apiErr(api.CodeBadRequest, "region %s: a descriptor and a CUDA handle came: lend a memfd or GPU memory, one per region", req.Name)
	case req.CUDA != nil && req.FDOffset != 0:
		return apiErr(api.CodeBadRequest, "region %s: fd_offset is for a memfd; GPU memory takes cuda.offset", req.Name)
	case req.CUDA != nil:
		mem, err = d.openCUDARegion(req)
	case fd < 0:
		return apiErr(api.CodeBadRequest,
			"region %s: no file descriptor came with the request: pass the memfd beside the request's bytes (sendmsg with SCM_RIGHTS on the control socket; the Go and Python clients do this), or name GPU memory with \"cuda\"", req.Name)
	default:
		mem, err = mapRegion(fd, req.Name, req.FDOffset, req.NBytes)
	}
	if err != nil {
		return err
	}
	// GPU memory goes through its device's nearest NICs, as that
	// device's arena does, and its slots' keys name the first of them;
	// host memory through rail 0.
	var nics []string
	if req.CUDA != nil {
		nics = d.affinity.NICsFor(req.CUDA.Device)
	}
	nic, on, nicErr := d.registerRegionNIC(mem, nics)
	gpu, err := d.registerEngineRegion(req.Name, mem, &l)
	var g api.Region
	if err == nil {
		g, err = d.reg.addRegionOn(req.Name, mem, nic, nicErr, uint8(on.Home), l)
	}
	if err != nil {
		_ = l.closeNIC()
		if nic != nil {
			_ = nic.Close()
		}
		_ = mem.Close()
		return err
	}
	// Counted once the region is in: a request refused after all
	// leaves no registration behind.
	switch {
	case nicErr != nil:
		d.metrics.regionRegistrations.WithLabelValues("failed").Inc()
		d.regionLog.Printf("region %s: %v; the region is registered for transfers all the same", req.Name, nicErr)
	case nic != nil:
		d.metrics.regionRegistrations.WithLabelValues("registered").Inc()
	}
	d.engineGPUTaken(req.Name, gpu)
	d.log.Info().Str("region", req.Name).Str("kind", g.Kind).Int64("nbytes", req.NBytes).Bool("nic", nic != nil).Msg("region registered")
	if l.owner > 0 {
		d.watchOwner(l.owner)
	}
	writeJSON(w, http.StatusCreated, g)
	return nil
}

// registerRegionNIC registers a region with the RDMA NIC, once, so that
// writes from it and into its slots go without a copy: a host region's
// mapping, or a CUDA region's device memory (rdma registers it where it
// reaches the GPU arena itself). With nics (a device arena's nearest
// NICs) rdma registers it on their rails too, and its sends go out
// through them; on says which it went on. A failure fails nothing: TCP
// peers read and write the region as it lies, and RDMA copies its
// writes through bounce and staging buffers (a CUDA region's through
// the pinned bounce area); the caller logs the reason (rate-limited),
// counts it, and lists it with the region.
func (d *Daemon) registerRegionNIC(mem arena.Memory, nics []string) (nic io.Closer, on rdma.RegionRails, err error) {
	rr := d.reg.registrar
	if rr == nil {
		return nil, on, nil
	}
	host, dev := mem.Host(), transport.Range{Addr: mem.Base(), Len: uint64(mem.Size())}
	if rails, ok := rr.(railRegistrar); ok {
		if host != nil {
			nic, on, err = rails.RegisterRegionOn(host, nics)
		} else {
			nic, on, err = rails.RegisterDeviceRegionOn(dev, nics)
		}
	} else if host != nil {
		nic, err = rr.RegisterRegion(host)
	} else {
		nic, err = rr.RegisterDeviceRegion(dev)
	}
	if err != nil {
		return nil, on, err
	}
	return nic, on, nil
}

// railRegistrar registers a region on the rails of named NICs too
// (rdma, with several RDMA devices).
type railRegistrar interface {
	RegisterRegionOn(mem []byte, nics []string) (io.Closer, rdma.RegionRails, error)
	RegisterDeviceRegionOn(r transport.Range, nics []string) (io.Closer, rdma.RegionRails, error)
}

func (d *Daemon) handleListRegions(w http.ResponseWriter, r *http.Request) error {
	writeJSON(w, http.StatusOK, d.reg.listRegions())
	return nil
}

// handleDeleteRegion unregisters a region: DELETE /v1/regions/{name}
// answers 204 once the writes and transfers using it have ended (up to
// ?wait=, default 30s) and ferryd has unmapped it.
func (d *Daemon) handleDeleteRegion(w http.ResponseWriter, r *http.Request) error {
	name := r.PathValue("name")
	wait, err := parseWait(r)
	if err != nil {
		return err
	}
	if r.URL.Query().Get("wait") == "" {
		wait = 30 * time.Second
	}
	end, err := d.reg.removeRegion(name)
	if err != nil {
		return err
	}
	timer := time.NewTimer(wait)
	defer timer.Stop()
	select {
	case <-end.done:
		if end.err != nil {
			return end.err
		}
	case <-timer.C:
		return d.regionBusy(end.g, wait)
	case <-r.Context().Done():
		return d.regionBusy(end.g, wait)
	}
	d.log.Info().Str("region", name).Msg("region unregistered")
	w.WriteHeader(http.StatusNoContent)
	return nil
}

func (d *Daemon) regionBusy(g *region, wait time.Duration) error {
	d.reg.mu.Lock()
	uses := g.uses
	d.reg.mu.Unlock()
	if uses == 0 {
		return apiErr(api.CodeTimeout,
			"region %s is closing, but after %s ferryd is still dropping its registration with the NIC (which unpins every page) or unmapping it: GET /v1/regions lists it (closing) until it is done; do not reuse its memory before",
			g.name, wait)
	}
	return apiErr(api.CodeTimeout,
		"region %s is closing, but %d transfer(s) or write(s) still use it after %s: ferryd unmaps it when they end, and GET /v1/regions lists it (closing) until then; do not reuse its memory before",
		g.name, uses, wait)
}
