package cuda

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/ferry-project/ferry/internal/fakecuda"
)

// buildFakeDriver builds the stand-in libcuda.so.1 (internal/fakecuda), so
// the whole call path (dlopen, the symbol table, the C helpers, the
// per-device thread with its context) runs here without a GPU.
func buildFakeDriver(t *testing.T, variant string) string {
	t.Helper()
	lib := filepath.Join(fakecuda.Build(t, variant), "libcuda.so.1")
	// Result names come from whichever driver loaded first; each test
	// starts and ends with none.
	loaded.Store(nil)
	t.Cleanup(func() { loaded.Store(nil) })
	return lib
}

func TestFakeDriverRunsTheRealCallPath(t *testing.T) {
	d, err := load(buildFakeDriver(t, fakecuda.Working))
	if err != nil {
		t.Fatal(err)
	}
	if d.Version() != "12.4" {
		t.Errorf("Version() = %q", d.Version())
	}
	if n, err := d.DeviceCount(); n != 2 || err != nil {
		t.Fatalf("DeviceCount = %d, %v", n, err)
	}
	if _, err := d.Open(2); !errors.Is(err, ErrNoDevice) || !strings.Contains(err.Error(), "cuda:2 does not exist: the driver sees 2 CUDA device(s) (cuda:0 to cuda:1)") {
		t.Errorf("Open(2): %v", err)
	}
	dev, err := d.Open(0)
	if err != nil {
		t.Fatal(err)
	}
	want := Info{Ordinal: 0, Name: "Fake GPU 0", UUID: "GPU-00010203-0405-0607-0809-0a0b0c0d0e0f", PCIBusID: "0000:3b:00.0",
		TotalMemory: 1 << 30, DMABuf: true, VMM: true, UnifiedAddressing: true}
	if dev.Info() != want {
		t.Errorf("Info() = %+v\nwant     %+v", dev.Info(), want)
	}

	// The fake refuses memory calls without a current context and copies
	// into memory without SYNC_MEMOPS: these succeed only if the device's
	// thread holds its context and the arena set the attribute.
	a, err := NewArena(dev, 8<<20, 1<<20)
	if err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	errs := make(chan error, 8)
	for i := range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			data := bytes.Repeat([]byte{byte(i + 1)}, 256<<10)
			buf, release, err := a.Bounce(int64(len(data)))
			if err != nil {
				errs <- err
				return
			}
			defer release()
			copy(buf, data)
			off := int64(i) * (1 << 20)
			if err := a.CopyIn(off, buf); err != nil {
				errs <- err
				return
			}
			got := make([]byte, len(data))
			if err := a.CopyOut(got, off); err != nil || !bytes.Equal(got, data) {
				errs <- errors.Join(err, errors.New("round trip differs"))
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}

	// The IPC handle crosses into C by value and back intact.
	h, err := a.IPCHandle()
	if err != nil {
		t.Fatal(err)
	}
	if base, err := dev.OpenIPC(h); err != nil || base != a.Base() {
		t.Errorf("OpenIPC = %#x, %v; want the arena's base %#x", base, err, a.Base())
	} else if err := dev.CloseIPC(base); err != nil {
		t.Error(err)
	}
	if fd, _, err := a.DMABuf(); err != nil || !fdOpen(fd) {
		t.Errorf("DMABuf = %d, %v", fd, err)
	}

	// A driver error is named by the driver and sorted as ErrCUDA.
	err = dev.CopyHtoD(0xdead0000, []byte{1})
	var ce *Error
	if !errors.As(err, &ce) || ce.Call != "cuMemcpyHtoD_v2" || !errors.Is(err, ErrCUDA) ||
		!strings.Contains(err.Error(), "cuda:0: cuMemcpyHtoD_v2: CUDA_ERROR_INVALID_VALUE (invalid argument)") {
		t.Errorf("a copy to a bad address: %v", err)
	}

	// A second device has its own thread and context.
	dev1, err := d.Open(1)
	if err != nil {
		t.Fatal(err)
	}
	p, err := dev1.Alloc(4096)
	if err != nil {
		t.Fatal(err)
	}
	if err := errors.Join(dev1.Free(p), dev1.Close()); err != nil {
		t.Fatal(err)
	}

	if err := errors.Join(a.Close(), dev.Close()); err != nil {
		t.Fatal(err)
	}
	if _, err := dev.Alloc(1); err == nil || !strings.Contains(err.Error(), "cuda:0: device is closed") {
		t.Errorf("Alloc after Close: %v", err)
	}
	if err := dev.Close(); err != nil {
		t.Errorf("second Close: %v", err)
	}
}

// The fake with four GPUs at the bus ids a test lays out: each is
// described without being opened, and each opened holds an arena of its
// own whose bytes stay its own.
func TestFakeDriverWithSeveralDevices(t *testing.T) {
	t.Setenv("FAKECUDA_BUS_IDS", "0000:17:00.0,0000:3D:00.0,0001:ae:1f.3,0000:c1:00.0")
	d, err := load(buildFakeDriver(t, fakecuda.Working))
	if err != nil {
		t.Fatal(err)
	}
	if n, err := d.DeviceCount(); n != 4 || err != nil {
		t.Fatalf("DeviceCount = %d, %v; want 4", n, err)
	}
	for i, want := range []string{"0000:17:00.0", "0000:3d:00.0", "0001:ae:1f.3", "0000:c1:00.0"} {
		in, err := d.Describe(i)
		if err != nil || in.PCIBusID != want || in.Ordinal != i || in.Name != fmt.Sprintf("Fake GPU %d", i) {
			t.Errorf("Describe(%d) = %+v, %v; want bus id %s", i, in, err, want)
		}
	}
	if _, err := d.Describe(4); err == nil || !strings.Contains(err.Error(), "cuda:4") {
		t.Errorf("Describe(4): %v", err)
	}
	var arenas []*Arena
	for i := range 4 {
		dev, err := d.Open(i)
		if err != nil {
			t.Fatal(err)
		}
		a, err := NewArena(dev, 2<<20, 1<<20)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() {
			a.Close()
			dev.Close()
		})
		if err := a.CopyIn(0, bytes.Repeat([]byte{byte(i + 1)}, 4096)); err != nil {
			t.Fatal(err)
		}
		arenas = append(arenas, a)
	}
	for i, a := range arenas {
		got := make([]byte, 4096)
		if err := a.CopyOut(got, 0); err != nil || !bytes.Equal(got, bytes.Repeat([]byte{byte(i + 1)}, 4096)) {
			t.Errorf("cuda:%d's arena holds %v... (%v)", i, got[:4], err)
		}
	}
}

func TestFakeDriverVariantsFailAsTheirKind(t *testing.T) {
	for _, c := range []struct {
		variant string
		kind    error
		says    []string
	}{
		{fakecuda.NoDevice, ErrNoDevice, []string{"cuInit: CUDA_ERROR_NO_DEVICE (no CUDA-capable device is detected)"}},
		{fakecuda.Stub, ErrNoDriver, []string{"cuInit: CUDA_ERROR_STUB_LIBRARY"}},
		{fakecuda.Broken, ErrNoDriver, []string{"lacks cuMemHostAlloc:", "install a newer one"}},
	} {
		t.Run(c.variant, func(t *testing.T) {
			_, err := load(buildFakeDriver(t, c.variant))
			if !errors.Is(err, c.kind) {
				t.Fatalf("want %v, got %v", c.kind, err)
			}
			for _, s := range c.says {
				if !strings.Contains(err.Error(), s) {
					t.Errorf("%q does not say %q", err, s)
				}
			}
		})
	}
}

// fakeDriverDevice opens cuda:0 of the variant of the fake driver, closed when
// t ends.
func fakeDriverDevice(t *testing.T, variant string) *Device {
	t.Helper()
	d, err := load(buildFakeDriver(t, variant))
	if err != nil {
		t.Fatal(err)
	}
	dev, err := d.Open(0)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { dev.Close() })
	return dev
}

// Without cuMemGetHandleForAddressRange (drivers before CUDA 11.7) the
// arena still works and says why there is no dmabuf.
func TestFakeDriverWithoutDMABufExport(t *testing.T) {
	dev := fakeDriverDevice(t, fakecuda.Old)
	a, err := NewArena(dev, 2<<20, 1<<20)
	if err != nil {
		t.Fatal(err)
	}
	defer a.Close()
	if fd, _, err := a.DMABuf(); fd != -1 || err == nil || !strings.Contains(err.Error(), "has no cuMemGetHandleForAddressRange: dmabuf export needs CUDA 11.7 or newer") {
		t.Errorf("DMABuf = %d, %v", fd, err)
	}
	// Nor has GPU memory lent by IPC handle.
	owner, err := dev.Alloc(1 << 20)
	if err != nil {
		t.Fatal(err)
	}
	defer dev.Free(owner)
	h, err := dev.IPCHandle(owner)
	if err != nil {
		t.Fatal(err)
	}
	r, err := OpenRegion(dev, h, 4096, 4096, &testStaging{})
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	if fd, _, err := r.ExportDMABuf(); fd != -1 || err == nil || !strings.Contains(err.Error(), "exporting the 4096-byte CUDA region as a dmabuf") || !strings.Contains(err.Error(), "CUDA 11.7") {
		t.Errorf("a region's dmabuf on a driver without export: %d, %v", fd, err)
	}
}

// A region opened by IPC handle copies in and out of the owner's
// allocation, at its offset, through the real call path.
func TestFakeDriverOpensARegionByIPCHandle(t *testing.T) {
	dev := fakeDriverDevice(t, fakecuda.Working)
	owner, err := dev.Alloc(1 << 20)
	if err != nil {
		t.Fatal(err)
	}
	defer dev.Free(owner)
	// The fake copies only into memory with SYNC_MEMOPS set, as the
	// arena sets it on its own; here the owner does.
	if err := dev.SetSyncMemops(owner); err != nil {
		t.Fatal(err)
	}
	h, err := dev.IPCHandle(owner)
	if err != nil {
		t.Fatal(err)
	}
	staging := &testStaging{}
	r, err := OpenRegion(dev, h, 4096, 64<<10, staging)
	if err != nil {
		t.Fatal(err)
	}
	data := bytes.Repeat([]byte("region"), 1000)
	if err := r.CopyIn(100, data); err != nil {
		t.Fatal(err)
	}
	// The bytes are the owner's, at the region's offset.
	got := make([]byte, len(data))
	if err := dev.CopyDtoH(got, owner+4096+100); err != nil || !bytes.Equal(got, data) {
		t.Fatalf("the owner's memory after CopyIn: %v", err)
	}
	back := make([]byte, len(data))
	if err := r.CopyOut(back, 100); err != nil || !bytes.Equal(back, data) {
		t.Fatalf("CopyOut: %v", err)
	}
	if staging.in != int64(len(data)) || staging.out != int64(len(data)) {
		t.Errorf("copies counted %d in, %d out; want %d each", staging.in, staging.out, len(data))
	}
	// Its dmabuf, through the driver's real call: the pages holding it
	// (the driver refuses unaligned ranges), the region at offset 0 of
	// them here; one at an unaligned offset too.
	if fd, off, err := r.ExportDMABuf(); err != nil || !fdOpen(fd) || off != 0 {
		t.Errorf("the region's dmabuf: fd %d at offset %d, %v", fd, off, err)
	} else {
		unix.Close(fd)
	}
	if u, err := OpenRegion(dev, h, 3*4096+100, 5000, staging); err != nil {
		t.Error(err)
	} else {
		if fd, off, err := u.ExportDMABuf(); err != nil || !fdOpen(fd) || off != u.Base()%uint64(os.Getpagesize()) {
			t.Errorf("an unaligned region's dmabuf: fd %d at offset %d, %v", fd, off, err)
		} else {
			unix.Close(fd)
		}
		u.Close()
	}
	if err := r.CopyIn(64<<10-1, []byte("xx")); err == nil || !strings.Contains(err.Error(), "outside the 65536-byte CUDA region") {
		t.Errorf("a copy past the region: %v", err)
	}
	if r.Base() != owner+4096 || r.Size() != 64<<10 || r.Kind() != "cuda" || r.Host() != nil {
		t.Errorf("region base %#x size %d kind %s", r.Base(), r.Size(), r.Kind())
	}
	if err := r.Close(); err != nil {
		t.Fatal(err)
	}
	// The allocation holds 1 MiB: a region may end at its end, not past.
	if r, err := OpenRegion(dev, h, 4096, 1<<20-4096, staging); err != nil {
		t.Errorf("a region to the allocation's end: %v", err)
	} else {
		r.Close()
	}
	for _, c := range []struct{ offset, size int64 }{{4096, 1<<20 - 4095}, {1 << 20, 1}, {2 << 20, 1}, {1, 1<<63 - 1}} {
		if _, err := OpenRegion(dev, h, c.offset, c.size, staging); err == nil || !strings.Contains(err.Error(), "runs past the allocation its IPC handle names, which holds 1048576 bytes") {
			t.Errorf("a region of %d bytes at offset %d: %v", c.size, c.offset, err)
		}
	}
	var bad IPCHandle
	if _, err := OpenRegion(dev, bad, 0, 1, staging); err == nil || !strings.Contains(err.Error(), "opening the region's CUDA IPC handle") {
		t.Errorf("a handle that names nothing: %v", err)
	}
}

// testStaging lends ordinary memory and counts the copies.
type testStaging struct{ in, out int64 }

func (s *testStaging) Bounce(n int64) ([]byte, func(), error) { return make([]byte, n), func() {}, nil }
func (s *testStaging) Copied(in, out int64)                   { s.in += in; s.out += out }
