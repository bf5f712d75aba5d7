package cuda

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"slices"
	"strings"
	"sync"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/ferry-project/ferry/arena"
)

// fakeDevice is a GPU beneath the device seam: "device memory" is Go memory
// at made-up addresses, reachable only through the copy calls. The real
// device runs the same Arena in make test-gpu.
type fakeDevice struct {
	info Info
	fail map[string]error // call name -> its failure

	mu        sync.Mutex
	next      uint64
	mem       map[uint64][]byte // live device allocations by base
	host      map[*byte]bool    // live pinned host allocations
	syncMemop map[uint64]bool
	calls     []string
}

func newFakeDevice() *fakeDevice {
	return &fakeDevice{
		info: Info{Ordinal: 0, Name: "Fake H200", TotalMemory: 1 << 30, DMABuf: true, UnifiedAddressing: true},
		fail: map[string]error{}, next: 0x7f1200000000,
		mem: map[uint64][]byte{}, host: map[*byte]bool{}, syncMemop: map[uint64]bool{},
	}
}

func (f *fakeDevice) called(name string) error {
	f.calls = append(f.calls, name)
	return f.fail[name]
}

func (f *fakeDevice) Info() Info { return f.info }

func (f *fakeDevice) Alloc(n int64) (uint64, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if err := f.called("Alloc"); err != nil {
		return 0, err
	}
	p := f.next
	f.next += uint64(n) + arenaGranule
	f.mem[p] = make([]byte, n)
	return p, nil
}

func (f *fakeDevice) Free(p uint64) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	if _, ok := f.mem[p]; !ok {
		return fmt.Errorf("Free(%#x): not allocated", p)
	}
	delete(f.mem, p)
	return f.called("Free")
}

func (f *fakeDevice) SetSyncMemops(p uint64) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.syncMemop[p] = true
	return f.called("SetSyncMemops")
}

func (f *fakeDevice) IPCHandle(p uint64) (IPCHandle, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	var h IPCHandle
	copy(h[:], fmt.Sprintf("ipc:%#x", p))
	return h, f.called("IPCHandle")
}

func (f *fakeDevice) ExportDMABuf(p uint64, n int64) (int, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if err := f.called("ExportDMABuf"); err != nil {
		return -1, err
	}
	// A real descriptor, so the test can see the Arena close it.
	return unix.Open(os.DevNull, unix.O_RDONLY|unix.O_CLOEXEC, 0)
}

func (f *fakeDevice) HostAlloc(n int64) ([]byte, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if err := f.called("HostAlloc"); err != nil {
		return nil, err
	}
	b := make([]byte, n)
	f.host[&b[0]] = true
	return b, nil
}

func (f *fakeDevice) HostFree(b []byte) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	delete(f.host, &b[0])
	return f.called("HostFree")
}

// at returns the device bytes [p, p+n), or an error like the driver's for
// an address outside every allocation.
func (f *fakeDevice) at(p uint64, n int) ([]byte, error) {
	for base, m := range f.mem {
		if p >= base && p+uint64(n) <= base+uint64(len(m)) {
			return m[p-base : p-base+uint64(n)], nil
		}
	}
	return nil, &Error{Call: "cuMemcpy", Result: 1}
}

func (f *fakeDevice) CopyHtoD(dst uint64, src []byte) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	m, err := f.at(dst, len(src))
	if err != nil {
		return err
	}
	copy(m, src)
	return f.called("CopyHtoD")
}

func (f *fakeDevice) CopyDtoH(dst []byte, src uint64) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	m, err := f.at(src, len(dst))
	if err != nil {
		return err
	}
	copy(dst, m)
	return f.called("CopyDtoH")
}

func (f *fakeDevice) live() (device, host int) {
	f.mu.Lock()
	defer f.mu.Unlock()
	return len(f.mem), len(f.host)
}

func fdOpen(fd int) bool {
	_, err := unix.FcntlInt(uintptr(fd), unix.F_GETFD, 0)
	return err == nil
}

func TestNewArenaAllocatesOnceAndExportsEverything(t *testing.T) {
	dev := newFakeDevice()
	a, err := newArena(dev, 3<<20+5, 1<<20)
	if err != nil {
		t.Fatal(err)
	}
	if a.Size() != 4<<20 {
		t.Errorf("Size() = %d, want 4 MiB (rounded up to 2 MiB)", a.Size())
	}
	if a.Kind() != "cuda" || a.Host() != nil || a.Device().Name != "Fake H200" {
		t.Errorf("Kind %q, Host %v, Device %+v", a.Kind(), a.Host(), a.Device())
	}
	count := func(call string) (n int) {
		for _, c := range dev.calls {
			if c == call {
				n++
			}
		}
		return n
	}
	if count("Alloc") != 1 || count("HostAlloc") != 1 {
		t.Errorf("calls %v: want one device and one pinned host allocation", dev.calls)
	}
	if !dev.syncMemop[a.Base()] {
		t.Error("SYNC_MEMOPS was not set on the arena")
	}
	h, err := a.IPCHandle()
	if err != nil || !bytes.HasPrefix(h[:], []byte(fmt.Sprintf("ipc:%#x", a.Base()))) {
		t.Errorf("IPCHandle = %q, %v: want the handle of the arena's base", h[:16], err)
	}
	fd, off, err := a.DMABuf()
	if err != nil || fd < 0 || off != 0 || !fdOpen(fd) {
		t.Fatalf("DMABuf = %d, %d, %v", fd, off, err)
	}
	if len(a.BounceArea()) != 1<<20 {
		t.Errorf("bounce area of %d bytes", len(a.BounceArea()))
	}

	if err := a.Close(); err != nil {
		t.Fatal(err)
	}
	if err := a.Close(); err != nil {
		t.Fatalf("second Close: %v", err)
	}
	if fdOpen(fd) {
		t.Error("Close left the dmabuf descriptor open")
	}
	if d, h := dev.live(); d != 0 || h != 0 {
		t.Errorf("after Close %d device and %d host allocations are live", d, h)
	}
	last := dev.calls[len(dev.calls)-2:]
	if !slices.Equal(last, []string{"HostFree", "Free"}) {
		t.Errorf("Close ended with %v; want the bounce area freed, then the device memory", last)
	}
}

func TestNewArenaRecordsWhyIPCAndDMABufAreMissing(t *testing.T) {
	dev := newFakeDevice()
	dev.fail["IPCHandle"] = &Error{Call: "cuIpcGetMemHandle", Result: Result(801)}
	dev.fail["ExportDMABuf"] = errors.New("cuda:0 (Fake H200) reports CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED=0")
	a, err := newArena(dev, 2<<20, 1<<20)
	if err != nil {
		t.Fatalf("missing IPC or dmabuf must not stop the arena: %v", err)
	}
	defer a.Close()
	if _, err := a.IPCHandle(); !errors.Is(err, Result(801)) || !strings.Contains(err.Error(), "upload staging still works") {
		t.Errorf("IPCHandle error = %v", err)
	}
	if fd, _, err := a.DMABuf(); fd != -1 || err == nil || !strings.Contains(err.Error(), "DMA_BUF_SUPPORTED=0") {
		t.Errorf("DMABuf = %d, %v", fd, err)
	}
}

func TestNewArenaFailuresFreeWhatWasAllocated(t *testing.T) {
	for _, c := range []struct {
		fail string
		want []string
	}{
		{"Alloc", []string{"allocating an arena", "nvidia-smi", "smaller arena"}},
		{"SetSyncMemops", []string{"CUDA_ERROR_OUT_OF_MEMORY"}},
		{"HostAlloc", []string{"pinning", "smaller bounce area"}},
	} {
		t.Run(c.fail, func(t *testing.T) {
			dev := newFakeDevice()
			dev.fail[c.fail] = &Error{Call: "cuX", Result: ErrorOutOfMemory}
			_, err := newArena(dev, 8<<20, 1<<20)
			if !errors.Is(err, ErrorOutOfMemory) {
				t.Fatalf("want the driver's error, got %v", err)
			}
			for _, w := range c.want {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("message %q does not say %q", err, w)
				}
			}
			if d, h := dev.live(); d != 0 || h != 0 {
				t.Errorf("%d device and %d host allocations leaked", d, h)
			}
		})
	}
	dev := newFakeDevice()
	if _, err := newArena(dev, 2<<30, 1<<20); err == nil || !strings.Contains(err.Error(), "does not fit") {
		t.Errorf("an arena larger than the GPU: %v", err)
	}
	if len(dev.calls) != 0 {
		t.Errorf("an arena that cannot fit still called %v", dev.calls)
	}
	if _, err := newArena(dev, 0, 1<<20); err == nil {
		t.Error("a zero-sized arena was accepted")
	}
}

func TestArenaCopiesInAndOutWithinBounds(t *testing.T) {
	dev := newFakeDevice()
	a, err := newArena(dev, 2<<20, 1<<20)
	if err != nil {
		t.Fatal(err)
	}
	defer a.Close()
	data := bytes.Repeat([]byte("ferry"), 1000)
	end := a.Size() - int64(len(data))
	for _, off := range []int64{0, 12345, end} {
		if err := a.CopyIn(off, data); err != nil {
			t.Fatal(err)
		}
		got := make([]byte, len(data))
		if err := a.CopyOut(got, off); err != nil || !bytes.Equal(got, data) {
			t.Fatalf("round trip at %d: %v", off, err)
		}
	}
	for _, off := range []int64{-1, end + 1} {
		if err := a.CopyIn(off, data); err == nil || !strings.Contains(err.Error(), "outside") {
			t.Errorf("CopyIn at %d: %v", off, err)
		}
		if err := a.CopyOut(make([]byte, len(data)), off); err == nil {
			t.Errorf("CopyOut at %d: no error", off)
		}
	}
}

func TestBounceLendsPinnedMemoryThenFallsBack(t *testing.T) {
	dev := newFakeDevice()
	a, err := newArena(dev, 2<<20, 64<<10)
	if err != nil {
		t.Fatal(err)
	}
	defer a.Close()
	area := a.BounceArea()
	inArea := func(b []byte) bool { return sameBacking(area, b) }

	bounce := func(n int64) ([]byte, func()) {
		t.Helper()
		b, release, err := a.Bounce(n)
		if err != nil {
			t.Fatalf("Bounce(%d): %v", n, err)
		}
		return b, release
	}
	b1, r1 := bounce(64 << 10) // the whole area
	if len(b1) != 64<<10 || cap(b1) != 64<<10 || !inArea(b1) {
		t.Fatalf("first bounce buffer (len %d, cap %d) is not in the pinned area", len(b1), cap(b1))
	}
	b2, r2 := bounce(1 << 20)
	if inArea(b2) || len(b2) != 1<<20 || a.BounceFallbacks() != 1 {
		t.Fatalf("second buffer in area=%v, fallbacks %d", inArea(b2), a.BounceFallbacks())
	}
	// Pageable memory is lent up to the arena's size (2 MiB): 1 MiB is,
	// so 1 MiB more fits and a byte more does not.
	if _, _, err := a.Bounce(1<<20 + 1); err == nil || !strings.Contains(err.Error(), "the pinned bounce area (65536 bytes) is lent out and 1048576 bytes of pageable memory stage other copies, of at most the arena's 2097152") {
		t.Fatalf("a copy past the pageable bound: %v", err)
	}
	b3, r3 := bounce(1 << 20)
	if inArea(b3) || a.BounceFallbacks() != 2 {
		t.Fatalf("third buffer in area=%v, fallbacks %d", inArea(b3), a.BounceFallbacks())
	}
	// The peak counts pinned and pageable bytes lent together, not the
	// copy refused.
	if got := a.StagingPeak(); got != 64<<10+2<<20 {
		t.Fatalf("staging peak %d with 64 KiB pinned and 2 MiB pageable lent, want %d", got, 64<<10+2<<20)
	}
	r3()
	r2()
	// With no pageable memory lent, one copy of any size is (a CUDA
	// region's may be larger than the arena): nothing is too large to
	// stage.
	big, rbig := bounce(4 << 20)
	if len(big) != 4<<20 || inArea(big) {
		t.Fatalf("a copy larger than the arena: %d bytes, in area=%v", len(big), inArea(big))
	}
	if _, _, err := a.Bounce(1); err == nil {
		t.Fatal("a byte more beside a copy larger than the arena was lent")
	}
	rbig()
	r1()
	b4, r4 := bounce(64 << 10)
	if !inArea(b4) {
		t.Fatal("released space was not lent again")
	}
	r4()
	if b, r := bounce(0); len(b) != 0 || a.BounceFallbacks() != 3 {
		t.Fatalf("Bounce(0) = %d bytes, fallbacks %d", len(b), a.BounceFallbacks())
	} else {
		r()
	}
	// The most lent at once was the 4 MiB copy beside the pinned 64 KiB,
	// the two pageable MiB released before it: releases count down.
	if got := a.StagingPeak(); got != 4<<20+64<<10 {
		t.Fatalf("staging peak %d, want %d", got, 4<<20+64<<10)
	}
}

func sameBacking(area, b []byte) bool {
	for i := range area {
		if &area[i] == &b[0] {
			return true
		}
	}
	return false
}

// The arena package's Filler and Readable over a device arena: the paths
// the daemon's upload, receive and send take.
func TestArenaSlicesOfDeviceMemoryThroughTheArenaPackage(t *testing.T) {
	dev := newFakeDevice()
	mem, err := newArena(dev, 2<<20, 1<<20)
	if err != nil {
		t.Fatal(err)
	}
	a, err := arena.New(mem, 256)
	if err != nil {
		t.Fatal(err)
	}
	defer a.Close()
	s, err := a.Alloc(1000)
	if err != nil {
		t.Fatal(err)
	}
	if a.Addr(s) != mem.Base()+uint64(s.Offset) {
		t.Fatalf("Addr = %#x, want the device pointer %#x + %d", a.Addr(s), mem.Base(), s.Offset)
	}
	f, err := arena.NewFiller(mem, s, 0, 1000, 1000)
	if err != nil {
		t.Fatal(err)
	}
	want := bytes.Repeat([]byte{0xab}, 1000)
	dst, _ := f.Next()
	copy(dst, want)
	if rest, err := f.Next(); len(rest) != 0 || err != nil {
		t.Fatalf("after its one piece the Filler lent %d bytes, %v", len(rest), err)
	}
	f.Close()
	src, release, err := arena.Readable(mem, s, 0, 1000)
	if err != nil || !bytes.Equal(src, want) {
		t.Fatalf("read back %d bytes, %v", len(src), err)
	}
	release()
	if !slices.Contains(dev.calls, "CopyHtoD") || !slices.Contains(dev.calls, "CopyDtoH") {
		t.Fatalf("calls %v: the bytes did not move by copies", dev.calls)
	}
}
