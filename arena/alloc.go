package arena

import (
	"errors"
	"fmt"
	"sync"

	"github.com/google/btree"
)

// MinAlign is the smallest alignment an Allocator accepts: large enough for
// any DMA engine or vector load a slice is handed to.
const MinAlign = 256

var (
	// ErrNoSpace is returned (wrapped) by Alloc when no free block fits.
	ErrNoSpace = errors.New("arena full")
	// ErrNotAllocated is returned (wrapped) by Free for an offset that is not
	// the start of a live allocation.
	ErrNotAllocated = errors.New("not allocated")
)

// Stats is a snapshot of an allocator's accounting. Used+Free == Size.
type Stats struct {
	Size        int64 // bytes managed
	Used        int64 // bytes in live allocations, after rounding to the alignment
	Free        int64 // bytes in free blocks
	LargestFree int64 // size of the largest free block: the biggest Alloc that can succeed
	Allocations int   // live allocations
	FreeBlocks  int   // free blocks; no two are adjacent
}

// block is a free extent [off, off+size).
type block struct{ off, size int64 }

// Allocator hands out aligned extents of [0, size) by offset only, so the
// same allocator serves host and device memory. It is best fit with
// immediate coalescing, which keeps fragmentation low when clients stage
// tensors of very different sizes; every operation is O(log n) in the
// number of free blocks. It is safe for concurrent use.
type Allocator struct {
	size, align int64

	mu sync.Mutex
	// bySize finds the best fit: the first block at or above a size is the
	// smallest that fits, lowest offset among equals.
	bySize *btree.BTreeG[block]
	// byOff finds the neighbours of a freed extent for coalescing.
	byOff *btree.BTreeG[block]
	used  map[int64]int64 // offset -> rounded length of live allocations
	inUse int64
}

// btreeDegree trades node size against depth; 32 keeps nodes within a few
// cache lines at the depths ferry sees.
const btreeDegree = 32

// NewAllocator manages [0, size). align must be a power of two of at least
// MinAlign, and size a positive multiple of align, so that every free block
// is itself aligned and any free byte can be handed out.
func NewAllocator(size, align int64) (*Allocator, error) {
	if err := checkAlign(align); err != nil {
		return nil, err
	}
	if size <= 0 || size%align != 0 {
		return nil, fmt.Errorf("arena: size %d is not a positive multiple of the alignment %d", size, align)
	}
	a := &Allocator{
		size:  size,
		align: align,
		bySize: btree.NewG(btreeDegree, func(x, y block) bool {
			return x.size < y.size || (x.size == y.size && x.off < y.off)
		}),
		byOff: btree.NewG(btreeDegree, func(x, y block) bool { return x.off < y.off }),
		used:  make(map[int64]int64),
	}
	a.insert(block{0, size})
	return a, nil
}

func checkAlign(align int64) error {
	if align < MinAlign || align&(align-1) != 0 {
		return fmt.Errorf("arena: alignment %d is not a power of two of at least %d", align, MinAlign)
	}
	return nil
}

// Alloc reserves n bytes, rounded up to the alignment, and returns the
// offset of the first byte.
func (a *Allocator) Alloc(n int64) (int64, error) {
	return a.alloc(n, func(need int64) (fit block, off int64, ok bool) {
		a.bySize.AscendGreaterOrEqual(block{size: need}, func(b block) bool {
			fit, ok = b, true
			return false
		})
		return fit, fit.off, ok
	})
}

// AllocRandom reserves n bytes, as Alloc does, at a place nobody can
// predict: one of the places the largest free block holds side by side
// (its size over n's aligned length), picked by intn(k), a uniform
// random integer in [0, k). A slot that anyone may write into by its
// address alone (Mooncake's wire carries no key) is placed so: a
// best-fit place is the first guess of anyone who knows where the arena
// starts. A guess at one address lands in the slot with probability
// 1/k, as it would were the slot placed at any aligned offset; whole
// places keep what is left on either side a multiple of its length, so
// slots of one size still fit where best fit would have put them.
func (a *Allocator) AllocRandom(n int64, intn func(k uint64) uint64) (int64, error) {
	return a.alloc(n, func(need int64) (fit block, off int64, ok bool) {
		if fit, ok = a.bySize.Max(); !ok || fit.size < need {
			return fit, 0, false
		}
		return fit, fit.off + int64(intn(uint64(fit.size/need)))*need, true
	})
}

// alloc reserves n bytes where place puts their aligned length need: at
// off in the free block fit, which holds it, or nowhere (!ok). What is
// left of fit on either side stays free. place runs under a.mu.
func (a *Allocator) alloc(n int64, place func(need int64) (fit block, off int64, ok bool)) (int64, error) {
	if n <= 0 {
		return 0, fmt.Errorf("arena: cannot allocate %d bytes", n)
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	// Checking against size first keeps the rounding below from overflowing:
	// size is a multiple of align, so any n <= size rounds to at most size.
	if n > a.size {
		return 0, a.noSpace(n, n)
	}
	need := (n + a.align - 1) &^ (a.align - 1)
	fit, off, ok := place(need)
	if !ok {
		return 0, a.noSpace(n, need)
	}
	a.remove(fit)
	if off > fit.off {
		a.insert(block{fit.off, off - fit.off})
	}
	if end := fit.off + fit.size; end > off+need {
		a.insert(block{off + need, end - off - need})
	}
	a.used[off] = need
	a.inUse += need
	return off, nil
}

// noSpace names the numbers an operator needs to decide between a larger
// arena and smaller requests: total free versus the largest block tells
// exhaustion from fragmentation.
func (a *Allocator) noSpace(n, need int64) error {
	var largest int64
	if b, ok := a.bySize.Max(); ok {
		largest = b.size
	}
	asked := fmt.Sprintf("%d bytes", n)
	if need != n {
		asked = fmt.Sprintf("%d bytes (%d aligned)", n, need)
	}
	return fmt.Errorf("%w: need %s, %d free, largest free block %d",
		ErrNoSpace, asked, a.size-a.inUse, largest)
}

// Free releases the allocation starting at off and returns its rounded
// length. Freeing anything else leaves the allocator unchanged.
func (a *Allocator) Free(off int64) (int64, error) {
	a.mu.Lock()
	defer a.mu.Unlock()
	n, ok := a.used[off]
	if !ok {
		return 0, fmt.Errorf("arena: free of offset %d: %w", off, ErrNotAllocated)
	}
	delete(a.used, off)
	a.inUse -= n
	merged := block{off, n}
	// off itself is not in byOff (it was allocated), so the first block at
	// or below it is the left neighbour.
	a.byOff.DescendLessOrEqual(block{off: off}, func(prev block) bool {
		if prev.off+prev.size == off {
			a.remove(prev)
			merged = block{prev.off, prev.size + n}
		}
		return false
	})
	if next, ok := a.byOff.Get(block{off: off + n}); ok {
		a.remove(next)
		merged.size += next.size
	}
	a.insert(merged)
	return n, nil
}

// Size returns the rounded length of the live allocation starting at off.
func (a *Allocator) Size(off int64) (int64, bool) {
	a.mu.Lock()
	defer a.mu.Unlock()
	n, ok := a.used[off]
	return n, ok
}

// Stats returns a consistent snapshot of the accounting.
func (a *Allocator) Stats() Stats {
	a.mu.Lock()
	defer a.mu.Unlock()
	s := Stats{
		Size:        a.size,
		Used:        a.inUse,
		Free:        a.size - a.inUse,
		Allocations: len(a.used),
		FreeBlocks:  a.byOff.Len(),
	}
	if b, ok := a.bySize.Max(); ok {
		s.LargestFree = b.size
	}
	return s
}

func (a *Allocator) insert(b block) {
	a.bySize.ReplaceOrInsert(b)
	a.byOff.ReplaceOrInsert(b)
}

func (a *Allocator) remove(b block) {
	a.bySize.Delete(b)
	a.byOff.Delete(b)
}
