package arena

import (
	"bytes"
	"errors"
	"path/filepath"
	"testing"
)

// copier stands in for device memory beneath the Copier seam (the real
// one, cuda.Arena, runs on a GPU in make test-gpu): its bytes are not
// host-addressable through Host, only through copies.
type copier struct {
	mem      []byte
	lent     int // bounce buffers not yet released
	failCopy error
}

func (c *copier) Base() uint64 { return 0x7f0000000000 }
func (c *copier) Size() int64  { return int64(len(c.mem)) }
func (c *copier) Host() []byte { return nil }
func (c *copier) Kind() string { return "fake-device" }
func (c *copier) Close() error { return nil }
func (c *copier) CopyIn(off int64, src []byte) error {
	if c.failCopy != nil {
		return c.failCopy
	}
	copy(c.mem[off:], src)
	return nil
}
func (c *copier) CopyOut(dst []byte, off int64) error {
	if c.failCopy != nil {
		return c.failCopy
	}
	copy(dst, c.mem[off:])
	return nil
}
func (c *copier) Bounce(n int64) ([]byte, func(), error) {
	c.lent++
	released := false
	return make([]byte, n), func() {
		if released {
			panic("bounce buffer released twice")
		}
		released = true
		c.lent--
	}, nil
}

func TestWritableAndReadableCopyThroughBounceBuffers(t *testing.T) {
	dev := &copier{mem: make([]byte, 64<<10)}
	a, err := New(dev, 4096)
	if err != nil {
		t.Fatal(err)
	}
	if a.Bytes(Slice{Offset: 0, Len: 10}) != nil {
		t.Fatal("Bytes of device memory must be nil")
	}
	s, err := a.Alloc(10000)
	if err != nil {
		t.Fatal(err)
	}
	_, _ = a.Alloc(4096) // a neighbour, which must stay untouched

	dst, commit, err := a.Writable(s, 100, 5)
	if err != nil {
		t.Fatal(err)
	}
	copy(dst, "hello")
	if got := dev.mem[s.Offset+100 : s.Offset+105]; bytes.Equal(got, []byte("hello")) {
		t.Fatal("bytes reached the device before commit")
	}
	if err := commit(true); err != nil {
		t.Fatal(err)
	}
	if got := string(dev.mem[s.Offset+100 : s.Offset+105]); got != "hello" {
		t.Fatalf("device holds %q after commit", got)
	}

	dst, commit, _ = a.Writable(s, 0, 5)
	copy(dst, "XXXXX")
	if err := commit(false); err != nil {
		t.Fatal(err)
	}
	if bytes.Contains(dev.mem, []byte("XXXXX")) {
		t.Fatal("commit(false) copied the bytes in")
	}

	src, release, err := a.Readable(s, 98, 9)
	if err != nil {
		t.Fatal(err)
	}
	if want := "\x00\x00hello\x00\x00"; string(src) != want {
		t.Fatalf("Readable = %q, want %q", src, want)
	}
	release()
	if dev.lent != 0 {
		t.Fatalf("%d bounce buffers never released", dev.lent)
	}
}

func TestWritableAndReadableReportFailures(t *testing.T) {
	boom := errors.New("copy engine on fire")
	dev := &copier{mem: make([]byte, 8192)}
	a, _ := New(dev, 4096)
	s, _ := a.Alloc(100)
	for _, r := range [][2]int64{{-1, 5}, {96, 5}, {0, 101}, {1, -2}} {
		if _, _, err := a.Writable(s, r[0], r[1]); err == nil {
			t.Errorf("Writable(%d, %d) on a 100-byte slice: no error", r[0], r[1])
		}
		if _, _, err := a.Readable(s, r[0], r[1]); err == nil {
			t.Errorf("Readable(%d, %d) on a 100-byte slice: no error", r[0], r[1])
		}
	}
	dev.failCopy = boom
	_, commit, err := a.Writable(s, 0, 10)
	if err != nil {
		t.Fatal(err)
	}
	if err := commit(true); !errors.Is(err, boom) {
		t.Fatalf("commit = %v, want the copy's error", err)
	}
	if _, _, err := a.Readable(s, 0, 10); !errors.Is(err, boom) {
		t.Fatalf("Readable = %v, want the copy's error", err)
	}
	if dev.lent != 0 {
		t.Fatalf("%d bounce buffers leaked on failures", dev.lent)
	}
}

func TestWritableAndReadableAreTheHostBytesThemselves(t *testing.T) {
	mem, err := CreateHostFile(filepath.Join(t.TempDir(), "arena"), 64<<10)
	if err != nil {
		t.Fatal(err)
	}
	a, _ := New(mem, 4096)
	defer a.Close()
	s, _ := a.Alloc(100)
	dst, commit, err := a.Writable(s, 10, 3)
	if err != nil {
		t.Fatal(err)
	}
	copy(dst, "abc")
	if got := string(a.Bytes(s)[10:13]); got != "abc" {
		t.Fatalf("host memory holds %q before commit; Writable must hand out the slice itself", got)
	}
	if err := commit(true); err != nil {
		t.Fatal(err)
	}
	src, release, err := a.Readable(s, 10, 3)
	if err != nil || string(src) != "abc" {
		t.Fatalf("Readable = %q, %v", src, err)
	}
	release()
	if err := mem.Close(); err != nil {
		t.Fatal(err)
	}
	if _, _, err := a.Writable(s, 0, 1); err == nil {
		t.Fatal("Writable on closed memory: no error")
	}
}
