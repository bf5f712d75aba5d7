package transporttest

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/ferry-project/ferry/transport"
)

func TestSlots(t *testing.T) {
	s := NewSlots(8192)
	key := s.Add(4096, 4096)
	refused := func(addr, n uint64, key transport.Key, want transport.Code) {
		t.Helper()
		_, _, err := s.Accept(addr, n, key, 9)
		if r := (*transport.Refusal)(nil); !errors.As(err, &r) || r.Code != want {
			t.Errorf("Accept(%#x, %d): got %v, want %s", addr, n, err, want)
		}
	}
	refused(0, 1, key, transport.NoSlot)
	refused(8192, 1, key, transport.NoSlot)
	wrong := key
	wrong[15] ^= 1
	refused(4096, 1, wrong, transport.NoSlot)
	refused(4096, 0, key, transport.OutOfBounds)
	refused(4097, 4096, key, transport.OutOfBounds)
	refused(4097, ^uint64(0), key, transport.OutOfBounds) // addr+n wraps

	dst, done, err := s.Accept(4096+100, 10, key, 7)
	if err != nil || len(dst) != 10 || cap(dst) != 10 {
		t.Fatalf("Accept: %d bytes (cap %d), %v", len(dst), cap(dst), err)
	}
	refused(4096, 1, key, transport.SlotBusy)
	copy(dst, "0123456789")
	if s.Pending() != 1 || s.Delivered(7) != 0 {
		t.Errorf("before done: pending %d, delivered %d", s.Pending(), s.Delivered(7))
	}
	waited := make(chan error, 1)
	go func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		waited <- s.Wait(ctx, 7)
	}()
	done(nil)
	if err := <-waited; err != nil {
		t.Error(err)
	}
	if string(s.Mem[4196:4206]) != "0123456789" || s.Pending() != 0 || s.Delivered(7) != 1 {
		t.Errorf("after done: memory %q, pending %d, delivered %d", s.Mem[4196:4206], s.Pending(), s.Delivered(7))
	}
	if err := s.Err(); err != nil {
		t.Errorf("Err before any breach: %v", err)
	}
	done(nil)
	if s.Err() == nil || s.Delivered(7) != 1 {
		t.Errorf("second done: Err %v, delivered %d; want a breach recorded, delivered still 1", s.Err(), s.Delivered(7))
	}

	ctx, cancel := context.WithTimeout(context.Background(), time.Millisecond)
	defer cancel()
	if err := s.Wait(ctx, 8); !errors.Is(err, context.DeadlineExceeded) {
		t.Errorf("Wait for a tag never sent: %v", err)
	}
}
