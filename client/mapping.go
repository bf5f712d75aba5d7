package client

import (
	"fmt"
	"os"

	"golang.org/x/sys/unix"

	"github.com/ferry-project/ferry/api"
)

// Mapping is a client's own view of ferryd's host-memory arena, for
// zero-copy staging (write a reserved slice in place, then commit) and for
// reading arrived data in place.
type Mapping struct {
	path string
	mem  []byte
}

// MapArena maps the arena file that Slice or WaitInfo named.
func MapArena(path string) (*Mapping, error) {
	f, err := os.OpenFile(path, os.O_RDWR, 0)
	if err != nil {
		return nil, fmt.Errorf("opening ferryd's arena file: %w (zero-copy needs read-write access to it: run as a member of ferryd's group)", err)
	}
	defer f.Close()
	fi, err := f.Stat()
	if err != nil {
		return nil, err
	}
	mem, err := unix.Mmap(int(f.Fd()), 0, int(fi.Size()), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		return nil, fmt.Errorf("mapping ferryd's arena file %s: %w", path, err)
	}
	return &Mapping{path: path, mem: mem}, nil
}

// Bytes returns the n bytes at offset, as ferryd's Slice or Receive named.
func (m *Mapping) Bytes(offset, n int64) ([]byte, error) {
	if offset < 0 || n < 0 || offset+n > int64(len(m.mem)) || offset+n < offset {
		return nil, fmt.Errorf("range [%d, +%d) is outside the arena file %s (%d bytes)", offset, n, m.path, len(m.mem))
	}
	return m.mem[offset : offset+n : offset+n], nil
}

// Slice returns the bytes of a reserved slice.
func (m *Mapping) Slice(s api.Slice) ([]byte, error) { return m.Bytes(s.Offset, s.NBytes) }

// Close unmaps the arena; slices taken from it must not be used after.
func (m *Mapping) Close() error {
	if m.mem == nil {
		return nil
	}
	err := unix.Munmap(m.mem)
	m.mem = nil
	return err
}
