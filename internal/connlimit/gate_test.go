package connlimit

import (
	"net"
	"net/http"
	"testing"
)

// sourcedConn is a net.Pipe end with the source and standing a Gate
// reads from it.
type sourcedConn struct {
	net.Conn
	source string
	proven bool
	closed bool
}

func (c *sourcedConn) Close() error { c.closed = true; return c.Conn.Close() }

// listOf is a listener that hands out conns in order.
type listOf struct {
	net.Listener
	conns []*sourcedConn
}

func (l *listOf) Accept() (net.Conn, error) {
	c := l.conns[0]
	l.conns = l.conns[1:]
	return c, nil
}

// A full gate evicts an unproven idle connection (a refused caller's)
// before a proven one; a source at its own cap replaces its own idlest
// rather than being refused; a connection in use is never evicted.
func TestGateEvictsStrangersFirstAndCountsRefusals(t *testing.T) {
	conn := func(source string, proven bool) *sourcedConn {
		a, b := net.Pipe()
		t.Cleanup(func() { a.Close(); b.Close() })
		return &sourcedConn{Conn: a, source: source, proven: proven}
	}
	proven, busy := conn("uid 1500", true), conn("uid 1500", true)
	stranger, own1, own2 := conn("uid 64992", false), conn("uid 7", false), conn("uid 7", false)
	newcomer := conn("uid 8", true)
	l := &listOf{conns: []*sourcedConn{proven, busy, stranger, own1, own2, newcomer}}
	g := NewGate("test", Limits{Total: 4, PerSource: 1}, func(c net.Conn) (string, bool) {
		return c.(*sourcedConn).source, c.(*sourcedConn).proven
	}, t.Logf)
	ln := g.Listener(l)
	accept := func() net.Conn {
		c, err := ln.Accept()
		if err != nil {
			t.Fatal(err)
		}
		return c
	}
	// PerSource 1: busy, from proven's uid, takes proven's place.
	accept()
	g.ConnState(accept(), http.StateActive)
	if !proven.closed || busy.closed {
		t.Fatalf("a uid at its cap: its idle connection closed %v, the newcomer %v; want the idle one replaced", proven.closed, busy.closed)
	}
	accept() // stranger
	accept() // own1
	accept() // own2 replaces own1, its own
	if !own1.closed || stranger.closed {
		t.Fatalf("own1 closed %v, stranger closed %v", own1.closed, stranger.closed)
	}
	accept() // newcomer: the gate holds busy, stranger, own2; a place is free
	st := g.Stats()
	if st.Open != 4 || st.Evicted != 2 || st.RefusedTotal+st.RefusedPerSource != 0 {
		t.Fatalf("stats %+v; want 4 open, 2 evicted, none refused", st)
	}
	// Full: one more evicts the least recently used unproven idle one
	// (the stranger), never the busy or the proven one.
	extra := conn("uid 9", false)
	// One more from busy's uid is refused: its one place is in use.
	refused, last := conn("uid 1500", true), conn("uid 10", false)
	l.conns = append(l.conns, extra, refused, last)
	accept()
	if busy.closed || newcomer.closed || own2.closed || !stranger.closed {
		t.Fatalf("full gate: busy %v newcomer %v own2 %v stranger %v closed; want the stranger alone", busy.closed, newcomer.closed, own2.closed, stranger.closed)
	}
	if c := accept(); c != last || !refused.closed {
		t.Fatalf("a uid whose one place is in use: closed %v; want it refused", refused.closed)
	}
	if st := g.Stats(); st.RefusedPerSource != 1 || st.Evicted != 4 {
		t.Fatalf("stats %+v; want 1 refused per source, 4 evicted", st)
	}
}
