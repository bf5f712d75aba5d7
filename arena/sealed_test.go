package arena

import (
	"errors"
	"os"
	"strconv"
	"strings"
	"testing"

	"golang.org/x/sys/unix"
)

// The sealed arena is shared with whoever maps its descriptor, read-write,
// and no holder of the descriptor can change its size: a shrink would make
// ferryd's next touch of a page past the new end a SIGBUS.
func TestSealedMemoryCannotBeResized(t *testing.T) {
	const size = MiB + 123
	h, err := NewSealedMemory(size, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer h.Close()
	if h.Size() != size || h.Path() != SealedName || h.HugePages() {
		t.Errorf("size %d path %q huge %v", h.Size(), h.Path(), h.HugePages())
	}
	checkSealed(t, h)
}

func checkSealed(t *testing.T, h *HostFile) {
	t.Helper()
	// A client's own descriptor, as SCM_RIGHTS would give it.
	fd, err := unix.Dup(h.Fd())
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(fd)
	seals, err := unix.FcntlInt(uintptr(fd), unix.F_GET_SEALS, 0)
	if err != nil || seals&Seals != Seals {
		t.Fatalf("seals %#x, %v; want %#x", seals, err, Seals)
	}
	// Whole pages: hugetlbfs refuses any other size with EINVAL before
	// it looks at the seals.
	step := max(h.PageSize(), 4096)
	for _, n := range []int64{0, h.Size() / 2 / step * step, h.Size() + step} {
		if err := unix.Ftruncate(fd, n); !errors.Is(err, unix.EPERM) {
			t.Errorf("ftruncate(%d) of the lent descriptor: %v; want EPERM", n, err)
		}
	}
	if _, err := unix.FcntlInt(uintptr(fd), unix.F_ADD_SEALS, unix.F_SEAL_WRITE); !errors.Is(err, unix.EPERM) {
		t.Errorf("adding F_SEAL_WRITE: %v; want EPERM (the seals are sealed)", err)
	}
	client, err := unix.Mmap(fd, 0, int(h.Size()), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		t.Fatalf("a client's read-write mapping: %v", err)
	}
	defer unix.Munmap(client)
	host := h.Host()
	client[0], client[len(client)-1] = 0xA5, 0x5A
	if host[0] != 0xA5 || host[len(host)-1] != 0x5A {
		t.Fatal("the client's writes are not in the daemon's mapping")
	}
	host[1] = 0x42
	if client[1] != 0x42 {
		t.Fatal("the daemon's writes are not in the client's mapping")
	}
}

// With huge pages the memfd is MFD_HUGETLB, rounded up to a page, and
// sealed the same way. It runs where the kernel has 2 MiB pages free.
func TestSealedMemoryHugePages(t *testing.T) {
	const page = 2 * MiB
	b, err := os.ReadFile(hugePagesDir(page) + "/free_hugepages")
	if free, _ := strconv.Atoi(strings.TrimSpace(string(b))); err != nil || free < 1 {
		_, err := NewSealedMemory(1, page)
		if err == nil || !strings.Contains(err.Error(), "huge pages") || !strings.Contains(err.Error(), hugePagesDir(page)) {
			t.Fatalf("with no free 2 MiB page: %v; want an error naming the huge pages and %s", err, hugePagesDir(page))
		}
		t.Skipf("no free 2 MiB huge page (%s): only the error was checked", hugePagesDir(page))
	}
	h, err := NewSealedMemory(1, page)
	if err != nil {
		t.Fatal(err)
	}
	defer h.Close()
	if h.Size() != page || !h.HugePages() || h.PageSize() != page {
		t.Errorf("size %d huge %v page %d; want one 2 MiB page", h.Size(), h.HugePages(), h.PageSize())
	}
	checkSealed(t, h)
}
