package tcp

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ferry-project/ferry/internal/connlimit"
	"github.com/ferry-project/ferry/transport"
	"github.com/ferry-project/ferry/transport/transporttest"
)

func listen(tb testing.TB, cfg Config) *Transport {
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
		return listen(t, Config{Sink: sink})
	})
}

func ctxFor(t *testing.T, d time.Duration) context.Context {
	ctx, cancel := context.WithTimeout(t.Context(), d)
	t.Cleanup(cancel)
	return ctx
}

// logs collects a Transport's log lines.
type logs struct {
	mu    sync.Mutex
	lines []string
}

func (l *logs) logf(format string, args ...any) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.lines = append(l.lines, fmt.Sprintf(format, args...))
}

func (l *logs) has(t *testing.T, want ...string) {
	t.Helper()
	l.mu.Lock()
	defer l.mu.Unlock()
	for _, line := range l.lines {
		found := true
		for _, w := range want {
			found = found && strings.Contains(line, w)
		}
		if found {
			return
		}
	}
	t.Errorf("no log line has all of %q; got %q", want, l.lines)
}

func (l *logs) none(t *testing.T, about string) {
	t.Helper()
	l.mu.Lock()
	defer l.mu.Unlock()
	for _, line := range l.lines {
		if strings.Contains(line, about) {
			t.Errorf("unexpected log line %q", line)
		}
	}
}

// served waits until tr has no accepted connection left, that is until
// every connection goroutine has finished.
func served(t *testing.T, tr *Transport) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		n := tr.PortStats().Open
		if n == 0 {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d accepted connections still served", n)
		}
		time.Sleep(time.Millisecond)
	}
}

// helloBytes is a hello in protocol version v.
func helloBytes(v uint32) []byte {
	var b [helloSize]byte
	h := ours(42, kindData, nil)
	h.version = v
	h.encode(&b)
	return b[:]
}

// stillServes checks that tr takes a write from a fresh session, into the
// last 4 KiB of slots' memory.
func stillServes(t *testing.T, tr *Transport, slots *transporttest.Slots) {
	t.Helper()
	tx := listen(t, Config{Sink: transporttest.NewSlots(0)})
	s, err := tx.Dial(ctxFor(t, 10*time.Second), tr.Addr().String())
	if err != nil {
		t.Fatalf("dial after hostile clients: %v", err)
	}
	defer s.Close()
	addr := uint64(len(slots.Mem) - 4096)
	w := transport.Write{Src: make([]byte, 4096), Remote: addr, Key: slots.Add(addr, 4096), Tag: 0xfe44}
	if err := s.Write(ctxFor(t, 10*time.Second), w); err != nil {
		t.Fatalf("write after hostile clients: %v", err)
	}
}

func TestHostileHandshake(t *testing.T) {
	var l logs
	slots := transporttest.NewSlots(1 << 20)
	rx := listen(t, Config{Sink: slots, HandshakeTimeout: 300 * time.Millisecond, Logf: l.logf})
	const noWelcome = ^uint32(0)
	for _, c := range []struct {
		name   string
		send   []byte   // then half-close; nil: send nothing, stay open
		status uint32   // of the welcome
		log    []string // words of the expected log line; nil: no line
	}{
		{"WrongMagic", []byte("GET / HTTP/1.1\r\nHost:x\r\n"), statusBadMagic, []string{"bad magic", `"GET "`}},
		{"WrongVersion", helloBytes(99), statusBadVersion, []string{"version 99", "version 4", "upgrade the older daemon"}},
		{"OldVersion", helloBytes(2), statusBadVersion, []string{"peer speaks version 2", "version 4", "upgrade the older daemon"}},
		{"Truncated", helloBytes(version)[:5], noWelcome, []string{"read 5 of the 24-byte hello", "EOF"}},
		{"Silent", nil, noWelcome, []string{"read 0 of the 24-byte hello", "timeout"}},
		{"ConnectAndClose", []byte{}, noWelcome, nil},
	} {
		t.Run(c.name, func(t *testing.T) {
			nc, err := net.Dial("tcp", rx.Addr().String())
			if err != nil {
				t.Fatal(err)
			}
			defer nc.Close()
			nc.SetDeadline(time.Now().Add(10 * time.Second))
			if c.send != nil {
				nc.Write(c.send)
				nc.(*net.TCPConn).CloseWrite()
			}
			var b [welcomeSize]byte
			n, err := io.ReadFull(nc, b[:])
			if c.status == noWelcome {
				if n != 0 || err != io.EOF {
					t.Errorf("got %d bytes and %v, want the connection closed", n, err)
				}
			} else {
				var w welcome
				w.decode(&b)
				if err != nil || w.status != c.status || w.version != version || string(w.magic[:]) != magic {
					t.Errorf("got welcome %+v, %v; want status %d", w, err, c.status)
				}
				if n, err := nc.Read(b[:]); err != io.EOF {
					t.Errorf("after the welcome: got %d bytes and %v, want the connection closed", n, err)
				}
			}
			served(t, rx)
			if c.log == nil {
				l.none(t, nc.LocalAddr().String())
			} else {
				l.has(t, c.log...)
			}
		})
	}
	stillServes(t, rx, slots)
}

// fakePeer listens on loopback and runs answer on each connection it
// accepts, closing it afterwards.
func fakePeer(t *testing.T, answer func(c net.Conn)) string {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	var mu sync.Mutex
	var conns []net.Conn
	t.Cleanup(func() {
		ln.Close()
		mu.Lock()
		for _, c := range conns {
			c.Close()
		}
		mu.Unlock()
		wg.Wait()
	})
	wg.Go(func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			mu.Lock()
			conns = append(conns, c)
			mu.Unlock()
			wg.Go(func() {
				defer c.Close()
				answer(c)
			})
		}
	})
	return ln.Addr().String()
}

// welcomeAs answers a hello the way a server speaking v would.
func welcomeAs(v, status uint32) func(c net.Conn) {
	return func(c net.Conn) {
		var hb [helloSize]byte
		if _, err := io.ReadFull(c, hb[:]); err != nil {
			return
		}
		var b [welcomeSize]byte
		w := welcome{hello: ours(7, kindData, nil), status: status}
		w.version = v
		w.encode(&b)
		c.Write(b[:])
	}
}

func TestDialHostilePeer(t *testing.T) {
	tx := listen(t, Config{Sink: transporttest.NewSlots(0)})
	for _, c := range []struct {
		name         string
		answer       func(c net.Conn)
		want         []string
		incompatible bool // no re-dial can help: the daemon must not retry
	}{
		{"WrongVersion", welcomeAs(5, statusBadVersion), []string{"peer speaks version 5", "this daemon speaks version 4", "upgrade the older daemon"}, true},
		{"NotFerry", func(c net.Conn) { io.WriteString(c, "HTTP/1.1 400 Bad Request\r\n\r\n") }, []string{"bad magic", "HTTP"}, true},
		{"Refused", welcomeAs(version, 77), []string{"status 77"}, false},
		{"ClosesEarly", func(c net.Conn) { c.Read(make([]byte, 1)) }, []string{"peer closed the connection"}, false},
	} {
		t.Run(c.name, func(t *testing.T) {
			addr := fakePeer(t, c.answer)
			_, err := tx.Dial(ctxFor(t, 10*time.Second), addr)
			if err == nil {
				t.Fatal("dial succeeded")
			}
			for _, w := range append(c.want, "tcp dial "+addr, "handshake") {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("error %q does not mention %q", err, w)
				}
			}
			if got := errors.Is(err, transport.ErrIncompatible); got != c.incompatible {
				t.Errorf("errors.Is(%q, ErrIncompatible) = %v, want %v", err, got, c.incompatible)
			}
		})
	}
}

// handshake opens a raw connection to tr through the handshake.
func handshake(t *testing.T, tr *Transport) net.Conn {
	t.Helper()
	nc, err := net.Dial("tcp", tr.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { nc.Close() })
	nc.SetDeadline(time.Now().Add(10 * time.Second))
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
	rx := listen(t, Config{Sink: slots, MaxWrite: limit})

	t.Run("Raw", func(t *testing.T) {
		other := handshake(t, rx)
		nc := handshake(t, rx)
		var hb [HeaderSize]byte
		h := Header{Addr: 0, Len: 1 << 62, Key: transport.Key{1}, Tag: 2}
		h.Encode(&hb)
		nc.Write(hb[:])
		var rb [ReplySize]byte
		if _, err := io.ReadFull(nc, rb[:]); err != nil {
			t.Fatal(err)
		}
		code, flags, n, err := DecodeReply(&rb)
		msg := make([]byte, n)
		io.ReadFull(nc, msg)
		if err != nil || code != transport.OutOfBounds || flags&FlagClose == 0 || !strings.Contains(string(msg), "limit") {
			t.Errorf("got reply %s flags %#x %q, %v; want out_of_bounds, closing, naming the limit", code, flags, msg, err)
		}
		if n, err := nc.Read(rb[:]); err != io.EOF {
			t.Errorf("after the refusal: got %d bytes and %v, want the connection closed", n, err)
		}
		// The other connection is untouched: a refused write on it still
		// gets its answer.
		h = Header{Addr: 1 << 30, Len: 3, Tag: 3}
		h.Encode(&hb)
		other.Write(append(hb[:], 1, 2, 3))
		if _, err := io.ReadFull(other, rb[:]); err != nil {
			t.Fatalf("other connection: %v", err)
		}
		if code, _, _, _ := DecodeReply(&rb); code != transport.NoSlot {
			t.Errorf("other connection: got %s, want no_slot", code)
		}
	})

	tx := listen(t, Config{Sink: transporttest.NewSlots(0)})
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
		err := s.Write(ctxFor(t, 10*time.Second), transport.Write{Src: make([]byte, n), Remote: 0, Key: key, Tag: uint32(i)})
		var r *transport.Refusal
		if !errors.As(err, &r) || r.Code != transport.OutOfBounds || !strings.Contains(r.Message, "limit") {
			t.Errorf("%d-byte write: got %v, want an out_of_bounds refusal naming the limit", n, err)
		}
	}
	if err := s.Write(ctxFor(t, 10*time.Second), transport.Write{Src: make([]byte, limit), Remote: 0, Key: key, Tag: 9}); err != nil {
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
	var l logs
	rx := listen(t, Config{Sink: slots, Logf: l.logf})
	nc := handshake(t, rx)
	var hb [HeaderSize]byte
	var rb [ReplySize]byte
	var first []byte
	for i := 1; i <= MaxUnmatched; i++ {
		guess := transport.NewKey()
		h := Header{Addr: 0, Len: 4, Key: guess, Tag: guess.Tag()}
		h.Encode(&hb)
		nc.SetDeadline(time.Now().Add(10 * time.Second))
		if _, err := nc.Write(append(hb[:], 1, 2, 3, 4)); err != nil {
			t.Fatalf("guess %d: %v", i, err)
		}
		if _, err := io.ReadFull(nc, rb[:]); err != nil {
			t.Fatalf("guess %d: reading the reply: %v", i, err)
		}
		code, flags, n, err := DecodeReply(&rb)
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
		if closing := flags&FlagClose != 0; closing != (i == MaxUnmatched) {
			t.Fatalf("guess %d: close flag %t", i, closing)
		}
	}
	if n, err := nc.Read(rb[:]); err != io.EOF {
		t.Errorf("after %d guesses: got %d bytes and %v, want the connection closed", MaxUnmatched, n, err)
	}
	nc.Close()
	served(t, rx)
	l.has(t, "matched no receive slot")
	// The holder of the key still writes, on a connection of its own.
	tx := listen(t, Config{Sink: transporttest.NewSlots(0)})
	s, err := tx.Dial(ctxFor(t, 10*time.Second), rx.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	if err := s.Write(ctxFor(t, 10*time.Second), transport.Write{Src: []byte("real"), Remote: 0, Key: key, Tag: 9}); err != nil {
		t.Fatalf("the key's holder: %v", err)
	}
}

func TestBodyCutShort(t *testing.T) {
	slots := transporttest.NewSlots(1 << 20)
	key := slots.Add(0, 4096)
	rx := listen(t, Config{Sink: slots})
	nc := handshake(t, rx)
	var hb [HeaderSize]byte
	h := Header{Addr: 0, Len: 4096, Key: key, Tag: 1}
	h.Encode(&hb)
	nc.Write(append(hb[:], make([]byte, 100)...))
	nc.Close()
	served(t, rx)
	if n := slots.Pending(); n != 0 {
		t.Errorf("%d writes still pending: done was not called", n)
	}
	if n := slots.Delivered(1); n != 0 {
		t.Errorf("a cut-short write was delivered %d times", n)
	}
	stillServes(t, rx, slots)
}

func TestHostileReply(t *testing.T) {
	tx := listen(t, Config{Sink: transporttest.NewSlots(0)})
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
			addr := fakePeer(t, func(nc net.Conn) {
				answer(nc)
				io.ReadFull(nc, make([]byte, HeaderSize+10))
				nc.Write(c.reply)
			})
			s, err := tx.Dial(ctxFor(t, 10*time.Second), addr)
			if err != nil {
				t.Fatal(err)
			}
			defer s.Close()
			err = s.Write(ctxFor(t, 10*time.Second), transport.Write{Src: make([]byte, 10)})
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
	addr := fakePeer(t, func(c net.Conn) {
		answer(c)
		<-t.Context().Done()
	})
	const timeout = 300 * time.Millisecond
	tx := listen(t, Config{Sink: transporttest.NewSlots(0), IOTimeout: timeout})
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
		err := s.Write(context.Background(), transport.Write{Src: make([]byte, c.n)})
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
	addr := fakePeer(t, func(c net.Conn) {
		answer(c)
		io.ReadFull(c, make([]byte, HeaderSize+1<<20))
	})
	tx := listen(t, Config{Sink: transporttest.NewSlots(0)})
	s, err := tx.Dial(ctxFor(t, 10*time.Second), addr)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	err = s.Write(ctxFor(t, 10*time.Second), transport.Write{Src: make([]byte, 64<<20)})
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
				if err := s.Write(b.Context(), ws[0]); err != nil {
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
					if err := s.Write(b.Context(), w); err != nil {
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
	rx := listen(b, Config{Sink: slots})
	tx := listen(b, Config{Sink: transporttest.NewSlots(0)})
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

func TestDialRDMA(t *testing.T) {
	tx := listen(t, Config{Sink: transporttest.NewSlots(0)})

	t.Run("NotServed", func(t *testing.T) {
		var l logs
		slots := transporttest.NewSlots(8192)
		rx := listen(t, Config{Sink: slots, Logf: l.logf})
		if _, _, err := tx.DialRDMA(ctxFor(t, 10*time.Second), rx.Addr().String()); err != ErrNoRDMA {
			t.Fatalf("DialRDMA to a transport without RDMA: got %v, want ErrNoRDMA", err)
		}
		served(t, rx)
		l.none(t, "")
		// The same peer still takes data connections.
		stillServes(t, rx, slots)
	})

	t.Run("Served", func(t *testing.T) {
		type call struct {
			instance uint64
			line     string
		}
		calls := make(chan call, 1)
		rx := listen(t, Config{Sink: transporttest.NewSlots(0), RDMA: func(c *connlimit.Conn, instance uint64) {
			line, _ := io.ReadAll(io.LimitReader(c, 5))
			calls <- call{instance, string(line)}
			c.Write([]byte("bye"))
		}})
		c, instance, err := tx.DialRDMA(ctxFor(t, 10*time.Second), rx.Addr().String())
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		if instance != rx.Instance() {
			t.Errorf("DialRDMA saw instance %#x, want %#x", instance, rx.Instance())
		}
		c.Write([]byte("hello"))
		select {
		case got := <-calls:
			if got.instance != tx.Instance() || got.line != "hello" {
				t.Errorf("handler got instance %#x and %q, want %#x and \"hello\"", got.instance, got.line, tx.Instance())
			}
		case <-time.After(10 * time.Second):
			t.Fatal("the RDMA handler never ran")
		}
		c.SetReadDeadline(time.Now().Add(10 * time.Second))
		if b, err := io.ReadAll(c); string(b) != "bye" || err != nil {
			t.Errorf("after the handler: read %q, %v; want \"bye\" and a close", b, err)
		}
	})
}
