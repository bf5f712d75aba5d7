package daemon

import (
	"errors"
	"fmt"
	"testing"

	"github.com/ferry-project/ferry/api"
	"github.com/ferry-project/ferry/transport"
)

// fakeWindows hands out rkeys and records which are open; fail makes
// the next Open or Close fail.
type fakeWindows struct {
	next uint32
	open map[uint32][2]uint64
	fail error
	rail uint8 // the rail its windows are on
}

func (w *fakeWindows) Open(addr, n uint64) (transport.Window, error) {
	if err := w.fail; err != nil {
		w.fail = nil
		return transport.Window{}, err
	}
	w.next += 0x100
	w.open[w.next] = [2]uint64{addr, n}
	return transport.Window{Rail: w.rail, RKey: w.next}, nil
}

func (w *fakeWindows) Close(win transport.Window) error {
	if err := w.fail; err != nil {
		w.fail = nil
		return err
	}
	if _, ok := w.open[win.RKey]; !ok || win.Rail != w.rail {
		return fmt.Errorf("no window %#x on rail %d", win.RKey, win.Rail)
	}
	delete(w.open, win.RKey)
	return nil
}

// TestSlotWindows: with windows, each arena slot's key names a window
// over exactly its bytes, closed when the slot's memory goes back; a
// window that cannot be opened fails the slot (its memory back), and
// one that cannot be closed keeps the slot's memory out of use.
func TestSlotWindows(t *testing.T) {
	r := newTestRegistry(t, 4096)
	w := &fakeWindows{open: make(map[uint32][2]uint64)}
	r.UseWindows(w)
	var lost []string
	r.windowLost = func(reqID string, err error) { lost = append(lost, reqID+": "+err.Error()) }

	a, err := r.newSlot("a", 1024, false)
	if err != nil {
		t.Fatal(err)
	}
	if got, ok := w.open[a.key.Window()]; !ok || got != [2]uint64{a.addr, 1024} {
		t.Fatalf("slot a's key names window %#x, open over %v; want one over [%#x, +1024)", a.key.Window(), got, a.addr)
	}
	_, done, err := r.Accept(a.addr, 1024, a.key, a.key.Tag())
	if err != nil {
		t.Fatalf("the slot's own key, window and all, is refused: %v", err)
	}
	if err := r.deleteSlot("a"); err != nil {
		t.Fatal(err)
	}
	// The granted write still pins the slot: its window stays open until
	// the write ends and the memory goes back.
	if _, ok := w.open[a.key.Window()]; !ok {
		t.Fatal("slot a's window was closed under a write still landing")
	}
	done(nil)
	if _, ok := w.open[a.key.Window()]; ok {
		t.Fatal("slot a's window is still open after its memory went back")
	}

	w.fail = errors.New("all windows over live slots")
	if _, err := r.newSlot("b", 1024, false); !isCode(err, api.CodeInternal) {
		t.Fatalf("a slot whose window could not be opened: %v, want an internal error", err)
	}
	// Its memory went back: four slots fit.
	var cs []*slot
	for i := range 4 {
		c, err := r.newSlot(fmt.Sprintf("c%d", i), 1024, false)
		if err != nil {
			t.Fatalf("slot c%d: %v (the failed slot's memory did not come back)", i, err)
		}
		cs = append(cs, c)
	}
	w.fail = errors.New("the bind did not complete")
	if err := r.deleteSlot("c0"); err != nil {
		t.Fatal(err)
	}
	if len(lost) != 1 {
		t.Fatalf("lost windows reported %q, want c0's", lost)
	}
	if err := r.deleteSlot("c1"); err != nil {
		t.Fatal(err)
	}
	if _, ok := w.open[cs[1].key.Window()]; ok {
		t.Fatal("c1's window is still open after its slot was freed")
	}
	// c1's memory came back; c0's, whose window may still be open, did not.
	if _, err := r.newSlot("d", 1024, false); err != nil {
		t.Fatal(err)
	}
	if _, err := r.newSlot("e", 1024, false); !isCode(err, api.CodeArenaFull) {
		t.Fatalf("another slot: %v; want arena_full, c0's memory held back", err)
	}
}

// nicCloser is a region's registration with the NIC: Close checks that
// no window over the region is still open, as a NIC refuses to drop a
// registration with windows bound over it.
type nicCloser struct {
	w      *fakeWindows
	closed int
}

func (c *nicCloser) Close() error {
	if len(c.w.open) != 0 {
		return fmt.Errorf("dropped with %d windows open", len(c.w.open))
	}
	c.closed++
	return nil
}

// TestRegionSlotWindows: with windows, a slot in a region the NIC
// registered gets a window over its bytes like an arena slot (a direct
// write through it fills the slot), and one in a region it did not gets
// none (its writes are staged); the
// region's registration is dropped once, when it is unregistered and
// the last write landing in it has ended, after the slot's window is
// closed.
func TestRegionSlotWindows(t *testing.T) {
	r := newTestRegistry(t, 4096)
	w := &fakeWindows{open: make(map[uint32][2]uint64)}
	r.UseWindows(w)
	r.windowLost = func(reqID string, err error) { t.Errorf("window of %s lost: %v", reqID, err) }
	r.regionNICLost = func(name string, err error) { t.Errorf("region %s: %v", name, err) }
	nic := &nicCloser{w: w}
	if _, err := r.addRegion("lent", hostRegion(make([]byte, 8192)), nic, nil); err != nil {
		t.Fatal(err)
	}
	if _, err := r.addRegion("copied", hostRegion(make([]byte, 4096)), nil, errors.New("no NIC")); err != nil {
		t.Fatal(err)
	}
	plain, err := r.newSlotIn("plain", 4096, "copied", 0)
	if err != nil {
		t.Fatal(err)
	}
	if plain.key.Window() != 0 {
		t.Errorf("a slot in a region the NIC did not register names window %#x", plain.key.Window())
	}
	s, err := r.newSlotIn("in", 4096, "lent", 4096)
	if err != nil {
		t.Fatal(err)
	}
	if got, ok := w.open[s.key.Window()]; !ok || got != [2]uint64{s.addr, 4096} {
		t.Fatalf("the slot's key names window %#x, open over %v; want one over [%#x, +4096)", s.key.Window(), got, s.addr)
	}
	// A direct write through its window fills a slot in the region.
	whole, err := r.newSlotIn("whole", 4096, "lent", 0)
	if err != nil {
		t.Fatal(err)
	}
	if err := r.Arrived(whole.key.Tag(), 4096); err != nil {
		t.Fatalf("a direct write through the window over a slot in a region: %v", err)
	}
	if desc, _, _, err := r.waitSlot(t.Context(), "whole", 0, false); err != nil || !desc.Arrived || desc.Region != "lent" {
		t.Fatalf("the slot filled by a direct write: %+v, %v", desc, err)
	}
	if err := r.deleteSlot("whole"); err != nil {
		t.Fatal(err)
	}
	// A write lands; meanwhile the slot is freed and the region
	// unregistered.
	_, done, err := r.Accept(s.addr, 4096, s.key, s.key.Tag())
	if err != nil {
		t.Fatal(err)
	}
	if err := r.deleteSlot("in"); err != nil {
		t.Fatal(err)
	}
	end, err := r.removeRegion("lent")
	if err != nil {
		t.Fatal(err)
	}
	if _, open := w.open[s.key.Window()]; !open || nic.closed != 0 {
		t.Fatalf("with a write landing: window open %v, registration dropped %d times; want open, kept", open, nic.closed)
	}
	done(nil)
	waitEnd(t, end)
	if len(w.open) != 0 || nic.closed != 1 {
		t.Fatalf("%d windows open, registration dropped %d times; want none open, dropped once", len(w.open), nic.closed)
	}
	if desc := r.listRegions(); len(desc) != 1 || desc[0].Name != "copied" || desc[0].NIC != nil {
		t.Errorf("regions left: %+v; want copied alone, with no nic (no registrar)", desc)
	}
}

// TestSlotWindowNamesItsRail: a slot whose window went on another rail
// (the NIC nearest its memory) has a key naming that rail beside the
// window's rkey; the key with its rail byte changed names no slot (keys
// are compared whole), and the window closes on its own rail.
func TestSlotWindowNamesItsRail(t *testing.T) {
	r := newTestRegistry(t, 4096)
	w := &fakeWindows{open: make(map[uint32][2]uint64), rail: 2}
	r.UseWindows(w)
	s, err := r.newSlot("a", 1024, false)
	if err != nil {
		t.Fatal(err)
	}
	if s.key.Rail() != 2 || s.key.Window() == 0 || s.key.WindowOn() != s.window {
		t.Fatalf("the slot's key names rail %d, window %#x (its window %+v): want rail 2's", s.key.Rail(), s.key.Window(), s.window)
	}
	for _, rail := range []uint8{0, 1, 3} {
		if _, _, err := r.Accept(s.addr, 1024, s.key.WithRail(rail), s.key.Tag()); !errors.Is(err, errRefuseNoSlot) {
			t.Fatalf("a write under the key naming rail %d: %v, want no slot", rail, err)
		}
	}
	_, done, err := r.Accept(s.addr, 1024, s.key, s.key.Tag())
	if err != nil {
		t.Fatal(err)
	}
	done(nil)
	if err := r.deleteSlot("a"); err != nil {
		t.Fatal(err)
	}
	if len(w.open) != 0 {
		t.Fatalf("windows %v still open after the slot was freed: want its window closed on rail 2", w.open)
	}
}
