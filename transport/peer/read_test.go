package peer

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ferry-project/ferry/transport"
	"github.com/ferry-project/ferry/transport/transporttest"
)

// readable is a Sink that serves reads of mem, at addresses from base
// on, under key alone: the shape of a ferry engine segment's memory.
type readable struct {
	*transporttest.Slots
	key  transport.Key
	base uint64
	mem  []byte
	pins atomic.Int32 // reads being answered: memory lent out
}

func (m *readable) ReadKeyed(addr, n uint64, key transport.Key) ([]byte, func(), error) {
	if key != m.key {
		return nil, nil, &transport.Refusal{Code: transport.NoSlot, Message: "no memory has this key"}
	}
	if addr < m.base || addr-m.base > uint64(len(m.mem)) || n > uint64(len(m.mem))-(addr-m.base) {
		return nil, nil, &transport.Refusal{Code: transport.OutOfBounds, Message: fmt.Sprintf("[%#x, +%d) lies outside the memory", addr, n)}
	}
	off := addr - m.base
	m.pins.Add(1)
	return m.mem[off : off+n], func() { m.pins.Add(-1) }, nil
}

func newReadable() *readable {
	m := &readable{Slots: transporttest.NewSlots(0), key: transport.NewKey(), base: 0x7f0000001000, mem: make([]byte, 3<<20)}
	for i := range m.mem {
		m.mem[i] = byte(i*7 + i>>12)
	}
	return m
}

func TestReadByteExact(t *testing.T) {
	for _, secret := range [][]byte{nil, []byte("a peer secret of enough bytes")} {
		t.Run(fmt.Sprintf("secret=%v", secret != nil), func(t *testing.T) {
			m := newReadable()
			rx := listen(t, Config{Sink: m, Secret: secret}, nil)
			tx := listen(t, Config{Secret: secret}, nil)
			// A small piece, one across IOChunk boundaries, and the last byte.
			a, b, c := make([]byte, 100), make([]byte, 2<<20+5), make([]byte, 1)
			err := tx.Read(ctxFor(t, 20*time.Second), rx.Addr().String(), []transport.Read{
				{Addr: m.base + 3, Key: m.key, Dst: a},
				{Addr: m.base + 4096, Key: m.key, Dst: b},
				{Addr: m.base + uint64(len(m.mem)) - 1, Key: m.key, Dst: c},
			})
			if err != nil {
				t.Fatal(err)
			}
			for _, p := range []struct {
				off int
				got []byte
			}{{3, a}, {4096, b}, {len(m.mem) - 1, c}} {
				if !bytes.Equal(p.got, m.mem[p.off:p.off+len(p.got)]) {
					t.Fatalf("the %d bytes read at offset %d differ from the peer's memory", len(p.got), p.off)
				}
			}
		})
	}
}

func TestReadRefused(t *testing.T) {
	m := newReadable()
	rx := listen(t, Config{Sink: m}, nil)
	tx := listen(t, Config{}, nil)
	for _, c := range []struct {
		name string
		r    transport.Read
		code transport.Code
	}{
		{"PastTheEnd", transport.Read{Addr: m.base + uint64(len(m.mem)) - 10, Key: m.key, Dst: make([]byte, 11)}, transport.OutOfBounds},
		{"Below", transport.Read{Addr: m.base - 1, Key: m.key, Dst: make([]byte, 2)}, transport.OutOfBounds},
		{"OtherKey", transport.Read{Addr: m.base, Key: transport.NewKey(), Dst: make([]byte, 2)}, transport.NoSlot},
	} {
		t.Run(c.name, func(t *testing.T) {
			err := tx.Read(ctxFor(t, 10*time.Second), rx.Addr().String(), []transport.Read{c.r})
			var rf *transport.Refusal
			if !errors.As(err, &rf) || rf.Code != c.code {
				t.Fatalf("read of [%#x, +%d): got %v, want a %s refusal", c.r.Addr, len(c.r.Dst), err, c.code)
			}
		})
	}
	// Guessing keys on one connection: each guess is answered no_slot,
	// the MaxUnmatched-th with the close flag, and the connection ends.
	c, _, err := tx.Dial(ctxFor(t, 10*time.Second), rx.Addr().String(), KindRead)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(10 * time.Second))
	var hdr [HeaderSize]byte
	var rep [ReplySize]byte
	for i := 1; i <= MaxUnmatched; i++ {
		h := Header{Addr: m.base, Len: 1, Key: transport.NewKey()}
		h.Encode(&hdr)
		if _, err := c.Write(hdr[:]); err != nil {
			t.Fatalf("guess %d: %v", i, err)
		}
		if _, err := io.ReadFull(c, rep[:]); err != nil {
			t.Fatalf("guess %d's reply: %v", i, err)
		}
		code, flags, n, err := DecodeReply(&rep)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := io.ReadFull(c, make([]byte, n)); err != nil {
			t.Fatalf("guess %d's message: %v", i, err)
		}
		if code != transport.NoSlot || (flags&FlagClose != 0) != (i == MaxUnmatched) {
			t.Fatalf("guess %d of %d: code %s, flags %#x; want no_slot, the close flag on the last only", i, MaxUnmatched, code, flags)
		}
	}
	if n, err := c.Read(make([]byte, 1)); err != io.EOF {
		t.Fatalf("after %d guesses the connection gave %d bytes, %v; want it closed", MaxUnmatched, n, err)
	}
}

// TestReadWire is a read connection's exchange written from the notes
// in read.go, byte by byte.
func TestReadWire(t *testing.T) {
	m := newReadable()
	rx := listen(t, Config{Sink: m}, nil)
	tx := listen(t, Config{}, nil)
	c, _, err := tx.Dial(ctxFor(t, 10*time.Second), rx.Addr().String(), KindRead)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(10 * time.Second))
	hdr := binary.LittleEndian.AppendUint64(nil, m.base+16) // addr
	hdr = binary.LittleEndian.AppendUint64(hdr, 5)          // len
	hdr = append(hdr, m.key[:]...)                          // key, 20 bytes
	hdr = append(hdr, 0, 0, 0, 0)                           // tag
	if _, err := c.Write(hdr); err != nil {
		t.Fatal(err)
	}
	got := make([]byte, 8+5)
	if _, err := io.ReadFull(c, got); err != nil {
		t.Fatal(err)
	}
	if want := append([]byte{0, 0, 0, 0, 0, 0, 0, 0}, m.mem[16:21]...); !bytes.Equal(got, want) {
		t.Fatalf("reply and bytes % x, want % x", got, want)
	}
	// Out of bounds: code 3, no close flag, its message.
	binary.LittleEndian.PutUint64(hdr[8:], uint64(len(m.mem)))
	c.Write(hdr)
	rep := make([]byte, 8)
	if _, err := io.ReadFull(c, rep); err != nil {
		t.Fatal(err)
	}
	if code, flags, n := binary.LittleEndian.Uint32(rep), binary.LittleEndian.Uint16(rep[4:]), binary.LittleEndian.Uint16(rep[6:]); code != 3 || flags != 0 || n == 0 {
		t.Fatalf("an out-of-bounds read's reply % x: want code 3, flags 0, a message", rep)
	}
}

func TestReadNotServed(t *testing.T) {
	rx := listen(t, Config{}, nil) // its Sink serves no reads
	tx := listen(t, Config{}, nil)
	err := tx.Read(ctxFor(t, 10*time.Second), rx.Addr().String(), []transport.Read{{Addr: 1, Dst: make([]byte, 1)}})
	if err == nil || !strings.Contains(err.Error(), "kind 2") {
		t.Fatalf("a read from a port serving none: %v, want it to name the connection kind", err)
	}
}

// A read whose context ends while the peer holds back its answer ends
// then, naming the context's error.
func TestReadCanceled(t *testing.T) {
	m := &stalling{readable: newReadable(), release: make(chan struct{})}
	defer close(m.release)
	rx := listen(t, Config{Sink: m}, nil)
	tx := listen(t, Config{}, nil)
	ctx, cancel := context.WithTimeout(t.Context(), 200*time.Millisecond)
	defer cancel()
	err := tx.Read(ctx, rx.Addr().String(), []transport.Read{{Addr: m.base, Key: m.key, Dst: make([]byte, 8)}})
	if !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("a read past its deadline: %v, want it to name the deadline", err)
	}
}

// stalling serves reads once release closes.
type stalling struct {
	*readable
	release chan struct{}
}

func (s *stalling) ReadKeyed(addr, n uint64, key transport.Key) ([]byte, func(), error) {
	<-s.release
	return s.readable.ReadKeyed(addr, n, key)
}

// TestReadAnswerDeadline: a reader that takes an answer's bytes, but
// slowly (1 MiB every 200 ms: each of the server's writes within its
// I/O timeout), has the whole answer within one deadline (the I/O
// timeout and a second per MinReadRate bytes) or not at all: past it
// the server cuts the answer, closes the connection, gives back the
// memory it lent, and says so in a line.
func TestReadAnswerDeadline(t *testing.T) {
	m := newReadable()
	m.mem = make([]byte, 48<<20) // 5 MiB/s would take 9.6 s; the deadline is 4 s
	var l transporttest.Logs
	const ioTimeout = time.Second
	rx := listen(t, Config{Sink: m, IOTimeout: ioTimeout, Logf: l.Logf}, nil)
	tx := listen(t, Config{}, nil)
	c, _, err := tx.Dial(ctxFor(t, 10*time.Second), rx.Addr().String(), KindRead)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	var hdr [HeaderSize]byte
	h := Header{Addr: m.base, Len: uint64(len(m.mem)), Key: m.key}
	h.Encode(&hdr)
	c.SetDeadline(time.Now().Add(30 * time.Second))
	if _, err := c.Write(hdr[:]); err != nil {
		t.Fatal(err)
	}
	got := make(chan int, 1)
	go func() { // the slow reader: the reply and bytes, 1 MiB a tick, until the connection ends
		tick := time.NewTicker(200 * time.Millisecond)
		defer tick.Stop()
		n, buf := 0, make([]byte, 1<<20)
		for range tick.C {
			k, err := io.ReadFull(c, buf)
			if n += k; err != nil {
				got <- n
				return
			}
		}
	}()
	l.Wait(t, "closed the connection after", "of the 50331648 bytes of a read", "within its 4s")
	if p := m.pins.Load(); p != 0 {
		t.Errorf("the answer cut short: %d reads still hold memory, want none", p)
	}
	select {
	case n := <-got:
		if want := ReplySize + len(m.mem); n >= want {
			t.Fatalf("the slow reader took all %d bytes of the answer: want it cut at the deadline", n)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("the slow reader's connection still open 30 s after the answer's deadline")
	}
}

// The answer's deadline grows a second per MinReadRate bytes to the
// largest reads, with no overflow (n seconds' worth of nanoseconds
// passes int64 at 8 GiB).
func TestAnswerTimeoutOfLargeReads(t *testing.T) {
	for _, c := range []struct {
		n    uint64
		want time.Duration
	}{
		{0, 10 * time.Second},
		{8 << 20, 10*time.Second + 500*time.Millisecond},
		{1 << 30, 74 * time.Second},
		{9 << 30, 10*time.Second + 576*time.Second},
		{64 << 30, 10*time.Second + 4096*time.Second},
	} {
		if got := AnswerTimeout(c.n, 10*time.Second); got != c.want {
			t.Errorf("AnswerTimeout(%d bytes, 10s) = %v, want %v", c.n, got, c.want)
		}
	}
}
