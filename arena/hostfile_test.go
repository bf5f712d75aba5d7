package arena

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"testing"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"
)

// tempDirs are the directories HostFile tests run in: the test's temp dir
// and, where it exists, /dev/shm, where ferryd puts the arena in practice.
func tempDirs(t *testing.T) map[string]string {
	dirs := map[string]string{"tempdir": t.TempDir()}
	if fi, err := os.Stat("/dev/shm"); err == nil && fi.IsDir() {
		dir, err := os.MkdirTemp("/dev/shm", "ferry-arena-test-")
		if err != nil {
			t.Logf("not testing in /dev/shm: %v", err)
		} else {
			t.Cleanup(func() { os.RemoveAll(dir) })
			dirs["devshm"] = dir
		}
	}
	return dirs
}

// clientMap maps path the way a client does: its own open and mmap.
func clientMap(t *testing.T, path string, size int64) []byte {
	t.Helper()
	f, err := os.OpenFile(path, os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	b, err := unix.Mmap(int(f.Fd()), 0, int(size), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { unix.Munmap(b) })
	return b
}

func TestHostFileSharedWithClient(t *testing.T) {
	for name, dir := range tempDirs(t) {
		t.Run(name, func(t *testing.T) {
			path := filepath.Join(dir, "arena")
			const size = MiB + 123 // not a page multiple: the size is kept as asked
			h, err := CreateHostFile(path, size)
			if err != nil {
				t.Fatal(err)
			}
			defer h.Close()
			if h.Kind() != "host" || h.Size() != size || h.Path() != path || h.HugePages() || h.PageSize() != int64(os.Getpagesize()) {
				t.Errorf("kind %q size %d path %q huge %v page %d", h.Kind(), h.Size(), h.Path(), h.HugePages(), h.PageSize())
			}
			host := h.Host()
			if int64(len(host)) != size {
				t.Fatalf("len(Host()) = %d, want %d", len(host), size)
			}
			if base := uint64(uintptr(unsafe.Pointer(&host[0]))); h.Base() != base {
				t.Errorf("Base() = %#x, want the mapping's address %#x", h.Base(), base)
			}
			fi, err := os.Stat(path)
			if err != nil {
				t.Fatal(err)
			}
			if fi.Mode().Perm() != 0o600 || fi.Size() != size {
				t.Errorf("file mode %v size %d, want -rw------- and %d", fi.Mode(), fi.Size(), size)
			}

			for i := range host {
				host[i] = byte(i * 7)
			}
			client := clientMap(t, path, size)
			if !bytes.Equal(client, host) {
				t.Fatal("a second mapping of the file does not see the bytes written through Host()")
			}
			copy(client[size-5:], "tail!")
			if string(host[size-5:]) != "tail!" {
				t.Error("bytes written by the client are not visible through Host()")
			}

			if err := h.Close(); err != nil {
				t.Fatal(err)
			}
			if _, err := os.Stat(path); !errors.Is(err, fs.ErrNotExist) {
				t.Errorf("file still there after Close: %v", err)
			}
			if h.Host() != nil {
				t.Error("Host() is not nil after Close")
			}
			if err := h.Close(); err != nil {
				t.Errorf("second Close: %v", err)
			}
		})
	}
}

// TestCreateHostFileUnderSignals: signals arriving while the arena is
// reserved (the Go runtime sends its threads SIGURG) interrupt fallocate
// with EINTR, on hugetlbfs and on older kernels' tmpfs; creating the file
// must still succeed. ferryd once failed to start with "arena: reserve
// ...: interrupted system call". Newer kernels (6.18 here) let tmpfs's
// fallocate finish; Debian 12's 6.1 does not, so test/rxevm runs this test
// in its VM too, with huge pages there.
func TestCreateHostFileUnderSignals(t *testing.T) {
	sizes := map[string]int64{} // directory: file size
	for _, d := range tempDirs(t) {
		var st unix.Statfs_t
		if unix.Statfs(d, &st) == nil && st.Type == unix.TMPFS_MAGIC {
			sizes[d] = 64 << 20
		}
	}
	var st unix.Statfs_t
	if n, err := freeHugePages(); err == nil && n >= 4 && unix.Statfs("/dev/hugepages", &st) == nil && st.Type == unix.HUGETLBFS_MAGIC {
		sizes["/dev/hugepages"] = 4 * st.Bsize
	}
	if len(sizes) == 0 {
		t.Skip("no tmpfs directory (TMPDIR, /dev/shm) and no 4 free huge pages: the interrupted fallocates are theirs")
	}
	// The signals go to the thread that calls fallocate.
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	tid := unix.Gettid()
	stop := make(chan struct{})
	done := make(chan struct{})
	go func() {
		defer close(done)
		// A signal every 100 µs: far more often than the runtime's.
		tick := time.NewTicker(100 * time.Microsecond)
		defer tick.Stop()
		for {
			select {
			case <-stop:
				return
			case <-tick.C:
				_ = unix.Tgkill(os.Getpid(), tid, unix.SIGURG) // the runtime takes it as a preemption request
			}
		}
	}()
	defer func() { close(stop); <-done }()
	for dir, size := range sizes {
		for i := range 2 {
			h, err := CreateHostFile(filepath.Join(dir, fmt.Sprintf("ferry-arena-test-%d-%d", os.Getpid(), i)), size)
			if err != nil {
				t.Fatalf("%d bytes in %s: %v", size, dir, err)
			}
			h.Close()
		}
	}
}

func TestCreateHostFileReplacesStale(t *testing.T) {
	path := filepath.Join(t.TempDir(), "arena")
	if err := os.WriteFile(path, bytes.Repeat([]byte("stale"), 1000), 0o600); err != nil {
		t.Fatal(err)
	}
	h, err := CreateHostFile(path, 4096)
	if err != nil {
		t.Fatal(err)
	}
	defer h.Close()
	if !bytes.Equal(h.Host(), make([]byte, 4096)) {
		t.Error("the new arena shows bytes of the stale file")
	}
}

func TestCloseLeavesSuccessorFile(t *testing.T) {
	path := filepath.Join(t.TempDir(), "arena")
	old, err := CreateHostFile(path, 4096)
	if err != nil {
		t.Fatal(err)
	}
	successor, err := CreateHostFile(path, 8192)
	if err != nil {
		t.Fatal(err)
	}
	if err := old.Close(); err != nil {
		t.Fatal(err)
	}
	if fi, err := os.Stat(path); err != nil || fi.Size() != 8192 {
		t.Fatalf("closing the old arena removed its successor's file: %v", err)
	}
	if err := successor.Close(); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(path); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("file still there after Close: %v", err)
	}
}

func TestCreateHostFileErrors(t *testing.T) {
	dir := t.TempDir()
	missing := filepath.Join(dir, "no", "such", "dir", "arena")
	_, err := CreateHostFile(missing, 4096)
	if err == nil || !strings.Contains(err.Error(), missing) || !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("CreateHostFile in a missing directory: %v; want an error naming %s", err, missing)
	}
	for _, size := range []int64{0, -1} {
		path := filepath.Join(dir, "arena")
		if _, err := CreateHostFile(path, size); err == nil || !strings.Contains(err.Error(), path) {
			t.Errorf("CreateHostFile(size %d): %v; want an error naming %s", size, err, path)
		}
	}
}

// The out-of-space paths need a full file system to reach, so check the
// advice they give directly.
func TestCreateErrorAdvice(t *testing.T) {
	for _, c := range []struct {
		h    *HostFile
		err  error
		want []string
	}{
		{&HostFile{path: "/dev/shm/ferry", size: 1 << 30}, unix.ENOSPC,
			[]string{"/dev/shm/ferry", "no space in /dev/shm for 1073741824 bytes", "smaller arena"}},
		{&HostFile{path: "/dev/hugepages/ferry", size: 1 << 30, huge: true, pageSize: 2 * MiB}, unix.ENOMEM,
			[]string{"/dev/hugepages/ferry", "2097152-byte huge pages", "vm.nr_hugepages", "smaller arena"}},
		{&HostFile{path: "/srv/ferry", size: 4096}, unix.EACCES,
			[]string{"/srv/ferry", "permission denied", "/srv"}},
	} {
		err := c.h.createErr("reserve", c.err)
		if !errors.Is(err, c.err) {
			t.Errorf("%v does not wrap %v", err, c.err)
		}
		for _, w := range c.want {
			if !strings.Contains(err.Error(), w) {
				t.Errorf("%q does not contain %q", err, w)
			}
		}
	}
}

// freeHugePages returns the free pages of the default huge page size.
func freeHugePages() (int64, error) {
	f, err := os.Open("/proc/meminfo")
	if err != nil {
		return 0, err
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		var n int64
		if _, err := fmt.Sscanf(sc.Text(), "HugePages_Free: %d", &n); err == nil {
			return n, nil
		}
	}
	return 0, errors.New("no HugePages_Free in /proc/meminfo")
}

func TestHostFileHugePages(t *testing.T) {
	var st unix.Statfs_t
	if err := unix.Statfs("/dev/hugepages", &st); err != nil || st.Type != unix.HUGETLBFS_MAGIC {
		t.Skip("/dev/hugepages is not a hugetlbfs mount")
	}
	if n, err := freeHugePages(); err != nil || n < 1 {
		t.Skipf("no free huge pages (%d, %v): set vm.nr_hugepages to run this test", n, err)
	}
	path := filepath.Join("/dev/hugepages", fmt.Sprintf("ferry-arena-test-%d", os.Getpid()))
	h, err := CreateHostFile(path, 1)
	if errors.Is(err, unix.EACCES) {
		t.Skipf("cannot write /dev/hugepages: %v", err)
	}
	if err != nil {
		t.Fatal(err)
	}
	defer h.Close()
	if !h.HugePages() || h.PageSize() != st.Bsize || h.Size() != st.Bsize {
		t.Errorf("huge %v page %d size %d; want huge pages of %d bytes", h.HugePages(), h.PageSize(), h.Size(), st.Bsize)
	}
	host := h.Host()
	host[0], host[len(host)-1] = 1, 2
	client := clientMap(t, path, h.Size())
	if client[0] != 1 || client[len(client)-1] != 2 {
		t.Error("a second mapping does not see the bytes")
	}
}
