package daemon

import (
	"errors"
	"fmt"

	"github.com/ferry-project/ferry/api"
	"github.com/ferry-project/ferry/arena"
	"github.com/ferry-project/ferry/config"
)

// The Mooncake pool. Over RDMA a Mooncake peer writes one-sidedly under
// the rkey its segment's descriptor lists per buffer, and its initiators
// cache the descriptor (Mooncake's metacache), so a buffer list changing
// with every receive slot would go unseen. So when ferryd's own segment
// speaks rdma, a fixed part of the first arena (mooncake_rdma_pool) is
// taken out of the arena's allocator at start, registered with the NIC
// on its own for peers' writes (never reads), and listed as the
// segment's one buffer: receive slots made with "mooncake": true come
// from it, and nothing else is ever placed there. A Mooncake peer's
// write outside it fails at the NIC (REM_ACCESS_ERR): it never gets the
// arena's rkey. Over tcp the data port checks every write against the
// live slots (AcceptUnkeyed), and those slots come from the whole arena.

// mooncakePool is the pool: its place in the first arena, and the
// allocator of the slots in it (offsets from its start).
type mooncakePool struct {
	slice arena.Slice
	alloc *arena.Allocator
}

// poolBytes is the pool's size for the setting over an arena of size
// bytes, rounded down to the alignment; it must leave the arena room.
func poolBytes(setting config.Share, size int64) (int64, error) {
	n := setting.Bytes(size) &^ (config.ArenaAlign - 1)
	if n <= 0 || n >= size {
		return 0, fmt.Errorf("mooncake_rdma_pool %s is %d bytes of the %d-byte first arena: it must be at least %d bytes and leave the rest of the arena room; give a size or a share below 100%%, or raise arena_size",
			setting, n, size, config.ArenaAlign)
	}
	return n, nil
}

// reservePool takes n bytes of the first arena for the Mooncake pool;
// usePool puts it in use once the NIC registered it, dropPool gives it
// back when it did not.
func (r *registry) reservePool(n int64) (arena.Slice, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	sl, err := r.arena.Alloc(n)
	if err != nil {
		return sl, fmt.Errorf("mooncake_rdma_pool: %d bytes do not fit the first arena: %w", n, err)
	}
	return sl, nil
}

func (r *registry) usePool(sl arena.Slice) error {
	a, err := arena.NewAllocator(sl.Len, config.ArenaAlign)
	if err != nil {
		return err
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	r.pool = &mooncakePool{slice: sl, alloc: a}
	return nil
}

func (r *registry) dropPool(sl arena.Slice) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.free(nil, sl)
}

// allocPooled allocates n bytes at a random place in the pool (as
// allocUnguessable does in the arena); callers hold mu.
func (r *registry) allocPooled(reqID string, n int64) (arena.Slice, error) {
	p := r.pool
	off, err := p.alloc.AllocRandom(n, randUint64N)
	switch {
	case err == nil:
		return arena.Slice{Offset: p.slice.Offset + off, Len: n}, nil
	case !errors.Is(err, arena.ErrNoSpace):
		return arena.Slice{}, err
	case n > p.slice.Len:
		return arena.Slice{}, apiErr(api.CodeTooLarge,
			"%s: %d bytes is larger than the whole Mooncake pool (%d bytes), the only memory Mooncake peers write into over RDMA: raise mooncake_rdma_pool (and arena_size)", reqID, n, p.slice.Len)
	}
	return arena.Slice{}, apiErr(api.CodeArenaFull,
		"%s: the Mooncake pool, where slots made with \"mooncake\": true lie over RDMA, is full: %v; free such receive slots you no longer need, or raise mooncake_rdma_pool", reqID, err)
}

// pooled says whether s, first-arena memory, lies in the pool; callers
// hold mu.
func (r *registry) pooled(s arena.Slice) bool {
	p := r.pool
	return p != nil && s.Offset >= p.slice.Offset && s.Offset < p.slice.Offset+p.slice.Len
}

// poolStatus is the pool's place, size and use; nil without one.
func (r *registry) poolStatus() *api.MooncakePool {
	r.mu.Lock()
	p := r.pool
	r.mu.Unlock()
	if p == nil {
		return nil
	}
	st := p.alloc.Stats()
	return &api.MooncakePool{Addr: r.arena.Addr(p.slice), Size: st.Size, Used: st.Used, Free: st.Free, Slots: st.Allocations}
}
