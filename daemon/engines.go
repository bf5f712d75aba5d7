package daemon

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"slices"
	"sort"
	"strconv"
	"sync"
	"time"

	"golang.org/x/sys/unix"

	"github.com/ferry-project/ferry/api"
	"github.com/ferry-project/ferry/arena"
	"github.com/ferry-project/ferry/internal/connlimit"
	"github.com/ferry-project/ferry/mooncake"
	"github.com/ferry-project/ferry/rdma"
	"github.com/ferry-project/ferry/transport"
)

// Engine memory: what ferry.mooncake.TransferEngine registers is where
// Mooncake peers write, at the engine's own addresses. A process started
// with ferry's allocator lends its memfd window (docs/python.md); each
// registered range is a region with a lend. Each engine has a segment of
// its own (engineSegment: its own RPC and data ports, its session id
// "host:rpc_port"), listing exactly the memory it registered, and owned
// by the process that opened it: when that process exits, or the engine
// closes it, the segment, its listeners and its regions go. Regions lent
// without a segment are listed in ferryd's own (--mooncake-listen).

// Between two ferryd an engine's memory is written over ferry's own peer
// protocol, not Mooncake's wire (over RDMA too: engines_rdma.go): the segment's
// descriptor names its ferryd's peer port and the segment's key
// (mooncake.FerryTarget), and a write carrying that key lands in the
// segment's regions at its Mooncake address (registry.acceptKeyed). With
// a peer secret those connections are authenticated, as all peer
// connections are.

// lend says where Mooncake peers write into a region: at addr (its
// owner's address of its first byte; 0: they do not), in the engine
// segment named segment ("": ferryd's own), lent by process owner, and
// over RDMA under mr (engines_rdma.go; nil on TCP), as engineNIC says.
type lend struct {
	mooncakeAddr uint64
	segment      string
	owner        int32
	mr           *rdma.EngineRegion
	engineNIC    *api.RegionEngineNIC
}

// lendFor checks a region request asking that Mooncake peers write into
// it, and says how it is lent: a memfd or GPU memory (a CUDA region,
// whose writes and reads go through host staging: regionWrite), into a
// segment that exists and belongs to the caller.
func (d *Daemon) lendFor(ctx context.Context, req api.RegionRequest) (lend, error) {
	a := req.MooncakeAddr
	switch {
	case a == 0 && req.MooncakeSegment != "":
		return lend{}, apiErr(api.CodeBadRequest, "region %s: mooncake_segment without mooncake_addr: pass the address the engine's peers write at", req.Name)
	case a == 0:
		return lend{}, nil
	case d.mooncake == nil:
		return lend{}, apiErr(api.CodeBadRequest, "region %s: mooncake_addr asks that Mooncake peers write into it, but this ferryd serves no Mooncake segment: start it with --mooncake-listen", req.Name)
	case a+uint64(req.NBytes) < a:
		return lend{}, apiErr(api.CodeBadRequest, "region %s: mooncake_addr %#x plus nbytes %d passes the end of the address space", req.Name, a, req.NBytes)
	}
	l := lend{mooncakeAddr: a, segment: req.MooncakeSegment, owner: callerOf(ctx).pid}
	if l.segment != "" {
		es := d.engines.get(l.segment)
		switch {
		case es == nil:
			return lend{}, apiErr(api.CodeNotFound, "region %s: no engine segment %s (it was closed, or its process exited): open one with POST /v1/mooncake/segments", req.Name, l.segment)
		case es.owner != l.owner:
			return lend{}, apiErr(api.CodeForbidden, "region %s: engine segment %s belongs to process %d, not to this caller (pid %d): an engine lists only memory its own process registered", req.Name, l.segment, es.owner, l.owner)
		}
	}
	return l, nil
}

// mayLend checks a region lent as l against the memory its segment
// lists already (ranges there must not overlap: a peer names memory by
// address alone); callers hold mu. A region lent counts toward
// mooncakeRegions when it is in ferryd's own segment.
func (r *registry) mayLend(name string, size uint64, l lend) error {
	if l.mooncakeAddr == 0 {
		return nil
	}
	start, end := l.mooncakeAddr, l.mooncakeAddr+size
	if l.segment == "" {
		if base := r.arena.Addr(arena.Slice{}); start < base+uint64(r.arena.Memory().Size()) && base < end {
			return apiErr(api.CodeBadRequest, "region %s: mooncake_addr [%#x, %#x) overlaps ferryd's arena [%#x, %#x), which its Mooncake segment lists too: peers could not tell them apart; lend memory at other addresses, or in an engine segment of its own",
				name, start, end, base, base+uint64(r.arena.Memory().Size()))
		}
	}
	for _, o := range r.regions {
		if o.mooncakeAddr != 0 && o.segment == l.segment && !o.closing && start < o.mooncakeAddr+uint64(o.size()) && o.mooncakeAddr < end {
			return apiErr(api.CodeExists, "region %s: mooncake_addr [%#x, %#x) overlaps region %s's [%#x, %#x) in the same Mooncake segment (%s): unregister that first",
				name, start, end, o.name, o.mooncakeAddr, o.mooncakeAddr+uint64(o.size()), segmentName(l.segment))
		}
	}
	if l.segment == "" {
		r.mooncakeRegions.Add(1)
	}
	return nil
}

// unlend is a lent region closing; callers hold mu.
func (r *registry) unlend(g *region) {
	if g.mooncakeAddr != 0 && g.segment == "" {
		r.mooncakeRegions.Add(-1)
	}
}

func segmentName(id string) string {
	if id == "" {
		return "ferryd's own"
	}
	return "engine segment " + id
}

// mooncakeRegionAt is the open region of segment that Mooncake peers
// write into at addr, or nil; callers hold mu.
func (r *registry) mooncakeRegionAt(segment string, addr uint64) *region {
	for _, g := range r.regions {
		if g.mooncakeAddr != 0 && g.segment == segment && !g.closing && addr >= g.mooncakeAddr && addr-g.mooncakeAddr < uint64(g.size()) {
			return g
		}
	}
	return nil
}

// mooncakeBuffers is the open regions of segment, as buffers named name,
// by address, regions that follow one another as one buffer (a write may
// span them) unless they have keys (over RDMA: each its own).
func (r *registry) mooncakeBuffers(segment, name string) []mooncake.Buffer {
	r.mu.Lock()
	defer r.mu.Unlock()
	var out []mooncake.Buffer
	for _, g := range r.regions {
		if g.mooncakeAddr != 0 && g.segment == segment && !g.closing {
			out = append(out, engineBuffer(g, name))
		}
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Addr < out[j].Addr })
	merged := out[:0]
	for _, b := range out {
		if k := len(merged) - 1; k >= 0 && merged[k].Addr+merged[k].Length == b.Addr && b.RKey == nil && merged[k].RKey == nil {
			merged[k].Length += b.Length
			continue
		}
		merged = append(merged, b)
	}
	return merged
}

// landInRegions takes a Mooncake peer's write of n bytes at addr into
// the open regions of segment there, one after another without a gap,
// each pinned until done; callers hold mu and release it with unlock.
// GPU memory takes the bytes through host staging of chunk bytes at
// most (regionWrite).
func (r *registry) landInRegions(segment string, addr, n uint64, chunk int64) (transport.Body, func(error), error) {
	parts, pinned, err := r.lentRange(segment, addr, n, "write")
	if err != nil {
		return nil, nil, err
	}
	w := &regionWrite{parts: parts, chunk: chunk}
	// The first region's staging is lent now, so that a ferryd out of
	// it refuses the write rather than failing it half read.
	if err := w.open(); err != nil {
		for _, g := range pinned {
			r.unuseRegion(g)
		}
		return nil, nil, r.noStaging(err, "GPU memory an engine registered")
	}
	done := func(err error) {
		if w.finish(err) != nil {
			r.refused(transport.Internal)
		}
		r.unpinRegions(pinned)
	}
	return w.next, done, nil
}

// regionWrite lends the memory of a write into regions, a part at a
// time: host memory as itself, GPU memory through host staging of chunk
// bytes at most, each staged piece copied in when the next is asked for
// (the last when the empty one is, or by finish for a transport that
// takes the write as one piece: Accept's chunk is the write's length).
type regionWrite struct {
	parts []lentPart // not yet lent
	chunk int64
	host  []byte        // a host part to lend next
	fill  *arena.Filler // the GPU part being lent
}

// open makes the next part the one lent.
func (w *regionWrite) open() error {
	p := w.parts[0]
	w.parts = w.parts[1:]
	if host := p.g.mem.Host(); host != nil {
		w.host = host[p.off : p.off+p.n]
		return nil
	}
	fill, err := arena.NewFiller(p.g.mem, arena.Slice{Len: p.g.size()}, int64(p.off), int64(p.n), w.chunk)
	if err != nil {
		return err
	}
	w.fill = fill
	return nil
}

// next implements transport.Body.
func (w *regionWrite) next() ([]byte, error) {
	for {
		if piece := w.host; piece != nil {
			w.host = nil
			return piece, nil
		}
		if w.fill != nil {
			piece, err := w.fill.Next()
			if err != nil {
				return nil, fmt.Errorf("the receiving ferryd could not copy the write's bytes into the GPU memory an engine registered: %v; send it again", err)
			}
			if len(piece) > 0 {
				return piece, nil
			}
			w.fill.Close()
			w.fill = nil
		}
		if len(w.parts) == 0 {
			return nil, nil
		}
		if err := w.open(); err != nil {
			return nil, fmt.Errorf("the receiving ferryd could not stage the write's bytes for the GPU memory an engine registered: %v; send it again", err)
		}
	}
}

// finish ends the write (err: what stopped it): what is still staged
// goes in when it landed, and the staging goes back. A copy that fails
// here is the error, the bytes short of their place.
func (w *regionWrite) finish(err error) error {
	if w.fill == nil {
		return nil
	}
	var cerr error
	if err == nil {
		_, cerr = w.fill.Next()
	}
	w.fill.Close()
	w.fill = nil
	return cerr
}

// lentPart is the part of a write or read that lies in region g: n
// bytes at offset off.
type lentPart struct {
	g      *region
	off, n uint64
}

// lentRange is [addr, addr+n) in segment's regions, as the parts in
// each, the regions pinned; callers hold mu.
func (r *registry) lentRange(segment string, addr, n uint64, what string) ([]lentPart, []*region, error) {
	refuse := func(at uint64) error {
		r.refused(transport.OutOfBounds)
		return &transport.Refusal{Code: transport.OutOfBounds,
			Message: fmt.Sprintf("a %s of %d bytes at %#x does not fit the memory registered in %s (it is empty, or runs past it at %#x)", what, n, addr, segmentName(segment), at)}
	}
	if n == 0 || addr+n < addr {
		return nil, nil, refuse(addr)
	}
	var parts []lentPart
	var pinned []*region
	for at, end := addr, addr+n; at < end; {
		g := r.mooncakeRegionAt(segment, at)
		if g == nil {
			return nil, nil, refuse(at)
		}
		off := at - g.mooncakeAddr
		take := min(end-at, uint64(g.size())-off)
		parts = append(parts, lentPart{g: g, off: off, n: take})
		pinned = append(pinned, g)
		at += take
	}
	for _, g := range pinned {
		g.uses++
	}
	return parts, pinned, nil
}

func (r *registry) unpinRegions(pinned []*region) {
	r.mu.Lock()
	for _, g := range pinned {
		r.unuseRegion(g)
	}
	r.unlock()
}

// engineSegment is one engine's own Mooncake segment: an RPC port whose
// descriptor lists exactly the memory its engine registered, and a TCP
// data port landing writes there and serving reads from there only.
type engineSegment struct {
	id    string
	key   transport.Key // ferry peers' writes carry it
	owner int32
	since time.Time
	seg   mooncake.Segment // the descriptor, less its buffers
	hs    *mooncake.Server
	data  *mooncake.DataServer
	eps   *mooncakeEndpoints // the QPs Mooncake initiators connected to it, over RDMA; else nil
	// notifies holds the Mooncake notifies its RPC port received until
	// its engine takes them (notifies.go).
	notifies notifyQueue
}

// close closes the segment's ports and its RDMA endpoints.
func (es *engineSegment) close() {
	es.hs.Close()
	es.data.Close()
	if es.eps != nil {
		es.eps.Close()
	}
}

// engines is the open engine segments by id.
type engines struct {
	mu   sync.Mutex
	next int
	byID map[string]*engineSegment
	// opening serialises openEngineSegment, so that its bounds hold
	// however many callers ask at once.
	opening sync.Mutex
	// retired is what closed segments' endpoint tables did, under mu
	// (engines_rdma.go).
	retired connlimit.Stats
}

func (e *engines) get(id string) *engineSegment {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.byID[id]
}

// ownedBy lists the segments process pid opened.
func (e *engines) ownedBy(pid int32) []*engineSegment {
	e.mu.Lock()
	defer e.mu.Unlock()
	var out []*engineSegment
	for _, es := range e.byID {
		if es.owner == pid {
			out = append(out, es)
		}
	}
	return out
}

// maxEngineSegments bounds the engine segments open at once, two
// listeners each: a host's engines, one per GPU rank and a few more, with
// room to spare; a client opening them in a loop meets the bound. One
// process may hold maxEngineSegmentsPerProcess of them (a framework's
// rank holds one or two), so no one process takes them all.
const (
	maxEngineSegments           = 256
	maxEngineSegmentsPerProcess = 16
)

// enginePortLimits caps the connections all engine segments' ports hold
// together, each port capped as ferryd's own besides: eight segments'
// ports full, at about a descriptor each, well under the unit's
// LimitNOFILE beside everything else ferryd holds (docs/operations.md).
// At the cap a newcomer takes the place of an idle connection, of any
// engine segment's port (connlimit).
var enginePortLimits = connlimit.Limits{Total: 8192}

// openEngineSegment listens on the host of --mooncake-listen, port (0:
// one the kernel picks) for the RPC port and any for the data port.
func (d *Daemon) openEngineSegment(owner int32, port int) (*engineSegment, error) {
	if d.mooncake == nil {
		return nil, apiErr(api.CodeBadRequest, "an engine segment listens beside ferryd's own Mooncake segment, and this ferryd serves none: start it with --mooncake-listen HOST:PORT")
	}
	if owner <= 0 {
		// The segment lives as long as its process: without its pid
		// ferryd could never see that process exit, and the segment, its
		// ports and the memory lent into it would stay forever.
		return nil, apiErr(api.CodeForbidden, "ferryd cannot see this caller's process id (the kernel reports pid 0: the caller runs in a PID namespace ferryd's is not an ancestor of, e.g. ferryd in a container and the engine outside it), so it could not drop an engine segment when that process exits: run ferryd in the host's PID namespace (its systemd service, or a container with hostPID) or the engines in ferryd's")
	}
	d.engines.opening.Lock()
	defer d.engines.opening.Unlock()
	d.engines.mu.Lock()
	open, mine := len(d.engines.byID), 0
	for _, es := range d.engines.byID {
		if es.owner == owner {
			mine++
		}
	}
	d.engines.mu.Unlock()
	switch {
	case open >= maxEngineSegments:
		return nil, apiErr(api.CodeBusy, "%d engine segments are open, this ferryd's limit: close engines no longer used (engine.close(); GET /v1/mooncake/segments lists them)", open)
	case mine >= maxEngineSegmentsPerProcess:
		return nil, apiErr(api.CodeBusy, "process %d holds %d engine segments, the limit for one process: close its engines no longer used (engine.close(); GET /v1/mooncake/segments lists them)", owner, mine)
	}
	if port < 0 || port > 65535 {
		return nil, apiErr(api.CodeBadRequest, "port %d: want 0 (any) or a port number", port)
	}
	host, _, _ := net.SplitHostPort(d.cfg.MooncakeListen)
	rpc, err := net.Listen("tcp", net.JoinHostPort(host, strconv.Itoa(port)))
	if err != nil {
		return nil, apiErr(api.CodeExists, "an engine segment's RPC port %s: %v: pass another port, or 0", net.JoinHostPort(host, strconv.Itoa(port)), err)
	}
	dl, err := net.Listen("tcp", net.JoinHostPort(host, "0"))
	if err != nil {
		rpc.Close()
		return nil, apiErr(api.CodeInternal, "an engine segment's data port on %s: %v", host, err)
	}
	allow, err := mooncakeAllow(d.cfg.MooncakeAllow)
	if err != nil {
		rpc.Close()
		dl.Close()
		return nil, apiErr(api.CodeInternal, "%v", err)
	}
	d.engines.mu.Lock()
	d.engines.next++
	// Never one a ferryd before it gave: an engine that outlived a restart
	// must not name (and close) another process's segment.
	id := fmt.Sprintf("e%d-%08x", d.engines.next, uint32(d.instance))
	d.engines.mu.Unlock()
	ra := rpc.Addr().(*net.TCPAddr)
	name := ra.String()
	if ra.IP.IsUnspecified() {
		ahost, _, _ := net.SplitHostPort(d.advertise)
		name = net.JoinHostPort(ahost, strconv.Itoa(ra.Port))
	}
	es := &engineSegment{id: id, key: transport.NewKey(), owner: owner, since: time.Now(), seg: mooncake.Segment{
		Name: name, Protocol: "tcp", TCPDataPort: dl.Addr().(*net.TCPAddr).Port, TCPProtoVersion: 2,
		Timestamp: time.Now().UTC().Format("2006-01-02 15:04:05.000000"),
	}}
	es.seg.Ferry = &mooncake.FerryTarget{Peer: d.advertise, Key: es.key}
	d.reg.mu.Lock()
	if d.reg.engineKeys == nil {
		d.reg.engineKeys = make(map[transport.Key]string)
	}
	d.reg.engineKeys[es.key] = id
	d.reg.mu.Unlock()
	logf := d.mooncake.engines.Printf
	es.data = mooncake.ServeData(dl, engineMemory{d.reg, id}, mooncake.DataConfig{
		IOTimeout: d.cfg.IOTimeout.D(), Logf: logf, Debugf: d.mooncake.debug.Printf, Allow: allow, Shared: d.mooncake.enginePorts,
	})
	h := mooncake.Handlers{Segment: func() *mooncake.Segment {
		seg := es.seg
		buf := name
		if seg.Protocol == "rdma" {
			buf = mooncakeLocation // the priority matrix's key
		}
		seg.Buffers = append(slices.Clip(es.seg.Buffers), d.reg.mooncakeBuffers(id, buf)...)
		if seg.Buffers == nil {
			seg.Buffers = []mooncake.Buffer{}
		}
		return &seg
	}, Notify: d.engineNotify(es)}
	d.serveEngineRDMA(es, &h)
	es.hs = mooncake.Serve(rpc, h, mooncake.ServerConfig{Logf: logf, Debugf: d.mooncake.debug.Printf, Allow: allow, ShareWith: d.mooncake.hs, Shared: d.mooncake.enginePorts})
	d.engines.mu.Lock()
	if d.engines.byID == nil {
		d.engines.byID = make(map[string]*engineSegment)
	}
	d.engines.byID[id] = es
	d.engines.mu.Unlock()
	if owner > 0 {
		d.watchOwner(owner)
	}
	d.log.Info().Str("engine_segment", id).Str("session", name).Int32("pid", owner).Int("data_port", es.seg.TCPDataPort).Msg("engine segment opened")
	return es, nil
}

// dropEngineSegment closes segment es: its regions stop taking writes at
// once and are unregistered once the writes landing in them end (within
// wait), then its ports close. The segment is gone from the list either
// way; a timeout leaves its regions closing (ferryd unmaps them when
// their writes end).
func (d *Daemon) dropEngineSegment(es *engineSegment, wait time.Duration, why string) error {
	d.engines.mu.Lock()
	if d.engines.byID[es.id] != es {
		d.engines.mu.Unlock()
		return apiErr(api.CodeNotFound, "no engine segment %s (it was closed already)", es.id)
	}
	delete(d.engines.byID, es.id)
	d.engines.mu.Unlock()
	d.reg.mu.Lock()
	delete(d.reg.engineKeys, es.key)
	d.reg.mu.Unlock()
	var ends []*regionEnd
	for _, name := range d.reg.lentIn(es.id) {
		if end, err := d.reg.removeRegion(name); err == nil {
			ends = append(ends, end)
		}
	}
	timer := time.NewTimer(wait)
	defer timer.Stop()
	var err error
	for _, end := range ends {
		select {
		case <-end.done:
		case <-timer.C:
			err = d.regionBusy(end.g, wait)
		}
		if err != nil {
			break
		}
	}
	es.close()
	d.engines.retire(es)
	d.log.Info().Str("engine_segment", es.id).Str("session", es.seg.Name).Int32("pid", es.owner).Int("regions", len(ends)).Msg("engine segment closed: " + why)
	return err
}

// lentIn is the open regions listed in segment.
func (r *registry) lentIn(segment string) []string {
	return r.lentWhere(func(g *region) bool { return g.mooncakeAddr != 0 && g.segment == segment })
}

// ownedBy is the open regions pid lent.
func (r *registry) ownedBy(pid int32) []string {
	return r.lentWhere(func(g *region) bool { return g.owner == pid })
}

// lentWhere names the open regions match accepts.
func (r *registry) lentWhere(match func(*region) bool) []string {
	r.mu.Lock()
	defer r.mu.Unlock()
	var names []string
	for _, g := range r.regions {
		if match(g) && !g.closing {
			names = append(names, g.name)
		}
	}
	return names
}

func (d *Daemon) describeEngine(es *engineSegment) api.EngineSegment {
	held, refused := es.notifies.stats()
	return api.EngineSegment{ID: es.id, Session: es.seg.Name, RPCPort: es.hs.Addr().(*net.TCPAddr).Port, DataPort: es.seg.TCPDataPort,
		PID: es.owner, Regions: len(d.reg.lentIn(es.id)), Since: es.since, Notifies: held, NotifiesRefused: refused}
}

// handleNewEngineSegment: POST /v1/mooncake/segments.
func (d *Daemon) handleNewEngineSegment(w http.ResponseWriter, r *http.Request) error {
	var req api.EngineSegmentRequest
	if err := d.decodeJSON(r, &req); err != nil {
		return err
	}
	es, err := d.openEngineSegment(callerOf(r.Context()).pid, req.Port)
	if err != nil {
		return err
	}
	writeJSON(w, http.StatusCreated, d.describeEngine(es))
	return nil
}

// handleListEngineSegments: GET /v1/mooncake/segments.
func (d *Daemon) handleListEngineSegments(w http.ResponseWriter, r *http.Request) error {
	d.engines.mu.Lock()
	all := make([]*engineSegment, 0, len(d.engines.byID))
	for _, es := range d.engines.byID {
		all = append(all, es)
	}
	d.engines.mu.Unlock()
	out := make([]api.EngineSegment, 0, len(all))
	for _, es := range all {
		out = append(out, d.describeEngine(es))
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Since.Before(out[j].Since) })
	writeJSON(w, http.StatusOK, out)
	return nil
}

// handleDeleteEngineSegment: DELETE /v1/mooncake/segments/{id}, 204 once
// the writes landing in its memory have ended.
func (d *Daemon) handleDeleteEngineSegment(w http.ResponseWriter, r *http.Request) error {
	id := r.PathValue("id")
	es := d.engines.get(id)
	if es == nil {
		return apiErr(api.CodeNotFound, "no engine segment %s (GET /v1/mooncake/segments lists them)", id)
	}
	if pid := callerOf(r.Context()).pid; pid != es.owner {
		return apiErr(api.CodeForbidden, "engine segment %s belongs to process %d, not to this caller (pid %d): an engine closes only its own segment (it closes by itself when its process exits)", id, es.owner, pid)
	}
	if err := d.dropEngineSegment(es, 30*time.Second, "its engine closed it"); err != nil {
		return err
	}
	w.WriteHeader(http.StatusNoContent)
	return nil
}

// closeEngines closes every engine segment's ports at shutdown.
func (d *Daemon) closeEngines() {
	d.engines.mu.Lock()
	defer d.engines.mu.Unlock()
	for id, es := range d.engines.byID {
		es.close()
		delete(d.engines.byID, id)
	}
}

// engineMemory is an engine segment's memory: the regions its engine
// registered, written and read at their owner's addresses.
type engineMemory struct {
	reg *registry
	id  string
}

func (m engineMemory) Write(addr, n uint64) (transport.Body, func(error), error) {
	r := m.reg
	r.mu.Lock()
	defer r.unlock()
	if r.stopping {
		return nil, nil, errRefuseStopping
	}
	return r.landInRegions(m.id, addr, n, stageChunk)
}

// Read serves a READ from one region (a range spanning two is refused:
// the data port sends one buffer). GPU memory is copied out into host
// staging, all n bytes at once, outside the lock: the region is pinned.
func (m engineMemory) Read(addr, n uint64) ([]byte, func(), error) {
	r := m.reg
	r.mu.Lock()
	if r.stopping {
		r.mu.Unlock()
		return nil, nil, errRefuseStopping
	}
	parts, pinned, err := r.lentRange(m.id, addr, n, "read")
	r.mu.Unlock() // pins taken, none dropped: no region ends here
	if err != nil {
		return nil, nil, err
	}
	if len(parts) > 1 {
		r.unpinRegions(pinned)
		return nil, nil, fmt.Errorf("a read of %d bytes at %#x spans %d registered ranges: read each on its own", n, addr, len(parts))
	}
	p := parts[0]
	src, release, err := arena.Readable(p.g.mem, arena.Slice{Len: p.g.size()}, int64(p.off), int64(p.n))
	if err != nil {
		r.unpinRegions(pinned)
		if errors.Is(err, arena.ErrNoStaging) {
			return nil, nil, fmt.Errorf("a read of %d bytes from GPU memory: this ferryd has no host memory to stage it in now (%v): read smaller pieces, or again once its copies in flight end (its operator may raise --bounce-size)", n, err)
		}
		return nil, nil, fmt.Errorf("a read of %d bytes at %#x from GPU memory an engine registered: %v", n, addr, err)
	}
	return src, func() { release(); r.unpinRegions(pinned) }, nil
}

// watchOwner drops what process pid lent for Mooncake peers once it
// exits (its engine segments and their regions, and regions it lent in
// ferryd's own): their addresses are that process's, and nothing else
// would unregister them. One watcher per process, polling its pidfd; it
// ends when the process has nothing lent any more or ferryd stops.
func (d *Daemon) watchOwner(pid int32) {
	r := d.reg
	r.mu.Lock()
	if r.watched[pid] {
		r.mu.Unlock()
		return
	}
	if r.watched == nil {
		r.watched = make(map[int32]bool)
	}
	r.watched[pid] = true
	r.mu.Unlock()
	unwatch := func(err error) {
		r.mu.Lock()
		delete(r.watched, pid)
		r.mu.Unlock()
		d.regionLog.Printf("watching process %d, which lent memory for Mooncake peers: %v; its regions and engine segments stay until closed", pid, err)
	}
	fd, err := unix.PidfdOpen(int(pid), 0)
	if err != nil && err != unix.ESRCH {
		unwatch(fmt.Errorf("pidfd_open: %w", err))
		return
	}
	go func() {
		if fd >= 0 {
			defer unix.Close(fd)
		}
		for exited := err == unix.ESRCH; !exited; {
			n, perr := unix.Poll([]unix.PollFd{{Fd: int32(fd), Events: unix.POLLIN}}, 1000)
			switch {
			case perr != nil && perr != unix.EINTR:
				unwatch(fmt.Errorf("poll: %w", perr))
				return
			case n > 0:
				exited = true
			case d.ownerGone(pid):
				return
			}
		}
		r.mu.Lock()
		delete(r.watched, pid)
		r.mu.Unlock()
		for _, es := range d.engines.ownedBy(pid) {
			_ = d.dropEngineSegment(es, 30*time.Second, "the process that opened it exited")
		}
		for _, name := range r.ownedBy(pid) {
			if _, err := r.removeRegion(name); err == nil {
				d.log.Info().Str("region", name).Int32("pid", pid).Msg("region unregistered: the process that lent it for Mooncake peers exited")
			}
		}
	}()
}

// ownerGone says whether pid has no engine segment and lent no open
// region any more, or ferryd is stopping; then pid is no longer watched.
func (d *Daemon) ownerGone(pid int32) bool {
	segments := len(d.engines.ownedBy(pid))
	r := d.reg
	r.mu.Lock()
	defer r.mu.Unlock()
	if !r.stopping {
		if segments > 0 {
			return false
		}
		for _, g := range r.regions {
			if g.owner == pid && !g.closing {
				return false
			}
		}
	}
	delete(r.watched, pid)
	return true
}
