package cuda

import (
	"errors"
	"fmt"
	"sync"
	"sync/atomic"

	"golang.org/x/sys/unix"

	"github.com/ferry-project/ferry/arena"
)

// device is what an Arena needs from a GPU. *Device implements it; tests
// put a fake beneath this seam, and make test-gpu runs the real one.
type device interface {
	Info() Info
	Alloc(n int64) (uint64, error)
	Free(p uint64) error
	SetSyncMemops(p uint64) error
	IPCHandle(p uint64) (IPCHandle, error)
	ExportDMABuf(p uint64, n int64) (int, error)
	HostAlloc(n int64) ([]byte, error)
	HostFree(b []byte) error
	CopyHtoD(dst uint64, src []byte) error
	CopyDtoH(dst []byte, src uint64) error
}

// arenaGranule is what the arena's size is rounded up to, so the range
// exported as a dmabuf is page aligned at both ends whatever the host page
// size (4 KiB or 64 KiB).
const arenaGranule = 2 << 20

// bounceAlign keeps bounce buffers page aligned, as DMA engines prefer.
const bounceAlign = 4096

// Arena is ferryd's arena in GPU memory: one cuMemAlloc of the whole size,
// made once. It is an arena.Memory and an arena.Copier: bytes move in and
// out by copies, staged in a pinned host bounce area. Local clients map it
// with its IPC handle; a NIC registers it through its dmabuf (or, with
// nvidia-peermem, its device pointer) or, without GPUDirect, registers the
// bounce area once and copies around each transfer.
type Arena struct {
	dev  device
	base uint64
	size int64

	ipc    IPCHandle
	ipcErr error // why clients cannot map the arena, if they cannot

	dmabufFD  int   // -1 when not exported
	dmabufErr error // why not

	bounce      []byte // pinned host memory
	bounceAlloc *arena.Allocator
	fallbacks   atomic.Int64
	// Host memory lent to stage copies: lent is all of it, pinned and
	// pageable, and peak the most lent at once (status shows it);
	// pageable is what was lent while the pinned area had no room, held
	// to the arena's size, one host copy of all it holds.
	stagingMu            sync.Mutex
	lent, peak, pageable int64
	// Bytes copied into and out of the arena: what a NIC that reaches
	// it directly spares.
	copiedIn, copiedOut atomic.Int64

	closeOnce sync.Once
	closeErr  error
}

// NewArena allocates size bytes (rounded up to 2 MiB) on dev with a pinned
// host bounce area of bounce bytes. It exports an IPC handle and, where the
// device supports it, a dmabuf; their failures are recorded (IPCError,
// DMABufError), not fatal: upload staging and the TCP transport need
// neither.
func NewArena(dev *Device, size, bounce int64) (*Arena, error) {
	return newArena(dev, size, bounce)
}

func newArena(dev device, size, bounce int64) (_ *Arena, err error) {
	if size <= 0 || bounce <= 0 {
		return nil, fmt.Errorf("arena of %d bytes with a bounce area of %d bytes: both must be positive", size, bounce)
	}
	info := dev.Info()
	size = (size + arenaGranule - 1) / arenaGranule * arenaGranule
	if size > info.TotalMemory {
		return nil, fmt.Errorf("%v: an arena of %d bytes does not fit its %d bytes of memory: ask for a smaller arena", info, size, info.TotalMemory)
	}
	bounce = (bounce + bounceAlign - 1) / bounceAlign * bounceAlign
	a := &Arena{dev: dev, size: size, dmabufFD: -1}
	if a.base, err = dev.Alloc(size); err != nil {
		if errors.Is(err, ErrorOutOfMemory) {
			return nil, fmt.Errorf("%v: allocating an arena of %d bytes: %w (other processes hold its memory: check nvidia-smi, or ask for a smaller arena)", info, size, err)
		}
		return nil, fmt.Errorf("%v: allocating an arena of %d bytes: %w", info, size, err)
	}
	defer func() {
		if err != nil {
			a.Close()
		}
	}()
	if err := dev.SetSyncMemops(a.base); err != nil {
		return nil, err
	}
	if a.bounce, err = dev.HostAlloc(bounce); err != nil {
		return nil, fmt.Errorf("%v: pinning a %d-byte host bounce area: %w (ask for a smaller bounce area)", info, bounce, err)
	}
	if a.bounceAlloc, err = arena.NewAllocator(bounce, bounceAlign); err != nil {
		return nil, err
	}
	if a.ipc, a.ipcErr = dev.IPCHandle(a.base); a.ipcErr != nil {
		a.ipcErr = fmt.Errorf("no CUDA IPC handle, so clients cannot map the arena (upload staging still works): %w", a.ipcErr)
	}
	if a.dmabufFD, a.dmabufErr = dev.ExportDMABuf(a.base, size); a.dmabufErr != nil {
		a.dmabufFD = -1
	}
	return a, nil
}

// Base is the device pointer of the arena's first byte.
func (a *Arena) Base() uint64 { return a.base }

// Size is the allocated size, a multiple of 2 MiB.
func (a *Arena) Size() int64 { return a.size }

// Host is nil: device memory is reached through copies or an IPC mapping.
func (a *Arena) Host() []byte { return nil }

// Kind is "cuda".
func (a *Arena) Kind() string { return "cuda" }

// Device describes the GPU holding the arena.
func (a *Arena) Device() Info { return a.dev.Info() }

// IPCHandle is the handle a local client opens (cuIpcOpenMemHandle) to map
// the whole arena; a slice at offset o is at the mapped base + o. The error
// says why there is none.
func (a *Arena) IPCHandle() (IPCHandle, error) { return a.ipc, a.ipcErr }

// DMABuf is the arena exported as a dmabuf, for ibv_reg_dmabuf_mr(pd,
// offset, Size(), Base(), fd, access): the arena starts at offset 0 of it.
// The Arena owns fd and closes it in Close, so a registration must be
// deregistered first. The error says why there is none.
func (a *Arena) DMABuf() (fd int, offset int64, err error) {
	return a.dmabufFD, 0, a.dmabufErr
}

// BounceArea is the pinned host memory that copies are staged in: the area
// a NIC registers once when it cannot reach GPU memory directly.
func (a *Arena) BounceArea() []byte { return a.bounce }

// CopiedBytes is the bytes copied into the arena and the regions staged
// through it (host to device) and out of them (device to host) since it
// was made.
func (a *Arena) CopiedBytes() (in, out int64) { return a.copiedIn.Load(), a.copiedOut.Load() }

// Copied implements Staging: a region's copies count with the arena's.
func (a *Arena) Copied(in, out int64) {
	a.copiedIn.Add(in)
	a.copiedOut.Add(out)
}

var _ Staging = (*Arena)(nil)

// BounceFallbacks counts copies staged in ordinary (pageable) memory
// because the pinned area had no room; a steady rise says --bounce-size is
// too small for the traffic.
func (a *Arena) BounceFallbacks() int64 { return a.fallbacks.Load() }

func (a *Arena) check(off, n int64) error {
	if off < 0 || n < 0 || off+n > a.size || off+n < off {
		return fmt.Errorf("range [%d, +%d) is outside the %d-byte device arena", off, n, a.size)
	}
	return nil
}

// CopyIn copies src to offset off (cuMemcpyHtoD); it has landed when
// CopyIn returns.
func (a *Arena) CopyIn(off int64, src []byte) error {
	if err := a.check(off, int64(len(src))); err != nil {
		return err
	}
	if err := a.dev.CopyHtoD(a.base+uint64(off), src); err != nil {
		return err
	}
	a.copiedIn.Add(int64(len(src)))
	return nil
}

// CopyOut copies len(dst) bytes at offset off into dst (cuMemcpyDtoH).
func (a *Arena) CopyOut(dst []byte, off int64) error {
	if err := a.check(off, int64(len(dst))); err != nil {
		return err
	}
	if err := a.dev.CopyDtoH(dst, a.base+uint64(off)); err != nil {
		return err
	}
	a.copiedOut.Add(int64(len(dst)))
	return nil
}

// Bounce lends n bytes of the pinned area, or of ordinary memory when the
// area has no room, where the copy is slower. Ordinary memory is lent
// only while the bytes lent so lie within the arena's size (any one copy
// when none is lent, so no copy is too large to stage). Copies in and
// out of the arena's distinct slots and entries never pass that, however
// many the transport's stripes make at once; without the bound, writes
// crossing one another (or a CUDA region's copies) could take ferryd's
// memory without limit. Past it the copy is refused, to be tried again.
func (a *Arena) Bounce(n int64) ([]byte, func(), error) {
	if n <= 0 {
		return nil, func() {}, nil
	}
	if off, err := a.bounceAlloc.Alloc(n); err == nil {
		a.lend(n, false)
		return a.bounce[off : off+n : off+n], func() {
			_, _ = a.bounceAlloc.Free(off)
			a.lend(-n, false)
		}, nil
	}
	limit := a.size
	a.stagingMu.Lock()
	lent := a.pageable
	if lent > 0 && n > limit-lent {
		a.stagingMu.Unlock()
		return nil, nil, fmt.Errorf("%w (%d bytes, to or from the GPU): the pinned bounce area (%d bytes) is lent out and %d bytes of pageable memory stage other copies, of at most the arena's %d: try again once copies in flight end, or raise --bounce-size", arena.ErrNoStaging, n, len(a.bounce), lent, limit)
	}
	a.lendLocked(n, true)
	a.stagingMu.Unlock()
	a.fallbacks.Add(1)
	return make([]byte, n), func() { a.lend(-n, true) }, nil
}

// lend counts n bytes more lent to stage a copy (fewer, when negative).
func (a *Arena) lend(n int64, pageable bool) {
	a.stagingMu.Lock()
	a.lendLocked(n, pageable)
	a.stagingMu.Unlock()
}

func (a *Arena) lendLocked(n int64, pageable bool) {
	a.lent += n
	a.peak = max(a.peak, a.lent)
	if pageable {
		a.pageable += n
	}
}

// StagingPeak is the most host memory (pinned and pageable) lent at once
// to stage copies since the arena was made: past the bounce area's size,
// copies spilled into pageable memory.
func (a *Arena) StagingPeak() int64 {
	a.stagingMu.Lock()
	defer a.stagingMu.Unlock()
	return a.peak
}

// Close frees the dmabuf descriptor, the bounce area and the device memory.
// Nothing may use them afterwards: registrations must be deregistered, IPC
// mappings closed and bounce buffers released first.
func (a *Arena) Close() error {
	a.closeOnce.Do(func() {
		var errs []error
		if a.dmabufFD >= 0 {
			errs = append(errs, unix.Close(a.dmabufFD))
		}
		if a.bounce != nil {
			errs = append(errs, a.dev.HostFree(a.bounce))
		}
		errs = append(errs, a.dev.Free(a.base))
		a.closeErr = errors.Join(errs...)
	})
	return a.closeErr
}

// The arena package sees the GPU arena through these interfaces.
var _ arena.Copier = (*Arena)(nil)
