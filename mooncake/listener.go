package mooncake

import (
	"net"
	"time"

	"github.com/ferry-project/ferry/internal/connlimit"
	"github.com/ferry-project/ferry/internal/loglimit"
)

// port serves a Mooncake port's connections under its caps
// (connlimit), each on its own goroutine; anyone may reach it, so what
// it logs goes through a rate limit. The handshake port and the data
// port both run on one.
type port struct {
	l    *connlimit.Listener
	warn *loglimit.Limiter
}

// openPort serves ln: every connection starts with handshake to say
// what it wants, and serve's error, if any, is logged (unless the
// port closed the connection itself: to make room, or closing).
func openPort(ln net.Listener, name string, lim connlimit.Limits, handshake time.Duration, logf, debugf func(string, ...any), serve func(c *connlimit.Conn) error) *port {
	p := &port{warn: loglimit.New("mooncake", logf)}
	p.l = connlimit.Listen(ln, connlimit.Config{
		Limits: lim, Name: name, HandshakeTimeout: handshake, Warnf: p.warn.Printf, Debugf: debugf,
		Serve: func(c *connlimit.Conn) {
			if err := serve(c); err != nil && !c.Dropped() {
				p.warn.Printf("%v", err)
			}
		},
	})
	return p
}

// Addr is the listening address.
func (p *port) Addr() net.Addr { return p.l.Addr() }

// Stats is what the port's caps did.
func (p *port) Stats() connlimit.Stats {
	s := p.l.Stats()
	s.Failures = p.warn.Count()
	return s
}

// Close stops accepting, closes every connection (work in flight fails)
// and waits for their goroutines.
func (p *port) Close() error {
	err := p.l.Close()
	p.warn.Stop()
	return err
}

func (p *port) logf(format string, args ...any) { p.warn.Printf(format, args...) }
