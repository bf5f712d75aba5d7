package daemon

import (
	"sync"

	"github.com/google/btree"
)

// slotIndex finds the live slot holding an address in O(log n): a B-tree
// of the slots' byte ranges ordered by start. The ranges it holds never
// overlap (the arena's allocator hands out disjoint slices), so the slot
// holding addr, if any, is the one starting last at or before it. A
// Mooncake write carries no key, only an address, and one that matches
// nothing (a stranger guessing, a stale slot) is refused after a lookup
// here, without the registry's lock: a scan of every slot under it made
// such writes cost O(slots) and held up the control API behind them.
//
// Its own lock guards the tree; the registry changes it under its lock
// as well, so a lookup made under the registry's lock agrees with the
// registry's tables.
type slotIndex struct {
	mu sync.RWMutex
	t  *btree.BTreeG[slotRange]
}

// slotRange is one slot's bytes, [start, end).
type slotRange struct {
	start, end uint64
	s          *slot
}

func byStart(a, b slotRange) bool { return a.start < b.start }

// indexDegree is the B-tree's degree: nodes of up to 63 ranges, a few
// cache lines each; 100k slots are 3 levels deep.
const indexDegree = 32

func newSlotIndex() *slotIndex { return &slotIndex{t: btree.NewG(indexDegree, byStart)} }

func (x *slotIndex) add(s *slot) {
	x.mu.Lock()
	defer x.mu.Unlock()
	x.t.ReplaceOrInsert(slotRange{start: s.addr, end: s.addr + uint64(s.nbytes), s: s})
}

func (x *slotIndex) remove(s *slot) {
	x.mu.Lock()
	defer x.mu.Unlock()
	x.t.Delete(slotRange{start: s.addr})
}

// at is the slot whose bytes hold addr, or nil.
func (x *slotIndex) at(addr uint64) *slot {
	x.mu.RLock()
	defer x.mu.RUnlock()
	var found *slot
	x.t.DescendLessOrEqual(slotRange{start: addr}, func(r slotRange) bool {
		if addr < r.end {
			found = r.s
		}
		return false // only the last range starting at or before addr
	})
	return found
}
