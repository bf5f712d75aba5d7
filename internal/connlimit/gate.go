package connlimit

import (
	"errors"
	"fmt"
	"net"
	"net/http"
	"sync"
)

// Gate puts the connections an http.Server accepts under a Table's caps,
// for the daemon's HTTP listeners (the control socket, the metrics
// listener): wrap the server's listener with Listener and give the
// server ConnState. A connection is in use while the server reads or
// answers a request on it, so never evicted then; one that has not sent
// a whole request's headers yet, or sits idle between requests, may be.
type Gate struct {
	name   string
	table  *Table[net.Conn]
	source func(net.Conn) (source string, proven bool)
	warnf  func(format string, args ...any)

	mu      sync.Mutex
	members map[net.Conn]*Member[net.Conn]
}

// NewGate caps connections at lim. source names a connection's source
// (an address, a uid) and says whether it is proven already (a caller
// the allow-lists admit): unproven ones are evicted first. warnf hears of
// refusals, which strangers can cause at will: give it a rate-limited
// logger.
func NewGate(name string, lim Limits, source func(net.Conn) (string, bool), warnf func(format string, args ...any)) *Gate {
	return &Gate{name: name, table: NewTable[net.Conn](lim), source: source, warnf: warnf, members: make(map[net.Conn]*Member[net.Conn])}
}

// Listener is ln admitting each connection it accepts, or closing it at
// once when the gate has no place for it.
func (g *Gate) Listener(ln net.Listener) net.Listener { return gateListener{ln, g} }

type gateListener struct {
	net.Listener
	g *Gate
}

func (l gateListener) Accept() (net.Conn, error) {
	for {
		c, err := l.Listener.Accept()
		if err != nil {
			return nil, err
		}
		if l.g.admit(c) {
			return c, nil
		}
	}
}

func (g *Gate) admit(c net.Conn) bool {
	src, proven := g.source(c)
	// At its own cap a source's newcomer takes the place of that source's
	// idlest connection (they are all its own), where the table alone
	// would refuse it.
	own := g.table.idlestAtCap(src)
	m, evicted, err := g.table.Replace(own, src, c)
	if err == nil && own != nil {
		evicted = own
		g.table.countEvicted()
	}
	if err != nil {
		// The source may be a uid: the Refusal's own words name an address.
		if r := (*Refusal)(nil); errors.As(err, &r) && r.Reason == ReasonPerSource {
			err = fmt.Errorf("it already holds %d, the most one source may", r.Limit)
		}
		g.warnf("%s: refused a connection from %s: %v", g.name, src, err)
		c.Close()
		return false
	}
	if proven {
		m.Prove()
	}
	g.mu.Lock()
	g.members[c] = m
	g.mu.Unlock()
	if evicted != nil {
		// The server sees the close and reports StateClosed for it.
		evicted.Value.Close()
	}
	return true
}

// ConnState is the http.Server's ConnState hook: it keeps the table's
// view of each connection (in use, idle, gone) current.
func (g *Gate) ConnState(c net.Conn, st http.ConnState) {
	g.mu.Lock()
	m := g.members[c]
	if st == http.StateClosed || st == http.StateHijacked {
		delete(g.members, c)
	}
	g.mu.Unlock()
	if m == nil {
		return
	}
	switch st {
	case http.StateActive:
		m.Busy()
	case http.StateIdle:
		m.Idle()
	case http.StateClosed, http.StateHijacked:
		// A hijacked connection (GET /v1/arena) is its handler's, which
		// closes it after one answer.
		m.Release()
	}
}

// Stats is what the gate's caps did.
func (g *Gate) Stats() Stats { return g.table.Stats() }

// idlestAtCap is source's least recently used member not in use when
// source holds the most one source may, else nil.
func (t *Table[V]) idlestAtCap(source string) *Member[V] {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.lim.PerSource <= 0 || t.per[source] < t.lim.PerSource {
		return nil
	}
	var v *Member[V]
	for m := range t.all {
		if m.source == source && !m.busy && (v == nil || m.used < v.used) {
			v = m
		}
	}
	return v
}

// countEvicted counts a member a Replace displaced.
func (t *Table[V]) countEvicted() {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.stats.Evicted++
}
