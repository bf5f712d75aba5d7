// Package arena manages ferryd's staging memory: one contiguous region
// whose slices local clients fill through their own mapping and peers
// write into. The Allocator deals in offsets only, so the region may be
// host memory (HostFile) or device memory (package cuda's Arena).
package arena

import "fmt"

// Slice is a piece of the arena. Len is the length asked for; the
// allocation behind it is Len rounded up to the alignment.
type Slice struct {
	Offset, Len int64
}

// Arena allocates Slices of a Memory.
type Arena struct {
	mem   Memory
	alloc *Allocator
}

// New manages mem with slices aligned to align (a power of two, at least
// MinAlign). A tail of mem shorter than align is left unused, so Stats().Size
// may be slightly below mem.Size().
func New(mem Memory, align int64) (*Arena, error) {
	if err := checkAlign(align); err != nil {
		return nil, err
	}
	usable := mem.Size() &^ (align - 1)
	if usable <= 0 {
		return nil, fmt.Errorf("arena: %s memory of %d bytes is smaller than the alignment %d", mem.Kind(), mem.Size(), align)
	}
	alloc, err := NewAllocator(usable, align)
	if err != nil {
		return nil, err
	}
	return &Arena{mem: mem, alloc: alloc}, nil
}

// Alloc reserves a slice of n bytes.
func (a *Arena) Alloc(n int64) (Slice, error) {
	off, err := a.alloc.Alloc(n)
	if err != nil {
		return Slice{}, err
	}
	return Slice{Offset: off, Len: n}, nil
}

// Free releases s.
func (a *Arena) Free(s Slice) error {
	_, err := a.alloc.Free(s.Offset)
	return err
}

// Stats returns the allocator's accounting.
func (a *Arena) Stats() Stats { return a.alloc.Stats() }

// Memory returns the memory the arena hands out.
func (a *Arena) Memory() Memory { return a.mem }

// Bytes returns the host bytes of s, or nil when the memory is not
// host-addressable. The capacity is s.Len, so an append cannot spill into a
// neighbouring slice.
func (a *Arena) Bytes(s Slice) []byte { return bytesOf(a.mem, s) }

func bytesOf(mem Memory, s Slice) []byte {
	host := mem.Host()
	if host == nil {
		return nil
	}
	end := s.Offset + s.Len
	return host[s.Offset:end:end]
}

// Writable returns host memory to put n bytes at offset off of s in, and
// commit, which must be called once: commit(true) makes the bytes s's (a
// copy in for a Copier; nothing for host memory, where dst is s itself),
// commit(false) drops them.
func (a *Arena) Writable(s Slice, off, n int64) (dst []byte, commit func(keep bool) error, err error) {
	return Writable(a.mem, s, off, n)
}

// Writable is (*Arena).Writable for a slice of any Memory, such as a
// region a client lent: s is then the bytes it is asked about.
func Writable(mem Memory, s Slice, off, n int64) (dst []byte, commit func(keep bool) error, err error) {
	if err := within(s, off, n); err != nil {
		return nil, nil, err
	}
	if host := bytesOf(mem, s); host != nil {
		return host[off : off+n], func(bool) error { return nil }, nil
	}
	c, ok := mem.(Copier)
	if !ok {
		return nil, nil, fmt.Errorf("arena: %s memory is closed", mem.Kind())
	}
	buf, release, err := c.Bounce(n)
	if err != nil {
		return nil, nil, err
	}
	return buf, func(keep bool) error {
		defer release()
		if !keep {
			return nil
		}
		return c.CopyIn(s.Offset+off, buf)
	}, nil
}

// Readable returns n bytes at offset off of s where the host can read
// them: s itself for host memory, a bounce buffer filled by a copy out for
// a Copier. release must be called once when done with them.
func (a *Arena) Readable(s Slice, off, n int64) (src []byte, release func(), err error) {
	return Readable(a.mem, s, off, n)
}

// Readable is (*Arena).Readable for a slice of any Memory.
func Readable(mem Memory, s Slice, off, n int64) (src []byte, release func(), err error) {
	if err := within(s, off, n); err != nil {
		return nil, nil, err
	}
	if host := bytesOf(mem, s); host != nil {
		return host[off : off+n], func() {}, nil
	}
	c, ok := mem.(Copier)
	if !ok {
		return nil, nil, fmt.Errorf("arena: %s memory is closed", mem.Kind())
	}
	buf, release, err := c.Bounce(n)
	if err != nil {
		return nil, nil, err
	}
	if err := c.CopyOut(buf, s.Offset+off); err != nil {
		release()
		return nil, nil, err
	}
	return buf, release, nil
}

func within(s Slice, off, n int64) error {
	if off < 0 || n < 0 || off+n > s.Len || off+n < off {
		return fmt.Errorf("arena: range [%d, +%d) is outside the %d-byte slice at offset %d", off, n, s.Len, s.Offset)
	}
	return nil
}

// Addr is the address of s's first byte as peers see it.
func (a *Arena) Addr(s Slice) uint64 { return a.mem.Base() + uint64(s.Offset) }

// Close closes the memory. Slices and their bytes are invalid afterwards.
func (a *Arena) Close() error { return a.mem.Close() }
