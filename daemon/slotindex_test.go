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
// past the last, nothing once the slot is freed, and the new slot where
// one is made again; a write that starts in a slot and runs into the next
// is refused, not split.
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
	if keyed.addr != a.addr+1024 || b.addr != keyed.addr+1024 || c.addr != b.addr+1024 {
		t.Fatalf("slots at %#x, %#x, %#x, %#x: want them packed from the arena's start", a.addr, keyed.addr, b.addr, c.addr)
	}
	for _, q := range []struct {
		addr uint64
		want *slot
		what string
	}{
		{a.addr, a, "a's first byte"},
		{a.addr + 500, a, "inside a"},
		{a.addr + 999, a, "a's last byte"},
		{a.addr + 1000, nil, "the gap after a, inside its aligned slice"},
		{keyed.addr + 10, nil, "a slot without \"mooncake\""},
		{b.addr, b, "b's first byte"},
		{b.addr + 1023, b, "b's last byte"},
		{c.addr + 511, c, "c's last byte"},
		{c.addr + 512, nil, "past the last slot"},
		{a.addr - 1, nil, "before the first slot"},
		{0, nil, "address 0"},
		{^uint64(0), nil, "the top address"},
	} {
		if got := r.unkeyed.at(q.addr); got != q.want {
			t.Errorf("%s (%#x): found %v, want %v", q.what, q.addr, got, q.want)
		}
	}
	// Straddling b and c: b's slot is found, and the write refused as
	// running past its end.
	if _, _, err := r.AcceptUnkeyed(b.addr+1000, 100); refusalCode(t, err) != transport.OutOfBounds {
		t.Fatalf("a write straddling two slots: %v, want out_of_bounds", err)
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
	if got := r.unkeyed.at(c.addr); got != c {
		t.Fatalf("c not found after b was freed: %v", got)
	}
	d := mk("d", 1024, true) // b's memory, free again
	if d.addr != b.addr || r.unkeyed.at(b.addr+1023) != d {
		t.Fatalf("slot d at %#x, found at b's old address: %v; want d in b's place", d.addr, r.unkeyed.at(b.addr+1023))
	}
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
