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

// AllocRandom reserves a slice of n bytes at an unpredictable place
// (Allocator.AllocRandom).
func (a *Arena) AllocRandom(n int64, intn func(k uint64) uint64) (Slice, error) {
	off, err := a.alloc.AllocRandom(n, intn)
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

// Filler puts n bytes at an offset of a slice in place in the order a
// writer has them (read from a stream), a piece at a time: Next lends the
// host memory for the next piece once the last is in place. Host memory
// is lent as itself, in one piece, and nothing is copied. Memory the
// host cannot address (a Copier) takes one loan of host staging of at
// most chunk bytes, reused for every piece, each copied in before the
// next is lent: a write of any size holds no more.
type Filler struct {
	staging
	lent int64 // bytes of buf the last Next lent, copied in by the next
}

// NewFiller lends the staging for n bytes at offset off of s, or fails
// when host memory for staging has run out for now (ErrNoStaging).
func NewFiller(mem Memory, s Slice, off, n, chunk int64) (*Filler, error) {
	st, err := stage(mem, s, off, n, chunk)
	if err != nil {
		return nil, err
	}
	return &Filler{staging: st}, nil
}

// Next copies in the piece it lent last, whose bytes must all be
// written, and lends the next: empty once all n bytes are in place. A
// failed copy in leaves the bytes short of their place.
func (f *Filler) Next() ([]byte, error) {
	if dst, ok := f.hostPiece(); ok {
		return dst, nil
	}
	if f.lent > 0 {
		if err := f.c.CopyIn(f.at, f.buf[:f.lent]); err != nil {
			return nil, err
		}
		f.at += f.lent
	}
	f.lent = min(int64(len(f.buf)), f.end-f.at)
	return f.buf[:f.lent], nil
}

// Fetcher is Filler's reverse: n bytes at an offset of a slice, a piece
// at a time, for a reader that passes each on before it asks for the
// next. Host memory comes as itself, in one piece; a Copier's through
// one loan of at most chunk bytes of host staging, each piece copied
// out over the last.
type Fetcher struct{ staging }

// NewFetcher lends the staging for n bytes at offset off of s, or fails
// when host memory for staging has run out for now (ErrNoStaging).
func NewFetcher(mem Memory, s Slice, off, n, chunk int64) (*Fetcher, error) {
	st, err := stage(mem, s, off, n, chunk)
	if err != nil {
		return nil, err
	}
	return &Fetcher{staging: st}, nil
}

// Next is the next piece of the bytes, valid until the next call: empty
// once all n have come.
func (f *Fetcher) Next() ([]byte, error) {
	if src, ok := f.hostPiece(); ok {
		return src, nil
	}
	n := min(int64(len(f.buf)), f.end-f.at)
	if n == 0 {
		return nil, nil
	}
	if err := f.c.CopyOut(f.buf[:n], f.at); err != nil {
		return nil, err
	}
	f.at += n
	return f.buf[:n], nil
}

// staging is what a Filler or Fetcher moves: host memory's bytes, or
// the range [at, end) of a Copier and the host staging lent for it.
type staging struct {
	host    []byte // until Next hands it out
	c       Copier
	at, end int64
	buf     []byte
	release func()
}

func stage(mem Memory, s Slice, off, n, chunk int64) (staging, error) {
	if err := within(s, off, n); err != nil {
		return staging{}, err
	}
	if chunk <= 0 {
		return staging{}, fmt.Errorf("arena: staging of %d bytes a piece: it must be positive", chunk)
	}
	if host := bytesOf(mem, s); host != nil {
		return staging{host: host[off : off+n : off+n], release: func() {}}, nil
	}
	c, ok := mem.(Copier)
	if !ok {
		return staging{}, fmt.Errorf("arena: %s memory is closed", mem.Kind())
	}
	buf, release, err := c.Bounce(min(n, chunk))
	if err != nil {
		return staging{}, err
	}
	at := s.Offset + off
	return staging{c: c, at: at, end: at + n, buf: buf, release: release}, nil
}

// hostPiece hands out host memory's bytes, in one piece, the first time.
func (st *staging) hostPiece() ([]byte, bool) {
	b := st.host
	st.host = nil
	return b, b != nil
}

// Close gives the staging back; it must be called once, when the pieces
// lent are no longer used.
func (st *staging) Close() { st.release() }

// Readable returns n bytes at offset off of s where the host can read
// them: s itself for host memory, a bounce buffer filled by a copy out for
// a Copier. release must be called once when done with them.
func Readable(mem Memory, s Slice, off, n int64) (src []byte, release func(), err error) {
	// All n bytes in one piece (a chunk is at least one byte).
	f, err := NewFetcher(mem, s, off, n, max(n, 1))
	if err != nil {
		return nil, nil, err
	}
	if src, err = f.Next(); err != nil {
		f.Close()
		return nil, nil, err
	}
	return src, f.Close, nil
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
