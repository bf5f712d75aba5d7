package transporttest

import (
	"fmt"
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

// Logs collects log lines: its Logf goes where a Logf is configured.
type Logs struct {
	mu    sync.Mutex
	lines []string
}

func (l *Logs) Logf(format string, args ...any) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.lines = append(l.lines, fmt.Sprintf(format, args...))
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
	lines := l.Lines()
	for _, line := range lines {
		found := true
		for _, w := range want {
			found = found && strings.Contains(line, w)
		}
		if found {
			return
		}
	}
	t.Errorf("no log line has all of %q; got %q", want, lines)
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
