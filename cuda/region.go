package cuda

import (
	"fmt"
	"os"
	"sync"

	"github.com/ferry-project/ferry/arena"
)

// ipcDevice is what a Region needs from a GPU: *Device implements it.
type ipcDevice interface {
	Info() Info
	OpenIPC(h IPCHandle) (uint64, error)
	AddressRange(p uint64) (base uint64, size int64, err error)
	CloseIPC(p uint64) error
	ExportDMABuf(p uint64, n int64) (int, error)
	CopyHtoD(dst uint64, src []byte) error
	CopyDtoH(dst []byte, src uint64) error
}

// Staging is what a Region borrows of the arena on its GPU: host memory
// to stage its copies in (the pinned bounce area), and the count of the
// bytes copied, so one count says what the GPU copied for ferryd.
// *Arena is one.
type Staging interface {
	Bounce(n int64) ([]byte, func(), error)
	// Copied counts in bytes copied to the device and out bytes to the
	// host.
	Copied(in, out int64)
}

// Region is GPU memory another process owns and lends ferryd: its
// allocation opened here by IPC handle, of which the region is size bytes
// at offset. It is an arena.Memory and an arena.Copier, like the arena,
// whose staging its copies borrow. Regions of one allocation share its
// opening (openings).
type Region struct {
	dev     ipcDevice
	handle  IPCHandle
	base    uint64
	size    int64
	staging Staging

	closeOnce sync.Once
	closeErr  error
}

// OpenRegion opens the allocation h names on dev and makes a region of
// size bytes at offset in it. The allocation must be on dev, and hold the
// region whole: the driver says how large it is.
func OpenRegion(dev *Device, h IPCHandle, offset, size int64, staging Staging) (*Region, error) {
	return openRegion(dev, h, offset, size, staging)
}

func openRegion(dev ipcDevice, h IPCHandle, offset, size int64, staging Staging) (*Region, error) {
	if offset < 0 || size <= 0 {
		return nil, fmt.Errorf("a region of %d bytes at offset %d: the size must be positive and the offset not negative", size, offset)
	}
	p, err := openings.open(dev, h)
	if err != nil {
		return nil, fmt.Errorf("%v: opening the region's CUDA IPC handle: %w (is the allocation on this GPU, and is its process alive?)", dev.Info(), err)
	}
	// The client's word for the size is not enough: a region running past
	// its allocation would have ferryd's copies, and the NIC's writes,
	// land in whatever memory follows on the GPU.
	base, n, err := dev.AddressRange(p)
	if err == nil && (p < base || p-base >= uint64(n)) {
		err = fmt.Errorf("the driver placed the opened allocation at %#x, outside the range it reports for it, [%#x, +%d)", p, base, n)
	}
	if err != nil {
		_ = openings.close(dev, h)
		return nil, fmt.Errorf("%v: asking the driver how large the allocation behind the IPC handle is: %w", dev.Info(), err)
	}
	if held := n - int64(p-base); offset > held || size > held-offset {
		_ = openings.close(dev, h)
		return nil, fmt.Errorf("a region of %d bytes at offset %d runs past the allocation its IPC handle names, which holds %d bytes: lend at most %d bytes at that offset (a caching allocator's tensor lies inside a larger allocation: pass the tensor's offset in it)", size, offset, held, max(held-offset, 0))
	}
	return &Region{dev: dev, handle: h, base: p + uint64(offset), size: size, staging: staging}, nil
}

// openings is the allocations opened by IPC handle, by GPU and handle,
// each with the count of regions on it. A process may open a handle
// once per context (PyTorch caches its openings for that reason), and
// a framework lends one allocation many times: a caching allocator's
// segment holds many tensors, each registered on its own. The first
// region opens the allocation, the last to close closes it; both under
// the lock, so an opening is never closed and reopened at once.
var openings = ipcOpenings{m: make(map[ipcOpeningKey]*ipcOpening)}

type ipcOpenings struct {
	mu sync.Mutex
	m  map[ipcOpeningKey]*ipcOpening
}

type ipcOpeningKey struct {
	dev ipcDevice
	h   IPCHandle
}

type ipcOpening struct {
	p    uint64 // the allocation's base, as opened here
	refs int
}

// open is h's allocation opened on dev, once for all its regions.
func (o *ipcOpenings) open(dev ipcDevice, h IPCHandle) (uint64, error) {
	o.mu.Lock()
	defer o.mu.Unlock()
	k := ipcOpeningKey{dev, h}
	if op := o.m[k]; op != nil {
		op.refs++
		return op.p, nil
	}
	p, err := dev.OpenIPC(h)
	if err != nil {
		return 0, err
	}
	o.m[k] = &ipcOpening{p: p, refs: 1}
	return p, nil
}

// close ends one region's use of h's allocation, and closes it on dev
// with the last.
func (o *ipcOpenings) close(dev ipcDevice, h IPCHandle) error {
	o.mu.Lock()
	defer o.mu.Unlock()
	k := ipcOpeningKey{dev, h}
	op := o.m[k]
	if op == nil {
		return fmt.Errorf("the CUDA IPC handle's allocation is not open here")
	}
	if op.refs--; op.refs > 0 {
		return nil
	}
	delete(o.m, k)
	return dev.CloseIPC(op.p)
}

func (r *Region) Base() uint64 { return r.base }
func (r *Region) Size() int64  { return r.size }
func (r *Region) Host() []byte { return nil }
func (r *Region) Kind() string { return "cuda" }

func (r *Region) check(off, n int64) error {
	if off < 0 || n < 0 || off+n > r.size || off+n < off {
		return fmt.Errorf("range [%d, +%d) is outside the %d-byte CUDA region", off, n, r.size)
	}
	return nil
}

// CopyIn copies src to offset off of the region (cuMemcpyHtoD).
func (r *Region) CopyIn(off int64, src []byte) error {
	if err := r.check(off, int64(len(src))); err != nil {
		return err
	}
	if err := r.dev.CopyHtoD(r.base+uint64(off), src); err != nil {
		return err
	}
	r.staging.Copied(int64(len(src)), 0)
	return nil
}

// CopyOut copies len(dst) bytes at offset off of the region (cuMemcpyDtoH).
func (r *Region) CopyOut(dst []byte, off int64) error {
	if err := r.check(off, int64(len(dst))); err != nil {
		return err
	}
	if err := r.dev.CopyDtoH(dst, r.base+uint64(off)); err != nil {
		return err
	}
	r.staging.Copied(0, int64(len(dst)))
	return nil
}

func (r *Region) Bounce(n int64) ([]byte, func(), error) { return r.staging.Bounce(n) }

// ExportDMABuf exports the region as a dmabuf for a NIC
// (ibv_reg_dmabuf_mr): the host pages holding it, as this process maps
// the allocation (cuMemGetHandleForAddressRange takes page-aligned
// ranges only), with the region's first byte at offset in it. The
// caller owns fd; a NIC's registration keeps the dmabuf, so fd may be
// closed once registered.
func (r *Region) ExportDMABuf() (fd int, offset uint64, err error) {
	page := uint64(os.Getpagesize())
	start := r.base &^ (page - 1)
	end := (r.base + uint64(r.size) + page - 1) &^ (page - 1)
	if fd, err = r.dev.ExportDMABuf(start, int64(end-start)); err != nil {
		return -1, 0, fmt.Errorf("exporting the %d-byte CUDA region as a dmabuf (the %d bytes of pages from %#x): %w", r.size, end-start, start, err)
	}
	return fd, r.base - start, nil
}

// Close unmaps the allocation from this process once no other region
// of it is open; its owner keeps it.
func (r *Region) Close() error {
	r.closeOnce.Do(func() { r.closeErr = openings.close(r.dev, r.handle) })
	return r.closeErr
}

var _ arena.Copier = (*Region)(nil)
