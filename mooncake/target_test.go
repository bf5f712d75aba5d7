package mooncake_test

import (
	"bytes"
	"errors"
	"net"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ferry-project/ferry/mooncake"
	"github.com/ferry-project/ferry/mooncake/mooncaketest"
	"github.com/ferry-project/ferry/transport"
	"github.com/ferry-project/ferry/transport/transporttest"
)

// stagedMemory is a buffer at base that a WRITE reaches only through
// copies, as GPU memory: its bytes come in pieces of chunk bytes of
// staging, each copied in when the next is asked for. The copy of the
// failAt-th piece of a WRITE (from 1; 0: none) fails.
type stagedMemory struct {
	base  uint64
	mem   []byte
	chunk int

	mu       sync.Mutex
	failAt   int
	largest  int // the largest piece lent
	finished []error
}

func (m *stagedMemory) Write(addr, n uint64) (transport.Body, func(error), error) {
	if addr < m.base || addr-m.base+n > uint64(len(m.mem)) {
		return nil, nil, errors.New("outside the buffer")
	}
	body := transporttest.StagedBody(m.mem[addr-m.base:addr-m.base+n], m.chunk,
		func(k int) bool { return k == m.failAt },
		func(n int) { m.largest = max(m.largest, n) })
	return func() ([]byte, error) {
			m.mu.Lock()
			defer m.mu.Unlock()
			return body()
		}, func(err error) {
			m.mu.Lock()
			defer m.mu.Unlock()
			m.finished = append(m.finished, err)
		}, nil
}

func (m *stagedMemory) Read(addr, n uint64) ([]byte, func(), error) {
	return nil, nil, errors.New("no READs here")
}

// A WRITE lands a piece at a time, byte-exact; one whose piece cannot be
// put in place is rejected, and done hears why.
func TestDataPortWritesAPieceAtATime(t *testing.T) {
	const n, chunk = 300<<10 + 7, 64 << 10
	m := &stagedMemory{base: 0x10000, mem: make([]byte, 2*n), chunk: chunk}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	var logs transporttest.Logs
	srv := mooncake.ServeData(ln, m, mooncake.DataConfig{Logf: logs.Logf})
	defer srv.Close()
	src := make([]byte, n)
	for i := range src {
		src[i] = byte(i * 13)
	}
	write := func(addr uint64) error {
		c, err := mooncaketest.DialPooled(ctxT(t), srv.Addr().String(), "")
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		return c.Write(addr, src, 10*time.Second)
	}

	if err := write(m.base); err != nil {
		t.Fatal(err)
	}
	m.mu.Lock()
	if !bytes.Equal(m.mem[:n], src) || m.largest != chunk || len(m.finished) != 1 || m.finished[0] != nil {
		t.Fatalf("the WRITE landed in pieces of at most %d bytes, finished %v: want the bytes, in pieces of %d, done(nil)", m.largest, m.finished, chunk)
	}
	m.failAt = 2
	m.mu.Unlock()
	if err := write(m.base + n); err == nil || !strings.Contains(err.Error(), "was rejected") {
		t.Fatalf("a WRITE whose second piece could not be placed: %v, want it rejected", err)
	}
	logs.Wait(t, "CUDA_ERROR_ILLEGAL_ADDRESS")
	m.mu.Lock()
	if len(m.finished) != 2 || m.finished[1] == nil {
		t.Fatalf("done heard %v, want the failed piece's error", m.finished)
	}
	// v1 has no status: a WRITE read whole whose last piece could not be
	// placed leaves nothing unread, and only a reset tells the writer.
	m.failAt = (n + chunk - 1) / chunk
	m.mu.Unlock()
	err = mooncake.Write(ctxT(t), mooncake.Request{Data: srv.Addr().String(), Addr: m.base, Buf: src})
	if re := (*mooncake.RejectedError)(nil); !errors.As(err, &re) {
		t.Fatalf("a v1 WRITE whose last piece could not be placed: %v, want it rejected", err)
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	if len(m.finished) != 3 || m.finished[2] == nil {
		t.Fatalf("done heard %v, want the failed piece's error", m.finished)
	}
}
