package connlimit

import (
	"context"
	"errors"
	"fmt"
	"net"
	"sync"
	"sync/atomic"
	"time"
)

// Config is a Listener's setup. Serve and HandshakeTimeout are required.
type Config struct {
	Limits
	// Name is the port in log lines, e.g. "peer port".
	Name string
	// HandshakeTimeout is the deadline every connection starts with, on
	// reads and writes: Serve moves or lifts it once the peer has said
	// who it is, so nobody holds a place by connecting and saying nothing.
	HandshakeTimeout time.Duration
	// Serve serves one admitted connection; the listener closes it after.
	Serve func(c *Conn)
	// Warnf hears of refused connections and failed accepts, which
	// strangers can cause at will: give it a rate-limited logger.
	Warnf func(format string, args ...any)
	// Debugf, if set, hears of connections evicted to make room, which
	// strangers can cause at will too: give it a rate-limited logger.
	Debugf func(format string, args ...any)
	// Shared, if set, is a table that several listeners' connections
	// take a place in too (NewShared): its caps bound them all together,
	// and a newcomer to one may take the place of another's idle
	// connection.
	Shared *Table[*Conn]
}

// NewShared makes a table for Config.Shared, capped at lim.
func NewShared(lim Limits) *Table[*Conn] { return NewTable[*Conn](lim) }

// Listener accepts connections under Limits and serves each on its own
// goroutine. Accepting never waits for a place: a newcomer takes an idle
// connection's (see Table.Admit) or is refused at once.
type Listener struct {
	ln    net.Listener
	cfg   Config
	table *Table[*Conn]
	ctx   context.Context
	stop  context.CancelFunc
	wg    sync.WaitGroup

	mu     sync.Mutex
	closed bool
}

// Conn is an accepted TCP connection and its place in the listener's
// table.
type Conn struct {
	*net.TCPConn
	m       *Member[*Conn]
	sm      *Member[*Conn]  // its place in Config.Shared; nil: none
	ctx     context.Context // the listener's
	dropped atomic.Bool
}

// Listen serves ln's connections until Close.
func Listen(ln net.Listener, cfg Config) *Listener {
	l := &Listener{ln: ln, cfg: cfg, table: NewTable[*Conn](cfg.Limits)}
	l.ctx, l.stop = context.WithCancel(context.Background())
	l.wg.Add(1)
	go l.accept()
	return l
}

// Addr is the listening address.
func (l *Listener) Addr() net.Addr { return l.ln.Addr() }

// Context ends when Close has closed every connection, for work a
// connection started beyond itself (an outbound handshake).
func (l *Listener) Context() context.Context { return l.ctx }

// Context is the listener's (see Listener.Context).
func (c *Conn) Context() context.Context { return c.ctx }

// Stats is what the listener's caps did.
func (l *Listener) Stats() Stats { return l.table.Stats() }

// closing reports whether Close has begun.
func (l *Listener) closing() bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.closed
}

// Close stops accepting, closes every connection (work in flight fails),
// ends Context and waits for the connections' goroutines.
func (l *Listener) Close() error {
	l.mu.Lock()
	if l.closed {
		l.mu.Unlock()
		l.wg.Wait()
		return nil
	}
	l.closed = true
	err := l.ln.Close()
	for _, m := range l.table.Members() {
		m.Value.drop()
	}
	l.mu.Unlock()
	l.stop()
	l.wg.Wait()
	return err
}

func (l *Listener) accept() {
	defer l.wg.Done()
	var backoff time.Duration
	for {
		nc, err := l.ln.Accept()
		if err != nil {
			if errors.Is(err, net.ErrClosed) || l.closing() {
				return
			}
			// Usually out of file descriptors: wait for some to free up
			// rather than spin.
			backoff = min(max(2*backoff, 5*time.Millisecond), time.Second)
			l.cfg.Warnf("%s: accept on %s: %v; retrying in %s", l.cfg.Name, l.ln.Addr(), err, backoff)
			select {
			case <-l.ctx.Done():
				return
			case <-time.After(backoff):
			}
			continue
		}
		backoff = 0
		tc, ok := nc.(*net.TCPConn)
		if !ok {
			nc.Close()
			l.cfg.Warnf("%s: accepted a %T, not a TCP connection: closed it", l.cfg.Name, nc)
			continue
		}
		c := &Conn{TCPConn: tc, ctx: l.ctx}
		l.mu.Lock()
		if l.closed {
			l.mu.Unlock()
			tc.Close()
			return
		}
		m, evicted, err := l.table.Admit(Source(tc.RemoteAddr()), c)
		var shared *Member[*Conn] // evicted from the shared table
		if err == nil && l.cfg.Shared != nil {
			if evicted != nil && evicted.Value.sm != nil {
				evicted.Value.sm.Release() // its place is this one's
			}
			if c.sm, shared, err = l.cfg.Shared.Admit(Source(tc.RemoteAddr()), c); err != nil {
				m.Release()
				err = fmt.Errorf("%w (of the places the ports sharing their caps hold together)", err)
			}
		}
		if err != nil {
			l.mu.Unlock()
			// Logged before the close, so whoever sees the close finds the line.
			l.cfg.Warnf("%s: refused a connection from %s: %v", l.cfg.Name, tc.RemoteAddr(), err)
			tc.Close()
			if evicted != nil {
				evicted.Value.drop()
			}
			continue
		}
		c.m = m
		l.wg.Add(1)
		l.mu.Unlock()
		for _, ev := range []*Member[*Conn]{evicted, shared} {
			if ev == nil {
				continue
			}
			if l.cfg.Debugf != nil {
				l.cfg.Debugf("%s: closed an idle connection from %s to make room for one from %s (the most kept: %d in all, %d from one address)",
					l.cfg.Name, ev.Value.RemoteAddr(), tc.RemoteAddr(), l.cfg.Total, l.cfg.PerSource)
			}
			ev.Value.drop()
		}
		tc.SetDeadline(time.Now().Add(l.cfg.HandshakeTimeout))
		go l.serve(c)
	}
}

func (l *Listener) serve(c *Conn) {
	defer l.wg.Done()
	defer func() {
		c.Close()
		c.m.Release()
		if c.sm != nil {
			c.sm.Release()
		}
	}()
	l.cfg.Serve(c)
}

// drop closes c for the listener (an eviction, or Close).
func (c *Conn) drop() {
	c.dropped.Store(true)
	c.Close()
}

// Dropped reports whether the listener closed c (to make room, or
// closing): whatever error that caused its Serve is no news.
func (c *Conn) Dropped() bool { return c.dropped.Load() }

// Busy marks c in use (a request under way), so it is not evicted; false
// means it was evicted already and its Serve should stop.
func (c *Conn) Busy() bool {
	ok := c.m.Busy()
	if c.sm != nil {
		ok = c.sm.Busy() && ok
	}
	return ok
}

// Idle marks c between requests: it may be evicted, the least recently
// used first.
func (c *Conn) Idle() {
	c.m.Idle()
	if c.sm != nil {
		c.sm.Idle()
	}
}

// Greeted marks c as having finished its handshake: until its first
// request it is evicted before the unproven connections still in theirs,
// which may be a peer's not served yet.
func (c *Conn) Greeted() {
	c.m.Greeted()
	if c.sm != nil {
		c.sm.Greeted()
	}
}

// Prove marks c as having carried successful traffic (an authenticated
// handshake, a write that landed): it is evicted after every connection
// that has not.
func (c *Conn) Prove() {
	c.m.Prove()
	if c.sm != nil {
		c.sm.Prove()
	}
}

// Closing counts why Serve is about to return: ReasonIdle or
// ReasonTimeout.
func (c *Conn) Closing(reason string) { c.m.Closing(reason) }
