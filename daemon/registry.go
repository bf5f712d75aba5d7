package daemon

import (
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"math/big"
	"sort"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ferry-project/ferry/api"
	"github.com/ferry-project/ferry/arena"
	"github.com/ferry-project/ferry/internal/size"
	"github.com/ferry-project/ferry/transport"
)

// entryState is where a staged entry is in its life.
type entryState int

const (
	reserved  entryState = iota // zero-copy slice handed out, not committed
	uploading                   // bytes being copied in from a PUT body
	staged                      // ready to send
	sending                     // a send owns it; delete and sweep wait
)

func (s entryState) String() string {
	return [...]string{"reserved", "uploading", "staged", "sending"}[s]
}

// entry is one req_id on the sending side.
type entry struct {
	reqID  string
	state  entryState
	slice  arena.Slice
	region *region // a device arena other than the first (see arenas.go), or nil
	shape  []int64
	dtype  string
	nbytes int64
	since  time.Time
}

// slot is one receive slot on the receiving side. Its memory goes back to
// the arena only when it is freed and no write or read still holds it
// (pins), so a late write can never land in a newer slot at the same
// address; with a quarantine set, only that long after that.
type slot struct {
	reqID    string
	slice    arena.Slice
	addr     uint64
	key      transport.Key
	window   transport.Window // the memory window over it (rdma's windows mode): its rail and rkey; rkey 0: none
	mooncake bool             // Mooncake peers, who carry no key, may write into it
	nbytes   int64
	since    time.Time
	pins     int // writes landing and reads in progress
	writes   int // writes landing
	waiters  int // waits in flight for its data (GET ?wait=)
	arrived  bool
	received int64
	tag      uint32
	freed    bool
	copyErr  error // the last write arrived but did not reach GPU memory
	pieces   spans // the ranges writes have filled so far

	// region, when set, holds the slot at regionOff instead of the arena.
	region    *region
	regionOff int64

	// filled: writes covering every byte have landed; the slot arrives
	// (with fillTag) once no write to it is still in flight, so a reader
	// never meets bytes a duplicate is rewriting.
	filled  bool
	fillTag uint32
}

// registry holds the staged entries and receive slots over one arena. It is
// the transports' Sink.
type registry struct {
	arena  *arena.Arena
	device string // the first arena's device ("cpu", "cuda:0"); the others' are regions (arenas.go)

	mu      sync.Mutex
	entries map[string]*entry
	slots   map[string]*slot
	byKey   map[transport.Key]*slot
	byTag   map[uint32]*slot // the tags writes carry name one live slot each
	// unkeyed is the live slots made for Mooncake writers, by address:
	// the only ones a write without a key may land in.
	unkeyed *slotIndex
	// pool, when set, is the Mooncake pool (mooncakepool.go): slots
	// made with mooncake come from it, and nothing else.
	pool     *mooncakePool
	regions  map[string]*region
	changed  chan struct{} // closed and replaced on every change
	stopping bool

	// discarded, if set, hears of a write that finished landing in a slot
	// freed meanwhile: its sender was told it completed. Called with mu held.
	discarded func(reqID string, nbytes uint64)
	// arrived, if set, hears of each slot whose data arrived. Called
	// with mu held.
	arrived func(reqID string, nbytes int64)
	// onRefusal, if set, counts each write refused, by code. Called with
	// or without mu held.
	onRefusal func(transport.Code)

	// quarantine, when above zero, holds a freed slot's memory back from
	// the arena that long after its last pin goes (held: those slots, with
	// their timers' Stop). One-sided writes (a Mooncake RDMA sender's) raise
	// no event and take no pin, so only time keeps a late one out of
	// memory handed out anew. Until then the arena counts it as used.
	quarantine time.Duration
	held       map[*slot]func() bool
	afterFunc  func(time.Duration, func()) func() bool // time.AfterFunc; tests fire it by hand

	// windows, when set, puts a NIC-enforced window over each arena slot
	// and each slot in a region the NIC registered (rdma's windows
	// mode): opened as the slot is made, closed before its memory goes
	// back. windowLost, if set, hears of a window that
	// could not be closed: its slot's memory stays out of use. Called
	// with mu held.
	windows    transport.Windows
	windowLost func(reqID string, err error)

	// registrar registers regions with the NIC (rdma), or is nil (TCP);
	// set before the control API serves. regionNICLost, if set, hears
	// of a region whose registration could not be dropped. Called
	// without mu.
	registrar     transport.RegionRegistrar
	regionNICLost func(name string, err error)
	// ended is the closing regions whose last use ended while mu was
	// held: unlock ends them once it is released. ending counts those
	// being ended on goroutines of their own (waitEnds).
	ended  []*region
	ending sync.WaitGroup
	// claims is the regions being mapped and registered, by name
	// (regionClaim). hostLimit bounds the host memory regions and
	// claims hold at once (max_region_bytes; zero: no bound); set
	// before the control API serves.
	claims    map[string]*regionClaim
	hostLimit hostLimit

	// mooncakeRegions counts the open regions Mooncake peers write into
	// (api.RegionRequest.MooncakeAddr): with none, a write without a key
	// that no slot holds is refused without mu.
	mooncakeRegions atomic.Int32
	// engineKeys names the engine segments ferry peers write into by
	// key (engines.go): key -> segment id.
	engineKeys map[transport.Key]string
	// watched is the processes whose regions for Mooncake peers go when
	// they exit (watchOwner).
	watched map[int32]bool
}

// hostLimit is max_region_bytes: as written, what a share is of, and in
// bytes on this host.
type hostLimit struct {
	setting string // "512GiB", "75%"
	of      string // a share's base: "physical memory (1TiB)"; "" for a size
	bytes   int64
}

// String says the limit in refusals: "512GiB (549755813888 bytes)", or
// "75% of physical memory (1TiB), 768GiB (824633720832 bytes)".
func (l hostLimit) String() string {
	if l.of == "" {
		return fmt.Sprintf("%s (%d bytes)", l.setting, l.bytes)
	}
	return fmt.Sprintf("%s of %s, %s (%d bytes)", l.setting, l.of, size.Format(l.bytes), l.bytes)
}

var _ transport.WindowSink = (*registry)(nil)

// UseWindows implements transport.WindowSink.
func (r *registry) UseWindows(w transport.Windows) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.windows = w
}

// mooncakeQuarantine is the quarantine while Mooncake peers may write over
// RDMA, or ferry peers may write directly (rdma's arena-rkey mode), which
// nothing pins either. ferry cannot see when their last WRITE is placed, and io_timeout
// bounds only ferry's own reads and writes, not a Mooncake sender's; 30 s
// is far past the RC retry window of the queue pairs ferry connects for
// Mooncake (timeout 14, 7 retries: about half a second per WRITE) and
// leaves a sender whose batch was queued behind others time to post it.
const mooncakeQuarantine = 30 * time.Second

func newRegistry(a *arena.Arena) *registry {
	return &registry{
		arena:   a,
		entries: make(map[string]*entry),
		slots:   make(map[string]*slot),
		byKey:   make(map[transport.Key]*slot),
		byTag:   make(map[uint32]*slot),
		unkeyed: newSlotIndex(),
		regions: make(map[string]*region),
		claims:  make(map[string]*regionClaim),
		changed: make(chan struct{}),
		held:    make(map[*slot]func() bool),
		afterFunc: func(d time.Duration, f func()) func() bool {
			return time.AfterFunc(d, f).Stop
		},
	}
}

// quarantineFreedSlots makes every receive slot freed from now on keep its
// memory out of use for d after its last pin goes.
func (r *registry) quarantineFreedSlots(d time.Duration) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.quarantine = d
}

// notify wakes every waiter; callers hold mu.
func (r *registry) notify() {
	close(r.changed)
	r.changed = make(chan struct{})
}

// alloc takes arena memory, turning the allocator's refusal into the API's
// 413 (can never fit) or 507 (does not fit now).
func (r *registry) alloc(g *region, reqID string, n int64) (arena.Slice, error) {
	a := r.arenaOf(g)
	s, err := a.Alloc(n)
	return placed(a, reqID, n, s, err)
}

// allocUnguessable allocates n bytes at a random place (a slot Mooncake
// peers write into by its address alone), in the Mooncake pool when
// there is one: the segment descriptor publishes the arena's base (or
// the pool's), and a best-fit place is the first guess of anyone who
// reads it.
func (r *registry) allocUnguessable(reqID string, n int64) (arena.Slice, error) {
	if r.pool != nil {
		return r.allocPooled(reqID, n)
	}
	s, err := r.arena.AllocRandom(n, randUint64N)
	return placed(r.arena, reqID, n, s, err)
}

// randUint64N is a uniform random integer in [0, k), from the system's
// cryptographic source.
func randUint64N(k uint64) uint64 {
	v, err := rand.Int(rand.Reader, new(big.Int).SetUint64(k))
	if err != nil {
		panic(fmt.Sprintf("ferryd: the system's random source failed: %v", err))
	}
	return v.Uint64()
}

// placed is alloc's answer for an allocation of n bytes that returned s
// and err: the error turned into what the client should do.
func placed(a *arena.Arena, reqID string, n int64, s arena.Slice, err error) (arena.Slice, error) {
	if err == nil {
		return s, nil
	}
	if errors.Is(err, arena.ErrNoSpace) {
		st := a.Stats()
		if n > st.Size {
			return s, apiErr(api.CodeTooLarge,
				"%s: %d bytes is larger than the whole arena (%d bytes): raise --arena-size", reqID, n, st.Size)
		}
		return s, apiErr(api.CodeArenaFull,
			"%s: %v; free staged entries or receive slots you no longer need, or raise --arena-size", reqID, err)
	}
	return s, err
}

// scratch allocates n bytes of the arena that no entry or slot names:
// an inline write's body (POST /v1/writes), for the request's length.
func (r *registry) scratch(n int64) (arena.Slice, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.stopping {
		return arena.Slice{}, errStopping
	}
	return r.alloc(nil, "write", n)
}

func (r *registry) freeScratch(s arena.Slice) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.free(nil, s)
}

func (r *registry) free(g *region, s arena.Slice) {
	// A failure here is a bookkeeping bug, never the client's doing.
	var err error
	if g == nil && r.pooled(s) {
		_, err = r.pool.alloc.Free(s.Offset - r.pool.slice.Offset)
	} else {
		err = r.arenaOf(g).Free(s)
	}
	if err != nil {
		panic(fmt.Sprintf("ferryd: arena bookkeeping broken: %v", err))
	}
}

// --- sending side ---

func (r *registry) exists(reqID string) error {
	if e, ok := r.entries[reqID]; ok {
		return apiErr(api.CodeExists,
			"req_id %s is already %s: DELETE /v1/embeddings/%s first or use another req_id", reqID, e.state, reqID)
	}
	return nil
}

// reserveOn creates an entry in state st with n bytes of g's arena
// (nil: the first device's).
func (r *registry) reserveOn(g *region, reqID string, n int64, shape []int64, dtype string, st entryState) (*entry, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.stopping {
		return nil, errStopping
	}
	if err := r.exists(reqID); err != nil {
		return nil, err
	}
	s, err := r.alloc(g, reqID, n)
	if err != nil {
		return nil, err
	}
	e := &entry{reqID: reqID, state: st, slice: s, region: g, shape: shape, dtype: dtype, nbytes: n, since: time.Now()}
	r.entries[reqID] = e
	return e, nil
}

// finishUpload makes an uploaded entry sendable, or drops it when the
// upload failed.
func (r *registry) finishUpload(e *entry, ok bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if ok {
		e.state = staged
		e.since = time.Now()
	} else {
		delete(r.entries, e.reqID)
		r.free(e.region, e.slice)
	}
	r.notify()
}

// commit seals a reserved zero-copy slice with its shape and dtype.
func (r *registry) commit(reqID string, shape []int64, dtype string) (*entry, error) {
	n, canon, err := api.NBytes(shape, dtype)
	if err != nil {
		return nil, apiErr(api.CodeBadRequest, "%s: %v", reqID, err)
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	e, ok := r.entries[reqID]
	if !ok {
		return nil, apiErr(api.CodeNoEmbedding,
			"no slice reserved for req_id %s: POST /v1/embeddings/%s/slice first", reqID, reqID)
	}
	if e.state != reserved {
		return nil, apiErr(api.CodeExists, "req_id %s is already %s, not a reserved slice", reqID, e.state)
	}
	if n != e.nbytes {
		return nil, apiErr(api.CodeBadRequest,
			"%s: shape %s %s is %d bytes but the reserved slice is %d bytes", reqID, api.ShapeString(shape), canon, n, e.nbytes)
	}
	e.shape, e.dtype, e.state, e.since = shape, canon, staged, time.Now()
	r.notify()
	return e, nil
}

// takeForSend waits up to wait for reqID to be staged and claims it for a
// send. The race the first seed lost (send before stage) is a wait here,
// then a no_embedding error naming the req_id.
// onWait runs once, when the send starts waiting.
func (r *registry) takeForSend(ctx context.Context, reqID string, wait time.Duration, onWait func()) (*entry, error) {
	deadline := time.NewTimer(wait)
	defer deadline.Stop()
	for first := true; ; first = false {
		r.mu.Lock()
		if r.stopping {
			r.mu.Unlock()
			return nil, errStopping
		}
		e, ok := r.entries[reqID]
		if ok && e.state == staged {
			e.state = sending
			r.mu.Unlock()
			return e, nil
		}
		if ok && e.state == sending {
			r.mu.Unlock()
			return nil, apiErr(api.CodeBusy, "req_id %s is already being sent: wait for that send to finish", reqID)
		}
		changed := r.changed
		r.mu.Unlock()
		if first && wait > 0 {
			onWait()
		}

		select {
		case <-changed:
			continue
		case <-ctx.Done():
		case <-deadline.C:
		}
		what := "nothing is staged under it"
		if ok {
			what = fmt.Sprintf("it is still %s (not committed)", e.state)
		}
		return nil, apiErr(api.CodeNoEmbedding,
			"no embedding staged for req_id %s after waiting %s: %s; stage it (PUT /v1/embeddings/%s or slice+commit) before sending, or pass wait_ms to cover a stage that races the send",
			reqID, wait, what, reqID)
	}
}

// finishSend frees a sent entry, or keeps it staged for a retry.
func (r *registry) finishSend(e *entry, sent bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if sent {
		delete(r.entries, e.reqID)
		r.free(e.region, e.slice)
	} else {
		e.state = staged
	}
	r.notify()
}

func (r *registry) deleteEntry(reqID string) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	e, ok := r.entries[reqID]
	if !ok {
		return apiErr(api.CodeNoEmbedding, "no embedding staged for req_id %s", reqID)
	}
	if e.state == sending || e.state == uploading {
		return apiErr(api.CodeBusy, "req_id %s is %s: delete it once that finishes", reqID, e.state)
	}
	delete(r.entries, reqID)
	r.free(e.region, e.slice)
	r.notify()
	return nil
}

func (r *registry) describe(e *entry) api.Embedding {
	return api.Embedding{
		ReqID: e.reqID, State: e.state.String(), Shape: e.shape, DType: e.dtype,
		NBytes: e.nbytes, Device: r.deviceOf(e.region), Offset: e.slice.Offset, Since: e.since,
	}
}

func (r *registry) embedding(reqID string) (api.Embedding, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	e, ok := r.entries[reqID]
	if !ok {
		return api.Embedding{}, apiErr(api.CodeNoEmbedding, "no embedding staged for req_id %s", reqID)
	}
	return r.describe(e), nil
}

func (r *registry) embeddings() []api.Embedding {
	r.mu.Lock()
	defer r.mu.Unlock()
	out := make([]api.Embedding, 0, len(r.entries))
	for _, e := range r.entries {
		out = append(out, r.describe(e))
	}
	sort.Slice(out, func(i, j int) bool { return out[i].ReqID < out[j].ReqID })
	return out
}

// --- receiving side ---

// newSlotOn allocates a receive slot in g's arena (nil: the first
// device's) with a fresh random key whose tag no live slot uses. Only a
// slot made with mooncake (in the first arena, which the Mooncake
// segment publishes) takes unkeyed writes.
func (r *registry) newSlotOn(g *region, reqID string, n int64, mooncake bool) (*slot, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if err := r.mayAddSlot(reqID); err != nil {
		return nil, err
	}
	var sl arena.Slice
	var err error
	if mooncake {
		sl, err = r.allocUnguessable(reqID, n)
	} else {
		sl, err = r.alloc(g, reqID, n)
	}
	if err != nil {
		return nil, err
	}
	s := &slot{reqID: reqID, slice: sl, addr: r.arenaOf(g).Addr(sl), mooncake: mooncake, nbytes: n}
	if g != nil {
		s.region, s.regionOff = g, sl.Offset
	}
	// A device arena the NIC did not register is reached as such a
	// region is: through staging, with no window.
	if r.windows != nil && (g == nil || g.nic != nil) {
		if err := r.openWindow(s); err != nil {
			r.free(g, sl)
			return nil, err
		}
	} else if g != nil {
		// No window: the key names the NIC nearest the device all the
		// same, where the sender's lane goes (docs/rdma.md, "Rails").
		s.window.Rail = g.rail
	}
	if g != nil {
		g.uses++
		g.slots++
	}
	return r.addSlot(s), nil
}

// openWindow puts a window over s's bytes; callers hold mu.
func (r *registry) openWindow(s *slot) (err error) {
	if s.window, err = r.windows.Open(s.addr, uint64(s.nbytes)); err != nil {
		return apiErr(api.CodeInternal, "%s: the NIC could not put a memory window over the receive slot: %v", s.reqID, err)
	}
	return nil
}

// newSlotIn makes a receive slot of n bytes at offset off of a registered
// region: writes land in the client's own memory. It may not overlap a
// live slot of that region.
func (r *registry) newSlotIn(reqID string, n int64, name string, off int64) (*slot, error) {
	r.mu.Lock()
	defer r.unlock()
	if err := r.mayAddSlot(reqID); err != nil {
		return nil, err
	}
	g, err := r.useRegion(name, reqID)
	if err != nil {
		return nil, err
	}
	size := g.size()
	if off < 0 || n > size || off > size-n {
		r.unuseRegion(g)
		return nil, apiErr(api.CodeBadRequest, "%s: %d bytes at region_offset %d do not fit region %s (%d bytes)", reqID, n, off, name, size)
	}
	overlaps := func(o *slot) bool { return off < o.regionOff+o.nbytes && o.regionOff < off+n }
	for _, o := range r.slots {
		if o.region == g && overlaps(o) {
			r.unuseRegion(g)
			return nil, apiErr(api.CodeBadRequest, "%s: bytes %d..%d of region %s overlap the live receive slot of req_id %s (%d..%d): free it first, or place this one elsewhere",
				reqID, off, off+n, name, o.reqID, o.regionOff, o.regionOff+o.nbytes)
		}
	}
	for o := range g.freed {
		if overlaps(o) {
			// Region memory is its client's: nothing holds it back for
			// a freed slot's late writes, as the arena's allocator does.
			r.unuseRegion(g)
			return nil, apiErr(api.CodeBusy, "%s: bytes %d..%d of region %s overlap the freed receive slot of req_id %s (%d..%d), which %d write(s) still land in: retry once they end (io_timeout at most), or place this one elsewhere",
				reqID, off, off+n, name, o.reqID, o.regionOff, o.regionOff+o.nbytes, o.writes)
		}
	}
	s := &slot{reqID: reqID, region: g, regionOff: off, addr: g.addr() + uint64(off), nbytes: n}
	// A region the NIC registered (host or CUDA) is reached through
	// windows like the arena; one it did not takes granted writes
	// through staging buffers (a CUDA region's through the bounce area).
	if r.windows != nil && g.nic != nil {
		if err := r.openWindow(s); err != nil {
			r.unuseRegion(g)
			return nil, err
		}
	}
	g.slots++
	return r.addSlot(s), nil
}

// mayAddSlot checks a new slot's req_id; callers hold mu.
func (r *registry) mayAddSlot(reqID string) error {
	if r.stopping {
		return errStopping
	}
	if _, ok := r.slots[reqID]; ok {
		return apiErr(api.CodeExists,
			"a receive slot for req_id %s already exists: DELETE /v1/receives/%s first or use another req_id", reqID, reqID)
	}
	return nil
}

// addSlot gives s a fresh key whose tag no live slot uses and enters it
// in the tables; callers hold mu.
func (r *registry) addSlot(s *slot) *slot {
	key := transport.NewKey()
	for key.Tag() == 0 || r.byTag[key.Tag()] != nil {
		key = transport.NewKey()
	}
	key = key.WithWindowOn(s.window)
	s.key, s.since = key, time.Now()
	r.slots[s.reqID] = s
	r.byKey[key] = s
	r.byTag[key.Tag()] = s
	if s.mooncake {
		r.unkeyed.add(s)
	}
	return s
}

// Accept implements transport.Sink. A key that is no live slot's, or an
// address outside the slot it names, is one refusal that tells a
// guessing peer nothing about the slots there are.
func (r *registry) Accept(addr, n uint64, key transport.Key, tag uint32) ([]byte, func(error), error) {
	// One piece of all n bytes (land refuses none): lent with no copy,
	// copied in by done.
	body, done, err := r.acceptKeyed(addr, n, key, tag, int64(n))
	if err != nil {
		return nil, nil, err
	}
	dst, err := body()
	if err != nil {
		done(err)
		return nil, nil, err
	}
	return dst, done, nil
}

// AcceptChunks implements transport.ChunkSink: a write into memory the
// host cannot address takes stageChunk bytes of host staging at most.
func (r *registry) AcceptChunks(addr, n uint64, key transport.Key, tag uint32) (transport.Body, func(error), error) {
	return r.acceptKeyed(addr, n, key, tag, stageChunk)
}

func (r *registry) acceptKeyed(addr, n uint64, key transport.Key, tag uint32, chunk int64) (transport.Body, func(error), error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	s := r.byKey[key]
	if r.closedTo(s) {
		return nil, nil, errRefuseStopping
	}
	if segment, ok := r.engineKeys[key]; ok && s == nil {
		return r.landInRegions(segment, addr, n, chunk) // a ferry peer's write into engine memory
	}
	if s == nil || addr < s.addr || addr >= s.addr+uint64(s.nbytes) {
		r.refused(transport.NoSlot)
		return nil, nil, errRefuseNoSlot
	}
	return r.land(s, addr, n, tag, chunk)
}

// AcceptInPlace implements transport.InPlaceSink: rdma places a write
// into GPU memory it registered itself, where the write is addressed:
// the arena, or a CUDA region it registered. A slot in any other region
// is refused: the NIC does not reach its memory.
func (r *registry) AcceptInPlace(addr, n uint64, key transport.Key, tag uint32) (func(error), error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	s := r.byKey[key]
	if r.closedTo(s) {
		return nil, errRefuseStopping
	}
	if s == nil || addr < s.addr || addr >= s.addr+uint64(s.nbytes) {
		r.refused(transport.NoSlot)
		return nil, errRefuseNoSlot
	}
	if s.region != nil && !s.region.inPlace() {
		r.refused(transport.OutOfBounds)
		return nil, &transport.Refusal{Code: transport.OutOfBounds,
			Message: fmt.Sprintf("the receive slot of req_id %s lies in region %s, outside the GPU memory the NIC writes into", s.reqID, s.region.name)}
	}
	_, done, err := r.land(s, addr, n, tag, 0)
	return done, err
}

// AcceptUnkeyed takes a write that carries no key (a Mooncake peer's):
// it must lie inside one live receive slot made for Mooncake writers,
// found by its address, or inside memory a Mooncake engine registered
// (regions with a mooncake_addr, landInRegions). Such writes may fill a slot piece by piece; the
// slot arrives when its last byte has. The data port reads them off a
// stream, stageChunk bytes of host staging at a time at most.
func (r *registry) AcceptUnkeyed(addr, n uint64) (transport.Body, func(error), error) {
	// A write that matches no slot is refused without the registry's
	// lock, which strangers' guesses would otherwise hold from the
	// control API; one that does is looked up again under it, as its
	// slot may have gone meanwhile.
	if r.unkeyed.at(addr) == nil && r.mooncakeRegions.Load() == 0 {
		return nil, nil, r.refuseUnkeyed(addr)
	}
	r.mu.Lock()
	defer r.unlock()
	s := r.unkeyed.at(addr)
	if r.closedTo(s) { // a wait in flight at the drain's start still takes its write
		return nil, nil, errRefuseStopping
	}
	if s != nil {
		return r.land(s, addr, n, s.key.Tag(), stageChunk)
	}
	if r.mooncakeRegionAt("", addr) != nil {
		return r.landInRegions("", addr, n, stageChunk)
	}
	return nil, nil, r.refuseUnkeyed(addr)
}

// refuseUnkeyed counts and explains a write without a key that no live
// Mooncake slot holds.
func (r *registry) refuseUnkeyed(addr uint64) error {
	r.refused(transport.NoSlot)
	return &transport.Refusal{Code: transport.NoSlot,
		Message: fmt.Sprintf("no live receive slot open to Mooncake writers, nor memory a Mooncake engine registered, at address %#x: it was freed or unregistered, timed out, made without \"mooncake\": true, or the receiver restarted; ask the receiver for a new slot or address", addr)}
}

var (
	errRefuseStopping = &transport.Refusal{Code: transport.ShuttingDown, Message: "the receiving ferryd is shutting down"}
	errRefuseNoSlot   = &transport.Refusal{Code: transport.NoSlot,
		Message: "no live receive slot here matches this address and key: it was freed, timed out, or the receiver restarted; ask the receiver for a new slot"}
)

// refused counts a refusal by its code.
func (r *registry) refused(code transport.Code) {
	if r.onRefusal != nil {
		r.onRefusal(code)
	}
}

// Arrived implements transport.DirectSink: a send from an authenticated
// peer landed in the arena without asking (rdma's arena-rkey mode), its
// completion naming the slot by tag and saying how many bytes it placed,
// all of the slot's or it is refused. Nothing pins the slot while such a
// write flies, so a late one meets a freed slot's memory in quarantine
// (see daemon.go).
func (r *registry) Arrived(tag uint32, n uint64) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	s := r.byTag[tag]
	if r.closedTo(s) {
		return errRefuseStopping
	}
	switch {
	case s == nil:
		r.refused(transport.NoSlot)
		return &transport.Refusal{Code: transport.NoSlot,
			Message: fmt.Sprintf("no live receive slot has tag %#x: it was freed or timed out before the write's completion, or the receiver restarted", tag)}
	case s.arrived:
		r.refused(transport.SlotBusy)
		return &transport.Refusal{Code: transport.SlotBusy,
			Message: fmt.Sprintf("the receive slot of req_id %s already holds its data", s.reqID)}
	case s.region != nil && s.window.RKey == 0:
		// Its bytes are in a region, which direct writes reach only
		// through a window over the slot (windows mode), never under
		// the arena's rkey.
		r.refused(transport.OutOfBounds)
		return &transport.Refusal{Code: transport.OutOfBounds,
			Message: fmt.Sprintf("the receive slot of req_id %s lies in region %s, outside the arena a direct write lands in", s.reqID, s.region.name)}
	case n != uint64(s.nbytes):
		r.refused(transport.OutOfBounds)
		return &transport.Refusal{Code: transport.OutOfBounds,
			Message: fmt.Sprintf("a direct write of %d bytes to the receive slot of req_id %s, which has %d: not its whole content (a longer one ran past its end)", n, s.reqID, s.nbytes)}
	}
	if !s.filled {
		s.filled, s.fillTag = true, tag
	}
	if s.filled && s.writes == 0 && s.copyErr == nil && !s.arrived {
		r.arrive(s)
	}
	return nil
}

// arrive marks s arrived, whole, and tells its waiters and the event
// stream; callers hold mu.
func (r *registry) arrive(s *slot) {
	s.arrived, s.received, s.tag = true, s.nbytes, s.fillTag
	r.notify()
	if r.arrived != nil {
		r.arrived(s.reqID, s.nbytes)
	}
}

// land checks a write of n bytes at addr against s and pins s for it;
// callers hold mu. Each write that lands adds its range; the slot
// arrives once such writes have covered every byte of it, so a reader
// never gets bytes no write put there (an earlier tenant's). A write
// that fails adds nothing, but what of it reached the slot stays: where
// it overlapped a range another write had landed, those bytes are the
// failed write's (writes into one slot carry its key, so they come from
// the one sender the slot was handed to). body lends the memory the
// bytes go to: for memory the host cannot address (a GPU arena, a CUDA
// region), host staging of chunk bytes at most, each piece copied in
// when the next is asked for (the last when an empty one is; Accept's
// one piece by done); chunk 0 says the bytes land (or are) where they
// are addressed, with no memory to lend (body nil).
func (r *registry) land(s *slot, addr, n uint64, tag uint32, chunk int64) (transport.Body, func(error), error) {
	end := addr + n
	if n == 0 || addr < s.addr || end < addr || end > s.addr+uint64(s.nbytes) {
		r.refused(transport.OutOfBounds)
		return nil, nil, &transport.Refusal{Code: transport.OutOfBounds,
			Message: fmt.Sprintf("a write of %d bytes at %#x does not fit the receive slot of req_id %s (%d bytes at %#x): the slot is too small for this embedding, or the write is empty", n, addr, s.reqID, s.nbytes, s.addr)}
	}
	if s.arrived {
		r.refused(transport.SlotBusy)
		return nil, nil, &transport.Refusal{Code: transport.SlotBusy,
			Message: fmt.Sprintf("the receive slot of req_id %s already holds its data: ask the receiver for a new slot", s.reqID)}
	}
	off := addr - s.addr
	// Every write in flight may add one more range, so counting them keeps
	// the set within maxPieces.
	if s.pieces.grows(off, n) && len(s.pieces.set)+s.writes >= maxPieces {
		r.refused(transport.OutOfBounds)
		return nil, nil, &transport.Refusal{Code: transport.OutOfBounds,
			Message: fmt.Sprintf("the receive slot of req_id %s already tracks %d separate pieces, this receiver's limit: send it in fewer, larger or contiguous pieces", s.reqID, maxPieces)}
	}
	var fill *arena.Filler
	if chunk > 0 {
		mem, sl := r.memoryOf(s)
		var err error
		if fill, err = arena.NewFiller(mem, sl, int64(off), int64(n), chunk); err != nil {
			return nil, nil, r.noStaging(err, "its GPU arena")
		}
	}
	s.pins++
	s.writes++
	var placeErr error // a piece body could not copy in
	done := func(err error) {
		var cerr error
		if fill != nil {
			if err == nil {
				// What is still lent (Accept's one piece) goes in now.
				_, cerr = fill.Next()
			}
			fill.Close()
		}
		r.mu.Lock()
		defer r.unlock()
		s.writes--
		switch {
		case err == nil && !s.freed:
			s.copyErr = cerr
			if cerr == nil && !s.filled && s.pieces.add(off, n) == uint64(s.nbytes) {
				s.filled, s.fillTag = true, tag
			}
		case err == nil && s.freed && r.discarded != nil:
			r.discarded(s.reqID, n)
		case placeErr != nil && !s.freed:
			// Read but not copied in: its waiters hear it now, and no
			// word from outside completes the slot until a write lands.
			s.copyErr = placeErr
		}
		if placeErr != nil {
			r.refused(transport.Internal) // the sender is told so
		}
		// Checked on every write's end, failed ones too: the last write
		// to finish delivers the slot.
		if s.filled && s.writes == 0 && s.copyErr == nil && !s.arrived && !s.freed {
			r.arrive(s)
		}
		r.unpin(s)
	}
	if fill == nil {
		return nil, done, nil
	}
	return func() ([]byte, error) {
		piece, err := fill.Next()
		if err != nil {
			placeErr = err
			return nil, fmt.Errorf("the receiving ferryd could not copy the write's bytes into the GPU memory of the receive slot of req_id %s: %v; send it again", s.reqID, err)
		}
		return piece, nil
	}, done, nil
}

// noStaging is the refusal of a write whose staging into GPU memory
// (where) could not be lent, or err as it is: a ferryd out of host
// staging tells the sender, whose write it is, that the remedy is here.
func (r *registry) noStaging(err error, where string) error {
	if !errors.Is(err, arena.ErrNoStaging) {
		return err
	}
	r.refused(transport.Internal)
	return &transport.Refusal{Code: transport.Internal, Message: fmt.Sprintf(
		"the receiving ferryd has no host memory to stage this write into %s now: send it again once its copies in flight end (its operator may raise its --bounce-size): %v", where, err)}
}

// completeWhole takes an out-of-band word (a Mooncake notify, or the
// receiving client's POST .../complete) that every byte of s was
// written, by one-sided writes ferry cannot see: s arrives, whole, once
// no write to it is landing. Callers hold mu; completeWhole releases it.
func (r *registry) completeWhole(s *slot) error {
	if s.copyErr != nil {
		r.mu.Unlock()
		return apiErr(api.CodeInternal, "req_id %s: a write into its receive slot could not be copied into GPU memory (%v), so its bytes are not all there: the slot stays open; have the sender send again", s.reqID, s.copyErr)
	}
	// The bytes are in place already: nothing to copy in.
	_, done, err := r.land(s, s.addr, uint64(s.nbytes), s.key.Tag(), 0)
	r.mu.Unlock()
	if err != nil {
		return err
	}
	done(nil)
	return nil
}

// completeReceive is the receiving client's word that the slot of reqID
// holds its data: for a slot Mooncake senders write into with one-sided
// RDMA WRITEs and no notify (transfer_sync_write), which ferry cannot see.
func (r *registry) completeReceive(reqID string) error {
	r.mu.Lock()
	s, ok := r.slots[reqID]
	switch {
	case r.stopping:
		r.mu.Unlock()
		return errStopping
	case !ok:
		r.mu.Unlock()
		return apiErr(api.CodeNotFound, "no receive slot for req_id %s: POST /v1/receives first (it may have been freed or timed out)", reqID)
	case !s.mooncake:
		r.mu.Unlock()
		return apiErr(api.CodeBadRequest,
			"req_id %s: only a slot made with \"mooncake\": true is completed by its client; a ferry sender's write completes its slot itself", reqID)
	case s.arrived:
		r.mu.Unlock()
		return apiErr(api.CodeExists, "req_id %s: its receive slot already holds its data", reqID)
	}
	return r.completeWhole(s)
}

// unpin drops a hold on s and returns its memory once it is freed and
// unheld; callers hold mu and release it with unlock (a slot in a region
// may hold the region's last use).
func (r *registry) unpin(s *slot) {
	s.pins--
	if s.freed && s.pins == 0 {
		r.release(s)
	}
}

// release returns a freed, unheld slot's memory to the arena, after the
// quarantine if one is set; callers hold mu and release it with unlock.
// Once stopping, nothing can be allocated any more, so the memory goes
// back at once.
func (r *registry) release(s *slot) {
	if s.window.RKey != 0 {
		// Nothing lands through the window from here on; a window still
		// open keeps its memory from every newer slot, and a region
		// under it registered and mapped.
		if err := r.windows.Close(s.window); err != nil {
			if r.windowLost != nil {
				r.windowLost(s.reqID, err)
			}
			return
		}
	}
	if s.region != nil {
		delete(s.region.freed, s)
		r.unuseRegion(s.region)
		if s.region.alloc == nil {
			return // a region slot's memory is its client's
		}
	}
	if r.quarantine <= 0 || r.stopping {
		r.free(s.region, s.slice)
		return
	}
	r.held[s] = r.afterFunc(r.quarantine, func() {
		r.mu.Lock()
		defer r.mu.Unlock()
		if _, ok := r.held[s]; ok { // stop may have freed it first
			delete(r.held, s)
			r.free(s.region, s.slice)
		}
	})
}

func (r *registry) describeSlot(s *slot) api.Receive {
	d := api.Receive{
		ReceiveSlot: api.ReceiveSlot{ReqID: s.reqID, BufferAddress: s.addr, Key: s.key, NBytes: s.nbytes},
		Arrived:     s.arrived, Received: s.received, Tag: s.tag, Mooncake: s.mooncake, Offset: s.slice.Offset, Since: s.since,
		WritesInFlight: s.writes,
		Waiters:        s.waiters,
	}
	switch {
	case s.region == nil:
		d.Device = r.device
	case s.region.alloc != nil:
		d.Device = s.region.device
	default:
		d.Offset, d.Region = s.regionOff, s.region.name
	}
	return d
}

// memoryOf is the memory s lies in, and s's bytes there.
func (r *registry) memoryOf(s *slot) (arena.Memory, arena.Slice) {
	if s.region != nil {
		return s.region.mem, arena.Slice{Offset: s.regionOff, Len: s.nbytes}
	}
	return r.arena.Memory(), s.slice
}

// waitSlot waits up to wait for reqID's data to arrive. With pin, the slot
// is returned pinned, with its bytes to read (valid until release): for
// memory the host cannot address, copied out stageChunk bytes at a time.
func (r *registry) waitSlot(ctx context.Context, reqID string, wait time.Duration, pin bool) (api.Receive, *arena.Fetcher, func(), error) {
	deadline := time.NewTimer(wait)
	defer deadline.Stop()
	for {
		// Not refused while stopping: only waits already in flight get
		// here then (serveOne turns new ones away), and the drain lets
		// them wait on for their data, which writes into their slot may
		// still bring (closedTo), until drain_timeout cancels them.
		r.mu.Lock()
		s, ok := r.slots[reqID]
		if !ok {
			r.mu.Unlock()
			return api.Receive{}, nil, nil, apiErr(api.CodeNotFound,
				"no receive slot for req_id %s: POST /v1/receives first (it may have been freed or timed out)", reqID)
		}
		if s.copyErr != nil {
			err := s.copyErr
			r.mu.Unlock()
			return api.Receive{}, nil, nil, apiErr(api.CodeInternal,
				"req_id %s: its data arrived but could not be copied into GPU memory: %v; the slot is still open: have the sender send again", reqID, err)
		}
		if s.arrived || wait == 0 {
			desc := r.describeSlot(s)
			pinned := s.arrived && pin
			if pinned {
				s.pins++
			}
			r.mu.Unlock()
			if !desc.Arrived && pin {
				return desc, nil, nil, apiErr(api.CodeTimeout,
					"req_id %s: no data has arrived in its receive slot yet: pass ?wait=30s to wait for it", reqID)
			}
			if !pinned {
				return desc, nil, func() {}, nil
			}
			unpin := func() {
				r.mu.Lock()
				defer r.unlock()
				r.unpin(s)
			}
			// Lent outside the lock: for a GPU arena, host staging.
			mem, sl := r.memoryOf(s)
			data, err := arena.NewFetcher(mem, sl, 0, desc.Received, stageChunk)
			if err != nil {
				unpin()
				return desc, nil, nil, fmt.Errorf("req_id %s: reading its receive slot: %w", reqID, err)
			}
			return desc, data, func() { data.Close(); unpin() }, nil
		}
		changed := r.changed
		s.waiters++
		r.mu.Unlock()
		woken := false
		select {
		case <-changed:
			woken = true
		case <-ctx.Done():
		case <-deadline.C:
		}
		r.mu.Lock()
		s.waiters--
		r.mu.Unlock()
		if woken {
			continue
		}
		return api.Receive{}, nil, nil, apiErr(api.CodeTimeout,
			"req_id %s: nothing arrived in its receive slot within %s: check the sender, or wait again", reqID, wait)
	}
}

// removeSlot takes s out of the tables; its memory follows once unpinned.
// Callers hold mu and release it with unlock.
func (r *registry) removeSlot(s *slot) {
	delete(r.slots, s.reqID)
	delete(r.byKey, s.key)
	delete(r.byTag, s.key.Tag())
	if s.mooncake {
		r.unkeyed.remove(s)
	}
	if s.region != nil {
		s.region.slots--
		if s.region.freed == nil {
			s.region.freed = make(map[*slot]struct{})
		}
		s.region.freed[s] = struct{}{} // until release
	}
	s.freed = true
	s.pins++
	r.unpin(s)
	r.notify()
}

func (r *registry) deleteSlot(reqID string) error {
	r.mu.Lock()
	defer r.unlock()
	s, ok := r.slots[reqID]
	if !ok {
		return apiErr(api.CodeNotFound, "no receive slot for req_id %s", reqID)
	}
	r.removeSlot(s)
	return nil
}

func (r *registry) receives() []api.Receive {
	r.mu.Lock()
	defer r.mu.Unlock()
	out := make([]api.Receive, 0, len(r.slots))
	for _, s := range r.slots {
		out = append(out, r.describeSlot(s))
	}
	sort.Slice(out, func(i, j int) bool { return out[i].ReqID < out[j].ReqID })
	return out
}

// counts returns how many entries and slots are live.
func (r *registry) counts() (entries, slots int) {
	r.mu.Lock()
	defer r.mu.Unlock()
	return len(r.entries), len(r.slots)
}

// dropped is one thing the TTL sweep took away.
type dropped struct {
	kind   string // "staged" or "receive"
	reqID  string
	state  string
	nbytes int64
	age    time.Duration
}

// sweep drops entries and slots older than their TTLs. Entries being sent
// or uploaded are left alone: their owners will finish them.
func (r *registry) sweep(now time.Time, stageTTL, receiveTTL time.Duration) []dropped {
	r.mu.Lock()
	defer r.unlock()
	var out []dropped
	for id, e := range r.entries {
		if (e.state == staged || e.state == reserved) && now.Sub(e.since) > stageTTL {
			delete(r.entries, id)
			r.free(e.region, e.slice)
			out = append(out, dropped{"staged", id, e.state.String(), e.nbytes, now.Sub(e.since)})
		}
	}
	for _, s := range r.slots {
		if now.Sub(s.since) > receiveTTL {
			state := "waiting"
			if s.arrived {
				state = "arrived"
			}
			out = append(out, dropped{"receive", s.reqID, state, s.nbytes, now.Sub(s.since)})
			r.removeSlot(s)
		}
	}
	if len(out) > 0 {
		r.notify()
	}
	return out
}

// closedTo says whether a peer's write into s (nil: no slot) is refused
// for the shutdown. Once stopping, only a slot a wait in flight is waiting
// on still takes writes: the drain lets that wait finish with its data.
// Callers hold mu.
func (r *registry) closedTo(s *slot) bool {
	return r.stopping && (s == nil || s.waiters == 0)
}

// stop refuses new work from now on and wakes every waiter.
func (r *registry) stop() {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.stopping = true
	// Shutdown waits on no quarantine: no new slot can take the memory now.
	for s, stopTimer := range r.held {
		stopTimer()
		delete(r.held, s)
		r.free(s.region, s.slice)
	}
	r.notify()
}
