package tcp

import (
	"bytes"
	"errors"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ferry-project/ferry/transport"
	"github.com/ferry-project/ferry/transport/peer"
	"github.com/ferry-project/ferry/transport/transporttest"
)

// chunkSlots is Slots as a transport.ChunkSink whose memory the host
// reaches only through copies, as a GPU arena's: each write's bytes come
// in pieces of chunk bytes of staging, each copied into Mem when the
// next is asked for. The copy of the failAt-th piece (from 1; 0: none)
// fails.
type chunkSlots struct {
	*transporttest.Slots
	chunk   int
	failAt  atomic.Int32
	largest atomic.Int64 // the largest piece lent
}

func (c *chunkSlots) AcceptChunks(addr, n uint64, key transport.Key, tag uint32) (transport.Body, func(error), error) {
	dst, done, err := c.Accept(addr, n, key, tag)
	if err != nil {
		return nil, nil, err
	}
	return transporttest.StagedBody(dst, c.chunk,
		func(k int) bool { return k == int(c.failAt.Load()) },
		func(n int) { c.largest.Store(max(c.largest.Load(), int64(n))) }), done, nil
}

// A write lands through a ChunkSink a piece at a time, byte-exact. A
// piece that cannot be put in place fails the write: its sender is told
// why, the slot holds nothing delivered, and the next write goes on.
func TestChunkSinkLandsAPieceAtATime(t *testing.T) {
	const n, chunk = 2<<20 + 123, 256 << 10
	cs := &chunkSlots{Slots: transporttest.NewSlots(2 * n), chunk: chunk}
	rx := listen(t, peer.Config{Sink: cs})
	tx := listen(t, peer.Config{Sink: transporttest.NewSlots(0)})
	s, err := tx.Dial(ctxFor(t, 10*time.Second), rx.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	src := make([]byte, n)
	for i := range src {
		src[i] = byte(i * 7)
	}
	keys := []transport.Key{cs.Add(0, n), cs.Add(n, n)}
	write := func(slot int, tag uint32) error {
		_, err := s.Write(ctxFor(t, 30*time.Second), transport.Write{Src: src, Remote: uint64(slot * n), Key: keys[slot], Tag: tag})
		return err
	}

	if err := write(0, 1); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(cs.Mem[:n], src) || cs.Delivered(1) != 1 || cs.largest.Load() != chunk {
		t.Fatalf("delivered %d times, the largest piece %d bytes: want the bytes once, in pieces of %d", cs.Delivered(1), cs.largest.Load(), chunk)
	}

	cs.failAt.Store(3)
	err = write(1, 2)
	var rf *transport.Refusal
	if !errors.As(err, &rf) || rf.Code != transport.Internal || !strings.Contains(rf.Message, transporttest.ErrCopy.Error()) {
		t.Fatalf("a write whose third piece could not be placed: %v; want the receiver's reason", err)
	}
	if err := cs.WaitIdle(ctxFor(t, 10*time.Second)); err != nil {
		t.Fatal(err)
	}
	if cs.Delivered(2) != 0 {
		t.Fatal("a write that failed midway was delivered")
	}
	cs.failAt.Store(0)
	if err := write(1, 2); err != nil {
		t.Fatalf("the resend: %v", err)
	}
	if !bytes.Equal(cs.Mem[n:], src) || cs.Delivered(2) != 1 {
		t.Fatal("the resend did not land the bytes once")
	}
}
