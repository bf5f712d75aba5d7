package daemon

import (
	"context"
	"net"
	"strings"
	"testing"
	"time"

	"github.com/ferry-project/ferry/api"
	"github.com/ferry-project/ferry/arena"
	"github.com/ferry-project/ferry/mooncake"
	"github.com/ferry-project/ferry/transport"
)

// Unkeyed (Mooncake) writes land in live slots only, and a slot filled
// in pieces arrives with its last byte, whatever the pieces' order; a
// piece sent twice counts once.
func TestUnkeyedWritesFillASlotPieceByPiece(t *testing.T) {
	r := newTestRegistry(t, 8192)
	s, err := r.newSlot("m", 3000, true)
	if err != nil {
		t.Fatal(err)
	}
	arrived := func() bool { return r.receives()[0].Arrived }
	write := func(off, n uint64) {
		t.Helper()
		body, done, err := r.AcceptUnkeyed(s.addr+off, n)
		if err != nil {
			t.Fatal(err)
		}
		// Host memory: the slot's bytes themselves, in one piece.
		dst, _ := body()
		for i := range dst {
			dst[i] = byte(off + uint64(i))
		}
		if rest, err := body(); len(dst) != int(n) || len(rest) != 0 || err != nil {
			t.Fatalf("a write of %d bytes lent pieces of %d and %d bytes (%v)", n, len(dst), len(rest), err)
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
	if got := r.receives()[0]; got.Received != 3000 || got.Tag != s.key.Tag() {
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

// The descriptor ferryd sends with its own metadata requests names its
// segment, protocol and NIC, and none of the arena's address, length or
// keys: whoever it dials has no use for them.
func TestMooncakeSelfHasNoKeys(t *testing.T) {
	m := &mooncakeSegment{name: "10.0.0.1:15302", seg: mooncake.Segment{
		Name: "10.0.0.1:15302", Protocol: "rdma", TCPDataPort: 4000,
		Devices:        []mooncake.Device{{Name: "rxe0", GID: "00:00:00:00:00:00:00:00:00:00:ff:ff:0a:00:00:01"}},
		Buffers:        []mooncake.Buffer{{Name: "cpu:0", Addr: 0x7f0000000000, Length: 1 << 30, RKey: []uint32{0x1234}, LKey: []uint32{0x5678}}},
		PriorityMatrix: mooncake.Priority{"cpu:0": {{"rxe0"}, {}}},
	}}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	got := make(chan []byte, 1)
	go func() {
		c, err := ln.Accept()
		if err != nil {
			return
		}
		defer c.Close()
		_, body, err := mooncake.ReadFrame(c)
		if err != nil {
			return
		}
		got <- body
		mooncake.WriteFrame(c, mooncake.Metadata, []byte(`{"name":"x:1","protocol":"tcp","tcp_data_port":9,"buffers":[]}`))
	}()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if _, err := mooncake.FetchSegment(ctx, ln.Addr().String(), m.self()); err != nil {
		t.Fatal(err)
	}
	body := string(<-got)
	for _, want := range []string{`"name":"10.0.0.1:15302"`, `"protocol":"rdma"`, `"rxe0"`, `"buffers":[]`} {
		if !strings.Contains(body, want) {
			t.Errorf("the metadata request %s does not say %s", body, want)
		}
	}
	for _, leak := range []string{"rkey", "lkey", "addr", "length", "4660"} {
		if strings.Contains(body, leak) {
			t.Errorf("the metadata request %s carries %q", body, leak)
		}
	}
	if len(m.seg.Buffers) != 1 || m.seg.Buffers[0].RKey[0] != 0x1234 {
		t.Error("self changed the segment's own descriptor")
	}
}

// The receiving client completes a Mooncake slot that one-sided writes
// filled without a notify; a keyed slot, a slot that arrived, or none
// at all are refused, each with its code.
func TestCompleteReceive(t *testing.T) {
	r := newTestRegistry(t, 1<<16)
	mc, err := r.newSlot("mc", 4096, true)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := r.newSlot("keyed", 4096, false); err != nil {
		t.Fatal(err)
	}
	for id, code := range map[string]string{"keyed": api.CodeBadRequest, "none": api.CodeNotFound} {
		if err := r.completeReceive(id); !isCode(err, code) {
			t.Errorf("complete %s: %v, want %s", id, err, code)
		}
	}
	if err := r.completeReceive("mc"); err != nil {
		t.Fatal(err)
	}
	desc, _, release, err := r.waitSlot(context.Background(), "mc", 0, false)
	if err != nil || !desc.Arrived || desc.Received != 4096 || desc.Tag != mc.key.Tag() {
		t.Fatalf("completed slot: %+v, %v", desc, err)
	}
	release()
	if err := r.completeReceive("mc"); !isCode(err, api.CodeExists) {
		t.Errorf("complete twice: %v, want %s", err, api.CodeExists)
	}
}

// TestMooncakeSlotsAreNotWhereAGuessLands: the segment descriptor
// publishes the arena's base, and a best-fit slot lay at its first bytes,
// the next one right after: two guesses found them. A Mooncake slot is
// placed at a random place of the largest free block instead, so those
// guesses (and the best-fit places of any slot) meet no slot. The places
// are random: with 256 MiB of free space and 4 KiB slots, a guess lands
// in one of the two slots with probability 2 / 2^16 (3e-5 a guess).
func TestMooncakeSlotsAreNotWhereAGuessLands(t *testing.T) {
	const arenaSize, n = 256 << 20, 4096
	r := newTestRegistry(t, arenaSize)
	base := r.arena.Addr(arena.Slice{})
	var slots []*slot
	for _, id := range []string{"m1", "m2"} {
		s, err := r.newSlot(id, n, true)
		if err != nil {
			t.Fatal(err)
		}
		slots = append(slots, s)
	}
	for _, guess := range []uint64{base, base + n} {
		if _, _, err := r.AcceptUnkeyed(guess, n); refusalCode(t, err) != transport.NoSlot {
			t.Fatalf("a guessed write at %#x (the arena's base + %d): %v, want no_slot", guess, guess-base, err)
		}
	}
	for _, s := range slots {
		if s.addr == base || s.addr == base+n {
			t.Fatalf("slot %s at the best-fit place %#x", s.reqID, s.addr)
		}
		body, done, err := r.AcceptUnkeyed(s.addr, n)
		if err != nil {
			t.Fatalf("a write at slot %s's own address: %v", s.reqID, err)
		}
		if _, err := body(); err != nil {
			t.Fatal(err)
		}
		done(nil)
	}
}
