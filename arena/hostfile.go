package arena

import (
	"errors"
	"fmt"
	"io/fs"
	"math"
	"math/bits"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"unsafe"

	"golang.org/x/sys/unix"
)

// Memory is the region an Arena hands out. The allocator deals in offsets
// only, so host memory and device memory plug in the same way.
type Memory interface {
	// Base is the address of the first byte as peers see it: the mapping's
	// virtual address for host memory, the device pointer for GPU memory.
	Base() uint64
	Size() int64
	// Host returns the bytes when they are host-addressable, nil otherwise.
	Host() []byte
	// Kind names the memory: "host" or "cuda".
	Kind() string
	Close() error
}

// ErrNoStaging is a Copier's Bounce finding no host memory to lend for
// now: the copy may be tried again once others end.
var ErrNoStaging = errors.New("no host memory to stage a copy in")

// Copier is Memory the host cannot address (Host returns nil), such as GPU
// memory: bytes move in and out by copies, staged in host memory that
// Bounce lends.
type Copier interface {
	Memory
	// CopyIn copies src to offset off; it has landed when CopyIn returns.
	CopyIn(off int64, src []byte) error
	// CopyOut copies len(dst) bytes at offset off into dst.
	CopyOut(dst []byte, off int64) error
	// Bounce lends n bytes of host memory to stage a copy in (pinned when
	// it can, so the copy runs at full speed); release gives them back.
	// It fails when host memory for staging has run out for now.
	Bounce(n int64) (buf []byte, release func(), err error)
}

// HostFile is host memory backed by a file that local clients map too, so
// they write tensors straight into the arena (zero-copy staging). Only
// the file's owner may open it (mode 0600): the daemon hands its
// descriptor to the clients it admits (Fd). On hugetlbfs the file is
// backed by huge pages. A sealed one (NewSealedMemory) is a memfd no one
// can shrink or grow, so it is safe to lend.
type HostFile struct {
	path     string
	size     int64
	base     uint64
	huge     bool
	sealed   bool // a sealed memfd: nothing to remove at Close
	pageSize int64
	ino      uint64 // Close removes the path only if it is still this file
	fd       int    // open until Close, to hand to clients

	mu   sync.Mutex
	data []byte // nil once closed
}

// CreateHostFile creates the file at path (mode 0600: its owner's alone),
// sizes it and maps it shared.
//
// A file already at path is removed first: it is a leftover of a daemon
// that did not shut down cleanly, and mapping it would hand clients stale
// bytes. The new file is then created with O_EXCL so that the mapping is
// always of a file this call created. Running one daemon per path is the
// caller's job.
//
// The file's blocks are reserved up front (fallocate) where the file system
// supports it: running out of /dev/shm or of huge pages then fails here,
// with a message, instead of as SIGBUS when a client first touches a page.
//
// If the directory is on hugetlbfs, size is rounded up to the huge page size.
func CreateHostFile(path string, size int64) (*HostFile, error) {
	if size <= 0 {
		return nil, fmt.Errorf("arena: %s: size must be positive, got %d", path, size)
	}
	dir := filepath.Dir(path)
	var st unix.Statfs_t
	if err := unix.Statfs(dir, &st); err != nil {
		return nil, fmt.Errorf("arena: cannot create %s: directory %s: %w (create the directory or choose another arena path)", path, dir, err)
	}
	h := &HostFile{path: path, pageSize: int64(os.Getpagesize())}
	if st.Type == unix.HUGETLBFS_MAGIC {
		h.huge, h.pageSize = true, st.Bsize
		if size > math.MaxInt64-h.pageSize {
			return nil, fmt.Errorf("arena: %s: size %d is too large", path, size)
		}
		size = (size + h.pageSize - 1) / h.pageSize * h.pageSize
	}
	h.size = size

	if err := os.Remove(path); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return nil, h.createErr("remove stale", err)
	}
	fd, err := unix.Open(path, unix.O_RDWR|unix.O_CREAT|unix.O_EXCL|unix.O_CLOEXEC, 0o600)
	if err != nil {
		return nil, h.createErr("create", err)
	}
	data, err := h.mapFile(fd)
	if err != nil {
		unix.Close(fd)
		_ = os.Remove(path)
		return nil, err
	}
	h.data, h.fd = data, fd
	h.base = uint64(uintptr(unsafe.Pointer(unsafe.SliceData(data))))
	return h, nil
}

// Seals are what NewSealedMemory's memfd carries: its size fixed, and
// the seals themselves, so no holder of the descriptor can shrink it
// (whose next touch of a page past the end would be SIGBUS in ferryd) or
// lift them. Writing stays allowed: clients write through their mapping.
const Seals = unix.F_SEAL_SHRINK | unix.F_SEAL_GROW | unix.F_SEAL_SEAL

// SealedName is the name NewSealedMemory gives its memfd (what
// /proc/PID/fd shows), and what Path reports.
const SealedName = "memfd:ferry-arena"

// NewSealedMemory is host memory of size bytes that is the daemon's own:
// an anonymous memfd, sized, its pages reserved, then sealed (Seals) and
// mapped shared. It takes no file system's space (no tmpfs of its size),
// and the descriptor lent to clients (Fd) can map it read-write but not
// change its size. hugePage > 0 asks for huge pages of that size
// (MFD_HUGETLB, sealable since Linux 4.16), to which size is rounded up.
func NewSealedMemory(size, hugePage int64) (*HostFile, error) {
	h := &HostFile{path: SealedName, sealed: true, pageSize: int64(os.Getpagesize())}
	if size <= 0 {
		return nil, fmt.Errorf("arena: %s: size must be positive, got %d", h.path, size)
	}
	flags := unix.MFD_CLOEXEC | unix.MFD_ALLOW_SEALING
	if hugePage > 0 {
		if hugePage&(hugePage-1) != 0 || size > math.MaxInt64-hugePage {
			return nil, fmt.Errorf("arena: huge pages of %d bytes for %d bytes: the page size must be a power of two", hugePage, size)
		}
		h.huge, h.pageSize = true, hugePage
		size = (size + hugePage - 1) / hugePage * hugePage
		flags |= unix.MFD_HUGETLB | bits.TrailingZeros64(uint64(hugePage))<<unix.MFD_HUGE_SHIFT
	}
	h.size = size
	fd, err := unix.MemfdCreate(strings.TrimPrefix(SealedName, "memfd:"), flags)
	if err != nil {
		return nil, h.createErr("create", err)
	}
	data, err := h.mapFile(fd)
	if err != nil {
		unix.Close(fd)
		return nil, err
	}
	h.data, h.fd = data, fd
	h.base = uint64(uintptr(unsafe.Pointer(unsafe.SliceData(data))))
	return h, nil
}

func (h *HostFile) mapFile(fd int) ([]byte, error) {
	var fst unix.Stat_t
	if err := unix.Fstat(fd, &fst); err != nil {
		return nil, h.createErr("stat", err)
	}
	h.ino = fst.Ino
	if err := unix.Ftruncate(fd, h.size); err != nil {
		return nil, h.createErr("size", err)
	}
	if err := h.reserve(fd); err != nil && !errors.Is(err, unix.EOPNOTSUPP) {
		return nil, h.createErr("reserve", err)
	}
	if h.sealed {
		if _, err := unix.FcntlInt(uintptr(fd), unix.F_ADD_SEALS, Seals); err != nil {
			return nil, h.createErr("seal", err)
		}
	}
	data, err := unix.Mmap(fd, 0, int(h.size), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		return nil, h.createErr("map", err)
	}
	return data, nil
}

// reserveChunk is how much of the file one fallocate call reserves at
// first; maxInterrupts bounds the interrupted calls in a row.
const (
	reserveChunk  = 16 << 20
	maxInterrupts = 100
)

// reserve allocates the file's blocks, a chunk per call. A signal (the Go
// runtime's own, for one) interrupts fallocate with EINTR: on hugetlbfs,
// and on tmpfs in older kernels (Debian 12's 6.1), where the kernel then
// gives back what that call had reserved. So the chunks done stay done,
// and an interrupted chunk is retried at half the size (down to a page),
// which gets through even when signals come faster than a chunk is
// reserved; each chunk that completes doubles the next one again.
func (h *HostFile) reserve(fd int) error {
	full := (max(reserveChunk, h.pageSize) + h.pageSize - 1) / h.pageSize * h.pageSize
	chunk, interrupts := full, 0
	for off := int64(0); off < h.size; {
		n := min(chunk, h.size-off)
		err := unix.Fallocate(fd, 0, off, n)
		switch {
		case err == unix.EINTR && interrupts < maxInterrupts:
			interrupts++
			chunk = max(chunk/2/h.pageSize*h.pageSize, h.pageSize)
			continue
		case err != nil:
			return err
		}
		off, interrupts = off+n, 0
		chunk = min(chunk*2, full)
	}
	return nil
}

// createErr says what failed and what the operator can do about it.
func (h *HostFile) createErr(op string, err error) error {
	dir := filepath.Dir(h.path)
	if h.sealed {
		dir = "memory"
	}
	var hint string
	switch {
	case (errors.Is(err, unix.ENOSPC) || errors.Is(err, unix.ENOMEM)) && h.huge:
		hint = fmt.Sprintf("not enough free %d-byte huge pages (%s) for %d bytes: raise vm.nr_hugepages or ask for a smaller arena", h.pageSize, hugePagesDir(h.pageSize), h.size)
	case (errors.Is(err, unix.EINVAL) || errors.Is(err, unix.ENOENT)) && h.huge && h.sealed:
		hint = fmt.Sprintf("the kernel offers no %d-byte huge pages (%s): choose a size it lists there, or none", h.pageSize, hugePagesDir(h.pageSize))
	case errors.Is(err, unix.ENOSPC) || errors.Is(err, unix.ENOMEM):
		hint = fmt.Sprintf("no space in %s for %d bytes: ask for a smaller arena or free space there", dir, h.size)
	case errors.Is(err, unix.EACCES) || errors.Is(err, unix.EPERM):
		hint = fmt.Sprintf("permission denied: run ferryd as a user that may write %s or choose another arena path", dir)
	case errors.Is(err, unix.EEXIST):
		hint = "another process created it concurrently: run one ferryd per arena path"
	default:
		hint = "check the arena's path and size"
	}
	return fmt.Errorf("arena: %s %s: %w (%s)", op, h.path, err, hint)
}

// hugePagesDir is where the kernel counts the huge pages of a size.
func hugePagesDir(pageSize int64) string {
	return fmt.Sprintf("/sys/kernel/mm/hugepages/hugepages-%dkB", pageSize>>10)
}

// Base is the virtual address of the mapping in this process.
func (h *HostFile) Base() uint64 { return h.base }

// Size is the mapped size, rounded up to the huge page size on hugetlbfs.
func (h *HostFile) Size() int64 { return h.size }

// Host returns the mapped bytes, nil after Close. They are not Go heap
// memory, so the garbage collector never moves or scans them.
func (h *HostFile) Host() []byte {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.data
}

// Kind is "host".
func (h *HostFile) Kind() string { return "host" }

// Path is the arena's file, SealedName for a sealed memfd.
func (h *HostFile) Path() string { return h.path }

// Fd is the open file, for handing to a client (SCM_RIGHTS); it stays
// valid until Close.
func (h *HostFile) Fd() int { return h.fd }

// HugePages reports whether the file is on hugetlbfs.
func (h *HostFile) HugePages() bool { return h.huge }

// PageSize is the page size backing the file: the huge page size on
// hugetlbfs, the system page size otherwise.
func (h *HostFile) PageSize() int64 { return h.pageSize }

// Close unmaps the file and removes it; later calls do nothing. Bytes
// obtained from Host must not be used after Close.
func (h *HostFile) Close() error {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.data == nil {
		return nil
	}
	var errs []error
	if err := unix.Munmap(h.data); err != nil {
		errs = append(errs, fmt.Errorf("arena: unmap %s: %w", h.path, err))
	}
	unix.Close(h.fd)
	h.data = nil
	if h.sealed {
		return errors.Join(errs...)
	}
	// A successor daemon may already have replaced the file; leave its file be.
	var st unix.Stat_t
	if err := unix.Stat(h.path, &st); err == nil && st.Ino == h.ino {
		if err := os.Remove(h.path); err != nil && !errors.Is(err, fs.ErrNotExist) {
			errs = append(errs, fmt.Errorf("arena: remove %s: %w", h.path, err))
		}
	}
	return errors.Join(errs...)
}
