package daemon

import (
	"fmt"
	"math/bits"
	"testing"
	"time"

	"github.com/google/btree"

	"github.com/ferry-project/ferry/transport"
)

// TestSlotIndexFindsTheSlotHoldingAnAddress: the Mooncake slot index
// finds a slot by any byte of it, nothing in the gaps between slots or
// past their ends, nothing once the slot is freed, and the new slot
// where one is made again; a write that starts in a slot and runs past
// its end is refused, not split. Mooncake slots are placed at random
// (the arena's AllocRandom), so what each address should find comes from
// a scan of the live slots, the index's model.
func TestSlotIndexFindsTheSlotHoldingAnAddress(t *testing.T) {
	r := newTestRegistry(t, 64<<10)
	mk := func(id string, n int64, mooncake bool) *slot {
		t.Helper()
		s, err := r.newSlot(id, n, mooncake)
		if err != nil {
			t.Fatal(err)
		}
		return s
	}
	a := mk("a", 1000, true) // 1024 bytes of arena, aligned
	keyed := mk("keyed", 1024, false)
	b := mk("b", 1024, true)
	c := mk("c", 512, true)
	check := func(live ...*slot) {
		t.Helper()
		holding := func(addr uint64) *slot {
			for _, s := range live {
				if addr >= s.addr && addr-s.addr < uint64(s.nbytes) {
					return s
				}
			}
			return nil
		}
		var probes []uint64
		for _, s := range append(live, keyed, b) {
			probes = append(probes, s.addr-1, s.addr, s.addr+1, s.addr+uint64(s.nbytes)-1, s.addr+uint64(s.nbytes), s.addr+1023, s.addr+1024)
		}
		probes = append(probes, 0, ^uint64(0))
		for _, addr := range probes {
			if got, want := r.unkeyed.at(addr), holding(addr); got != want {
				t.Errorf("%#x: found %v, want %v", addr, got, want)
			}
		}
	}
	check(a, b, c)
	if got := r.unkeyed.at(a.addr + 1000); got != nil {
		t.Errorf("the gap after a, inside its aligned slice: found %v", got)
	}
	if got := r.unkeyed.at(keyed.addr + 10); got != nil {
		t.Errorf("a slot without \"mooncake\": found %v", got)
	}
	// Running past b's end, whatever lies there: refused, not split.
	if _, _, err := r.AcceptUnkeyed(b.addr+1000, 100); refusalCode(t, err) != transport.OutOfBounds {
		t.Fatalf("a write running past its slot's end: %v, want out_of_bounds", err)
	}
	if err := r.deleteSlot("b"); err != nil {
		t.Fatal(err)
	}
	if got := r.unkeyed.at(b.addr + 10); got != nil {
		t.Fatalf("freed slot b still found: %s", got.reqID)
	}
	if _, _, err := r.AcceptUnkeyed(b.addr, 8); refusalCode(t, err) != transport.NoSlot {
		t.Fatalf("a write into freed slot b: %v, want no_slot", err)
	}
	check(a, c)
	d := mk("d", 1024, true)
	check(a, c, d)
}

// TestSlotIndexLookupIsLogarithmic: among 100,000 slots a lookup compares
// a few dozen ranges, hit or miss, where a scan compared every slot.
// Counted through the tree's ordering, not timed.
func TestSlotIndexLookupIsLogarithmic(t *testing.T) {
	const n = 100_000
	compares := 0
	x := &slotIndex{t: btree.NewG(indexDegree, func(a, b slotRange) bool { compares++; return byStart(a, b) })}
	for i := range n {
		x.add(&slot{reqID: fmt.Sprint(i), addr: uint64(i) * 8192, nbytes: 4096})
	}
	// Per level a binary search within one node: log2(2*degree) compares,
	// over the tree's height of about log(n)/log(degree) levels.
	limit := 2 * bits.Len(2*indexDegree) * (bits.Len(n)/bits.Len(indexDegree) + 1)
	for _, addr := range []uint64{0, 4095, 4096, 8191, n / 2 * 8192, n/2*8192 + 5000, (n - 1) * 8192, n * 8192, ^uint64(0)} {
		compares = 0
		x.at(addr)
		if compares > limit {
			t.Fatalf("a lookup of %#x among %d slots compared %d ranges, want at most %d", addr, n, compares, limit)
		}
	}
}

// TestRefusedUnkeyedWriteTakesNoRegistryLock: a Mooncake write that
// matches no slot is refused while something else holds the registry's
// lock (a control API call): strangers' guesses do not queue behind it,
// nor hold it up.
func TestRefusedUnkeyedWriteTakesNoRegistryLock(t *testing.T) {
	r := newTestRegistry(t, 8192)
	s, err := r.newSlot("m", 1024, true)
	if err != nil {
		t.Fatal(err)
	}
	r.mu.Lock()
	refused := make(chan error, 1)
	go func() {
		_, _, err := r.AcceptUnkeyed(s.addr+4096, 8)
		refused <- err
	}()
	select {
	case err := <-refused:
		r.mu.Unlock()
		if refusalCode(t, err) != transport.NoSlot {
			t.Fatalf("a write outside every slot: %v, want no_slot", err)
		}
	case <-time.After(10 * time.Second):
		r.mu.Unlock()
		<-refused
		t.Fatal("a write matching no slot waited 10s for the registry's lock")
	}
}
