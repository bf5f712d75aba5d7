package rdma

import (
	"bytes"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/ferry-project/ferry/transport"
	"github.com/ferry-project/ferry/transport/peer"
	"github.com/ferry-project/ferry/transport/transporttest"
)

// TestWindowsRefuse: in windows mode any peer, authenticated or not,
// writes whole slots directly through their windows, and the receiver's
// NIC itself refuses what lies outside a live slot's window: a write one
// byte past the slot, a write after the slot was freed, and a write
// under the arena's own rkey each fail at the sender with REM_ACCESS_ERR
// and deliver nothing, and touch no byte. A good write after each goes
// through on a fresh lane. Soft-RoCE bounds a write through a window
// only by the registration under it (rxe_resp.c checks the MR's range):
// there the write past the slot lands, which the test reports as a skip.
func TestWindowsRefuse(t *testing.T) {
	const size = 64 << 10
	p := newPair(t, newFabric(), size+1, 8*size, nil, 2, true)
	if m, why := p.rx.Mode(), p.rx.ModeWhy(); m != ModeWindows || why != "" {
		t.Fatalf("receiver's mode %q (%s), want %q", m, why, ModeWindows)
	}
	fill(p.src, 3)
	good := func(t *testing.T) {
		t.Helper()
		w := p.slot(size)
		if _, err := p.s.Write(ctxFor(t, 60*time.Second), w); err != nil {
			t.Fatalf("a good write: %v", err)
		}
		p.landed(t, w)
	}
	good(t)
	for _, c := range []struct {
		name string
		bad  func(t *testing.T, w *transport.Write)
	}{
		{"one byte past the slot", func(t *testing.T, w *transport.Write) { w.Src = p.src[:size+1] }},
		{"after the slot was freed", func(t *testing.T, w *transport.Write) {
			if err := p.slots.Remove(w.Key); err != nil {
				t.Fatal(err)
			}
		}},
		{"under the arena's rkey", func(t *testing.T, w *transport.Write) {
			// rxe gives a registration without remote access rkey 0, and
			// would make its lkey the rkey otherwise: try that.
			rkey := p.rx.shared.RKey()
			if rkey == 0 {
				rkey = p.rx.shared.LKey()
			}
			w.Key = w.Key.WithWindow(rkey)
		}},
	} {
		t.Run(c.name, func(t *testing.T) {
			defer good(t)
			w := p.slot(size)
			// The slot and the bytes after it, where a write past it lands.
			off := w.Remote - p.slots.Base
			before := bytes.Clone(p.slots.Mem[off : off+size+4096])
			tag := w.Tag
			c.bad(t, &w)
			_, err := p.s.Write(ctxFor(t, 60*time.Second), w)
			if dev := p.rx.nic.(mooncakeNIC).deviceName(); err == nil && len(w.Src) > size && strings.HasPrefix(dev, "rxe") {
				// What holds there: the length check on completion.
				p.logs.Wait(t, fmt.Sprintf("direct write of %d bytes tagged %#x counted for nothing", size+1, tag))
				if n := p.slots.Delivered(tag); n != 0 {
					t.Fatalf("a write %s was delivered %d times", c.name, n)
				}
				t.Skipf("%s placed a write one byte past its window (soft-RoCE bounds a write through a window only by the registration under it); the receiver counted it for nothing", dev)
			}
			if got := transport.StatusName(err); got != "REM_ACCESS_ERR" {
				t.Fatalf("a write %s: %v (status %q), want REM_ACCESS_ERR", c.name, err, got)
			}
			t.Logf("a write %s: %v", c.name, err)
			if n := p.slots.Delivered(tag); n != 0 {
				t.Errorf("a write %s was delivered %d times", c.name, n)
			}
			if !bytes.Equal(before, p.slots.Mem[off:off+size+4096]) {
				t.Errorf("a write %s changed the receiver's memory", c.name)
			}
		})
	}
	if st := p.rx.Stats(); st.WindowBinds < 5 || st.WindowInvalidations < 2 {
		t.Errorf("receiver stats %+v: want a bind per slot and an invalidation per free", st)
	}
	if st := p.tx.Stats(); st.ControlMessages != 0 {
		t.Errorf("sender stats %+v: windows mode sent control messages", st)
	}
}

// TestWindowsFallBack: without windows on the NIC, with a NIC that
// refuses to bind them, or with a Sink that puts none over its slots,
// the receiver says why, and falls back to direct writes under the
// arena's rkey between authenticated peers, else to a grant per write.
func TestWindowsFallBack(t *testing.T) {
	for _, c := range []struct {
		secret                        []byte
		nicWindows, refuseBinds, sink bool
		mode, why                     string
	}{
		{nil, true, false, true, ModeWindows, ""},
		{nil, false, false, true, ModeGrant, "no memory windows: the fake NIC has no memory windows; no direct writes under the arena's rkey without a peer secret"},
		{testSecret, false, false, true, ModeArenaRKey, "no memory windows: the fake NIC has no memory windows"},
		{testSecret, true, true, true, ModeArenaRKey, "no memory windows: binding a memory window over"},
		{testSecret, true, false, false, ModeArenaRKey, "no memory windows: the receiving Sink puts no windows over its slots"},
	} {
		f := newFabric()
		f.windows, f.refuseBinds = c.nicWindows, c.refuseBinds
		slots := mappedSlots(t, 4096)
		slots.Base = addrOf(slots.Mem)
		var sink transport.Sink = slots
		if c.sink {
			sink = transporttest.WindowSlots{Slots: slots}
		}
		rx := listenFake(t, f, Config{Peer: peer.Config{Sink: sink, Secret: c.secret}, Memory: slots.Mem})
		m, why := rx.Mode(), rx.ModeWhy()
		t.Logf("mode %s: %s", m, why)
		if m != c.mode || !strings.HasPrefix(why, c.why) || c.why == "" && why != "" {
			t.Errorf("windows on the NIC %v, in the Sink %v, secret %v: mode %q (%s), want %q (%s)", c.nicWindows, c.sink, c.secret != nil, m, why, c.mode, c.why)
		}
	}
}

// TestWindowsAfterClose: once the transport closed (its windows
// deallocated), opening a window fails with ErrClosed, and closing one
// succeeds: nothing can write through it any more.
func TestWindowsAfterClose(t *testing.T) {
	f := newFabric()
	f.windows = true
	slots := mappedSlots(t, 4096)
	slots.Base = addrOf(slots.Mem)
	ws := transporttest.WindowSlots{Slots: slots}
	rx := listenFake(t, f, Config{Peer: peer.Config{Sink: ws}, Memory: slots.Mem})
	key := slots.Add(0, 4096)
	if err := rx.Close(); err != nil {
		t.Fatal(err)
	}
	if err := slots.Remove(key); err != nil {
		t.Fatalf("closing a window after the transport closed: %v", err)
	}
	if _, err := rx.windows.Open(slots.Base, 4096); !errors.Is(err, transport.ErrClosed) {
		t.Fatalf("opening a window after the transport closed: %v, want ErrClosed", err)
	}
}

// TestWindowsGrantedPieces: in windows mode a write that must ask first
// (a piece of a slot) is granted under the slot's window, which the
// grant names, and lands; the direct path carries none of it.
func TestWindowsGrantedPieces(t *testing.T) {
	const size = 64 << 10
	p := newPair(t, newFabric(), size, 4*size, nil, 1, true)
	fill(p.src, 5)
	w := p.slot(size)
	for _, half := range []int{0, size / 2} {
		piece := w
		piece.Whole, piece.Src, piece.Remote = false, p.src[half:half+size/2], w.Remote+uint64(half)
		if _, err := p.s.Write(ctxFor(t, 60*time.Second), piece); err != nil {
			t.Fatalf("the piece at %d: %v", half, err)
		}
		// The sender's completion can come before the receiver's: the
		// test's Slots take one write into a slot at a time.
		if err := p.slots.WaitIdle(ctxFor(t, 30*time.Second)); err != nil {
			t.Fatal(err)
		}
	}
	if n := p.slots.Delivered(w.Tag); n != 2 {
		t.Fatalf("%d pieces delivered, want 2", n)
	}
	off := w.Remote - p.slots.Base
	if !bytes.Equal(p.slots.Mem[off:off+size], p.src[:size]) {
		t.Fatal("the pieces landed wrong")
	}
	if st := p.tx.Stats(); st.Direct != 0 || st.ControlMessages != 4 {
		t.Errorf("sender stats %+v: want two granted writes (a header and a reply each), none direct", st)
	}
}

// TestWindowOutsideTheRegistrations: a window asked over memory no
// registration holds is refused before any bind, which the NIC would
// fail, breaking the binding QP: windows over the arena still open.
func TestWindowOutsideTheRegistrations(t *testing.T) {
	f := newFabric()
	f.windows = true
	slots := mappedSlots(t, 8192)
	slots.Base = addrOf(slots.Mem)
	rx := listenFake(t, f, Config{Peer: peer.Config{Sink: transporttest.WindowSlots{Slots: slots}}, Memory: slots.Mem[:4096]})
	if _, err := rx.windows.Open(slots.Base+4096, 4096); err == nil || !strings.Contains(err.Error(), "no registration on rail 0 holds") {
		t.Fatalf("a window past the arena: %v, want refused", err)
	}
	if _, err := rx.windows.Open(slots.Base+4095, 2); err == nil {
		t.Fatal("a window across the arena's end opened")
	}
	rkey, err := rx.windows.Open(slots.Base, 4096)
	if err != nil {
		t.Fatalf("a window over the arena after the refusals: %v", err)
	}
	if err := rx.windows.Close(rkey); err != nil {
		t.Fatal(err)
	}
}
