package cuda

import (
	"errors"
	"testing"
)

// ipcStub is a GPU beneath the ipcDevice seam that, as the driver, lets
// a handle be opened once until closed; it counts the openings.
type ipcStub struct {
	open          map[IPCHandle]bool
	opens, closes int
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
