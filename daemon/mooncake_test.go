package daemon

import (
	"testing"

	"github.com/ferry-project/ferry/transport"
)

// Unkeyed (Mooncake) writes land in live slots only, and a slot filled
// in pieces arrives with its last byte, whatever the pieces' order; a
// piece sent twice counts once.
func TestUnkeyedWritesFillASlotPieceByPiece(t *testing.T) {
	r := newTestRegistry(t, 8192)
	s, err := r.newSlot("m", 3000)
	if err != nil {
		t.Fatal(err)
	}
	arrived := func() bool { return r.receives()[0].Arrived }
	write := func(off, n uint64) {
		t.Helper()
		dst, done, err := r.AcceptUnkeyed(s.addr+off, n)
		if err != nil {
			t.Fatal(err)
		}
		for i := range dst {
			dst[i] = byte(off + uint64(i))
		}
		done(nil)
	}
	write(2000, 1000)
	write(0, 1000)
	write(0, 1000) // a retried piece
	if arrived() {
		t.Fatal("slot arrived with 1000 of its 3000 bytes missing")
	}
	// A piece that broke leaves its range unfilled.
	_, done, err := r.AcceptUnkeyed(s.addr+1000, 1000)
	if err != nil {
		t.Fatal(err)
	}
	done(errBroken)
	if arrived() {
		t.Fatal("a broken piece completed the slot")
	}
	write(999, 1001)
	if !arrived() {
		t.Fatal("slot not arrived once every byte was written")
	}
	if got := r.receives()[0]; got.Received != 3000 || got.Tag != s.key {
		t.Fatalf("arrived slot %+v", got)
	}
	if _, _, err := r.AcceptUnkeyed(s.addr, 10); refusalCode(t, err) != transport.SlotBusy {
		t.Fatalf("a write into an arrived slot: %v", err)
	}
	if _, _, err := r.AcceptUnkeyed(s.addr+2990, 20); refusalCode(t, err) != transport.OutOfBounds {
		t.Fatalf("a write past the slot's end: %v", err)
	}
	if _, _, err := r.AcceptUnkeyed(s.addr+4096, 8); refusalCode(t, err) != transport.NoSlot {
		t.Fatalf("a write outside every slot: %v", err)
	}
}

var errBroken = transport.ErrClosed

func TestSpansMerge(t *testing.T) {
	var s spans
	for _, c := range []struct{ off, n, want uint64 }{
		{10, 5, 5}, {0, 5, 10}, {5, 5, 15}, {3, 4, 15}, {20, 0, 15}, {14, 10, 24},
	} {
		if got := s.add(c.off, c.n); got != c.want {
			t.Fatalf("after [%d,+%d): %d bytes covered, want %d (set %v)", c.off, c.n, got, c.want, s)
		}
	}
	if len(s.set) != 1 || s.set[0] != (span{0, 24}) || s.total != 24 {
		t.Fatalf("set %v (total %d), want one span [0,24)", s.set, s.total)
	}
}
