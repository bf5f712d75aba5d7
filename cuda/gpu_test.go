package cuda_test

// These tests run on a real GPU: they skip without one, and make test-gpu
// runs them with FERRY_REQUIRE_GPU=1 so that a missing GPU fails instead.

import (
	"bytes"
	"context"
	"encoding/base64"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"os/exec"
	"regexp"
	"strconv"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/ferry-project/ferry/cuda"
	"github.com/ferry-project/ferry/cuda/cudatest"
)

const MiB = 1 << 20

func random(n int, seed uint64) []byte {
	r := rand.New(rand.NewPCG(seed, seed^0x9e3779b97f4a7c15))
	b := make([]byte, n)
	for i := range b {
		b[i] = byte(r.Uint32())
	}
	return b
}

func TestGPUDeviceDescription(t *testing.T) {
	dev := cudatest.Device(t)
	in := dev.Info()
	drv, _ := cuda.Load()
	t.Logf("%v: driver CUDA %s, uuid %s, pci %s, %d MiB, gpudirect_rdma=%v dmabuf=%v vmm=%v unified_addressing=%v",
		in, drv.Version(), in.UUID, in.PCIBusID, in.TotalMemory/MiB, in.GPUDirectRDMA, in.DMABuf, in.VMM, in.UnifiedAddressing)
	if in.Name == "" || in.TotalMemory < 1<<30 || !in.UnifiedAddressing {
		t.Errorf("implausible description %+v", in)
	}
	if !regexp.MustCompile(`^GPU-[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$`).MatchString(in.UUID) {
		t.Errorf("UUID %q is not GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx", in.UUID)
	}
	if _, err := os.Stat("/sys/bus/pci/devices/" + in.PCIBusID); err != nil {
		t.Errorf("PCI bus id %q is not a device in sysfs: %v", in.PCIBusID, err)
	}
	n, err := drv.DeviceCount()
	if err != nil {
		t.Fatal(err)
	}
	if _, err := drv.Open(n); !errors.Is(err, cuda.ErrNoDevice) || !regexp.MustCompile(fmt.Sprintf("cuda:%d does not exist.*%d CUDA device", n, n)).MatchString(err.Error()) {
		t.Errorf("opening cuda:%d of %d: %v", n, n, err)
	}
}

func TestGPUArenaCopiesRoundTrip(t *testing.T) {
	dev := cudatest.Device(t)
	a, err := cuda.NewArena(dev, 64*MiB, 16*MiB)
	if err != nil {
		t.Fatal(err)
	}
	defer a.Close()
	data := random(3*MiB+17, 1)
	for _, off := range []int64{0, 4096 + 3, a.Size() - int64(len(data))} {
		// From ordinary Go memory, and through the pinned area.
		if err := a.CopyIn(off, data); err != nil {
			t.Fatal(err)
		}
		got := make([]byte, len(data))
		if err := a.CopyOut(got, off); err != nil || !bytes.Equal(got, data) {
			t.Fatalf("round trip at offset %d: %v", off, err)
		}
		buf, release, err := a.Bounce(int64(len(data)))
		if err != nil {
			t.Fatal(err)
		}
		clear(buf)
		if err := a.CopyOut(buf, off); err != nil || !bytes.Equal(buf, data) {
			t.Fatalf("round trip through the pinned area at offset %d: %v", off, err)
		}
		release()
	}
	if a.BounceFallbacks() != 0 {
		t.Errorf("%d bounce fallbacks for buffers that fit the pinned area", a.BounceFallbacks())
	}
	if err := a.CopyIn(a.Size()-1, []byte{1, 2}); err == nil {
		t.Error("a copy past the end was accepted")
	}
	if _, err := a.IPCHandle(); err != nil {
		t.Errorf("no IPC handle: %v", err)
	}
}

// A multi-GiB arena, allocated once; its cost per GiB is logged (measured,
// not asserted). Bytes beyond 4 GiB prove the offsets are 64-bit throughout.
func TestGPUArenaMultiGiB(t *testing.T) {
	dev := cudatest.Device(t)
	gib := int64(8)
	if v, err := strconv.Atoi(os.Getenv("FERRY_GPU_ARENA_GIB")); err == nil && v > 0 {
		gib = int64(v)
	}
	start := time.Now()
	a, err := cuda.NewArena(dev, gib<<30, 64*MiB)
	took := time.Since(start)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("arena of %d GiB on %v: allocated and set up in %s, %.2f ms per GiB", gib, dev.Info(), took.Round(time.Microsecond),
		float64(took.Microseconds())/1000/float64(gib))
	data := random(MiB, 2)
	for _, off := range []int64{0, 4<<30 + 12345, a.Size() - MiB} {
		if off+MiB > a.Size() {
			continue
		}
		if err := a.CopyIn(off, data); err != nil {
			t.Fatal(err)
		}
		got := make([]byte, MiB)
		if err := a.CopyOut(got, off); err != nil || !bytes.Equal(got, data) {
			t.Fatalf("round trip at offset %d: %v", off, err)
		}
	}
	start = time.Now()
	if err := a.Close(); err != nil {
		t.Fatal(err)
	}
	t.Logf("freed in %s", time.Since(start).Round(time.Microsecond))
}

const ipcEnv = "FERRY_TEST_IPC_HANDLE"

// A second process maps the arena by its IPC handle, checks what this one
// wrote, and writes its own bytes, which this one then reads: what a torch
// client does with the ipc_handle ferryd hands out.
func TestGPUIPCInASecondProcess(t *testing.T) {
	dev := cudatest.Device(t)
	a, err := cuda.NewArena(dev, 64*MiB, 8*MiB)
	if err != nil {
		t.Fatal(err)
	}
	defer a.Close()
	h, err := a.IPCHandle()
	if err != nil {
		t.Fatal(err)
	}
	if err := a.CopyIn(0, random(MiB, 3)); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	child := exec.CommandContext(ctx, os.Args[0], "-test.run=^TestGPUIPCChild$", "-test.v", "-test.count=1")
	child.Env = append(os.Environ(), ipcEnv+"="+base64.StdEncoding.EncodeToString(h[:]))
	out, err := child.CombinedOutput()
	t.Logf("child process (pid %d):\n%s", child.Process.Pid, out)
	if err != nil || !bytes.Contains(out, []byte("--- PASS: TestGPUIPCChild")) {
		t.Fatalf("the child process failed: %v", err)
	}
	for _, line := range bytes.Split(out, []byte("\n")) {
		if bytes.HasPrefix(line, []byte("== GPU region dmabuf")) {
			fmt.Printf("%s\n", line) // for make test-gpu's report
		}
	}
	got := make([]byte, MiB)
	if err := a.CopyOut(got, MiB); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, random(MiB, 4)) {
		t.Fatal("the child's bytes at offset 1 MiB did not arrive in the arena")
	}
}

// TestGPUIPCChild is the second process of TestGPUIPCInASecondProcess.
func TestGPUIPCChild(t *testing.T) {
	enc := os.Getenv(ipcEnv)
	if enc == "" {
		t.Skip("runs only as the child of TestGPUIPCInASecondProcess")
	}
	raw, err := base64.StdEncoding.DecodeString(enc)
	if err != nil || len(raw) != len(cuda.IPCHandle{}) {
		t.Fatalf("bad handle %q: %v", enc, err)
	}
	var h cuda.IPCHandle
	copy(h[:], raw)
	dev := cudatest.Device(t)
	base, err := dev.OpenIPC(h)
	if err != nil {
		t.Fatal(err)
	}
	open := true
	defer func() {
		if open {
			dev.CloseIPC(base)
		}
	}()
	got := make([]byte, MiB)
	if err := dev.CopyDtoH(got, base); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, random(MiB, 3)) {
		t.Fatal("the parent's bytes are not visible through the IPC mapping")
	}
	if err := dev.CopyHtoD(base+MiB, random(MiB, 4)); err != nil {
		t.Fatal(err)
	}
	open = false
	if err := dev.CloseIPC(base); err != nil { // a handle opens once per process: the region opens it again
		t.Fatal(err)
	}
	regionDMABuf(t, dev, h)
}

// regionDMABuf: a region of the allocation h names, lent at an offset inside a page as a tensor of a caching allocator's
// segment may be, exported as a dmabuf as ferryd exports GPU memory an
// engine registered: the pages holding it, from this process's IPC
// mapping, the region at its offset in them. Whether the driver exports
// IPC-opened memory is printed ("== GPU region dmabuf") for make
// test-gpu's report: where it does not, ferryd registers such memory by
// peermem, saying why.
func regionDMABuf(t *testing.T, dev *cuda.Device, h cuda.IPCHandle) {
	const off, n = MiB + 100, MiB
	r, err := cuda.OpenRegion(dev, h, off, n, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	fd, at, err := r.ExportDMABuf()
	switch {
	case err != nil && !dev.Info().DMABuf:
		fmt.Printf("== GPU region dmabuf: none: %v reports no dmabuf support: %v\n", dev.Info(), err)
	case err != nil:
		fmt.Printf("== GPU region dmabuf: the driver did not export IPC-opened memory (ferryd registers it by peermem): %v\n", err)
	default:
		defer unix.Close(fd)
		if want := r.Base() % uint64(os.Getpagesize()); at != want {
			t.Errorf("the region lies at offset %d of its dmabuf, want %d", at, want)
		}
		link, _ := os.Readlink(fmt.Sprintf("/proc/self/fd/%d", fd))
		fmt.Printf("== GPU region dmabuf: exported: %d bytes at offset %d of IPC-opened memory, the region at offset %d of fd %d (%s)\n", n, off, at, fd, link)
	}
}

func TestGPUDMABufExport(t *testing.T) {
	dev := cudatest.Device(t)
	a, err := cuda.NewArena(dev, 64*MiB, 8*MiB)
	if err != nil {
		t.Fatal(err)
	}
	defer a.Close()
	fd, off, err := a.DMABuf()
	if !dev.Info().DMABuf {
		if err == nil {
			t.Fatal("a dmabuf was exported from a device that reports no dmabuf support")
		}
		t.Skipf("%v has no dmabuf support; the arena says: %v", dev.Info(), err)
	}
	if err != nil {
		t.Fatalf("%v reports dmabuf support but the export failed: %v", dev.Info(), err)
	}
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil || off != 0 {
		t.Fatalf("dmabuf fd %d (offset %d): %v", fd, off, err)
	}
	link, _ := os.Readlink(fmt.Sprintf("/proc/self/fd/%d", fd))
	t.Logf("dmabuf fd %d -> %s, %d bytes from device pointer %#x", fd, link, a.Size(), a.Base())
}

// BenchmarkCopy times ferry's copies the way the daemon makes them: between
// the pinned bounce area and the device arena. make test-gpu prints them
// beside torch's copies of the same sizes.
func BenchmarkCopy(b *testing.B) {
	dev := cudatest.Device(b)
	const most = 256 * MiB
	a, err := cuda.NewArena(dev, most, most)
	if err != nil {
		b.Fatal(err)
	}
	defer a.Close()
	buf, release, err := a.Bounce(most)
	if err != nil {
		b.Fatal(err)
	}
	defer release()
	for _, size := range []int{4 * MiB, 64 * MiB, 256 * MiB} {
		name := fmt.Sprintf("%dMiB", size/MiB)
		b.Run("HtoD/"+name, func(b *testing.B) {
			b.SetBytes(int64(size))
			for b.Loop() {
				if err := a.CopyIn(0, buf[:size]); err != nil {
					b.Fatal(err)
				}
			}
		})
		b.Run("DtoH/"+name, func(b *testing.B) {
			b.SetBytes(int64(size))
			for b.Loop() {
				if err := a.CopyOut(buf[:size], 0); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}
