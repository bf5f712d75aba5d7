package transporttest

import (
	"fmt"
	"io"
	"net"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ferry-project/ferry/internal/connlimit"
)

// What the tests of the peer port and its transports share: a fake peer
// to dial, a log to search, and a wait for a port to let go.

// FakePeer listens on loopback and runs answer on each connection it
// accepts, closing it afterwards; it returns the address. It stops when
// t ends.
func FakePeer(t testing.TB, answer func(c net.Conn)) string {
	ln := Listener(t)
	serve(t, ln, answer)
	return ln.Addr().String()
}

// Listener is a loopback listener for Relay to serve, for a test that
// needs its address first.
func Listener(t testing.TB) net.Listener {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	return ln
}

// Relay serves ln as a host in the middle: it connects each connection
// it accepts to the address to and copies bytes both ways until either
// side closes. It stops when t ends.
func Relay(t testing.TB, ln net.Listener, to string) {
	serve(t, ln, func(c net.Conn) {
		o, err := net.DialTimeout("tcp", to, 10*time.Second)
		if err != nil {
			return
		}
		done := make(chan struct{})
		go func() {
			defer close(done)
			io.Copy(o, c)
			o.Close() // and so the copy the other way ends
		}()
		io.Copy(c, o)
		c.Close()
		o.Close()
		<-done
	})
}

// serve runs answer on each connection ln accepts, closing it
// afterwards, until t ends.
func serve(t testing.TB, ln net.Listener, answer func(c net.Conn)) {
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
}

// Dial connects to addr for a test that writes and reads the bytes
// itself: the connection has 10 s to do its work, and closes when t ends.
func Dial(t testing.TB, addr string) net.Conn {
	t.Helper()
	return DialFrom(t, "", addr)
}

// DialFrom is Dial from the local address src (any of 127.0.0.0/8 is
// this host's), so one test plays several sources; "" lets the kernel
// choose.
func DialFrom(t testing.TB, src, addr string) net.Conn {
	t.Helper()
	d := net.Dialer{Timeout: 10 * time.Second}
	if src != "" {
		d.LocalAddr = &net.TCPAddr{IP: net.ParseIP(src)}
	}
	c, err := d.Dial("tcp", addr)
	if err != nil {
		t.Fatalf("connecting to %s from %q: %v", addr, src, err)
	}
	t.Cleanup(func() { c.Close() })
	c.SetDeadline(time.Now().Add(10 * time.Second))
	return c
}

// Logs collects log lines: its Logf goes where a Logf is configured.
type Logs struct {
	mu      sync.Mutex
	lines   []string
	changed chan struct{} // closed at the next line; nil: nobody waits
}

func (l *Logs) Logf(format string, args ...any) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.lines = append(l.lines, fmt.Sprintf(format, args...))
	if l.changed != nil {
		close(l.changed)
		l.changed = nil
	}
}

// Lines is every line so far.
func (l *Logs) Lines() []string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return append([]string(nil), l.lines...)
}

// Has fails t unless a line contains every one of want.
func (l *Logs) Has(t testing.TB, want ...string) {
	t.Helper()
	if !l.has(want) {
		t.Errorf("no log line has all of %q; got %q", want, l.Lines())
	}
}

// Wait waits, 30 s at most, for a line that contains every one of want.
func (l *Logs) Wait(t testing.TB, want ...string) {
	t.Helper()
	deadline := time.After(30 * time.Second)
	for {
		l.mu.Lock()
		if l.changed == nil {
			l.changed = make(chan struct{})
		}
		changed := l.changed
		l.mu.Unlock()
		if l.has(want) {
			return
		}
		select {
		case <-changed:
		case <-deadline:
			t.Fatalf("no log line has all of %q within 30s; got %q", want, l.Lines())
		}
	}
}

func (l *Logs) has(want []string) bool {
	for _, line := range l.Lines() {
		found := true
		for _, w := range want {
			found = found && strings.Contains(line, w)
		}
		if found {
			return true
		}
	}
	return false
}

// None fails t for every line that contains about.
func (l *Logs) None(t testing.TB, about string) {
	t.Helper()
	for _, line := range l.Lines() {
		if strings.Contains(line, about) {
			t.Errorf("unexpected log line %q", line)
		}
	}
}

// Served waits until a port (stats is its Stats) holds no accepted
// connection, that is until every connection's goroutine has finished.
func Served(t testing.TB, stats func() connlimit.Stats) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		n := stats().Open
		if n == 0 {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d accepted connections still served", n)
		}
		time.Sleep(time.Millisecond)
	}
}
