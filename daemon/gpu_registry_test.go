package daemon

import (
	"bytes"
	"context"
	"errors"
	"strings"
	"testing"

	"github.com/ferry-project/ferry/api"
	"github.com/ferry-project/ferry/arena"
	"github.com/ferry-project/ferry/config"
)

// deviceMemory stands in for a GPU arena beneath the arena.Copier seam
// (the real one runs in make test-gpu, and over a stand-in driver in the
// e2e tests): bytes reach it only through copies, which can be made to fail.
type deviceMemory struct {
	mem      []byte
	failCopy error
}

func (m *deviceMemory) Base() uint64 { return 0x7f5500000000 }
func (m *deviceMemory) Size() int64  { return int64(len(m.mem)) }
func (m *deviceMemory) Host() []byte { return nil }
func (m *deviceMemory) Kind() string { return "cuda" }
func (m *deviceMemory) Close() error { return nil }
func (m *deviceMemory) CopyIn(off int64, src []byte) error {
	if m.failCopy != nil {
		return m.failCopy
	}
	copy(m.mem[off:], src)
	return nil
}
func (m *deviceMemory) CopyOut(dst []byte, off int64) error {
	copy(dst, m.mem[off:])
	return nil
}
func (m *deviceMemory) Bounce(n int64) ([]byte, func()) { return make([]byte, n), func() {} }

// A write whose copy into GPU memory fails is not marked arrived: the
// receiver's wait says what happened, and a resend can still land.
func TestReceiveIntoDeviceMemoryThroughCopies(t *testing.T) {
	dev := &deviceMemory{mem: make([]byte, 8192)}
	a, err := arena.New(dev, config.ArenaAlign)
	if err != nil {
		t.Fatal(err)
	}
	r := newRegistry(a)
	s, err := r.newSlot("g1", 100, false)
	if err != nil {
		t.Fatal(err)
	}
	data := bytes.Repeat([]byte("gpu!"), 25)
	write := func() {
		dst, done, err := r.Accept(s.addr, 100, s.key, 7)
		if err != nil {
			t.Fatal(err)
		}
		copy(dst, data)
		done(nil)
	}

	dev.failCopy = errors.New("cuMemcpyHtoD_v2: CUDA_ERROR_ILLEGAL_ADDRESS")
	write()
	_, _, _, err = r.waitSlot(context.Background(), "g1", 0, true)
	var ae *apiError
	if !errors.As(err, &ae) || ae.code != api.CodeInternal || !strings.Contains(ae.msg, "could not be copied into GPU memory") ||
		!strings.Contains(ae.msg, "CUDA_ERROR_ILLEGAL_ADDRESS") || !strings.Contains(ae.msg, "g1") {
		t.Fatalf("wait after a failed copy: %v", err)
	}

	dev.failCopy = nil
	write()
	desc, got, release, err := r.waitSlot(context.Background(), "g1", 0, true)
	if err != nil || !desc.Arrived || desc.Tag != 7 || !bytes.Equal(got, data) {
		t.Fatalf("after a resend: %+v, %q, %v", desc, got, err)
	}
	release()
	if !bytes.Equal(dev.mem[s.slice.Offset:s.slice.Offset+100], data) {
		t.Fatal("the bytes are not in device memory")
	}
	if err := r.deleteSlot("g1"); err != nil {
		t.Fatal(err)
	}
	if st := a.Stats(); st.Used != 0 {
		t.Fatalf("%d bytes still allocated after the slot was freed", st.Used)
	}
}
