package arena

import (
	"cmp"
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
)

const (
	KiB = 1 << 10
	MiB = 1 << 20
)

// model mirrors an Allocator with a plain map of live allocations and
// checks it against the allocator after every operation.
type model struct {
	t           testing.TB
	a           *Allocator
	size, align int64
	live        map[int64]int64 // offset -> rounded length
	offs        []int64         // live offsets, for picking one at random
}

func newModel(t testing.TB, size, align int64) *model {
	t.Helper()
	a, err := NewAllocator(size, align)
	if err != nil {
		t.Fatal(err)
	}
	m := &model{t: t, a: a, size: size, align: align, live: map[int64]int64{}}
	m.check()
	return m
}

func (m *model) roundUp(n int64) int64 { return (n + m.align - 1) / m.align * m.align }

// gaps returns the maximal free extents between live allocations, by offset.
func (m *model) gaps() []block {
	offs := slices.Sorted(func(yield func(int64) bool) {
		for off := range m.live {
			if !yield(off) {
				return
			}
		}
	})
	var gaps []block
	var end int64
	for _, off := range offs {
		if off < end {
			m.t.Fatalf("allocation at %d overlaps the one ending at %d", off, end)
		}
		if off > end {
			gaps = append(gaps, block{end, off - end})
		}
		end = off + m.live[off]
	}
	if end > m.size {
		m.t.Fatalf("allocation ends at %d, past the size %d", end, m.size)
	}
	if end < m.size {
		gaps = append(gaps, block{end, m.size - end})
	}
	return gaps
}

// bestFit is the brute-force answer Alloc must give: the smallest gap that
// fits, lowest offset among equals.
func bestFit(gaps []block, need int64) (block, bool) {
	var best block
	found := false
	for _, g := range gaps {
		if g.size >= need && (!found || g.size < best.size) {
			best, found = g, true
		}
	}
	return best, found
}

func (m *model) alloc(n int64) {
	m.t.Helper()
	before := m.a.Stats()
	off, err := m.a.Alloc(n)
	switch {
	case n <= 0:
		if err == nil || errors.Is(err, ErrNoSpace) {
			m.t.Fatalf("Alloc(%d): got offset %d, err %v; want a non-space error", n, off, err)
		}
	case n > m.size:
		if !errors.Is(err, ErrNoSpace) {
			m.t.Fatalf("Alloc(%d) over size %d: err %v, want ErrNoSpace", n, m.size, err)
		}
	default:
		need := m.roundUp(n)
		want, ok := bestFit(m.gaps(), need)
		if !ok {
			if !errors.Is(err, ErrNoSpace) {
				m.t.Fatalf("Alloc(%d) with largest gap %d: got offset %d, err %v; want ErrNoSpace", n, before.LargestFree, off, err)
			}
			wantMsg := fmt.Sprintf("%d free, largest free block %d", before.Free, before.LargestFree)
			if !strings.Contains(err.Error(), wantMsg) || !strings.Contains(err.Error(), fmt.Sprint(n)) {
				m.t.Fatalf("Alloc(%d) error %q does not name the size asked and %q", n, err, wantMsg)
			}
			break
		}
		if err != nil {
			m.t.Fatalf("Alloc(%d): %v; gap of %d at %d fits", n, err, want.size, want.off)
		}
		if off != want.off {
			m.t.Fatalf("Alloc(%d) = %d; best fit is the %d-byte gap at %d", n, off, want.size, want.off)
		}
		if got, ok := m.a.Size(off); !ok || got != need {
			m.t.Fatalf("Size(%d) = %d, %v; want %d", off, got, ok, need)
		}
		m.live[off] = need
		m.offs = append(m.offs, off)
	}
	m.check()
}

// free frees off, which may or may not be live.
func (m *model) free(off int64) {
	m.t.Helper()
	n, err := m.a.Free(off)
	if want, ok := m.live[off]; ok {
		if err != nil || n != want {
			m.t.Fatalf("Free(%d) = %d, %v; want %d", off, n, err, want)
		}
		delete(m.live, off)
		i := slices.Index(m.offs, off)
		m.offs[i] = m.offs[len(m.offs)-1]
		m.offs = m.offs[:len(m.offs)-1]
	} else if !errors.Is(err, ErrNotAllocated) || !strings.Contains(err.Error(), fmt.Sprint(off)) {
		m.t.Fatalf("Free(%d) of a non-live offset: %d, %v; want ErrNotAllocated naming the offset", off, n, err)
	}
	m.check()
}

// check compares the allocator with the model: public accounting and the
// internal free trees, which must be exactly the maximal gaps.
func (m *model) check() {
	m.t.Helper()
	gaps := m.gaps()
	var used, largest int64
	for off, n := range m.live {
		if off%m.align != 0 {
			m.t.Fatalf("offset %d is not aligned to %d", off, m.align)
		}
		used += n
	}
	for _, g := range gaps {
		largest = max(largest, g.size)
	}
	want := Stats{Size: m.size, Used: used, Free: m.size - used, LargestFree: largest,
		Allocations: len(m.live), FreeBlocks: len(gaps)}
	if got := m.a.Stats(); got != want {
		m.t.Fatalf("Stats() = %+v, want %+v", got, want)
	}

	m.a.mu.Lock()
	defer m.a.mu.Unlock()
	var byOff, bySize []block
	var free int64
	m.a.byOff.Ascend(func(b block) bool { byOff = append(byOff, b); free += b.size; return true })
	m.a.bySize.Ascend(func(b block) bool { bySize = append(bySize, b); return true })
	if !slices.Equal(byOff, gaps) {
		m.t.Fatalf("free blocks by offset %v, want the gaps %v", byOff, gaps)
	}
	slices.SortFunc(byOff, func(x, y block) int {
		return cmp.Or(cmp.Compare(x.size, y.size), cmp.Compare(x.off, y.off))
	})
	if !slices.Equal(bySize, byOff) {
		m.t.Fatalf("free blocks by size %v, want %v", bySize, byOff)
	}
	if free != m.size-used || m.a.inUse != used {
		m.t.Fatalf("free blocks hold %d bytes and inUse is %d; want %d and %d", free, m.a.inUse, m.size-used, used)
	}
	if len(m.a.used) != len(m.live) {
		m.t.Fatalf("allocator tracks %d allocations, want %d", len(m.a.used), len(m.live))
	}
	for off, n := range m.live {
		if m.a.used[off] != n {
			m.t.Fatalf("allocator has %d bytes at %d, want %d", m.a.used[off], off, n)
		}
	}
}

// freeAll frees every live allocation in a random order and checks the
// arena is back to one free block.
func (m *model) freeAll(rng *rand.Rand) {
	m.t.Helper()
	for len(m.offs) > 0 {
		m.free(m.offs[rng.IntN(len(m.offs))])
	}
	want := Stats{Size: m.size, Free: m.size, LargestFree: m.size, FreeBlocks: 1}
	if got := m.a.Stats(); got != want {
		m.t.Fatalf("after freeing everything Stats() = %+v, want %+v", got, want)
	}
}

func TestNewAllocatorRejects(t *testing.T) {
	for _, c := range []struct{ size, align int64 }{
		{MiB, 0}, {MiB, -256}, {MiB, 128}, {MiB, 384}, {MiB, 255},
		{0, 256}, {-256, 256}, {1000, 256}, {4096 + 256, 4096},
	} {
		if _, err := NewAllocator(c.size, c.align); err == nil {
			t.Errorf("NewAllocator(%d, %d) succeeded", c.size, c.align)
		} else if !strings.Contains(err.Error(), fmt.Sprint(c.align)) {
			t.Errorf("NewAllocator(%d, %d): %q does not name the alignment", c.size, c.align, err)
		}
	}
}

func TestAllocRoundsAndRejectsNonPositive(t *testing.T) {
	m := newModel(t, MiB, 4096)
	for _, n := range []int64{0, -1, -4096} {
		m.alloc(n)
	}
	for _, n := range []int64{1, 4095, 4096, 4097, 3 * 4096} {
		m.alloc(n)
	}
	if got := m.a.Stats().Used; got != 4096+4096+4096+8192+3*4096 {
		t.Errorf("Used = %d after allocating 1, 4095, 4096, 4097 and 12288 bytes at 4096 alignment", got)
	}
	if _, ok := m.a.Size(1); ok {
		t.Error("Size(1) reports an allocation inside another")
	}
}

func TestBestFitPicksSmallestHole(t *testing.T) {
	a, err := NewAllocator(64*KiB, 256)
	if err != nil {
		t.Fatal(err)
	}
	// Layout: [big hole 4 KiB][pin][small hole 1 KiB][pin][rest].
	var offs []int64
	for _, n := range []int64{4 * KiB, 256, KiB, 256} {
		off, err := a.Alloc(n)
		if err != nil {
			t.Fatal(err)
		}
		offs = append(offs, off)
	}
	for _, i := range []int{0, 2} {
		if _, err := a.Free(offs[i]); err != nil {
			t.Fatal(err)
		}
	}
	off, err := a.Alloc(700)
	if err != nil {
		t.Fatal(err)
	}
	if off != offs[2] {
		t.Errorf("Alloc(700) = %d; want the 1 KiB hole at %d, not the 4 KiB hole at %d or the tail", off, offs[2], offs[0])
	}
	if s := a.Stats(); s.FreeBlocks != 3 || s.LargestFree != 64*KiB-5*KiB-512 {
		t.Errorf("Stats() = %+v; the big hole and the tail must be untouched", s)
	}
}

func TestBestFitLowestOffsetOnTie(t *testing.T) {
	a, err := NewAllocator(16*KiB, 256)
	if err != nil {
		t.Fatal(err)
	}
	var offs []int64
	for range 6 {
		off, err := a.Alloc(KiB)
		if err != nil {
			t.Fatal(err)
		}
		offs = append(offs, off)
	}
	// Two equal holes; free the higher one first so tree order is not insertion order.
	for _, i := range []int{3, 1} {
		if _, err := a.Free(offs[i]); err != nil {
			t.Fatal(err)
		}
	}
	if off, err := a.Alloc(KiB); err != nil || off != offs[1] {
		t.Errorf("Alloc(1 KiB) = %d, %v; want the lower hole at %d", off, err, offs[1])
	}
}

func TestNoSpaceMessage(t *testing.T) {
	a, err := NewAllocator(6*MiB, 256)
	if err != nil {
		t.Fatal(err)
	}
	var offs []int64
	for range 6 {
		off, err := a.Alloc(MiB)
		if err != nil {
			t.Fatal(err)
		}
		offs = append(offs, off)
	}
	for _, i := range []int{0, 2, 4} {
		if _, err := a.Free(offs[i]); err != nil {
			t.Fatal(err)
		}
	}
	for _, c := range []struct {
		n    int64
		want string
	}{
		{4 * MiB, "arena full: need 4194304 bytes, 3145728 free, largest free block 1048576"},
		{MiB + 1, "arena full: need 1048577 bytes (1048832 aligned), 3145728 free, largest free block 1048576"},
		{7 * MiB, "arena full: need 7340032 bytes, 3145728 free, largest free block 1048576"},
	} {
		_, err := a.Alloc(c.n)
		if !errors.Is(err, ErrNoSpace) || err.Error() != c.want {
			t.Errorf("Alloc(%d) error = %v, want %q", c.n, err, c.want)
		}
	}
}

func TestFreeErrorsLeaveStateAlone(t *testing.T) {
	m := newModel(t, MiB, 256)
	m.alloc(1000)
	m.alloc(5000)
	second := m.offs[1]
	m.free(second + 256) // inside an allocation
	m.free(MiB)          // past the end
	m.free(-256)
	m.free(second)
	m.free(second) // double free
	_, err := m.a.Free(second)
	if want := fmt.Sprintf("arena: free of offset %d: not allocated", second); err == nil || err.Error() != want {
		t.Errorf("double Free error = %v, want %q", err, want)
	}
}

// TestAllocatorRandom runs thousands of random operation sequences against
// the brute-force model: placement must be exactly best fit, and the free
// blocks exactly the maximal gaps (complete coalescing).
func TestAllocatorRandom(t *testing.T) {
	sequences, ops := 1500, 150
	if testing.Short() {
		sequences = 200
	}
	for seq := range sequences {
		rng := rand.New(rand.NewPCG(uint64(seq), 0xfe77))
		align := int64(256) << rng.IntN(5)
		size := align * int64(1+rng.IntN(16*MiB/int(align)))
		m := newModel(t, size, align)
		var freed []int64
		for range ops {
			switch r := rng.IntN(100); {
			case r < 35 && len(m.offs) > 0:
				off := m.offs[rng.IntN(len(m.offs))]
				m.free(off)
				freed = append(freed, off)
			case r < 40 && len(freed) > 0:
				m.free(freed[rng.IntN(len(freed))]) // double free, unless reused since
			case r < 42:
				m.free(rng.Int64N(size + align)) // mostly not an allocation start
			default:
				m.alloc(randomSize(rng, size, align, m.a.Stats().LargestFree))
			}
		}
		m.freeAll(rng)
		if t.Failed() {
			t.Fatalf("sequence %d (align %d, size %d) failed", seq, align, size)
		}
	}
}

// randomSize mixes the sizes that stress an allocator: tiny, arbitrary up
// to a few MiB, exact multiples of the alignment, exactly the largest free
// block, just over it, and more than the whole arena.
func randomSize(rng *rand.Rand, size, align, largest int64) int64 {
	switch rng.IntN(10) {
	case 0, 1:
		return 1 + rng.Int64N(2*align)
	case 2, 3, 4:
		return 1 + rng.Int64N(4*MiB)
	case 5, 6:
		return align * (1 + rng.Int64N(64))
	case 7:
		return max(largest, 1)
	case 8:
		return largest + 1
	default:
		return size + 1 + rng.Int64N(size)
	}
}

// FuzzAllocator decodes the input into operations: the first byte picks
// the alignment, then each 3-byte group is one op (op, then 16 bits).
func FuzzAllocator(f *testing.F) {
	// The mutator grows inputs to megabytes; past a few hundred ops on a
	// 48-unit arena longer inputs only slow each run down.
	const maxOps = 1000
	f.Fuzz(func(t *testing.T, data []byte) {
		if len(data) == 0 {
			return
		}
		data = data[:min(len(data), 1+3*maxOps)]
		align := int64(256) << (data[0] % 4)
		size := 48 * align
		m := newModel(t, size, align)
		for data = data[1:]; len(data) >= 3; data = data[3:] {
			v := int64(data[1])<<8 | int64(data[2])
			switch data[0] % 4 {
			case 0:
				if len(m.offs) > 0 {
					m.free(m.offs[int(v)%len(m.offs)])
				}
			case 1:
				m.free(v * align / 256) // any offset, aligned or not
			default:
				// Up to 64 units: enough to overflow the 48-unit arena.
				m.alloc(v * align / 1024)
			}
		}
		m.freeAll(rand.New(rand.NewPCG(uint64(len(m.offs)), 1)))
	})
}

// TestAllocatorConcurrent hammers one allocator from several goroutines.
// Each claims the alignment units of its allocations with a CAS, so two
// live allocations sharing a byte are caught the moment they happen.
func TestAllocatorConcurrent(t *testing.T) {
	const (
		size       = 4 * MiB
		align      = 256
		goroutines = 8
		ops        = 2000
	)
	a, err := NewAllocator(size, align)
	if err != nil {
		t.Fatal(err)
	}
	owner := make([]atomic.Int32, size/align)
	claim := func(id int32, off, n int64) {
		for u := off / align; u < (off+n)/align; u++ {
			if !owner[u].CompareAndSwap(0, id) {
				t.Errorf("goroutine %d got [%d,%d), but byte %d belongs to goroutine %d", id, off, off+n, u*align, owner[u].Load())
				return
			}
		}
	}
	release := func(off, n int64) {
		for u := off / align; u < (off+n)/align; u++ {
			owner[u].Store(0)
		}
	}
	var wg sync.WaitGroup
	for g := range goroutines {
		wg.Go(func() {
			id := int32(g + 1)
			rng := rand.New(rand.NewPCG(uint64(g), 7))
			live := map[int64]int64{}
			var offs []int64
			free := func(i int) {
				off := offs[i]
				release(off, live[off])
				n, err := a.Free(off)
				if err != nil || n != live[off] {
					t.Errorf("Free(%d) = %d, %v; want %d", off, n, err, live[off])
				}
				delete(live, off)
				offs[i] = offs[len(offs)-1]
				offs = offs[:len(offs)-1]
			}
			for range ops {
				if len(offs) > 0 && rng.IntN(2) == 0 {
					free(rng.IntN(len(offs)))
					continue
				}
				n := 1 + rng.Int64N(64*KiB)
				off, err := a.Alloc(n)
				if errors.Is(err, ErrNoSpace) {
					continue
				}
				if err != nil {
					t.Errorf("Alloc(%d): %v", n, err)
					return
				}
				rounded := (n + align - 1) / align * align
				claim(id, off, rounded)
				live[off] = rounded
				offs = append(offs, off)
				if s := a.Stats(); s.Used+s.Free != s.Size || s.Used%align != 0 {
					t.Errorf("inconsistent Stats() = %+v", s)
				}
			}
			for len(offs) > 0 {
				free(0)
			}
		})
	}
	wg.Wait()
	m := &model{t: t, a: a, size: size, align: align, live: map[int64]int64{}}
	m.check()
}

// BenchmarkAllocFree measures one Free plus one Alloc of random size with
// many live blocks and about as many holes between them; per-op cost should
// grow with log(live), not live.
func BenchmarkAllocFree(b *testing.B) {
	for _, live := range []int{1_000, 100_000} {
		b.Run(fmt.Sprintf("live=%d", live), func(b *testing.B) {
			a, err := NewAllocator(1<<40, 256)
			if err != nil {
				b.Fatal(err)
			}
			rng := rand.New(rand.NewPCG(1, 2))
			sizes := make([]int64, 4096)
			for i := range sizes {
				sizes[i] = 1 + rng.Int64N(256*KiB)
			}
			offs := make([]int64, 0, 2*live)
			for i := range 2 * live {
				off, err := a.Alloc(sizes[i%len(sizes)])
				if err != nil {
					b.Fatal(err)
				}
				offs = append(offs, off)
			}
			// Free every other block to leave a hole between live ones.
			kept := offs[:0]
			for i, off := range offs {
				if i%2 == 0 {
					kept = append(kept, off)
				} else if _, err := a.Free(off); err != nil {
					b.Fatal(err)
				}
			}
			victims := make([]int, 4096)
			for i := range victims {
				victims[i] = rng.IntN(live)
			}
			i := 0
			for b.Loop() {
				v := victims[i%len(victims)]
				if _, err := a.Free(kept[v]); err != nil {
					b.Fatal(err)
				}
				off, err := a.Alloc(sizes[(i*7)%len(sizes)])
				if err != nil {
					b.Fatal(err)
				}
				kept[v] = off
				i++
			}
			b.ReportMetric(float64(a.Stats().FreeBlocks), "holes")
		})
	}
}

// allocRandom checks AllocRandom against the model: the place is the
// one intn picked among the whole places side by side in the largest gap
// (the highest of equally large gaps: the end of the size order).
func (m *model) allocRandom(n int64, rng *rand.Rand) {
	m.t.Helper()
	need := m.roundUp(n)
	var largest block
	for _, g := range m.gaps() {
		if g.size >= largest.size {
			largest = g
		}
	}
	var asked, picked uint64
	off, err := m.a.AllocRandom(n, func(k uint64) uint64 {
		asked, picked = k, rng.Uint64N(k)
		return picked
	})
	if largest.size < need {
		if !errors.Is(err, ErrNoSpace) {
			m.t.Fatalf("AllocRandom(%d) with largest gap %d: offset %d, err %v; want ErrNoSpace", n, largest.size, off, err)
		}
		return
	}
	if want := uint64(largest.size / need); err != nil || asked != want || off != largest.off+int64(picked)*need {
		m.t.Fatalf("AllocRandom(%d) = %d, %v after asking for one of %d places; want one of %d places in the %d-byte gap at %d",
			n, off, err, asked, want, largest.size, largest.off)
	}
	m.live[off] = need
	m.offs = append(m.offs, off)
	m.check()
}

// AllocRandom places a slice in the largest free block, at the place
// among those it holds side by side that its random source picks;
// best-fit allocations and frees around such slices keep the free blocks
// exact.
func TestAllocRandomPlacesAnywhereInTheLargestBlock(t *testing.T) {
	for seq := range 200 {
		rng := rand.New(rand.NewPCG(uint64(seq), 0x5107))
		align := int64(256) << rng.IntN(3)
		size := align * int64(1+rng.IntN(4*MiB/int(align)))
		m := newModel(t, size, align)
		for range 100 {
			switch r := rng.IntN(100); {
			case r < 35 && len(m.offs) > 0:
				m.free(m.offs[rng.IntN(len(m.offs))])
			case r < 70:
				m.allocRandom(randomSize(rng, size, align, m.a.Stats().LargestFree), rng)
			default:
				m.alloc(randomSize(rng, size, align, m.a.Stats().LargestFree))
			}
		}
		m.freeAll(rng)
		if t.Failed() {
			t.Fatalf("sequence %d (align %d, size %d) failed", seq, align, size)
		}
	}
	// In an empty arena the first slot's place is not the first-fit
	// address (offset 0) unless the source says so: every place of its
	// length is one of its choices; and the rest still fits another of
	// the same length.
	a, err := NewAllocator(MiB+KiB, 256)
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []int64{MiB / 2, 0} {
		off, err := a.AllocRandom(MiB/2-100, func(k uint64) uint64 {
			if k != uint64(want/(MiB/2))+1 {
				t.Fatalf("asked for one of %d places", k)
			}
			return k - 1
		})
		if err != nil || off != want {
			t.Fatalf("AllocRandom = %d, %v; want the last place, %d", off, err, want)
		}
	}
}
