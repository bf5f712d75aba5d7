package mooncake

import (
	"net"
	"net/netip"
	"slices"
	"sync/atomic"
	"time"

	"github.com/ferry-project/ferry/internal/connlimit"
	"github.com/ferry-project/ferry/internal/loglimit"
)

// port serves a Mooncake port's connections under its caps
// (connlimit), each on its own goroutine; anyone may reach it, so what
// it logs goes through a rate limit. The handshake port and the data
// port both run on one. A connection from an address its Allow refuses
// is closed at accept, before it takes a place.
type port struct {
	l          *connlimit.Listener
	warn       *loglimit.Limiter
	notAllowed atomic.Uint64
}

// Allow says which addresses may use a segment's ports. Mooncake's wire
// carries no key: the address a write comes from is all a port can go
// by, and a segment's descriptor tells whoever asks where its buffers
// are.
type Allow struct {
	// Prefixes are the addresses allowed; nil allows every address.
	Prefixes []netip.Prefix
	// Setting names where the list comes from, for the refusal's log
	// line (e.g. "mooncake_allow").
	Setting string
}

// allows reports whether a may connect.
func (a Allow) allows(addr net.Addr) bool {
	if a.Prefixes == nil {
		return true
	}
	ta, ok := addr.(*net.TCPAddr)
	if !ok {
		return false
	}
	ip, ok := netip.AddrFromSlice(ta.IP)
	return ok && slices.ContainsFunc(a.Prefixes, func(p netip.Prefix) bool { return p.Contains(ip.Unmap()) })
}

// openPort serves ln: every connection starts with handshake to say
// what it wants, and serve's error, if any, is logged (unless the
// port closed the connection itself: to make room, or closing).
func openPort(ln net.Listener, name string, allow Allow, lim connlimit.Limits, shared *connlimit.Table[*connlimit.Conn], handshake time.Duration, logf, debugf func(string, ...any), serve func(c *connlimit.Conn) error) *port {
	p := &port{warn: loglimit.New("mooncake", logf)}
	if allow.Prefixes != nil {
		ln = &allowListener{Listener: ln, p: p, name: name, allow: allow}
	}
	p.l = connlimit.Listen(ln, connlimit.Config{
		Limits: lim, Shared: shared, Name: name, HandshakeTimeout: handshake, Warnf: p.warn.Printf, Debugf: debugf,
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

// Stats is what the port's caps and its Allow did.
func (p *port) Stats() connlimit.Stats {
	s := p.l.Stats()
	s.Failures = p.warn.Count()
	s.RefusedNotAllowed = p.notAllowed.Load()
	return s
}

// allowListener closes, at accept, connections from addresses its Allow
// refuses: they hold no place, no goroutine, and read nothing.
type allowListener struct {
	net.Listener
	p     *port
	name  string
	allow Allow
}

func (l *allowListener) Accept() (net.Conn, error) {
	for {
		c, err := l.Listener.Accept()
		if err != nil || l.allow.allows(c.RemoteAddr()) {
			return c, err
		}
		l.p.notAllowed.Add(1)
		// Logged before the close, so whoever sees the close finds the line.
		l.p.warn.Printf("%s: refused a connection from %s: its address is not on %s; add it there if a Mooncake engine there should write into this segment",
			l.name, c.RemoteAddr(), l.allow.Setting)
		if tc, ok := c.(*net.TCPConn); ok {
			// A reset, not a clean end: the engine's write fails at once.
			_ = tc.SetLinger(0)
		}
		c.Close()
	}
}

// Close stops accepting, closes every connection (work in flight fails)
// and waits for their goroutines.
func (p *port) Close() error {
	err := p.l.Close()
	p.warn.Stop()
	return err
}

func (p *port) logf(format string, args ...any) { p.warn.Printf(format, args...) }
