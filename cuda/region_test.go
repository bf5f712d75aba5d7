package cuda

import (
	"errors"
	"os"
	"testing"
)

// ipcStub is a GPU beneath the ipcDevice seam that, as the driver, lets
// a handle be opened once until closed; it counts the openings.
type ipcStub struct {
	open          map[IPCHandle]bool
	opens, closes int
	// exported is each range ExportDMABuf was asked for.
	exported [][2]uint64
}

func (s *ipcStub) Info() Info { return Info{Name: "stub"} }
func (s *ipcStub) OpenIPC(h IPCHandle) (uint64, error) {
	if s.open[h] {
		return 0, errors.New("CUDA_ERROR_ALREADY_MAPPED")
	}
	s.open[h] = true
	s.opens++
	return 0x7f0000000000 + uint64(h[0])<<32, nil
}
func (s *ipcStub) AddressRange(p uint64) (uint64, int64, error) { return p, 1 << 20, nil }
func (s *ipcStub) CloseIPC(p uint64) error {
	s.open[IPCHandle{byte((p - 0x7f0000000000) >> 32)}] = false
	s.closes++
	return nil
}
func (s *ipcStub) ExportDMABuf(p uint64, n int64) (int, error) {
	s.exported = append(s.exported, [2]uint64{p, uint64(n)})
	return 100 + len(s.exported), nil
}
func (s *ipcStub) CopyHtoD(uint64, []byte) error { return nil }
func (s *ipcStub) CopyDtoH([]byte, uint64) error { return nil }

// Regions of one allocation (a caching allocator's segment, lent tensor
// by tensor) share one opening of its handle, which the driver allows
// once: the first opens it, the last to close closes it; a region
// refused (past the allocation) gives its use back.
func TestRegionsOfOneAllocationShareItsOpening(t *testing.T) {
	dev := &ipcStub{open: map[IPCHandle]bool{}}
	h, other := IPCHandle{1}, IPCHandle{2}
	k, err := openRegion(dev, h, 0, 4096, &testStaging{})
	if err != nil {
		t.Fatal(err)
	}
	v, err := openRegion(dev, h, 8192, 4096, &testStaging{})
	if err != nil {
		t.Fatalf("a second region of the allocation: %v", err)
	}
	if _, err := openRegion(dev, h, 1<<20, 1, &testStaging{}); err == nil {
		t.Fatal("a region past the allocation was opened")
	}
	o, err := openRegion(dev, other, 0, 4096, &testStaging{})
	if err != nil {
		t.Fatal(err)
	}
	if dev.opens != 2 || v.Base() != k.Base()+8192 {
		t.Fatalf("%d openings for two allocations; regions at %#x and %#x", dev.opens, k.Base(), v.Base())
	}
	for i, r := range []*Region{k, o, v} {
		if err := r.Close(); err != nil {
			t.Fatal(err)
		}
		if want := []int{0, 1, 2}[i]; dev.closes != want {
			t.Fatalf("after closing %d regions, %d openings closed; want %d", i+1, dev.closes, want)
		}
	}
	if err := k.Close(); err != nil || dev.closes != 2 {
		t.Fatalf("closing a region twice: %v, %d closes", err, dev.closes)
	}
	if len(openings.m) != 0 {
		t.Fatalf("openings left: %v", openings.m)
	}
	again, err := openRegion(dev, h, 0, 4096, &testStaging{})
	if err != nil {
		t.Fatalf("the allocation opened again once closed: %v", err)
	}
	again.Close()
}

// A region's dmabuf is the whole host pages holding it, as the driver
// exports only page-aligned ranges, and says where the region starts
// in it: a tensor of a caching allocator's segment starts anywhere.
func TestRegionDMABufCoversItsPages(t *testing.T) {
	dev := &ipcStub{open: map[IPCHandle]bool{}}
	page := uint64(os.Getpagesize())
	for i, c := range []struct {
		offset, size int64
		start, n     uint64 // the range asked for, from the allocation's base
	}{
		{0, int64(page), 0, page},
		{int64(page) + 100, 5000, page, (100 + 5000 + page - 1) / page * page},
		{int64(3*page) - 1, 2, 2 * page, 2 * page},
	} {
		r, err := openRegion(dev, IPCHandle{byte(3 + i)}, c.offset, c.size, &testStaging{})
		if err != nil {
			t.Fatal(err)
		}
		base := r.Base() - uint64(c.offset)
		fd, off, err := r.ExportDMABuf()
		if err != nil || fd <= 100 {
			t.Fatalf("a region of %d bytes at offset %d: fd %d, %v", c.size, c.offset, fd, err)
		}
		got := dev.exported[len(dev.exported)-1]
		if got != [2]uint64{base + c.start, c.n} || base+c.start+off != r.Base() {
			t.Errorf("a region of %d bytes at offset %d: exported %d bytes from %#x, region at offset %d of it; want %d bytes from %#x, the region at %d",
				c.size, c.offset, got[1], got[0], off, c.n, base+c.start, r.Base()-base-c.start)
		}
		r.Close()
	}
}
