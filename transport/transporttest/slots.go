// Package transporttest is the conformance suite every ferry transport
// must pass, Slots, the reference transport.Sink it runs against, and
// helpers the tests of the peer port and its transports share.
package transporttest

import (
	"context"
	"errors"
	"fmt"
	"sync"

	"github.com/ferry-project/ferry/transport"
)

// Slots is a transport.Sink over one memory arena: a table of receive
// slots, each a range of Mem (addresses are Base plus offsets into Mem)
// with its own random key. It admits one write at a time per slot, counts
// each tag completed with done(nil), and records what breaks the Sink
// contract. As a transport.DirectSink it counts the tag of a write it
// hears of only by its key's tag and length, when the length is the
// slot's.
type Slots struct {
	Mem []byte
	// Base is the address of Mem[0]: 0 by default; a test of direct
	// writes sets Mem's own address, as a DirectSink's slots have.
	Base uint64

	mu      sync.Mutex
	slots   []*slot
	tags    map[uint32]int // completions per tag
	pending int            // accepted writes whose done has not run
	changed chan struct{}  // closed and replaced on every done
	errs    []error
	windows transport.Windows // set through WindowSlots
}

type slot struct {
	addr, size uint64
	key        transport.Key
	busy       bool
	filled     bool // by a direct write (Arrived)
}

var _ transport.DirectSink = (*Slots)(nil)

// WindowSlots is Slots as a transport.WindowSink: once the transport
// hands it windows, each slot Add makes gets one over its bytes (Base
// must be Mem's own address), named in its key, which Remove closes.
type WindowSlots struct{ *Slots }

var _ transport.WindowSink = WindowSlots{}

// UseWindows implements transport.WindowSink.
func (w WindowSlots) UseWindows(ws transport.Windows) {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.windows = ws
}

// NewSlots returns a Sink with size bytes of zeroed memory and no slots.
func NewSlots(size int) *Slots {
	return &Slots{Mem: make([]byte, size), tags: make(map[uint32]int), changed: make(chan struct{})}
}

// Add makes [addr, addr+size) of Mem a receive slot and returns its key.
// It panics on a range outside Mem or overlapping another slot.
func (s *Slots) Add(addr, size uint64) (key transport.Key) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if size == 0 || addr >= uint64(len(s.Mem)) || size > uint64(len(s.Mem))-addr {
		panic(fmt.Sprintf("transporttest: slot [%#x, +%d) outside %d bytes of memory", addr, size, len(s.Mem)))
	}
	for _, o := range s.slots {
		if addr < o.addr+o.size && o.addr < addr+size {
			panic(fmt.Sprintf("transporttest: slot [%#x, +%d) overlaps [%#x, +%d)", addr, size, o.addr, o.size))
		}
	}
	sl := &slot{addr: addr, size: size, key: transport.NewKey()}
	// Tags name one slot each, as a DirectSink needs.
	for s.byTag(sl.key.Tag()) != nil {
		sl.key = transport.NewKey()
	}
	if s.windows != nil {
		w, err := s.windows.Open(s.Base+addr, size)
		if err != nil {
			panic(fmt.Sprintf("transporttest: a window over the slot [%#x, +%d): %v", addr, size, err))
		}
		sl.key = sl.key.WithWindowOn(w)
	}
	s.slots = append(s.slots, sl)
	return sl.key
}

// Remove frees the slot of key, closing its window when it has one.
func (s *Slots) Remove(key transport.Key) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	for i, o := range s.slots {
		if o.key != key {
			continue
		}
		s.slots = append(s.slots[:i], s.slots[i+1:]...)
		if s.windows != nil {
			return s.windows.Close(key.WindowOn())
		}
		return nil
	}
	return fmt.Errorf("transporttest: no slot has key %s", key)
}

// byTag is the slot whose key has tag, or nil; s.mu is held.
func (s *Slots) byTag(tag uint32) *slot {
	for _, o := range s.slots {
		if o.key.Tag() == tag {
			return o
		}
	}
	return nil
}

// Arrived implements transport.DirectSink.
func (s *Slots) Arrived(tag uint32, n uint64) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	sl := s.byTag(tag)
	switch {
	case sl == nil:
		return &transport.Refusal{Code: transport.NoSlot, Message: fmt.Sprintf("no receive slot has tag %#x", tag)}
	case sl.filled:
		return &transport.Refusal{Code: transport.SlotBusy, Message: fmt.Sprintf("the slot [%#x, +%d) holds its data already", sl.addr, sl.size)}
	case n != sl.size:
		return &transport.Refusal{Code: transport.OutOfBounds, Message: fmt.Sprintf("%d bytes are not the whole of the slot [%#x, +%d)", n, sl.addr, sl.size)}
	}
	sl.filled = true
	s.tags[tag]++
	close(s.changed)
	s.changed = make(chan struct{})
	return nil
}

// Accept implements transport.Sink.
func (s *Slots) Accept(addr, n uint64, key transport.Key, tag uint32) ([]byte, func(error), error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if addr < s.Base {
		return nil, nil, &transport.Refusal{Code: transport.NoSlot, Message: fmt.Sprintf("no receive slot at %#x with that key", addr)}
	}
	addr -= s.Base
	var sl *slot
	for _, o := range s.slots {
		if addr >= o.addr && addr-o.addr < o.size {
			sl = o
			break
		}
	}
	switch {
	case sl == nil || key != sl.key:
		return nil, nil, &transport.Refusal{Code: transport.NoSlot, Message: fmt.Sprintf("no receive slot at %#x with that key", addr)}
	case n == 0 || n > sl.addr+sl.size-addr: // written so as not to overflow
		return nil, nil, &transport.Refusal{Code: transport.OutOfBounds, Message: fmt.Sprintf("%d bytes at %#x run past the slot [%#x, +%d)", n, addr, sl.addr, sl.size)}
	case sl.busy:
		return nil, nil, &transport.Refusal{Code: transport.SlotBusy, Message: fmt.Sprintf("the slot at %#x has a write landing", sl.addr)}
	}
	sl.busy = true
	s.pending++
	called := false
	done := func(err error) {
		s.mu.Lock()
		defer s.mu.Unlock()
		if called {
			s.errs = append(s.errs, fmt.Errorf("done called twice for the write tagged %d", tag))
			return
		}
		called = true
		sl.busy = false
		s.pending--
		if err == nil {
			s.tags[tag]++
		}
		close(s.changed)
		s.changed = make(chan struct{})
	}
	return s.Mem[addr : addr+n : addr+n], done, nil
}

// AcceptInPlace implements transport.InPlaceSink: Accept, the bytes
// landing where they are addressed (Mem stands for the device memory a
// transport registered).
func (s *Slots) AcceptInPlace(addr, n uint64, key transport.Key, tag uint32) (func(error), error) {
	_, done, err := s.Accept(addr, n, key, tag)
	return done, err
}

// Delivered is how many writes tagged tag have completed.
func (s *Slots) Delivered(tag uint32) int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.tags[tag]
}

// Pending is how many accepted writes have not yet called done.
func (s *Slots) Pending() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.pending
}

// Wait waits until a write with each of tags has completed. A transport
// may report a completion to its sender before the receiver's done runs
// (RDMA does), so a test waits here before reading Mem.
func (s *Slots) Wait(ctx context.Context, tags ...uint32) error {
	return s.wait(ctx, func() error {
		for _, tag := range tags {
			if s.tags[tag] == 0 {
				return fmt.Errorf("tag %d not delivered", tag)
			}
		}
		return nil
	})
}

// WaitIdle waits until every accepted write has called done.
func (s *Slots) WaitIdle(ctx context.Context) error {
	return s.wait(ctx, func() error {
		if s.pending > 0 {
			return fmt.Errorf("%d accepted writes never called done", s.pending)
		}
		return nil
	})
}

// wait waits until unmet, called with s.mu held, returns nil.
func (s *Slots) wait(ctx context.Context, unmet func() error) error {
	for {
		s.mu.Lock()
		err, changed := unmet(), s.changed
		s.mu.Unlock()
		if err == nil {
			return nil
		}
		select {
		case <-changed:
		case <-ctx.Done():
			return fmt.Errorf("%w: %w", err, ctx.Err())
		}
	}
}

// Err reports the breaches of the Sink contract seen so far.
func (s *Slots) Err() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	return errors.Join(s.errs...)
}

// ErrCopy is the copy into device memory that StagedBody's fail makes fail.
var ErrCopy = errors.New("cuMemcpyHtoD_v2: CUDA_ERROR_ILLEGAL_ADDRESS")

// StagedBody is a transport.Body over dst as memory the host reaches only
// through copies (a GPU arena's): pieces of at most chunk bytes of one
// staging buffer, each copied into dst when the next is asked for. fail
// says whether the copy of the k-th piece (from 1) fails with ErrCopy;
// lent hears each piece's length.
func StagedBody(dst []byte, chunk int, fail func(k int) bool, lent func(n int)) transport.Body {
	staging := make([]byte, min(chunk, len(dst)))
	var at, last, pieces int
	return func() ([]byte, error) {
		if last > 0 {
			if pieces++; fail(pieces) {
				return nil, ErrCopy
			}
			at += copy(dst[at:], staging[:last])
		}
		last = min(len(staging), len(dst)-at)
		lent(last)
		return staging[:last], nil
	}
}
