package tcp

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"runtime"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ferry-project/ferry/transport"
	"github.com/ferry-project/ferry/transport/peer"
	"github.com/ferry-project/ferry/transport/transporttest"
)

func listen(tb testing.TB, cfg peer.Config) *Transport {
	tb.Helper()
	if cfg.Addr == "" {
		cfg.Addr = "127.0.0.1:0"
	}
	tr, err := Listen(cfg)
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { tr.Close() })
	return tr
}

func TestConformance(t *testing.T) {
	transporttest.Run(t, func(t *testing.T, sink transport.Sink) transport.Transport {
		return listen(t, peer.Config{Sink: sink})
	})
}

func ctxFor(t *testing.T, d time.Duration) context.Context {
	ctx, cancel := context.WithTimeout(t.Context(), d)
	t.Cleanup(cancel)
	return ctx
}

// The handshake of the peer port (transport/peer/wire.go), as the raw
// clients and fake servers of these tests write and read it: from the
// notes, not from package peer's codec.
const (
	version         = 8
	helloSize       = 24
	welcomeSize     = 28
	nonceSize       = 32
	verdictSize     = 36
	statusOK        = 0
	statusBadProof  = 7
	statusNotHere   = 8
	statusBadDialed = 9
	flagAuth        = 1
)

// helloBytes is a hello in protocol version v: instance 42 asking for a
// data connection, without a secret.
func helloBytes(v uint32) []byte {
	b := make([]byte, helloSize)
	copy(b, "FERY")
	binary.LittleEndian.PutUint32(b[4:], v)
	binary.LittleEndian.PutUint64(b[8:], 42)
	return b // kind 0 (data) and flags 0
}

// welcomeAs answers a hello the way a server speaking v would.
func welcomeAs(v, status uint32) func(c net.Conn) {
	return func(c net.Conn) {
		if _, err := io.ReadFull(c, make([]byte, helloSize)); err != nil {
			return
		}
		c.Write(binary.LittleEndian.AppendUint32(helloBytes(v), status))
	}
}

// stillServes checks that tr takes a write from a fresh session, into the
// last 4 KiB of slots' memory.
func stillServes(t *testing.T, tr *Transport, slots *transporttest.Slots) {
	t.Helper()
	tx := listen(t, peer.Config{Sink: transporttest.NewSlots(0)})
	s, err := tx.Dial(ctxFor(t, 10*time.Second), tr.Addr().String())
	if err != nil {
		t.Fatalf("dial after hostile clients: %v", err)
	}
	defer s.Close()
	addr := uint64(len(slots.Mem) - 4096)
	w := transport.Write{Src: make([]byte, 4096), Remote: addr, Key: slots.Add(addr, 4096), Tag: 0xfe44}
	if _, err := s.Write(ctxFor(t, 10*time.Second), w); err != nil {
		t.Fatalf("write after hostile clients: %v", err)
	}
}

// handshake opens a raw connection to tr through the handshake.
func handshake(t *testing.T, tr *Transport) net.Conn {
	t.Helper()
	nc := transporttest.Dial(t, tr.Addr().String())
	nc.Write(helloBytes(version))
	var b [welcomeSize]byte
	if _, err := io.ReadFull(nc, b[:]); err != nil {
		t.Fatal(err)
	}
	return nc
}

func TestOversizedWrite(t *testing.T) {
	const limit = 1 << 20
	slots := transporttest.NewSlots(65 << 20)
	rx := listen(t, peer.Config{Sink: slots, MaxWrite: limit})

	t.Run("Raw", func(t *testing.T) {
		other := handshake(t, rx)
		nc := handshake(t, rx)
		var hb [peer.HeaderSize]byte
		h := peer.Header{Addr: 0, Len: 1 << 62, Key: transport.Key{1}, Tag: 2}
		h.Encode(&hb)
		nc.Write(hb[:])
		var rb [peer.ReplySize]byte
		if _, err := io.ReadFull(nc, rb[:]); err != nil {
			t.Fatal(err)
		}
		code, flags, n, err := peer.DecodeReply(&rb)
		msg := make([]byte, n)
		io.ReadFull(nc, msg)
		if err != nil || code != transport.OutOfBounds || flags&peer.FlagClose == 0 || !strings.Contains(string(msg), "limit") {
			t.Errorf("got reply %s flags %#x %q, %v; want out_of_bounds, closing, naming the limit", code, flags, msg, err)
		}
		if n, err := nc.Read(rb[:]); err != io.EOF {
			t.Errorf("after the refusal: got %d bytes and %v, want the connection closed", n, err)
		}
		// The other connection is untouched: a refused write on it still
		// gets its answer.
		h = peer.Header{Addr: 1 << 30, Len: 3, Tag: 3}
		h.Encode(&hb)
		other.Write(append(hb[:], 1, 2, 3))
		if _, err := io.ReadFull(other, rb[:]); err != nil {
			t.Fatalf("other connection: %v", err)
		}
		if code, _, _, _ := peer.DecodeReply(&rb); code != transport.NoSlot {
			t.Errorf("other connection: got %s, want no_slot", code)
		}
	})

	tx := listen(t, peer.Config{Sink: transporttest.NewSlots(0)})
	s, err := tx.Dial(ctxFor(t, 10*time.Second), rx.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	key := slots.Add(0, 64<<20)
	// 2 MiB fits in the socket buffers, so the sender reads the reply
	// after its body; 64 MiB does not, so the receiver closes on it
	// mid-body and the sender finds the reply after its write fails.
	for i, n := range []int{2 << 20, 64 << 20} {
		_, err := s.Write(ctxFor(t, 10*time.Second), transport.Write{Src: make([]byte, n), Remote: 0, Key: key, Tag: uint32(i)})
		var r *transport.Refusal
		if !errors.As(err, &r) || r.Code != transport.OutOfBounds || !strings.Contains(r.Message, "limit") {
			t.Errorf("%d-byte write: got %v, want an out_of_bounds refusal naming the limit", n, err)
		}
	}
	if _, err := s.Write(ctxFor(t, 10*time.Second), transport.Write{Src: make([]byte, limit), Remote: 0, Key: key, Tag: 9}); err != nil {
		t.Errorf("write at the limit: %v", err)
	}
	stillServes(t, rx, slots)
}

// A connection that keeps sending writes no slot matches (a peer guessing
// keys) gets one uniform refusal each, and after MaxUnmatched of them the
// receiver closes it; other connections go on.
func TestWrongKeyFloodClosesConnection(t *testing.T) {
	slots := transporttest.NewSlots(1 << 20)
	key := slots.Add(0, 4096)
	var l transporttest.Logs
	rx := listen(t, peer.Config{Sink: slots, Logf: l.Logf})
	nc := handshake(t, rx)
	var hb [peer.HeaderSize]byte
	var rb [peer.ReplySize]byte
	var first []byte
	for i := 1; i <= peer.MaxUnmatched; i++ {
		guess := transport.NewKey()
		h := peer.Header{Addr: 0, Len: 4, Key: guess, Tag: guess.Tag()}
		h.Encode(&hb)
		nc.SetDeadline(time.Now().Add(10 * time.Second))
		if _, err := nc.Write(append(hb[:], 1, 2, 3, 4)); err != nil {
			t.Fatalf("guess %d: %v", i, err)
		}
		if _, err := io.ReadFull(nc, rb[:]); err != nil {
			t.Fatalf("guess %d: reading the reply: %v", i, err)
		}
		code, flags, n, err := peer.DecodeReply(&rb)
		msg := make([]byte, n)
		io.ReadFull(nc, msg)
		if err != nil || code != transport.NoSlot {
			t.Fatalf("guess %d: got %s %q, %v; want no_slot", i, code, msg, err)
		}
		if first == nil {
			first = msg
		} else if !bytes.Equal(msg, first) {
			t.Errorf("guess %d: refusal %q differs from the first, %q: refusals must be uniform", i, msg, first)
		}
		if closing := flags&peer.FlagClose != 0; closing != (i == peer.MaxUnmatched) {
			t.Fatalf("guess %d: close flag %t", i, closing)
		}
	}
	if n, err := nc.Read(rb[:]); err != io.EOF {
		t.Errorf("after %d guesses: got %d bytes and %v, want the connection closed", peer.MaxUnmatched, n, err)
	}
	nc.Close()
	transporttest.Served(t, rx.PortStats)
	l.Has(t, "matched no receive slot")
	// The holder of the key still writes, on a connection of its own.
	tx := listen(t, peer.Config{Sink: transporttest.NewSlots(0)})
	s, err := tx.Dial(ctxFor(t, 10*time.Second), rx.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	if _, err := s.Write(ctxFor(t, 10*time.Second), transport.Write{Src: []byte("real"), Remote: 0, Key: key, Tag: 9}); err != nil {
		t.Fatalf("the key's holder: %v", err)
	}
}

func TestBodyCutShort(t *testing.T) {
	slots := transporttest.NewSlots(1 << 20)
	key := slots.Add(0, 4096)
	rx := listen(t, peer.Config{Sink: slots})
	nc := handshake(t, rx)
	var hb [peer.HeaderSize]byte
	h := peer.Header{Addr: 0, Len: 4096, Key: key, Tag: 1}
	h.Encode(&hb)
	nc.Write(append(hb[:], make([]byte, 100)...))
	nc.Close()
	transporttest.Served(t, rx.PortStats)
	if n := slots.Pending(); n != 0 {
		t.Errorf("%d writes still pending: done was not called", n)
	}
	if n := slots.Delivered(1); n != 0 {
		t.Errorf("a cut-short write was delivered %d times", n)
	}
	stillServes(t, rx, slots)
}

func TestHostileReply(t *testing.T) {
	tx := listen(t, peer.Config{Sink: transporttest.NewSlots(0)})
	for _, c := range []struct {
		name    string
		reply   []byte
		refusal bool
		want    string
	}{
		{"LongMessage", []byte{1, 0, 0, 0, 0, 0, 0x88, 0x13}, false, "exceeds the 1024-byte limit"},
		{"OKWithMessage", []byte{0, 0, 0, 0, 0, 0, 1, 0, 'x'}, false, "ok reply carries a 1-byte message"},
		{"UnknownCode", []byte{99, 0, 0, 0, 0, 0, 2, 0, 'h', 'i'}, true, "code_99"},
		{"Truncated", []byte{1, 0}, false, "peer closed the connection"},
	} {
		t.Run(c.name, func(t *testing.T) {
			answer := welcomeAs(version, statusOK)
			addr := transporttest.FakePeer(t, func(nc net.Conn) {
				answer(nc)
				io.ReadFull(nc, make([]byte, peer.HeaderSize+10))
				nc.Write(c.reply)
			})
			s, err := tx.Dial(ctxFor(t, 10*time.Second), addr)
			if err != nil {
				t.Fatal(err)
			}
			defer s.Close()
			_, err = s.Write(ctxFor(t, 10*time.Second), transport.Write{Src: make([]byte, 10)})
			if err == nil || transport.IsRefusal(err) != c.refusal || !strings.Contains(err.Error(), c.want) {
				t.Errorf("got %v, want an error naming %q (refusal: %v)", err, c.want, c.refusal)
			}
		})
	}
}

// TestStalledPeer covers a peer that completes the handshake and then
// reads nothing: IOTimeout alone ends the write.
func TestStalledPeer(t *testing.T) {
	answer := welcomeAs(version, statusOK)
	addr := transporttest.FakePeer(t, func(c net.Conn) {
		answer(c)
		<-t.Context().Done()
	})
	const timeout = 300 * time.Millisecond
	tx := listen(t, peer.Config{Sink: transporttest.NewSlots(0), IOTimeout: timeout})
	s, err := tx.Dial(ctxFor(t, 10*time.Second), addr)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	for _, c := range []struct {
		n    int
		want string
	}{
		{64 << 20, "of 67108864 bytes"},              // stuck in the body
		{4096, "waiting for the completion of 4096"}, // stuck waiting for the reply
	} {
		start := time.Now()
		_, err := s.Write(context.Background(), transport.Write{Src: make([]byte, c.n)})
		if took := time.Since(start); took > timeout+5*time.Second {
			t.Errorf("%d-byte write took %s with IOTimeout %s", c.n, took, timeout)
		}
		if err == nil || !strings.Contains(err.Error(), "no progress") || !strings.Contains(err.Error(), c.want) || !strings.Contains(err.Error(), addr) {
			t.Errorf("%d-byte write: got %v, want no progress %s naming %s", c.n, err, c.want, addr)
		}
	}
}

func TestPeerGoneMidBody(t *testing.T) {
	answer := welcomeAs(version, statusOK)
	addr := transporttest.FakePeer(t, func(c net.Conn) {
		answer(c)
		io.ReadFull(c, make([]byte, peer.HeaderSize+1<<20))
	})
	tx := listen(t, peer.Config{Sink: transporttest.NewSlots(0)})
	s, err := tx.Dial(ctxFor(t, 10*time.Second), addr)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	_, err = s.Write(ctxFor(t, 10*time.Second), transport.Write{Src: make([]byte, 64<<20)})
	want := "tcp write to " + addr + ": peer closed the connection after "
	if err == nil || !strings.Contains(err.Error(), want) || !strings.Contains(err.Error(), "of 67108864 bytes") {
		t.Errorf("got %v, want %q… of 67108864 bytes", err, want)
	}
}

// BenchmarkWrite measures one writer on one session over loopback: every
// write waits for its completion before the next starts.
func BenchmarkWrite(b *testing.B) {
	for _, size := range []int{1 << 20, 4 << 20, 16 << 20} {
		b.Run(fmt.Sprintf("%dMiB", size>>20), func(b *testing.B) {
			s, ws := benchSession(b, size, 1)
			b.ReportAllocs()
			for b.Loop() {
				if _, err := s.Write(b.Context(), ws[0]); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

// BenchmarkWriteConcurrent measures one writer per P sharing one session,
// as the daemon runs them: each write has its own connection.
func BenchmarkWriteConcurrent(b *testing.B) {
	for _, size := range []int{1 << 20, 16 << 20} {
		b.Run(fmt.Sprintf("%dMiB", size>>20), func(b *testing.B) {
			s, ws := benchSession(b, size, runtime.GOMAXPROCS(0))
			var next atomic.Int32
			b.RunParallel(func(pb *testing.PB) {
				w := ws[next.Add(1)-1]
				for pb.Next() {
					if _, err := s.Write(b.Context(), w); err != nil {
						b.Error(err)
						return
					}
				}
			})
		})
	}
}

// benchSession makes a receiver with n slots of size bytes, a session to
// it, and a write of random bytes into each slot.
func benchSession(b *testing.B, size, n int) (transport.Session, []transport.Write) {
	slots := transporttest.NewSlots(n * size)
	rx := listen(b, peer.Config{Sink: slots})
	tx := listen(b, peer.Config{Sink: transporttest.NewSlots(0)})
	s, err := tx.Dial(b.Context(), rx.Addr().String())
	if err != nil {
		b.Fatal(err)
	}
	src := make([]byte, size)
	rand.NewChaCha8([32]byte{}).Read(src)
	ws := make([]transport.Write, n)
	for i := range ws {
		addr := uint64(i * size)
		ws[i] = transport.Write{Src: src, Remote: addr, Key: slots.Add(addr, uint64(size)), Tag: uint32(i)}
	}
	b.SetBytes(int64(size))
	return s, ws
}
