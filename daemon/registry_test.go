package daemon

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ferry-project/ferry/api"
	"github.com/ferry-project/ferry/arena"
	"github.com/ferry-project/ferry/config"
	"github.com/ferry-project/ferry/transport"
)

func newTestRegistry(t testing.TB, size int64) *registry {
	t.Helper()
	mem, err := arena.CreateHostFile(filepath.Join(t.TempDir(), "arena"), size)
	if err != nil {
		t.Fatal(err)
	}
	a, err := arena.New(mem, config.ArenaAlign)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { a.Close() })
	return newRegistry(a)
}

func refusalCode(t *testing.T, err error) transport.Code {
	t.Helper()
	var r *transport.Refusal
	if !errors.As(err, &r) {
		t.Fatalf("want a refusal, got %v", err)
	}
	return r.Code
}

// A slot freed while a write is landing keeps its memory until the write
// ends, so a newer slot never shares those bytes; the late write does not
// mark anything arrived.
func TestFreedSlotKeepsMemoryUntilWriteEnds(t *testing.T) {
	r := newTestRegistry(t, 4096)
	a, err := r.newSlot("a", 1024, false)
	if err != nil {
		t.Fatal(err)
	}
	var discarded []string
	r.discarded = func(id string, n uint64) { discarded = append(discarded, fmt.Sprintf("%s/%d", id, n)) }
	dst, done, err := r.Accept(a.addr, 1024, a.key, a.key.Tag())
	if err != nil {
		t.Fatal(err)
	}
	if got := r.receives()[0].WritesInFlight; got != 1 {
		t.Fatalf("slot a shows %d writes in flight, want 1", got)
	}
	if err := r.deleteSlot("a"); err != nil {
		t.Fatal(err)
	}
	// New writes to the freed slot are refused at once.
	if _, _, err := r.Accept(a.addr, 1024, a.key, a.key.Tag()); refusalCode(t, err) != transport.NoSlot {
		t.Fatalf("write to a freed slot: %v", err)
	}
	// Fill the rest of the arena: none of it may overlap a's pinned bytes.
	var others []*slot
	for i := 0; ; i++ {
		s, err := r.newSlot("b"+string(rune('0'+i)), 1024, false)
		if err != nil {
			if !isCode(err, api.CodeArenaFull) {
				t.Fatal(err)
			}
			break
		}
		if s.addr < a.addr+1024 && a.addr < s.addr+1024 {
			t.Fatalf("slot %s at %#x overlaps the freed slot still being written at %#x", s.reqID, s.addr, a.addr)
		}
		others = append(others, s)
	}
	if len(others) != 3 {
		t.Fatalf("want 3 more slots beside the pinned one, got %d", len(others))
	}
	for i := range dst {
		dst[i] = 0xAB
	}
	done(nil)
	for _, s := range others {
		if s.arrived {
			t.Fatalf("a late write marked %s arrived", s.reqID)
		}
	}
	if len(discarded) != 1 || discarded[0] != "a/1024" {
		t.Fatalf("the discarded write was reported as %q, want [a/1024]", discarded)
	}
	// Now a's memory is back.
	if _, err := r.newSlot("c", 1024, false); err != nil {
		t.Fatalf("memory of the freed slot did not come back after its write ended: %v", err)
	}
}

func TestAcceptRefusals(t *testing.T) {
	r := newTestRegistry(t, 1<<16)
	s, err := r.newSlot("r", 1000, false)
	if err != nil {
		t.Fatal(err)
	}
	other, err := r.newSlot("other", 1000, false)
	if err != nil {
		t.Fatal(err)
	}
	wrong := s.key
	wrong[15] ^= 1
	refusals := map[transport.Code]int{}
	r.onRefusal = func(c transport.Code) { refusals[c]++ }
	cases := []struct {
		name    string
		addr, n uint64
		key     transport.Key
		want    transport.Code
	}{
		{"wrong key inside a slot", s.addr, 10, wrong, transport.NoSlot},
		{"no slot", s.addr + 1<<15, 10, wrong, transport.NoSlot},
		{"another slot's key", s.addr, 10, other.key, transport.NoSlot},
		{"right key, another slot's address", other.addr, 10, s.key, transport.NoSlot},
		{"past the end", s.addr + 990, 11, s.key, transport.OutOfBounds},
		{"wrapping length", s.addr, ^uint64(0), s.key, transport.OutOfBounds},
		{"empty", s.addr, 0, s.key, transport.OutOfBounds},
	}
	for _, c := range cases {
		_, _, err := r.Accept(c.addr, c.n, c.key, 0)
		if got := refusalCode(t, err); got != c.want {
			t.Errorf("%s: got %s, want %s (%v)", c.name, got, c.want, err)
		}
		// A peer without the key learns nothing of the slots there are.
		if c.want == transport.NoSlot && (err.Error() != errRefuseNoSlot.Error() || strings.Contains(err.Error(), "other")) {
			t.Errorf("%s: the refusal %q is not the one uniform no_slot refusal", c.name, err)
		}
	}
	if refusals[transport.NoSlot] != 4 || refusals[transport.OutOfBounds] != 3 {
		t.Errorf("refusals counted %v, want 4 no_slot and 3 out_of_bounds", refusals)
	}
	// A filled slot refuses a second write.
	_, done, err := r.Accept(s.addr, 1000, s.key, 7)
	if err != nil {
		t.Fatal(err)
	}
	done(nil)
	if _, _, err := r.Accept(s.addr, 1000, s.key, 7); refusalCode(t, err) != transport.SlotBusy {
		t.Fatalf("second write into a filled slot: %v", err)
	}
	desc, data, release, err := r.waitSlot(context.Background(), "r", 0, true)
	if err != nil || !desc.Arrived || desc.Tag != 7 || len(fetchAll(t, data)) != 1000 {
		t.Fatalf("arrived slot: %+v, %v", desc, err)
	}
	release()
}

// A slot arrives only once writes have covered every byte of it: a
// partial write never hands its reader bytes nobody wrote (an earlier
// tenant's).
func TestPartialWriteNeverArrives(t *testing.T) {
	r := newTestRegistry(t, 1<<16)
	// An earlier tenant leaves its bytes in the arena.
	old, err := r.newSlot("old", 2048, false)
	if err != nil {
		t.Fatal(err)
	}
	dst, done, err := r.Accept(old.addr, 2048, old.key, 1)
	if err != nil {
		t.Fatal(err)
	}
	copy(dst, bytes.Repeat([]byte("secret"), 400))
	done(nil)
	if err := r.deleteSlot("old"); err != nil {
		t.Fatal(err)
	}
	s, err := r.newSlot("fresh", 2048, false)
	if err != nil {
		t.Fatal(err)
	}
	write := func(off, n uint64) {
		t.Helper()
		dst, done, err := r.Accept(s.addr+off, n, s.key, s.key.Tag())
		if err != nil {
			t.Fatal(err)
		}
		for i := range dst {
			dst[i] = 'x'
		}
		done(nil)
	}
	arrived := func() bool { return r.receives()[0].Arrived }
	write(1024, 16)
	if arrived() {
		t.Fatal("a 16-byte write at offset 1024 made a 2048-byte slot arrive")
	}
	write(0, 1024)
	write(1024, 16) // a retry of a piece counts once
	if arrived() {
		t.Fatal("the slot arrived with bytes 1040..2047 never written")
	}
	write(1040, 1008)
	desc, data, release, err := r.waitSlot(context.Background(), "fresh", 0, true)
	if err != nil || !desc.Arrived || desc.Received != 2048 || !bytes.Equal(fetchAll(t, data), bytes.Repeat([]byte("x"), 2048)) {
		t.Fatalf("slot covered whole: %+v, %v", desc, err)
	}
	release()
}

// A failed write leaves the slot open for the retry.
func TestFailedWriteLeavesSlotOpen(t *testing.T) {
	r := newTestRegistry(t, 1<<16)
	s, _ := r.newSlot("r", 100, false)
	_, done, err := r.Accept(s.addr, 100, s.key, s.key.Tag())
	if err != nil {
		t.Fatal(err)
	}
	done(errors.New("connection reset"))
	_, done, err = r.Accept(s.addr, 100, s.key, s.key.Tag())
	if err != nil {
		t.Fatalf("retry after a failed write refused: %v", err)
	}
	done(nil)
}

func TestTakeForSendWaitsForStage(t *testing.T) {
	r := newTestRegistry(t, 1<<16)
	waiting := make(chan struct{})
	got := make(chan error, 1)
	go func() {
		e, err := r.takeForSend(context.Background(), "x", time.Minute, func() { close(waiting) })
		if err == nil && e.state != sending {
			err = errors.New("entry not claimed for sending")
		}
		got <- err
	}()
	<-waiting
	e, err := r.reserve("x", 64, []int64{64}, "u8", uploading)
	if err != nil {
		t.Fatal(err)
	}
	r.finishUpload(e, true)
	if err := <-got; err != nil {
		t.Fatal(err)
	}
	// While it is sending, a second send and a delete are refused.
	if _, err := r.takeForSend(context.Background(), "x", 0, func() {}); !isCode(err, api.CodeBusy) {
		t.Fatalf("second send: %v", err)
	}
	if err := r.deleteEntry("x"); !isCode(err, api.CodeBusy) {
		t.Fatalf("delete while sending: %v", err)
	}
	r.finishSend(e, false)
	if st := r.entries["x"].state; st != staged {
		t.Fatalf("failed send left the entry %s, want staged", st)
	}
}

func TestTakeForSendTimesOutNamingReqID(t *testing.T) {
	r := newTestRegistry(t, 1<<16)
	if _, err := r.reserve("z", 64, nil, "", reserved); err != nil {
		t.Fatal(err)
	}
	_, err := r.takeForSend(context.Background(), "z", time.Millisecond, func() {})
	if !isCode(err, api.CodeNoEmbedding) || !contains(err.Error(), "z", "not committed") {
		t.Fatalf("send of an uncommitted slice: %v", err)
	}
}

func TestSweepDropsOnlyIdleOldEntries(t *testing.T) {
	r := newTestRegistry(t, 1<<16)
	old, _ := r.reserve("old", 64, []int64{64}, "u8", uploading)
	r.finishUpload(old, true)
	busy, _ := r.reserve("busy", 64, []int64{64}, "u8", uploading)
	r.finishUpload(busy, true)
	if _, err := r.takeForSend(context.Background(), "busy", 0, func() {}); err != nil {
		t.Fatal(err)
	}
	if _, err := r.newSlot("slot", 64, false); err != nil {
		t.Fatal(err)
	}
	out := r.sweep(time.Now().Add(time.Hour), time.Minute, time.Minute)
	names := map[string]bool{}
	for _, d := range out {
		names[d.reqID] = true
	}
	if !names["old"] || !names["slot"] || names["busy"] || len(out) != 2 {
		t.Fatalf("sweep dropped %+v", out)
	}
	if st := r.arena.Stats(); st.Used != 256 {
		t.Fatalf("after the sweep %d bytes are used; want only the sending entry's 256", st.Used)
	}
}

func TestConcurrentSlotsAndWrites(t *testing.T) {
	r := newTestRegistry(t, 1<<20)
	var wg sync.WaitGroup
	for g := range 8 {
		wg.Add(1)
		go func(g int) {
			defer wg.Done()
			for i := range 200 {
				id := "g" + string(rune('a'+g)) + "-" + string(rune('a'+i%26)) + string(rune('a'+i/26))
				s, err := r.newSlot(id, 512, false)
				if err != nil {
					t.Error(err)
					return
				}
				dst, done, err := r.Accept(s.addr, 512, s.key, s.key.Tag())
				if err != nil {
					t.Error(err)
					return
				}
				dst[0] = byte(i)
				if i%2 == 0 {
					_ = r.deleteSlot(id) // freed mid-write
				}
				done(nil)
				if i%2 == 1 {
					_ = r.deleteSlot(id)
				}
			}
		}(g)
	}
	wg.Wait()
	if st := r.arena.Stats(); st.Used != 0 || len(r.slots) != 0 || len(r.byKey) != 0 {
		t.Fatalf("leak: %+v, %d slots, %d keys", st, len(r.slots), len(r.byKey))
	}
}

func contains(s string, subs ...string) bool {
	for _, x := range subs {
		if !strings.Contains(s, x) {
			return false
		}
	}
	return true
}

// quarantineClock replaces the registry's timers: each quarantine started
// is one fire func on armed, and stopped counts the timers stopped.
type quarantineClock struct {
	armed   chan func()
	stopped int
}

func withQuarantine(r *registry, d time.Duration) *quarantineClock {
	c := &quarantineClock{armed: make(chan func(), 16)}
	r.afterFunc = func(got time.Duration, f func()) func() bool {
		if got != d {
			panic(fmt.Sprintf("quarantine of %s, want %s", got, d))
		}
		c.armed <- f
		return func() bool { c.stopped++; return true }
	}
	r.quarantineFreedSlots(d)
	return c
}

func (c *quarantineClock) next(t *testing.T) func() {
	t.Helper()
	select {
	case f := <-c.armed:
		return f
	default:
		t.Fatal("no quarantine was started")
		return nil
	}
}

// With a quarantine (a Mooncake RDMA segment: one-sided writes take no
// pin), a freed slot's memory stays in use, whether the slot was deleted
// or swept, until the quarantine ends; a write pinning it defers the
// start of the quarantine to its end.
func TestQuarantineHoldsFreedSlotMemory(t *testing.T) {
	r := newTestRegistry(t, 4096)
	clock := withQuarantine(r, time.Hour)
	whole := func() error { _, err := r.newSlot("whole", 4096, false); return err }

	a, err := r.newSlot("a", 4096, false)
	if err != nil {
		t.Fatal(err)
	}
	_, done, err := r.Accept(a.addr, 16, a.key, a.key.Tag())
	if err != nil {
		t.Fatal(err)
	}
	if err := r.deleteSlot("a"); err != nil {
		t.Fatal(err)
	}
	if len(clock.armed) != 0 {
		t.Fatal("the quarantine started while a write still pinned the slot")
	}
	done(nil)
	release := clock.next(t)
	if err := whole(); !isCode(err, api.CodeArenaFull) {
		t.Fatalf("a new slot over the quarantined memory: %v, want arena_full", err)
	}
	if st := r.arena.Stats(); st.Used != 4096 {
		t.Fatalf("the arena shows %d bytes used during the quarantine, want 4096", st.Used)
	}
	release()
	if st := r.arena.Stats(); st.Used != 0 {
		t.Fatalf("the arena shows %d bytes used after the quarantine, want 0", st.Used)
	}

	// The TTL sweep frees a slot the same way.
	if err := whole(); err != nil {
		t.Fatal(err)
	}
	if got := r.sweep(time.Now().Add(time.Minute), time.Second, time.Second); len(got) != 1 {
		t.Fatalf("swept %v, want the one slot", got)
	}
	release = clock.next(t)
	if err := whole(); !isCode(err, api.CodeArenaFull) {
		t.Fatalf("a new slot over memory swept into quarantine: %v, want arena_full", err)
	}
	release()
	if err := whole(); err != nil {
		t.Fatalf("memory did not come back after the quarantine: %v", err)
	}
}

// Shutdown waits on no quarantine: stop stops the timers and returns the
// memory at once (nothing can be allocated any more), slots freed later
// skip it, and a timer that fires anyway does nothing.
func TestStopEndsQuarantines(t *testing.T) {
	r := newTestRegistry(t, 4096)
	clock := withQuarantine(r, time.Hour)
	for _, id := range []string{"a", "b"} {
		if _, err := r.newSlot(id, 1024, false); err != nil {
			t.Fatal(err)
		}
	}
	if err := r.deleteSlot("a"); err != nil {
		t.Fatal(err)
	}
	late := clock.next(t)
	r.stop()
	if clock.stopped != 1 || len(r.held) != 0 {
		t.Fatalf("stop stopped %d timers and left %d slots held, want 1 and 0", clock.stopped, len(r.held))
	}
	r.sweep(time.Now(), -1, -1) // as Serve does after draining
	if len(clock.armed) != 0 {
		t.Fatal("a slot freed while stopping was quarantined")
	}
	late() // fired racing stop: a second free would panic
	if st := r.arena.Stats(); st.Used != 0 {
		t.Fatalf("the arena shows %d bytes used after stop, want 0", st.Used)
	}
}

// Direct writes (rdma's arena-rkey mode) are heard of by tag and length
// only, and must be their slot's whole content: the slot arrives at
// once. A length that is not the slot's, a tag no live slot has (one
// freed meanwhile) and a resend to a slot holding its data are refused
// and counted.
func TestDirectArrivals(t *testing.T) {
	r := newTestRegistry(t, 1<<16)
	refusals := map[transport.Code]int{}
	r.onRefusal = func(c transport.Code) { refusals[c]++ }
	var events []string
	r.arrived = func(reqID string, n int64) { events = append(events, fmt.Sprintf("%s %d", reqID, n)) }
	s, err := r.newSlot("direct", 2048, false)
	if err != nil {
		t.Fatal(err)
	}
	arrived := func() bool { return r.receives()[0].Arrived }
	for _, n := range []uint64{1024, 4096} {
		if err := r.Arrived(s.key.Tag(), n); refusalCode(t, err) != transport.OutOfBounds || !strings.Contains(err.Error(), "not its whole content") || arrived() {
			t.Fatalf("a direct write of %d bytes to a 2048-byte slot: %v, arrived %v", n, err, arrived())
		}
	}
	if err := r.Arrived(s.key.Tag(), 2048); err != nil || !arrived() {
		t.Fatalf("the slot's whole content: %v, arrived %v; want it arrived", err, arrived())
	}
	if want := []string{"direct 2048"}; !slices.Equal(events, want) {
		t.Errorf("the event stream heard %q, want %q", events, want)
	}
	desc, _, release, err := r.waitSlot(context.Background(), "direct", 0, true)
	if err != nil || desc.Received != 2048 || desc.Tag != s.key.Tag() {
		t.Fatalf("the arrived slot: %+v, %v", desc, err)
	}
	release()
	if err := r.Arrived(s.key.Tag(), 2048); refusalCode(t, err) != transport.SlotBusy {
		t.Fatalf("a direct write resent to a slot holding its data: %v", err)
	}
	if err := r.deleteSlot("direct"); err != nil {
		t.Fatal(err)
	}
	if err := r.Arrived(s.key.Tag(), 2048); refusalCode(t, err) != transport.NoSlot || !strings.Contains(err.Error(), "freed") {
		t.Fatalf("a direct write to a freed slot: %v", err)
	}
	// A slot in a region: a direct write into the arena cannot fill it.
	if _, err := r.addRegion("lent", hostRegion(make([]byte, 4096)), nil, nil); err != nil {
		t.Fatal(err)
	}
	in, err := r.newSlotIn("in-region", 4096, "lent", 0)
	if err != nil {
		t.Fatal(err)
	}
	if err := r.Arrived(in.key.Tag(), 4096); refusalCode(t, err) != transport.OutOfBounds || !strings.Contains(err.Error(), "region lent") {
		t.Fatalf("a direct write naming a slot in a region: %v", err)
	}
	if want := (map[transport.Code]int{transport.OutOfBounds: 3, transport.SlotBusy: 1, transport.NoSlot: 1}); fmt.Sprint(refusals) != fmt.Sprint(want) {
		t.Errorf("refusals counted %v, want %v", refusals, want)
	}
}

// A region's memory is its client's: a slot freed while a write still
// lands in it keeps its bytes from a new slot until that write ends (the
// arena's allocator does this for arena slots), so the late write never
// lands on the new slot's data.
func TestFreedRegionSlotKeepsItsBytesWhileWritesLand(t *testing.T) {
	r := newTestRegistry(t, 1<<16)
	if _, err := r.addRegion("g", hostRegion(make([]byte, 8192)), nil, nil); err != nil {
		t.Fatal(err)
	}
	a, err := r.newSlotIn("a", 4096, "g", 0)
	if err != nil {
		t.Fatal(err)
	}
	_, done, err := r.Accept(a.addr, 4096, a.key, a.key.Tag())
	if err != nil {
		t.Fatal(err)
	}
	if err := r.deleteSlot("a"); err != nil {
		t.Fatal(err)
	}
	if _, err := r.newSlotIn("b", 4096, "g", 2048); !isCode(err, api.CodeBusy) || !strings.Contains(err.Error(), "freed receive slot of req_id a") {
		t.Fatalf("a slot over a freed one's landing write: %v, want busy naming it", err)
	}
	if _, err := r.newSlotIn("elsewhere", 4096, "g", 4096); err != nil {
		t.Fatalf("a slot clear of it: %v", err)
	}
	done(nil)
	if _, err := r.newSlotIn("b", 2048, "g", 2048); err != nil {
		t.Fatalf("the same bytes once the write ended: %v", err)
	}
}

// newSlot and reserve make slots and entries in the first device's arena.
func (r *registry) newSlot(reqID string, n int64, mooncake bool) (*slot, error) {
	return r.newSlotOn(nil, reqID, n, mooncake)
}

func (r *registry) reserve(reqID string, n int64, shape []int64, dtype string, st entryState) (*entry, error) {
	return r.reserveOn(nil, reqID, n, shape, dtype, st)
}
