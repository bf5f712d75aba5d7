package peer

import (
	"context"
	"errors"
	"io"
	"net"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/ferry-project/ferry/internal/connlimit"
	"github.com/ferry-project/ferry/transport"
	"github.com/ferry-project/ferry/transport/transporttest"
)

// listen opens a port on loopback whose data connections echo what they
// get; rdma, if set, serves its RDMA connections.
func listen(tb testing.TB, cfg Config, rdma Handler) *Port {
	tb.Helper()
	if cfg.Addr == "" {
		cfg.Addr = "127.0.0.1:0"
	}
	if cfg.Sink == nil {
		cfg.Sink = transporttest.NewSlots(0)
	}
	p, err := Listen(cfg)
	if err != nil {
		tb.Fatal(err)
	}
	p.Serve(Handlers{Data: func(c *connlimit.Conn, _ uint64) { io.Copy(c, c) }, RDMA: rdma})
	tb.Cleanup(func() { p.Close() })
	return p
}

func ctxFor(t *testing.T, d time.Duration) context.Context {
	ctx, cancel := context.WithTimeout(t.Context(), d)
	t.Cleanup(cancel)
	return ctx
}

// helloBytes is a hello in protocol version v.
func helloBytes(v uint32) []byte {
	var b [helloSize]byte
	h := ours(42, KindData, nil)
	h.version = v
	h.encode(&b)
	return b[:]
}

// stillServes checks that rx takes a data connection from a fresh
// dialer, and serves it.
func stillServes(t *testing.T, rx *Port) {
	t.Helper()
	tx := listen(t, Config{Secret: rx.Config().Secret}, nil)
	c, _, err := tx.Dial(ctxFor(t, 10*time.Second), rx.Addr().String(), KindData)
	if err != nil {
		t.Fatalf("dial after hostile clients: %v", err)
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(10 * time.Second))
	c.Write([]byte("echo"))
	if b, err := io.ReadAll(io.LimitReader(c, 4)); string(b) != "echo" {
		t.Fatalf("the data connection after hostile clients: read %q, %v", b, err)
	}
}

func TestHostileHandshake(t *testing.T) {
	var l transporttest.Logs
	rx := listen(t, Config{HandshakeTimeout: 300 * time.Millisecond, Logf: l.Logf}, nil)
	const noWelcome = ^uint32(0)
	for _, c := range []struct {
		name   string
		send   []byte   // then half-close; nil: send nothing, stay open
		status uint32   // of the welcome
		log    []string // words of the expected log line; nil: no line
	}{
		{"WrongMagic", []byte("GET / HTTP/1.1\r\nHost:x\r\n"), statusBadMagic, []string{"bad magic", `"GET "`}},
		{"WrongVersion", helloBytes(99), statusBadVersion, []string{"version 99", "version 8", "upgrade the older daemon"}},
		{"OldVersion", helloBytes(7), statusBadVersion, []string{"peer speaks version 7", "version 8", "upgrade the older daemon"}},
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
			transporttest.Served(t, rx.Stats)
			if c.log == nil {
				l.None(t, nc.LocalAddr().String())
			} else {
				l.Has(t, c.log...)
			}
		})
	}
	stillServes(t, rx)
}

// welcomeAs answers a hello the way a server speaking v would.
func welcomeAs(v, status uint32) func(c net.Conn) {
	return func(c net.Conn) {
		var hb [helloSize]byte
		if _, err := io.ReadFull(c, hb[:]); err != nil {
			return
		}
		var b [welcomeSize]byte
		w := welcome{hello: ours(7, KindData, nil), status: status}
		w.version = v
		w.encode(&b)
		c.Write(b[:])
	}
}

func TestDialHostilePeer(t *testing.T) {
	tx := listen(t, Config{}, nil)
	for _, c := range []struct {
		name         string
		kind         Kind
		answer       func(c net.Conn)
		want         []string
		incompatible bool // no re-dial can help: the daemon must not retry
	}{
		{"WrongVersion", KindData, welcomeAs(9, statusBadVersion), []string{"peer speaks version 9", "this daemon speaks version 8", "upgrade the older daemon"}, true},
		{"NotFerry", KindData, func(c net.Conn) { io.WriteString(c, "HTTP/1.1 400 Bad Request\r\n\r\n") }, []string{"bad magic", "HTTP"}, true},
		{"Refused", KindData, welcomeAs(version, 77), []string{"status 77"}, false},
		{"ClosesEarly", KindData, func(c net.Conn) { c.Read(make([]byte, 1)) }, []string{"peer closed the connection"}, false},
		{"KindNotEchoed", KindRDMA, welcomeAs(version, statusOK), []string{"peer welcomed connection kind 0", "asked for kind 1"}, false},
	} {
		t.Run(c.name, func(t *testing.T) {
			addr := transporttest.FakePeer(t, c.answer)
			_, _, err := tx.Dial(ctxFor(t, 10*time.Second), addr, c.kind)
			if err == nil {
				t.Fatal("dial succeeded")
			}
			for _, w := range append(c.want, "handshake") {
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

// TestDialKinds: a hello asking for RDMA reaches the port's RDMA handler
// with the dialer's instance, or where there is none gets ErrNoRDMA,
// quietly; data connections are served either way.
func TestDialKinds(t *testing.T) {
	tx := listen(t, Config{}, nil)

	t.Run("NotServed", func(t *testing.T) {
		var l transporttest.Logs
		rx := listen(t, Config{Logf: l.Logf}, nil)
		if _, _, err := tx.Dial(ctxFor(t, 10*time.Second), rx.Addr().String(), KindRDMA); err != ErrNoRDMA {
			t.Fatalf("an RDMA dial to a port without RDMA: got %v, want ErrNoRDMA", err)
		}
		transporttest.Served(t, rx.Stats)
		l.None(t, "")
		stillServes(t, rx)
	})

	t.Run("Served", func(t *testing.T) {
		type call struct {
			instance uint64
			line     string
		}
		calls := make(chan call, 1)
		rx := listen(t, Config{}, func(c *connlimit.Conn, instance uint64) {
			line, _ := io.ReadAll(io.LimitReader(c, 5))
			calls <- call{instance, string(line)}
			c.Write([]byte("bye"))
		})
		c, instance, err := tx.Dial(ctxFor(t, 10*time.Second), rx.Addr().String(), KindRDMA)
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		if instance != rx.Instance() {
			t.Errorf("the dial saw instance %#x, want %#x", instance, rx.Instance())
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
		stillServes(t, rx)
	})
}

// TestClosedPortDialsNothing: a port that closed neither dials nor
// serves.
func TestClosedPortDialsNothing(t *testing.T) {
	rx := listen(t, Config{}, nil)
	tx := listen(t, Config{}, nil)
	tx.Close()
	if _, _, err := tx.Dial(ctxFor(t, 10*time.Second), rx.Addr().String(), KindData); !errors.Is(err, transport.ErrClosed) {
		t.Fatalf("dial from a closed port: %v, want ErrClosed", err)
	}
}

// A dialed connection gets the configured send buffer (the kernel keeps
// twice what it is given); without one, the kernel's own.
func TestDialSetsTheSendBuffer(t *testing.T) {
	rx := listen(t, Config{}, nil)
	sndbuf := func(cfg Config) int {
		tx := listen(t, cfg, nil)
		c, _, err := tx.Dial(ctxFor(t, 10*time.Second), rx.Addr().String(), KindData)
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		raw, err := c.SyscallConn()
		if err != nil {
			t.Fatal(err)
		}
		var v int
		raw.Control(func(fd uintptr) { v, err = unix.GetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_SNDBUF) })
		if err != nil {
			t.Fatal(err)
		}
		return v
	}
	if got := sndbuf(Config{SendBuffer: 96 << 10}); got != 2*96<<10 {
		t.Errorf("SO_SNDBUF with SendBuffer 96 KiB: %d, want %d", got, 2*96<<10)
	}
	if got := sndbuf(Config{}); got == 2*96<<10 {
		t.Errorf("SO_SNDBUF without SendBuffer: %d, the configured size of another connection", got)
	}
}
