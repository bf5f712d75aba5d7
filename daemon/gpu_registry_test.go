package daemon

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"

	"github.com/ferry-project/ferry/api"
	"github.com/ferry-project/ferry/arena"
	"github.com/ferry-project/ferry/config"
	"github.com/ferry-project/ferry/transport"
)

// deviceMemory stands in for a GPU arena beneath the arena.Copier seam
// (the real one runs in make test-gpu, and over a stand-in driver in the
// e2e tests): bytes reach it only through copies, which can be made to fail.
type deviceMemory struct {
	mem       []byte
	failCopy  error
	noStaging bool // Bounce has no host memory to lend

	mu         sync.Mutex
	lent, peak int64 // host staging Bounce lends now, and the most at once
	lends      int   // Bounce's loans so far
	lendLimit  int   // > 0: Bounce lends this many in all, then has none
	copiesIn   int   // CopyIn's calls so far
	failFrom   int   // > 0: CopyIn fails from its failFrom-th call on (a GPU fault)
	copiesOut  int   // CopyOut's calls so far
	failOut    int   // > 0: CopyOut fails from its failOut-th call on
}

func (m *deviceMemory) Base() uint64 { return 0x7f5500000000 }
func (m *deviceMemory) Size() int64  { return int64(len(m.mem)) }
func (m *deviceMemory) Host() []byte { return nil }
func (m *deviceMemory) Kind() string { return "cuda" }
func (m *deviceMemory) Close() error { return nil }
func (m *deviceMemory) CopyIn(off int64, src []byte) error {
	if m.failCopy != nil {
		return m.failCopy
	}
	m.mu.Lock()
	m.copiesIn++
	failed := m.failFrom > 0 && m.copiesIn >= m.failFrom
	m.mu.Unlock()
	if failed {
		return errors.New("cuMemcpyHtoD_v2: CUDA_ERROR_ILLEGAL_ADDRESS")
	}
	copy(m.mem[off:], src)
	return nil
}
func (m *deviceMemory) CopyOut(dst []byte, off int64) error {
	m.mu.Lock()
	m.copiesOut++
	failed := m.failOut > 0 && m.copiesOut >= m.failOut
	m.mu.Unlock()
	if failed {
		return errors.New("cuMemcpyDtoH_v2: CUDA_ERROR_ILLEGAL_ADDRESS")
	}
	copy(dst, m.mem[off:])
	return nil
}
func (m *deviceMemory) Bounce(n int64) ([]byte, func(), error) {
	if m.noStaging {
		return nil, nil, fmt.Errorf("%w: the test lends none", arena.ErrNoStaging)
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.lendLimit > 0 && m.lends >= m.lendLimit {
		return nil, nil, fmt.Errorf("%w: the test lends no more", arena.ErrNoStaging)
	}
	m.lends++
	m.lent += n
	m.peak = max(m.peak, m.lent)
	return make([]byte, n), func() {
		m.mu.Lock()
		defer m.mu.Unlock()
		m.lent -= n
	}, nil
}

// fetchAll is the bytes f has, read to the end.
func fetchAll(t *testing.T, f *arena.Fetcher) []byte {
	t.Helper()
	var all []byte
	for {
		piece, err := f.Next()
		if err != nil {
			t.Fatal(err)
		}
		if len(piece) == 0 {
			return all
		}
		all = append(all, piece...)
	}
}

// takePeak is the most staging lent at once since the last takePeak.
func (m *deviceMemory) takePeak() int64 {
	m.mu.Lock()
	defer m.mu.Unlock()
	peak := m.peak
	m.peak = m.lent
	return peak
}

// A write whose copy into GPU memory fails is not marked arrived: the
// receiver's wait says what happened, and a resend can still land.
func TestReceiveIntoDeviceMemoryThroughCopies(t *testing.T) {
	dev := &deviceMemory{mem: make([]byte, 8192)}
	a, err := arena.New(dev, config.ArenaAlign)
	if err != nil {
		t.Fatal(err)
	}
	r := newRegistry(a)
	s, err := r.newSlot("g1", 100, false)
	if err != nil {
		t.Fatal(err)
	}
	data := bytes.Repeat([]byte("gpu!"), 25)
	write := func() {
		dst, done, err := r.Accept(s.addr, 100, s.key, 7)
		if err != nil {
			t.Fatal(err)
		}
		copy(dst, data)
		done(nil)
	}

	// With no host memory to stage it in, a write is refused and takes
	// no hold on the slot; a control call meeting it is answered busy.
	dev.noStaging = true
	refusals := map[transport.Code]int{}
	r.onRefusal = func(c transport.Code) { refusals[c]++ }
	if _, _, err := r.Accept(s.addr, 100, s.key, 7); !transport.IsRefusal(err) || !strings.Contains(err.Error(), "the receiving ferryd has no host memory to stage this write") {
		t.Fatalf("a write with no staging memory: %v", err)
	}
	if s.writes != 0 || s.pins != 0 || refusals[transport.Internal] != 1 {
		t.Fatalf("the refused write left %d writes and %d pins on the slot, counted %v", s.writes, s.pins, refusals)
	}
	if code := internalCode(fmt.Errorf("reading: %w", arena.ErrNoStaging)); code != api.CodeBusy {
		t.Fatalf("no staging memory answered %s, want busy", code)
	}
	dev.noStaging = false

	dev.failCopy = errors.New("cuMemcpyHtoD_v2: CUDA_ERROR_ILLEGAL_ADDRESS")
	write()
	_, _, _, err = r.waitSlot(context.Background(), "g1", 0, true)
	var ae *apiError
	if !errors.As(err, &ae) || ae.code != api.CodeInternal || !strings.Contains(ae.msg, "could not be copied into GPU memory") ||
		!strings.Contains(ae.msg, "CUDA_ERROR_ILLEGAL_ADDRESS") || !strings.Contains(ae.msg, "g1") {
		t.Fatalf("wait after a failed copy: %v", err)
	}

	dev.failCopy = nil
	write()
	desc, got, release, err := r.waitSlot(context.Background(), "g1", 0, true)
	if err != nil || !desc.Arrived || desc.Tag != 7 || !bytes.Equal(fetchAll(t, got), data) {
		t.Fatalf("after a resend: %+v, %v", desc, err)
	}
	release()
	if !bytes.Equal(dev.mem[s.slice.Offset:s.slice.Offset+100], data) {
		t.Fatal("the bytes are not in device memory")
	}
	if err := r.deleteSlot("g1"); err != nil {
		t.Fatal(err)
	}
	if st := a.Stats(); st.Used != 0 {
		t.Fatalf("%d bytes still allocated after the slot was freed", st.Used)
	}
}

// A region of GPU memory (beneath the arena.Copier seam, as a CUDA
// region is): a slot in it lands by a copy in at its offset, a transfer
// reads it by a copy out, and unregistering closes it.
func TestRegionOfDeviceMemoryMovesThroughCopies(t *testing.T) {
	a, err := arena.New(&deviceMemory{mem: make([]byte, 8192)}, config.ArenaAlign)
	if err != nil {
		t.Fatal(err)
	}
	r := newRegistry(a)
	dev := &deviceMemory{mem: make([]byte, 1<<16)}
	if _, err := r.addRegion("kv", dev, nil, nil); err != nil {
		t.Fatal(err)
	}
	s, err := r.newSlotIn("r1", 100, "kv", 4096)
	if err != nil {
		t.Fatal(err)
	}
	if s.addr != dev.Base()+4096 {
		t.Fatalf("slot address %#x, want the region's base + 4096", s.addr)
	}
	data := bytes.Repeat([]byte("kv!!"), 25)
	dst, done, err := r.Accept(s.addr, 100, s.key, 7)
	if err != nil {
		t.Fatal(err)
	}
	copy(dst, data)
	done(nil)
	if !bytes.Equal(dev.mem[4096:4196], data) {
		t.Fatal("the write did not reach the region's memory at the slot's offset")
	}
	desc, got, release, err := r.waitSlot(context.Background(), "r1", 0, true)
	if err != nil || !desc.Arrived || desc.Region != "kv" || desc.Offset != 4096 || !bytes.Equal(fetchAll(t, got), data) {
		t.Fatalf("reading the slot back: %+v, %v", desc, err)
	}
	release()
	g, err := r.pinRegion("kv", "test")
	if err != nil {
		t.Fatal(err)
	}
	src, rel, err := arena.Readable(g.mem, arena.Slice{Len: g.size()}, 4096, 100)
	if err != nil || !bytes.Equal(src, data) {
		t.Fatalf("reading the region as a source: %v", err)
	}
	rel()
	r.unpinRegion(g)
	if _, err := r.removeRegion("kv"); !isCode(err, api.CodeBusy) {
		t.Fatalf("unregistering a region with a live slot: %v", err)
	}
	if err := r.deleteSlot("r1"); err != nil {
		t.Fatal(err)
	}
	end, err := r.removeRegion("kv")
	if err != nil {
		t.Fatal(err)
	}
	waitEnd(t, end)
}

// TestRegisteredCUDARegionSlotsLandInPlace: a slot in a CUDA region the
// NIC registered gets a window (windows mode) and takes a write the NIC
// placed itself (AcceptInPlace), arriving with no copy in; a slot in a
// CUDA region the NIC did not register gets no window and is refused in
// place (its writes come through the bounce area). The registration is
// dropped when the region is unregistered, its windows closed first.
func TestRegisteredCUDARegionSlotsLandInPlace(t *testing.T) {
	a, err := arena.New(&deviceMemory{mem: make([]byte, 8192)}, config.ArenaAlign)
	if err != nil {
		t.Fatal(err)
	}
	r := newRegistry(a)
	w := &fakeWindows{open: make(map[uint32][2]uint64)}
	r.UseWindows(w)
	r.regionNICLost = func(name string, err error) { t.Errorf("region %s: %v", name, err) }
	nic := &nicCloser{w: w}
	// Any copy into the registered region fails: the write must not take one.
	reached := &deviceMemory{mem: make([]byte, 1<<16), failCopy: errors.New("copied into a region the NIC reaches")}
	if _, err := r.addRegion("reached", reached, nic, nil); err != nil {
		t.Fatal(err)
	}
	if _, err := r.addRegion("copied", &deviceMemory{mem: make([]byte, 1<<16)}, nil, errors.New("no peermem")); err != nil {
		t.Fatal(err)
	}
	s, err := r.newSlotIn("in", 100, "reached", 4096)
	if err != nil {
		t.Fatal(err)
	}
	if got, ok := w.open[s.key.Window()]; !ok || got != [2]uint64{reached.Base() + 4096, 100} {
		t.Fatalf("the slot's key names window %#x, open over %v; want one over [%#x, +100)", s.key.Window(), got, reached.Base()+4096)
	}
	done, err := r.AcceptInPlace(s.addr, 100, s.key, 7)
	if err != nil {
		t.Fatalf("a write into a slot in a registered CUDA region, in place: %v", err)
	}
	done(nil)
	if desc, _, _, err := r.waitSlot(t.Context(), "in", 0, false); err != nil || !desc.Arrived || desc.Region != "reached" {
		t.Fatalf("the slot after its write landed in place: %+v, %v", desc, err)
	}
	plain, err := r.newSlotIn("plain", 100, "copied", 0)
	if err != nil {
		t.Fatal(err)
	}
	if plain.key.Window() != 0 {
		t.Errorf("a slot in a CUDA region the NIC did not register names window %#x", plain.key.Window())
	}
	_, err = r.AcceptInPlace(plain.addr, 100, plain.key, 8)
	var rf *transport.Refusal
	if !errors.As(err, &rf) || rf.Code != transport.OutOfBounds || !strings.Contains(rf.Message, "outside the GPU memory the NIC writes into") {
		t.Errorf("a write in place into a slot in an unregistered CUDA region: %v", err)
	}
	for _, id := range []string{"in", "plain"} {
		if err := r.deleteSlot(id); err != nil {
			t.Fatal(err)
		}
	}
	end, err := r.removeRegion("reached")
	if err != nil {
		t.Fatal(err)
	}
	waitEnd(t, end)
	if len(w.open) != 0 || nic.closed != 1 {
		t.Fatalf("%d windows open, registration dropped %d times; want none open, dropped once", len(w.open), nic.closed)
	}
}
