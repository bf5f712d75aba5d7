package daemon

import (
	"strings"
	"testing"

	"github.com/ferry-project/ferry/api"
	"github.com/ferry-project/ferry/config"
)

// Slots made with mooncake come from the pool once it is in use, others
// from the rest of the arena; a full pool refuses with arena_full naming
// the setting; a freed Mooncake slot goes back to the pool; the status
// counts the pool's use.
func TestMooncakePoolHoldsMooncakeSlotsOnly(t *testing.T) {
	r := newTestRegistry(t, 1<<20)
	n, err := poolBytes(config.Share("25%"), 1<<20)
	if err != nil || n != 1<<18 {
		t.Fatalf("a quarter of a 1 MiB arena: %d, %v", n, err)
	}
	for _, bad := range []config.Share{"100%", "2MiB", "1"} {
		if _, err := poolBytes(bad, 1<<20); err == nil || !strings.Contains(err.Error(), "mooncake_rdma_pool") {
			t.Errorf("a pool of %s: %v, want a refusal naming mooncake_rdma_pool", bad, err)
		}
	}
	sl, err := r.reservePool(n)
	if err != nil {
		t.Fatal(err)
	}
	if err := r.usePool(sl); err != nil {
		t.Fatal(err)
	}
	base := r.arena.Addr(sl)
	in := func(s *slot) bool { return s.addr >= base && s.addr+uint64(s.nbytes) <= base+uint64(n) }
	out := func(s *slot) bool { return s.addr+uint64(s.nbytes) <= base || s.addr >= base+uint64(n) }
	var mc []*slot
	for i := range 3 {
		s, err := r.newSlot(string(rune('a'+i)), 64<<10, true)
		if err != nil || !in(s) {
			t.Fatalf("Mooncake slot %d: %+v, %v; want it in the pool [%#x, +%d)", i, s, err, base, n)
		}
		mc = append(mc, s)
		k, err := r.newSlot(string(rune('k'+i)), 64<<10, false)
		if err != nil || !out(k) {
			t.Fatalf("keyed slot %d: %+v, %v; want it outside the pool", i, k, err)
		}
	}
	if p := r.poolStatus(); p == nil || p.Addr != base || p.Size != n || p.Used != 3*64<<10 || p.Slots != 3 {
		t.Fatalf("pool status %+v", p)
	}
	if _, err := r.newSlot("big", 128<<10, true); !isCode(err, api.CodeArenaFull) || !strings.Contains(err.Error(), "raise mooncake_rdma_pool") {
		t.Fatalf("a Mooncake slot past the pool's room: %v, want arena_full naming mooncake_rdma_pool", err)
	}
	if _, err := r.newSlot("huge", n+256, true); !isCode(err, api.CodeTooLarge) || !strings.Contains(err.Error(), "mooncake_rdma_pool") {
		t.Fatalf("a Mooncake slot larger than the pool: %v, want too_large naming mooncake_rdma_pool", err)
	}
	if err := r.deleteSlot(mc[0].reqID); err != nil {
		t.Fatal(err)
	}
	if p := r.poolStatus(); p.Used != 2*64<<10 || p.Slots != 2 {
		t.Fatalf("after freeing a Mooncake slot the pool says %+v", p)
	}
	if s, err := r.newSlot("again", 64<<10, true); err != nil || !in(s) {
		t.Fatalf("a Mooncake slot in the room freed: %+v, %v", s, err)
	}
}
