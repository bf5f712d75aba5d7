package mooncake_test

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/ferry-project/ferry/mooncake"
	"github.com/ferry-project/ferry/mooncake/mooncaketest"
	"github.com/ferry-project/ferry/transport"
)

func ctxT(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	t.Cleanup(cancel)
	return ctx
}

func startPeer(t *testing.T, cfg mooncaketest.Config) *mooncaketest.Peer {
	t.Helper()
	p, err := mooncaketest.Start(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(p.Close)
	return p
}

func noise(n int, seed uint64) []byte {
	b := make([]byte, n)
	rand.NewChaCha8([32]byte{byte(seed)}).Read(b)
	return b
}

func dial(t *testing.T, p *mooncaketest.Peer) *mooncake.Session {
	t.Helper()
	d := &mooncake.Dialer{Self: &mooncake.Segment{Name: "ferry-test", Protocol: "tcp"}}
	s, err := d.Dial(ctxT(t), mooncake.Scheme+p.Name())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close() })
	return s.(*mooncake.Session)
}

func TestSessionWritesByteExactV1AndV2(t *testing.T) {
	for _, v := range []int{1, 2} {
		p := startPeer(t, mooncaketest.Config{ProtoVersion: v, BufferSize: 8 << 20})
		s := dial(t, p)
		if got := s.Segment().TCPProtoVersion; got != v {
			t.Fatalf("descriptor says version %d, want %d", got, v)
		}
		var wg sync.WaitGroup
		errs := make([]error, 4)
		reps := make([]transport.Report, 4)
		for i := range errs {
			wg.Add(1)
			go func() {
				defer wg.Done()
				addr := p.Base() + uint64(i)*(2<<20)
				reps[i], errs[i] = s.Write(ctxT(t), transport.Write{Src: noise(2<<20-7, uint64(i)), Remote: addr})
			}()
		}
		wg.Wait()
		for i, err := range errs {
			if err != nil {
				t.Fatalf("v%d write %d: %v", v, i, err)
			}
			// The header, and in v2 the status word; nothing registered.
			if want := (transport.Report{Messages: v}); reps[i] != want {
				t.Errorf("v%d write %d reported %+v, want %+v", v, i, reps[i], want)
			}
			if !bytes.Equal(p.Bytes(p.Base()+uint64(i)*(2<<20), 2<<20-7), noise(2<<20-7, uint64(i))) {
				t.Fatalf("v%d write %d: bytes differ", v, i)
			}
		}
	}
}

func TestSessionRefusesARangeOutsideTheBuffersNamingThem(t *testing.T) {
	p := startPeer(t, mooncaketest.Config{BufferSize: 1 << 20})
	s := dial(t, p)
	_, err := s.Write(ctxT(t), transport.Write{Src: make([]byte, 16), Remote: p.Base() + 1<<20 - 8})
	var rf *transport.Refusal
	if !errors.As(err, &rf) || rf.Code != transport.OutOfBounds {
		t.Fatalf("want an out_of_bounds refusal, got %v", err)
	}
	for _, want := range []string{"16 bytes", "lies in none of the buffers", p.Name()} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("refusal does not say %q: %v", want, err)
		}
	}
	if p.Writes() != 0 {
		t.Fatal("a refused write reached the peer")
	}
}

// Reads over the data port, v1 and v2: each piece byte-exact from the
// segment's buffer; a piece outside the buffers is refused naming it and
// the segment before any is read; a read the peer rejects (its buffer
// gone while the descriptor was cached) fails, and the next read fetches
// the descriptor again and refuses the range as lying outside it.
func TestSessionReadsV1AndV2(t *testing.T) {
	for _, v := range []int{1, 2} {
		p := startPeer(t, mooncaketest.Config{ProtoVersion: v, BufferSize: 4 << 20})
		s := dial(t, p)
		data := noise(3<<20+5, uint64(v))
		if _, err := s.Write(ctxT(t), transport.Write{Src: data, Remote: p.Base() + 100}); err != nil {
			t.Fatal(err)
		}
		dst := make([]byte, 2<<20+11)
		reads := []transport.Read{{Addr: p.Base() + 1<<20, Dst: dst[:2<<20]}, {Addr: p.Base() + 100, Dst: dst[2<<20:]}}
		for round := range 2 { // the second on kept connections (v2)
			clear(dst)
			if err := s.Read(ctxT(t), reads); err != nil {
				t.Fatalf("v%d round %d: %v", v, round, err)
			}
			if !bytes.Equal(dst[:2<<20], data[1<<20-100:3<<20-100]) || !bytes.Equal(dst[2<<20:], data[:11]) {
				t.Fatalf("v%d round %d: other bytes than the segment holds", v, round)
			}
		}

		clear(dst)
		past := []transport.Read{{Addr: p.Base(), Dst: dst[:8]}, {Addr: p.Base() + 4<<20 - 8, Dst: dst[8:24]}}
		err := s.Read(ctxT(t), past)
		var rf *transport.Refusal
		if !errors.As(err, &rf) || rf.Code != transport.OutOfBounds {
			t.Fatalf("v%d: a piece past the buffer: %v, want an out_of_bounds refusal", v, err)
		}
		for _, want := range []string{"piece 1", "16 bytes", "lies in none of the buffers", p.Name()} {
			if !strings.Contains(err.Error(), want) {
				t.Errorf("v%d: the refusal does not say %q: %v", v, want, err)
			}
		}
		if !bytes.Equal(dst[:8], make([]byte, 8)) {
			t.Errorf("v%d: piece 0 was read though piece 1 was refused", v)
		}

		p.Unregister() // the cached descriptor still lists the buffer
		if err := s.Read(ctxT(t), reads[1:]); !mooncake.IsRejected(err) {
			t.Fatalf("v%d: a read of a buffer gone: %v, want the peer's rejection", v, err)
		}
		if err := s.Read(ctxT(t), reads[1:]); !errors.As(err, &rf) || !strings.Contains(err.Error(), "none registered") {
			t.Fatalf("v%d: the read after a failed one: %v, want a refusal from the descriptor fetched again", v, err)
		}
	}
}

func TestPeerRejectionIsReported(t *testing.T) {
	for _, v := range []int{1, 2} {
		p := startPeer(t, mooncaketest.Config{ProtoVersion: v, BufferSize: 1 << 20})
		s := dial(t, p)
		p.Unregister() // the cached descriptor still lists the buffer
		_, err := s.Write(ctxT(t), transport.Write{Src: make([]byte, 64<<10), Remote: p.Base()})
		if !mooncake.IsRejected(err) || transport.IsRefusal(err) {
			t.Fatalf("v%d: want the peer's rejection, got %v", v, err)
		}
		if v == 2 && !strings.Contains(err.Error(), `status "rejected"`) {
			t.Fatalf("v2 rejection does not quote the status: %v", err)
		}
	}
}

// A restarted peer has a new data port and new buffer addresses; a write
// into the new buffer fetches the descriptor again.
func TestSessionFollowsARestartedPeer(t *testing.T) {
	p := startPeer(t, mooncaketest.Config{BufferSize: 1 << 20})
	s := dial(t, p)
	before := s.PeerInstance()
	name := p.Name()
	p.Close()
	p2 := startPeer(t, mooncaketest.Config{Addr: name, BufferSize: 2 << 20})
	data := noise(4096, 9)
	addr := p2.Base() + 1<<20 + 8
	if _, ok := s.Segment().Buffer(addr, 4096); ok {
		t.Skip("the new buffer overlaps the old one; the fetch-again path is not exercised")
	}
	if _, err := s.Write(ctxT(t), transport.Write{Src: data, Remote: addr}); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(p2.Bytes(addr, 4096), data) {
		t.Fatal("bytes differ")
	}
	if s.PeerInstance() == before {
		t.Fatal("the peer instance did not change with the new descriptor")
	}
}

func TestClosedSessionFailsWithErrClosed(t *testing.T) {
	p := startPeer(t, mooncaketest.Config{})
	s := dial(t, p)
	s.Close()
	if _, err := s.Write(ctxT(t), transport.Write{Src: make([]byte, 8), Remote: p.Base()}); !errors.Is(err, transport.ErrClosed) {
		t.Fatalf("got %v", err)
	}
}

func TestHandshakeProbeNotifyAndNoRDMA(t *testing.T) {
	p := startPeer(t, mooncaketest.Config{})
	ctx := ctxT(t)
	if err := mooncake.ProbeSegment(ctx, p.Name()); err != nil {
		t.Fatal(err)
	}
	if err := mooncake.SendNotify(ctx, p.Name(), mooncake.NotifyDesc{Name: "x", NotifyMsg: "done:7"}); err != nil {
		t.Fatal(err)
	}
	if n := p.Notifies(); len(n) != 1 || n[0].NotifyMsg != "done:7" {
		t.Fatalf("notifies %+v", n)
	}
	var reply mooncake.HandshakeDesc
	req := mooncake.HandshakeDesc{LocalNICPath: "a:1@mlx5_0", PeerNICPath: p.Name() + "@mlx5_0", QPNum: []uint32{17}}
	if err := mooncake.Exchange(ctx, p.Name(), mooncake.Connect, req, &reply); err != nil {
		t.Fatal(err)
	}
	if reply.ReplyMsg != mooncake.NoRDMA {
		t.Fatalf("connection request answered %+v", reply)
	}
}

// A notify the handler refuses (ErrNotifyRefused) is answered with an
// empty notify_msg, which Mooncake's sender reads as rejected, and the
// reason, which ferry's sender returns; other handler errors are only
// logged, the reply "success". A notify past MaxSmallMessage is not
// sent.
func TestRefusedNotifiesAreAnsweredAsRefusals(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv := mooncake.Serve(ln, mooncake.Handlers{
		Segment: func() *mooncake.Segment { return &mooncake.Segment{} },
		Notify: func(_ net.Addr, n mooncake.NotifyDesc) error {
			if n.NotifyMsg == "full" {
				return fmt.Errorf("%w: the queue is full", mooncake.ErrNotifyRefused)
			}
			return errors.New("only logged")
		},
	}, mooncake.ServerConfig{})
	defer srv.Close()
	addr := ln.Addr().String()
	err = mooncake.SendNotify(ctxT(t), addr, mooncake.NotifyDesc{Name: "x", NotifyMsg: "full"})
	if !errors.Is(err, mooncake.ErrNotifyRefused) || !strings.Contains(err.Error(), "the queue is full") {
		t.Fatalf("a refused notify: %v", err)
	}
	var raw map[string]any
	if err := mooncake.Exchange(ctxT(t), addr, mooncake.Notify, mooncake.NotifyDesc{NotifyMsg: "full"}, &raw); err != nil || raw["notify_msg"] != "" {
		t.Fatalf("the refusal on the wire: %v, %v; want an empty notify_msg", raw, err)
	}
	if err := mooncake.SendNotify(ctxT(t), addr, mooncake.NotifyDesc{Name: "x", NotifyMsg: "other"}); err != nil {
		t.Fatalf("a notify whose handler failed otherwise: %v, want success", err)
	}
	long := mooncake.NotifyDesc{Name: "x", NotifyMsg: strings.Repeat("a", mooncake.MaxSmallMessage)}
	if err := mooncake.SendNotify(ctxT(t), addr, long); err == nil || !strings.Contains(err.Error(), "past the 16384 a notify may have") {
		t.Fatalf("an oversize notify: %v", err)
	}
}

// Malformed requests close the connection without a reply; the server
// says why and keeps serving.
func TestServerRefusesMalformedHandshakes(t *testing.T) {
	srv, seg, logged := loggingServer(t, nil)
	defer srv.Close()
	for _, c := range []struct {
		raw  []byte
		want string
	}{
		{lenPrefix(0, nil), "length word is 0"},
		{lenPrefix(mooncake.MaxMessage+10, []byte{1, '{'}), "exceeds the 1048576-byte limit"},
		{lenPrefix(3, []byte{9, '{', '}'}), "unknown message type 9"},
		{lenPrefix(50, []byte{1, '{', '}'}), "announces 50 bytes"},
		{lenPrefix(3, []byte{1, '{', '"'}), "not valid JSON"},
		{mooncake.AppendFrame(nil, mooncake.Notify, []byte(`{"name":"x","notify_msg":"1","NOTIFY_MSG":"2"}`)), `"NOTIFY_MSG" comes twice`},
	} {
		// A close, clean or a reset (the server left bytes unread).
		if n, err := sendRaw(t, seg.Name, c.raw); err != nil && !errors.Is(err, syscall.ECONNRESET) || len(n) != 0 {
			t.Errorf("%q: server answered %q, %v; want a close", c.want, n, err)
		}
		lines := logged()
		last := ""
		if len(lines) > 0 {
			last = lines[len(lines)-1]
		}
		if !strings.Contains(last, c.want) {
			t.Errorf("want a log line containing %q, got %q", c.want, last)
		}
	}
	got, err := mooncake.FetchSegment(ctxT(t), seg.Name, &mooncake.Segment{Name: "c"})
	if err != nil || got.Name != seg.Name {
		t.Fatalf("the server stopped answering: %v %v", got, err)
	}
}

// TestServerLogIsRateLimited: a peer sending malformed requests as fast
// as it can does not get a line each into the log: the first is logged,
// and every one is either logged or counted in a "suppressed" line by the
// time the server's Close returns.
func TestServerLogIsRateLimited(t *testing.T) {
	srv, seg, logged := loggingServer(t, nil)
	const flood = 40
	for range flood {
		// The server logs before it closes the connection.
		if _, err := sendRaw(t, seg.Name, lenPrefix(0, nil)); err != nil && !errors.Is(err, syscall.ECONNRESET) {
			t.Fatal(err)
		}
	}
	srv.Close()
	lines := logged()
	if len(lines) == 0 || !strings.Contains(lines[0], "length word is 0") {
		t.Fatalf("the first malformed request was not logged: %q", lines)
	}
	passed, suppressed := 0, 0
	for _, line := range lines {
		var n int
		if _, err := fmt.Sscanf(line, "mooncake: suppressed %d more lines", &n); err == nil {
			suppressed += n
		} else if strings.Contains(line, "length word is 0") {
			passed++
		}
	}
	if passed+suppressed != flood {
		t.Fatalf("%d lines logged and %d counted as suppressed, want %d in all: %q", passed, suppressed, flood, lines)
	}
	t.Logf("%d malformed requests: %d logged, %d suppressed", flood, passed, suppressed)
}

// TestServerLogsRefusedConnections: a connection request the handler
// refuses gets its reply_msg back, and the server logs it, under the
// port's rate limit like every line a peer can cause.
func TestServerLogsRefusedConnections(t *testing.T) {
	srv, seg, logged := loggingServer(t, func(_ context.Context, _ net.Addr, req mooncake.HandshakeDesc) (mooncake.HandshakeDesc, func()) {
		return mooncake.HandshakeDesc{ReplyMsg: "peer_nic_path names no NIC of this segment"}, nil
	})
	defer srv.Close()
	var reply mooncake.HandshakeDesc
	req := mooncake.HandshakeDesc{LocalNICPath: "10.0.0.9:1@mlx5_3", PeerNICPath: seg.Name + "@mlx5_9", QPNum: []uint32{17}}
	if err := mooncake.Exchange(ctxT(t), seg.Name, mooncake.Connect, req, &reply); err != nil {
		t.Fatal(err)
	}
	if reply.ReplyMsg == "" {
		t.Fatalf("the refusal did not reach the initiator: %+v", reply)
	}
	lines := logged()
	if len(lines) != 1 || !strings.Contains(lines[0], `refused an RDMA connection request from "10.0.0.9:1@mlx5_3" (127.0.0.1:`) ||
		!strings.Contains(lines[0], "): peer_nic_path names no NIC") {
		t.Fatalf("want one line naming the initiator and the reason, got %q", lines)
	}
}

// loggingServer serves a TCP segment's handshake on loopback, collecting
// what it logs; logged returns the lines so far. connect answers
// connection requests (nil: no RDMA served).
func loggingServer(t *testing.T, connect func(context.Context, net.Addr, mooncake.HandshakeDesc) (mooncake.HandshakeDesc, func())) (srv *mooncake.Server, seg *mooncake.Segment, logged func() []string) {
	t.Helper()
	var mu sync.Mutex
	var lines []string
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	seg = &mooncake.Segment{Name: ln.Addr().String(), Protocol: "tcp", TCPDataPort: 1, TCPProtoVersion: 2}
	srv = mooncake.Serve(ln, mooncake.Handlers{Segment: func() *mooncake.Segment { return seg }, Connect: connect}, mooncake.ServerConfig{
		Logf: func(f string, a ...any) {
			mu.Lock()
			defer mu.Unlock()
			lines = append(lines, fmt.Sprintf(f, a...))
		},
	})
	return srv, seg, func() []string {
		mu.Lock()
		defer mu.Unlock()
		return append([]string(nil), lines...)
	}
}

// sendRaw writes raw to addr as one request and reads whatever comes
// back until the server closes.
func sendRaw(t *testing.T, addr string, raw []byte) ([]byte, error) {
	t.Helper()
	conn, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	conn.Write(raw)
	conn.(*net.TCPConn).CloseWrite()
	conn.SetReadDeadline(time.Now().Add(10 * time.Second))
	return io.ReadAll(conn)
}

func lenPrefix(n uint64, rest []byte) []byte {
	return append(binary.LittleEndian.AppendUint64(nil, n), rest...)
}

// acceptCounter is a listener that keeps what it accepted.
type acceptCounter struct {
	net.Listener
	mu    sync.Mutex
	conns []net.Conn
}

func (l *acceptCounter) Accept() (net.Conn, error) {
	c, err := l.Listener.Accept()
	if err == nil {
		l.mu.Lock()
		l.conns = append(l.conns, c)
		l.mu.Unlock()
	}
	return c, err
}

func (l *acceptCounter) accepted() []net.Conn {
	l.mu.Lock()
	defer l.mu.Unlock()
	return append([]net.Conn(nil), l.conns...)
}

// A session's v2 writes in a row go on one data connection, kept between
// them (as a Mooncake connection pool's do): no connect per write. One
// the peer closed meanwhile is not used again, and Close closes the kept
// one.
func TestSessionKeepsItsDataConnection(t *testing.T) {
	p := startPeer(t, mooncaketest.Config{BufferSize: 1 << 20})
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	counted := &acceptCounter{Listener: ln}
	data := mooncake.ServeData(counted, p, mooncake.DataConfig{Logf: t.Logf})
	defer data.Close()
	rpc, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	hs := mooncake.Serve(rpc, mooncake.Handlers{Segment: func() *mooncake.Segment {
		seg := p.Segment()
		seg.Name, seg.TCPDataPort = rpc.Addr().String(), ln.Addr().(*net.TCPAddr).Port
		return seg
	}}, mooncake.ServerConfig{})
	defer hs.Close()
	d := &mooncake.Dialer{Self: &mooncake.Segment{Name: "ferry-test", Protocol: "tcp"}}
	sess, err := d.Dial(ctxT(t), mooncake.Scheme+rpc.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	write := func(i int) {
		t.Helper()
		addr := p.Base() + uint64(i%16)*(64<<10)
		if _, err := sess.Write(ctxT(t), transport.Write{Src: noise(64<<10, uint64(i)), Remote: addr}); err != nil {
			t.Fatalf("write %d: %v", i, err)
		}
		if !bytes.Equal(p.Bytes(addr, 64<<10), noise(64<<10, uint64(i))) {
			t.Fatalf("write %d: bytes differ", i)
		}
	}
	for i := range 20 {
		write(i)
	}
	if n := len(counted.accepted()); n != 1 {
		t.Fatalf("20 writes in a row opened %d data connections, want 1 kept between them", n)
	}
	counted.accepted()[0].Close() // the peer ends it (a restart, a port making room)
	write(20)
	if n := len(counted.accepted()); n != 2 {
		t.Fatalf("after the peer closed the kept connection, %d connections were opened in all, want 2", n)
	}
	// The port ends the connection closed under it when its goroutine
	// sees the close, which may come after the write on a busy machine.
	for deadline := time.Now().Add(10 * time.Second); data.Stats().Open != 1; time.Sleep(time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("the data port holds %d connections 10 s after the peer closed one, want the 1 kept", data.Stats().Open)
		}
	}
	sess.Close()
	// The port's goroutine sees the client's close and ends the connection.
	for deadline := time.Now().Add(10 * time.Second); data.Stats().Open != 0; time.Sleep(time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("the data port still holds %d connections 10 s after the session closed", data.Stats().Open)
		}
	}
}

// TestFerryTargetOnlyOnTheHostDialed: a segment whose descriptor names a
// ferry peer port is written over ferry's peer protocol only when that
// port is on the host its RPC port was reached on; one naming another
// host (a hostile segment sending this ferryd's writes elsewhere) is
// written over Mooncake's wire, to the host dialed.
func TestFerryTargetOnlyOnTheHostDialed(t *testing.T) {
	for _, c := range []struct {
		peer  string
		ferry bool
	}{{"127.0.0.1:17100", true}, {"192.0.2.7:17100", false}} {
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		seg := &mooncake.Segment{Name: ln.Addr().String(), Protocol: "tcp", TCPDataPort: 9, TCPProtoVersion: 2,
			Buffers: []mooncake.Buffer{}, Ferry: &mooncake.FerryTarget{Peer: c.peer, Key: transport.NewKey()}}
		srv := mooncake.Serve(ln, mooncake.Handlers{Segment: func() *mooncake.Segment { return seg }}, mooncake.ServerConfig{})
		var asked []string
		d := &mooncake.Dialer{Self: &mooncake.Segment{Name: "ferry-test", Protocol: "tcp"},
			Ferry: func(_ context.Context, peer string) (transport.Session, error) {
				asked = append(asked, peer)
				return nil, errors.New("no ferry peer in this test")
			}}
		s, err := d.Dial(ctxT(t), mooncake.Scheme+ln.Addr().String())
		switch {
		case c.ferry && (len(asked) != 1 || asked[0] != c.peer || err == nil):
			t.Errorf("ferry peer %s on the host dialed: asked %v, %v; want it dialed", c.peer, asked, err)
		case !c.ferry && (len(asked) != 0 || err != nil):
			t.Errorf("ferry peer %s on another host: asked %v, %v; want Mooncake's wire to the host dialed", c.peer, asked, err)
		}
		if s != nil {
			s.Close()
		}
		srv.Close()
	}
}
