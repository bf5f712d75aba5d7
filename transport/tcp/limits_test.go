package tcp

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ferry-project/ferry/internal/connlimit"
	"github.com/ferry-project/ferry/transport"
	"github.com/ferry-project/ferry/transport/peer"
	"github.com/ferry-project/ferry/transport/transporttest"
)

// lineWaiter collects log lines and wakes a test waiting for one.
type lineWaiter struct {
	mu    sync.Mutex
	lines []string
	ch    chan string
}

func newLineWaiter() *lineWaiter { return &lineWaiter{ch: make(chan string, 4096)} }

func (l *lineWaiter) logf(format string, args ...any) {
	line := fmt.Sprintf(format, args...)
	l.mu.Lock()
	l.lines = append(l.lines, line)
	l.mu.Unlock()
	select {
	case l.ch <- line:
	default:
	}
}

// wait waits up to 10 s for a line containing s.
func (l *lineWaiter) wait(t *testing.T, s string) string {
	t.Helper()
	deadline := time.After(10 * time.Second)
	for {
		select {
		case line := <-l.ch:
			if strings.Contains(line, s) {
				return line
			}
		case <-deadline:
			t.Fatalf("no log line with %q within 10s", s)
		}
	}
}

func (l *lineWaiter) all() []string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return append([]string(nil), l.lines...)
}

// TestIdleConnectionReapedSenderRedials: the receiver closes a data
// connection that carried no write for IdleTimeout; the sender's next
// write finds its pooled connection closed and goes on a new one without
// failing.
func TestIdleConnectionReapedSenderRedials(t *testing.T) {
	debug := newLineWaiter()
	slots := transporttest.NewSlots(1 << 16)
	rx := listen(t, peer.Config{Sink: slots, IdleTimeout: 100 * time.Millisecond, Debugf: debug.logf})
	tx := listen(t, peer.Config{Sink: transporttest.NewSlots(0)})
	ctx := ctxFor(t, 10*time.Second)
	s, err := tx.Dial(ctx, rx.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	for i := range 3 {
		addr := uint64(i * 4096)
		w := transport.Write{Src: []byte(fmt.Sprintf("write %d", i)), Remote: addr, Key: slots.Add(addr, 7), Tag: uint32(i)}
		if _, err := s.Write(ctx, w); err != nil {
			t.Fatalf("write %d (after %d idle closes): %v", i, i, err)
		}
		if i < 2 {
			debug.wait(t, "no write for 100ms")
		}
	}
	if st := rx.PortStats(); st.Idle != 2 {
		t.Fatalf("the receiver closed %d connections idle, want 2", st.Idle)
	}
}

// TestReapCrossingAWriteIsRetried: a receiver that closes a pooled
// connection just as a write goes out on it (its idle close crossing the
// header) has taken nothing; the write goes again on a new connection.
// A fresh connection closed the same way fails the write: no loop.
func TestReapCrossingAWriteIsRetried(t *testing.T) {
	tx := listen(t, peer.Config{Sink: transporttest.NewSlots(0)})
	var mu sync.Mutex
	conns := 0
	addr := transporttest.FakePeer(t, func(c net.Conn) {
		mu.Lock()
		conns++
		n := conns
		mu.Unlock()
		c.SetDeadline(time.Now().Add(10 * time.Second))
		welcomeAs(version, statusOK)(c)
		// Connection 1 completes one write and closes under the second,
		// unanswered; connection 2 completes whatever comes; 3 closes
		// under its first.
		for i := 0; ; i++ {
			var hb [peer.HeaderSize]byte
			if _, err := io.ReadFull(c, hb[:]); err != nil {
				return
			}
			var h peer.Header
			h.Decode(&hb)
			if n == 1 && i == 1 || n == 3 {
				return
			}
			if _, err := io.CopyN(io.Discard, c, int64(h.Len)); err != nil {
				return
			}
			var rb [peer.ReplySize + peer.MaxMessage]byte
			c.Write(peer.EncodeReply(&rb, transport.OK, 0, ""))
		}
	})
	ctx := ctxFor(t, 10*time.Second)
	s, err := tx.Dial(ctx, addr)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	w := transport.Write{Src: []byte("bytes"), Key: transport.Key{1}}
	for i := range 2 {
		if _, err := s.Write(ctx, w); err != nil {
			t.Fatalf("write %d: %v", i, err)
		}
	}
	mu.Lock()
	if conns != 2 {
		t.Fatalf("the sender opened %d connections, want 2 (the second write went again on a new one)", conns)
	}
	mu.Unlock()

	// A session whose fresh connection is closed unanswered fails.
	s2, err := tx.Dial(ctx, addr)
	if err != nil {
		t.Fatal(err)
	}
	defer s2.Close()
	if _, err := s2.Write(ctx, w); err == nil || !strings.Contains(err.Error(), "peer closed the connection") {
		t.Fatalf("a write on a fresh connection closed under it: %v, want it to fail naming the close", err)
	}
}

// TestHandshakeWarningsAreRateLimited: 500 failed handshakes (a scanner,
// a broken peer) give at most a burst of WARN lines a second and a line
// saying how many more there were, all 500 accounted for.
func TestHandshakeWarningsAreRateLimited(t *testing.T) {
	var l transporttest.Logs
	rx := listen(t, peer.Config{Sink: transporttest.NewSlots(0), Logf: l.Logf})
	start := time.Now()
	for range 500 {
		c, err := net.Dial("tcp", rx.Addr().String())
		if err != nil {
			t.Fatal(err)
		}
		c.SetDeadline(time.Now().Add(10 * time.Second))
		c.Write([]byte("GET / HTTP/1.1\r\n\r\nxxxxxx"))
		io.Copy(io.Discard, c) // the receiver closes after its refusal
		c.Close()
	}
	transporttest.Served(t, rx.PortStats)
	elapsed := time.Since(start)
	rx.Close() // says what is still suppressed
	logged, suppressed := 0, 0
	for _, line := range l.Lines() {
		var n int
		switch {
		case strings.HasPrefix(line, "tcp: handshake from"):
			logged++
		case strings.HasPrefix(line, "peer port: suppressed "):
			fmt.Sscanf(line, "peer port: suppressed %d more lines", &n)
			suppressed += n
		default:
			t.Errorf("unexpected line %q", line)
		}
	}
	windows := int(elapsed/time.Second) + 1
	if logged > 10*windows || suppressed == 0 || logged+suppressed != 500 {
		t.Fatalf("500 failed handshakes in %s: %d lines logged, %d counted as suppressed; want at most %d logged (10 a second) and the rest suppressed",
			elapsed, logged, suppressed, 10*windows)
	}
}

// TestFullPortStillServesPeers: strangers that fill the peer port with
// connections that only said hello lose their places to a peer's new
// connection, and one address that goes on takes its own places only.
func TestFullPortStillServesPeers(t *testing.T) {
	debug := newLineWaiter()
	slots := transporttest.NewSlots(1 << 16)
	rx := listen(t, peer.Config{Sink: slots, Limits: connlimit.Limits{Total: 4, PerSource: 2}, Debugf: debug.logf})
	var first net.Conn
	for i, src := range []string{"127.0.0.2", "127.0.0.2", "127.0.0.3", "127.0.0.3"} {
		if c := helloFrom(t, src, rx); i == 0 {
			first = c
		}
	}
	helloFrom(t, "127.0.0.2", rx)
	debug.wait(t, "peer port: closed an idle connection from 127.0.0.2")
	first.SetReadDeadline(time.Now().Add(10 * time.Second))
	if n, err := first.Read(make([]byte, 1)); n != 0 || err == nil {
		t.Fatalf("a third connection from one address: its oldest read %d, %v; want it closed", n, err)
	}
	stillServes(t, rx, slots)
	st := rx.PortStats()
	if st.Evicted != 2 || st.RefusedPerSource != 0 || st.Open > 4 {
		t.Fatalf("port stats %+v: want one stranger evicted for its own newcomer and one for the peer, none refused", st)
	}
}

// TestStrangerSharingAddressLeavesPeerIn: a stranger on the peer's own
// address (the same host, one NAT) fills that address's quota with
// connections that only said hello, and fills it again before every
// send; the peer's sends all land, with or without a peer secret. Its
// newcomers take the stranger's places, and what proved itself (a write
// that landed; with a secret, the handshake) is not displaced by the
// stranger's next connections.
func TestStrangerSharingAddressLeavesPeerIn(t *testing.T) {
	for _, c := range []struct {
		name   string
		secret []byte
	}{{"NoSecret", nil}, {"Secret", secretA}} {
		t.Run(c.name, func(t *testing.T) {
			const sends = 5
			slots := transporttest.NewSlots(1 << 16)
			rx := listen(t, peer.Config{Sink: slots, Secret: c.secret})
			tx := listen(t, peer.Config{Sink: transporttest.NewSlots(0), Secret: c.secret})
			hello := helloBytes(version)
			if c.secret != nil {
				// A stranger without the secret claims one and stalls
				// where its proof is due.
				binary.LittleEndian.PutUint32(hello[20:], flagAuth)
			}
			flood := func() {
				for range peer.DefaultLimits.PerSource {
					s := transporttest.DialFrom(t, "127.0.0.1", rx.Addr().String())
					s.Write(hello)
					if _, err := io.ReadFull(s, make([]byte, welcomeSize)); err != nil {
						t.Fatalf("a stranger's hello on the peer's address: %v", err)
					}
				}
			}
			flood()
			ctx := ctxFor(t, 10*time.Second)
			s, err := tx.Dial(ctx, rx.Addr().String())
			if err != nil {
				t.Fatalf("the peer's dial with its address's quota full of strangers: %v", err)
			}
			defer s.Close()
			for i := range sends {
				addr := uint64(i * 4096)
				w := transport.Write{Src: []byte(fmt.Sprintf("send %d", i)), Remote: addr, Key: slots.Add(addr, 6), Tag: uint32(i)}
				if _, err := s.Write(ctx, w); err != nil {
					t.Fatalf("send %d of %d with its address's quota full of strangers: %v", i+1, sends, err)
				}
				flood()
			}
			st := rx.PortStats()
			if st.RefusedPerSource != 0 || st.Open != peer.DefaultLimits.PerSource {
				t.Fatalf("port stats %+v: want no refusal, the address's %d places held", st, peer.DefaultLimits.PerSource)
			}
		})
	}
}

// helloFrom opens a connection from src that completes the handshake and
// returns it for the test to go on with; it closes at the end of the test.
func helloFrom(t *testing.T, src string, rx *Transport) net.Conn {
	t.Helper()
	c := transporttest.DialFrom(t, src, rx.Addr().String())
	c.SetDeadline(time.Now().Add(10 * time.Second))
	c.Write(helloBytes(version))
	if _, err := io.ReadFull(c, make([]byte, welcomeSize)); err != nil {
		t.Fatalf("hello from %s: %v", src, err)
	}
	return c
}

// sendBogus sends the header of an n-byte write with a guessed key on nc
// and reads its refusal, which must be no_slot with a message.
func sendBogus(t *testing.T, nc net.Conn, n uint64) peer.Reply {
	t.Helper()
	var hb [peer.HeaderSize]byte
	h := peer.Header{Len: n, Key: transport.NewKey(), Tag: 1}
	h.Encode(&hb)
	if _, err := nc.Write(hb[:]); err != nil {
		t.Fatal(err)
	}
	var rb [peer.ReplySize]byte
	r, _, err := peer.ReadReply(nc, &rb, nil)
	if err != nil || r.Code != transport.NoSlot || r.Msg == "" {
		t.Fatalf("a guessed key's %d-byte write: reply %+v, %v; want no_slot with a message", n, r, err)
	}
	return r
}

// TestRefusedBodyTrickleIsCut: a stranger that sends a write no slot
// matches and then its body a byte at a time (slowloris) gets its refusal
// and loses its connection within a bound however steadily it trickles:
// at once for a body too big to skip (the refusal says the connection
// closes), within one IOTimeout for a body small enough to skip.
func TestRefusedBodyTrickleIsCut(t *testing.T) {
	const ioTimeout = 500 * time.Millisecond
	var l transporttest.Logs
	rx := listen(t, peer.Config{Sink: transporttest.NewSlots(1 << 16), IOTimeout: ioTimeout, Logf: l.Logf})
	for _, c := range []struct {
		name    string
		n       uint64
		closing bool
	}{
		{"TooBigToSkip", 1 << 30, true},
		{"Skipped", maxSkip, false},
	} {
		t.Run(c.name, func(t *testing.T) {
			nc := handshake(t, rx)
			start := time.Now()
			nc.SetDeadline(start.Add(10 * ioTimeout))
			// A byte every tenth of IOTimeout, until the receiver closes.
			stop := make(chan struct{})
			var wg sync.WaitGroup
			defer wg.Wait()
			defer close(stop)
			r := sendBogus(t, nc, c.n)
			wg.Go(func() {
				tick := time.NewTicker(ioTimeout / 10)
				defer tick.Stop()
				for {
					select {
					case <-stop:
						return
					case <-tick.C:
					}
					if _, err := nc.Write([]byte{0}); err != nil {
						return
					}
				}
			})
			if closing := r.Flags&peer.FlagClose != 0; closing != c.closing {
				t.Errorf("refusal of a %d-byte write: close flag %t, want %t", c.n, closing, c.closing)
			}
			var b [1]byte
			if n, err := nc.Read(b[:]); n != 0 || err == nil || errors.Is(err, os.ErrDeadlineExceeded) {
				t.Fatalf("%s after the refusal of a %d-byte write, trickled: read %d bytes, %v; want the connection closed", time.Since(start), c.n, n, err)
			}
			// Its place is free while it still trickles.
			transporttest.Served(t, rx.PortStats)
			if c.closing {
				// Closed after its refusal, not for what came after.
				l.None(t, "tcp: connection from")
			}
		})
	}
}

// TestRefusedWritesHoldNoPlace: connections whose writes were refused
// fill the peer port while their bodies do not come, yet a peer's new
// connection takes one's place: one only discarding a refused body is not
// in use.
func TestRefusedWritesHoldNoPlace(t *testing.T) {
	slots := transporttest.NewSlots(1 << 16)
	rx := listen(t, peer.Config{Sink: slots, Limits: connlimit.Limits{Total: 2, PerSource: 2}})
	for range 2 {
		sendBogus(t, helloFrom(t, "127.0.0.2", rx), maxSkip)
	}
	stillServes(t, rx, slots)
	if st := rx.PortStats(); st.Evicted != 1 {
		t.Fatalf("port stats %+v: want one stranger evicted for the peer", st)
	}
}

// TestRefusedWriteSenderCarriesOn: a sender whose write is refused gets
// the refusal's code and message whatever its body's size (skipped; or its
// connection closed, with the body in the socket buffers or cut short),
// and its session's next write lands.
func TestRefusedWriteSenderCarriesOn(t *testing.T) {
	slots := transporttest.NewSlots(1 << 16)
	rx := listen(t, peer.Config{Sink: slots})
	tx := listen(t, peer.Config{Sink: transporttest.NewSlots(0)})
	ctx := ctxFor(t, 10*time.Second)
	s, err := tx.Dial(ctx, rx.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	for i, n := range []int{maxSkip, maxSkip + 1, 2 << 20, 64 << 20} {
		_, err := s.Write(ctx, transport.Write{Src: make([]byte, n), Key: transport.NewKey(), Tag: 1})
		var r *transport.Refusal
		if !errors.As(err, &r) || r.Code != transport.NoSlot || !strings.Contains(r.Message, "no receive slot") {
			t.Errorf("%d-byte write with a wrong key: got %v, want the no_slot refusal and its message", n, err)
		}
		addr := uint64(i * 4096)
		w := transport.Write{Src: []byte("after"), Remote: addr, Key: slots.Add(addr, 5), Tag: uint32(100 + i)}
		if _, err := s.Write(ctx, w); err != nil {
			t.Fatalf("the write after a refused %d-byte one: %v", n, err)
		}
	}
}
