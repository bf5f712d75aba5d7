package arena

import (
	"bytes"
	"errors"
	"path/filepath"
	"slices"
	"strings"
	"testing"
)

// copier stands in for device memory beneath the Copier seam (the real
// one, cuda.Arena, runs on a GPU in make test-gpu): its bytes are not
// host-addressable through Host, only through copies.
type copier struct {
	mem      []byte
	lent     int   // bounce buffers not yet released
	loans    int   // Bounce's loans so far
	largest  int64 // the largest loan
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
	c.loans++
	c.largest = max(c.largest, n)
	released := false
	return make([]byte, n), func() {
		if released {
			panic("bounce buffer released twice")
		}
		released = true
		c.lent--
	}, nil
}

// fill writes src through f, a piece at a time, and returns the pieces'
// lengths.
func fill(t *testing.T, f *Filler, src []byte) []int {
	t.Helper()
	var lens []int
	for {
		piece, err := f.Next()
		if err != nil {
			t.Fatal(err)
		}
		if len(piece) == 0 {
			break
		}
		if len(piece) > len(src) {
			t.Fatalf("a piece of %d bytes with %d left", len(piece), len(src))
		}
		src = src[copy(piece, src):]
		lens = append(lens, len(piece))
	}
	if len(src) > 0 {
		t.Fatalf("%d bytes left over", len(src))
	}
	return lens
}

// fetch reads f to its end and returns the bytes and the pieces' lengths.
func fetch(t *testing.T, f *Fetcher) ([]byte, []int) {
	t.Helper()
	var got []byte
	var lens []int
	for {
		piece, err := f.Next()
		if err != nil {
			t.Fatal(err)
		}
		if len(piece) == 0 {
			return got, lens
		}
		got = append(got, piece...)
		lens = append(lens, len(piece))
	}
}

// Bytes move in and out of device memory through one loan of host
// staging a chunk long, each piece copied in before the next is lent
// (out, after the last was taken), never past the range asked for.
func TestFillerAndFetcherCopyThroughStagingAChunkAtATime(t *testing.T) {
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

	src := bytes.Repeat([]byte("0123456789"), 250)
	f, err := NewFiller(dev, s, 100, int64(len(src)), 1000)
	if err != nil {
		t.Fatal(err)
	}
	piece, _ := f.Next()
	copy(piece, src)
	if bytes.Contains(dev.mem, src[:len(piece)]) {
		t.Fatal("a piece reached the device before the next was asked for")
	}
	if lens := append([]int{len(piece)}, fill(t, f, src[len(piece):])...); !slices.Equal(lens, []int{1000, 1000, 500}) {
		t.Fatalf("pieces of %v bytes, want 1000, 1000 and 500", lens)
	}
	f.Close()
	if got := dev.mem[s.Offset+100 : s.Offset+100+int64(len(src))]; !bytes.Equal(got, src) {
		t.Fatal("the device does not hold the bytes filled in")
	}
	if dev.mem[s.Offset+99] != 0 || dev.mem[s.Offset+100+int64(len(src))] != 0 {
		t.Fatal("bytes beside the range changed")
	}

	f2, err := NewFetcher(dev, s, 98, int64(len(src))+4, 1000)
	if err != nil {
		t.Fatal(err)
	}
	got, lens := fetch(t, f2)
	f2.Close()
	if want := append(append([]byte{0, 0}, src...), 0, 0); !bytes.Equal(got, want) || !slices.Equal(lens, []int{1000, 1000, 504}) {
		t.Fatalf("fetched %d bytes in pieces of %v, want the range in pieces of 1000, 1000 and 504", len(got), lens)
	}
	if dev.loans != 2 || dev.largest != 1000 || dev.lent != 0 {
		t.Fatalf("%d loans, the largest %d bytes, %d unreturned; want one loan of a chunk each way, all returned", dev.loans, dev.largest, dev.lent)
	}

	// Shorter than a chunk: a loan of its own length, in one piece.
	src2, _, err := Readable(dev, s, 100, 5)
	if err != nil || string(src2) != "01234" || dev.largest != 1000 {
		t.Fatalf("Readable = %q, %v (largest loan %d)", src2, err, dev.largest)
	}
}

func TestFillerAndFetcherReportFailures(t *testing.T) {
	boom := errors.New("copy engine on fire")
	dev := &copier{mem: make([]byte, 8192)}
	a, _ := New(dev, 4096)
	s, _ := a.Alloc(100)
	for _, r := range [][2]int64{{-1, 5}, {96, 5}, {0, 101}, {1, -2}} {
		if _, err := NewFiller(dev, s, r[0], r[1], 16); err == nil {
			t.Errorf("NewFiller(%d, %d) on a 100-byte slice: no error", r[0], r[1])
		}
		if _, err := NewFetcher(dev, s, r[0], r[1], 16); err == nil {
			t.Errorf("NewFetcher(%d, %d) on a 100-byte slice: no error", r[0], r[1])
		}
	}
	if _, err := NewFiller(dev, s, 0, 10, 0); err == nil || !strings.Contains(err.Error(), "must be positive") {
		t.Errorf("a Filler of 0-byte pieces: %v", err)
	}
	dev.failCopy = boom
	f, err := NewFiller(dev, s, 0, 10, 16)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := f.Next(); err != nil {
		t.Fatalf("the first piece is lent with no copy, yet: %v", err)
	}
	if _, err := f.Next(); !errors.Is(err, boom) {
		t.Fatalf("copying the piece in: %v, want the copy's error", err)
	}
	f.Close()
	if _, _, err := Readable(dev, s, 0, 10); !errors.Is(err, boom) {
		t.Fatalf("Readable = %v, want the copy's error", err)
	}
	if dev.lent != 0 {
		t.Fatalf("%d bounce buffers leaked on failures", dev.lent)
	}
}

// Host memory is lent as itself, whole, whatever the chunk: no copy.
func TestFillerAndFetcherLendTheHostBytesThemselves(t *testing.T) {
	mem, err := CreateHostFile(filepath.Join(t.TempDir(), "arena"), 64<<10)
	if err != nil {
		t.Fatal(err)
	}
	a, _ := New(mem, 4096)
	defer a.Close()
	s, _ := a.Alloc(100)
	f, err := NewFiller(mem, s, 10, 3, 1)
	if err != nil {
		t.Fatal(err)
	}
	dst, _ := f.Next()
	copy(dst, "abc")
	if got := string(a.Bytes(s)[10:13]); got != "abc" {
		t.Fatalf("host memory holds %q before the next piece; a Filler must lend the slice itself", got)
	}
	if rest, err := f.Next(); len(rest) != 0 || err != nil {
		t.Fatalf("after the one piece: %d bytes, %v", len(rest), err)
	}
	f.Close()
	g, err := NewFetcher(mem, s, 10, 3, 1)
	if err != nil {
		t.Fatal(err)
	}
	if got, err := g.Next(); string(got) != "abc" || err != nil || &got[0] != &a.Bytes(s)[10] {
		t.Fatalf("fetched %q, %v; want the host bytes themselves", got, err)
	}
	if rest, err := g.Next(); len(rest) != 0 || err != nil {
		t.Fatalf("after the one piece: %d bytes, %v", len(rest), err)
	}
	g.Close()
	if err := mem.Close(); err != nil {
		t.Fatal(err)
	}
	if _, err := NewFiller(mem, s, 0, 1, 1); err == nil {
		t.Fatal("NewFiller on closed memory: no error")
	}
}
