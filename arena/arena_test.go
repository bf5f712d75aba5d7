package arena

import (
	"errors"
	"path/filepath"
	"testing"
)

func TestArenaOverHostFile(t *testing.T) {
	path := filepath.Join(t.TempDir(), "arena")
	mem, err := CreateHostFile(path, MiB)
	if err != nil {
		t.Fatal(err)
	}
	a, err := New(mem, 4096)
	if err != nil {
		t.Fatal(err)
	}
	defer a.Close()
	if a.Memory() != Memory(mem) {
		t.Error("Memory() is not the memory given to New")
	}
	s1, err := a.Alloc(1000)
	if err != nil {
		t.Fatal(err)
	}
	s2, err := a.Alloc(5000)
	if err != nil {
		t.Fatal(err)
	}
	if s1.Len != 1000 || s2.Len != 5000 || s1.Offset%4096 != 0 || s2.Offset%4096 != 0 || s1.Offset == s2.Offset {
		t.Fatalf("slices %+v and %+v", s1, s2)
	}
	if got := a.Stats(); got.Used != 4096+8192 || got.Allocations != 2 {
		t.Errorf("Stats() = %+v; want 12288 bytes in 2 allocations", got)
	}
	if a.Addr(s2) != mem.Base()+uint64(s2.Offset) {
		t.Errorf("Addr(%+v) = %#x, base %#x", s2, a.Addr(s2), mem.Base())
	}

	b := a.Bytes(s2)
	if len(b) != 5000 || cap(b) != 5000 {
		t.Fatalf("Bytes: len %d cap %d, want 5000 and 5000", len(b), cap(b))
	}
	copy(b, "tensor")
	client := clientMap(t, path, MiB)
	if got := string(client[s2.Offset : s2.Offset+6]); got != "tensor" {
		t.Errorf("the client sees %q at offset %d, want %q", got, s2.Offset, "tensor")
	}

	for _, s := range []Slice{s1, s2} {
		if err := a.Free(s); err != nil {
			t.Fatal(err)
		}
	}
	if err := a.Free(s1); !errors.Is(err, ErrNotAllocated) {
		t.Errorf("double Free: %v, want ErrNotAllocated", err)
	}
	if got := a.Stats(); got.Used != 0 || got.FreeBlocks != 1 || got.Size != MiB {
		t.Errorf("Stats() = %+v after freeing everything", got)
	}
}

// device stands in for memory the host cannot address.
type device struct{ size int64 }

func (d device) Base() uint64 { return 0x7f00_0000_0000 }
func (d device) Size() int64  { return d.size }
func (d device) Host() []byte { return nil }
func (d device) Kind() string { return "cuda" }
func (d device) Close() error { return nil }

func TestArenaOverDeviceMemory(t *testing.T) {
	a, err := New(device{MiB + 100}, 256)
	if err != nil {
		t.Fatal(err)
	}
	if got := a.Stats().Size; got != MiB {
		t.Errorf("Stats().Size = %d; want the size rounded down to the alignment, %d", got, MiB)
	}
	s, err := a.Alloc(300)
	if err != nil {
		t.Fatal(err)
	}
	if a.Bytes(s) != nil {
		t.Error("Bytes of device memory is not nil")
	}
	if a.Addr(s) != 0x7f00_0000_0000+uint64(s.Offset) {
		t.Errorf("Addr = %#x", a.Addr(s))
	}
	if _, err := a.Alloc(MiB); !errors.Is(err, ErrNoSpace) {
		t.Errorf("Alloc past the end: %v, want ErrNoSpace", err)
	}
}

func TestNewRejects(t *testing.T) {
	if _, err := New(device{MiB}, 100); err == nil {
		t.Error("New accepted alignment 100")
	}
	if _, err := New(device{255}, 256); err == nil {
		t.Error("New accepted memory smaller than the alignment")
	}
}
