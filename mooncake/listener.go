package mooncake

import (
	"context"
	"errors"
	"net"
	"sync"
	"time"

	"github.com/ferry-project/ferry/internal/loglimit"
)

// listener serves each accepted connection on its own goroutine, at most
// max at once (more wait in the backlog), and on close ends them all and
// waits. The handshake port and the data port both run on one.
type listener struct {
	ln    net.Listener
	serve func(c net.Conn) error // the connection is closed after it
	// ctx ends with Close, for work a connection starts beyond itself
	// (an outbound handshake).
	ctx    context.Context
	cancel context.CancelFunc
	logf   func(format string, args ...any) // rate-limited by start
	limit  *loglimit.Limiter
	sem    chan struct{}
	wg     sync.WaitGroup
	mu     sync.Mutex
	live   map[net.Conn]struct{}
	shut   bool
}

func (l *listener) start(max int) {
	l.ctx, l.cancel = context.WithCancel(context.Background())
	l.limit = loglimit.New("mooncake", l.logf)
	l.logf = l.limit.Printf
	l.sem = make(chan struct{}, max)
	l.live = make(map[net.Conn]struct{})
	l.wg.Add(1)
	go l.accept()
}

// Addr is the listening address.
func (l *listener) Addr() net.Addr { return l.ln.Addr() }

// Close stops accepting, closes every connection (work in flight fails)
// and waits for their goroutines.
func (l *listener) Close() error {
	l.mu.Lock()
	l.shut = true
	err := l.ln.Close()
	for c := range l.live {
		c.Close()
	}
	l.cancel() // after the connections: work it ends finds them closed
	l.mu.Unlock()
	l.wg.Wait()
	l.limit.Stop()
	return err
}

func (l *listener) closing() bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.shut
}

func (l *listener) accept() {
	defer l.wg.Done()
	for {
		c, err := l.ln.Accept()
		if err != nil {
			if errors.Is(err, net.ErrClosed) {
				return
			}
			// Usually out of descriptors: wait for some rather than spin.
			l.logf("mooncake: accept on %s: %v", l.ln.Addr(), err)
			time.Sleep(10 * time.Millisecond)
			continue
		}
		l.sem <- struct{}{}
		l.mu.Lock()
		if l.shut {
			l.mu.Unlock()
			c.Close()
			<-l.sem
			return
		}
		l.live[c] = struct{}{}
		l.wg.Add(1)
		l.mu.Unlock()
		go func() {
			defer func() {
				c.Close()
				l.mu.Lock()
				delete(l.live, c)
				l.mu.Unlock()
				<-l.sem
				l.wg.Done()
			}()
			if err := l.serve(c); err != nil && !l.closing() {
				l.logf("%v", err)
			}
		}()
	}
}
