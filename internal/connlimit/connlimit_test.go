package connlimit

import (
	"errors"
	"fmt"
	"io"
	"net"
	"strings"
	"sync"
	"testing"
	"time"
)

func admit(t *testing.T, tb *Table[string], source, name string) (*Member[string], string) {
	t.Helper()
	m, ev, err := tb.Admit(source, name)
	if err != nil {
		t.Fatalf("admitting %s from %q: %v", name, source, err)
	}
	if ev == nil {
		return m, ""
	}
	return m, ev.Value
}

// TestEvictionOrder: at the total cap the newcomer takes the place of an
// unproven member before any proven one, of the source holding the most
// first, then of the least recently used; members in use are never
// taken, and with only those left the newcomer is refused.
func TestEvictionOrder(t *testing.T) {
	tb := NewTable[string](Limits{Total: 4})
	legit, _ := admit(t, tb, "10.0.0.1", "legit")
	legit.Prove()
	admit(t, tb, "10.0.0.9", "stranger-1")
	admit(t, tb, "10.0.0.9", "stranger-2")
	admit(t, tb, "10.0.0.5", "lone")
	// The stranger holds the most; then lone, the newcomers and lone
	// hold one each, and the least recently used of them goes.
	for i, want := range []string{"stranger-1", "stranger-2", "lone"} {
		if _, ev := admit(t, tb, fmt.Sprintf("10.0.1.%d", i), fmt.Sprintf("new-%d", i)); ev != want {
			t.Fatalf("newcomer %d evicted %q, want %q", i, ev, want)
		}
	}
	// Only the proven one and three newcomers are left.
	if _, ev := admit(t, tb, "10.0.2.1", "late"); ev != "new-0" {
		t.Fatalf("evicted %q, want new-0, the oldest unproven", ev)
	}
	for _, m := range tb.Members() {
		if !m.Busy() {
			t.Fatalf("%s was evicted", m.Value)
		}
	}
	_, _, err := tb.Admit("10.0.3.1", "refused")
	var r *Refusal
	if !errors.As(err, &r) || r.Reason != ReasonTotal || !strings.Contains(err.Error(), "all 4 places are in use") {
		t.Fatalf("a newcomer into a table in use: %v, want a refusal naming the cap", err)
	}
	legit.Idle()
	if _, ev := admit(t, tb, "10.0.3.1", "taker"); ev != "legit" {
		t.Fatalf("evicted %q, want legit, the only member not in use", ev)
	}
	st := tb.Stats()
	if st.Open != 4 || st.Evicted != 5 || st.RefusedTotal != 1 {
		t.Fatalf("stats %+v, want 4 open, 5 evicted, 1 refused", st)
	}
}

// TestPerSourceCap: a source at its cap makes room among its own
// unproven members not in use, the least recently used first, and is
// refused when none is left; it never displaces what proved itself
// there, nor anyone elsewhere. The daemon's own members ("") are not
// capped.
func TestPerSourceCap(t *testing.T) {
	tb := NewTable[string](Limits{Total: 10, PerSource: 3})
	peer, _ := admit(t, tb, "10.0.0.9", "peer")
	s1, _ := admit(t, tb, "10.0.0.9", "s1")
	s2, _ := admit(t, tb, "10.0.0.9", "s2")
	admit(t, tb, "10.0.0.8", "elsewhere")
	peer.Prove()
	s2.Greeted()
	s1.Idle() // used after s2: both quiet, s2 the least recently used
	for i, want := range []string{"s2", "s1", "s3"} {
		if _, ev := admit(t, tb, "10.0.0.9", fmt.Sprint("s", i+3)); ev != want {
			t.Fatalf("newcomer %d over its source's cap evicted %q, want %q", i, ev, want)
		}
	}
	for _, m := range tb.Members() {
		if m != peer {
			m.Busy()
		}
	}
	_, _, err := tb.Admit("10.0.0.9", "refused")
	var r *Refusal
	if !errors.As(err, &r) || r.Reason != ReasonPerSource || !strings.Contains(err.Error(), "already holds 3") {
		t.Fatalf("a newcomer over a cap held by one proven member and two in use: %v, want a per-source refusal", err)
	}
	for i := range 5 {
		admit(t, tb, "", fmt.Sprint("own-", i))
	}
	if !peer.Release() || peer.Release() {
		t.Fatal("Release reports a member twice")
	}
	admit(t, tb, "10.0.0.9", "back")
	if st := tb.Stats(); st.RefusedPerSource != 1 || st.Evicted != 3 || st.Open != 9 {
		t.Fatalf("stats %+v, want 1 refused per source, 3 evicted, 9 open", st)
	}
}

// TestQuietGoFirst: among unproven members, the quiet ones (a stranger's
// connection that said hello, or had a request refused, and waits) are
// evicted before one still in its handshake, though it is older (a
// peer's connection not served yet); when no quiet member is left, the
// least recently used goes.
func TestQuietGoFirst(t *testing.T) {
	tb := NewTable[string](Limits{Total: 3, PerSource: 3})
	admit(t, tb, "10.0.0.1", "peer")
	s1, _ := admit(t, tb, "10.0.0.1", "s1")
	s1.Greeted()
	s2, _ := admit(t, tb, "10.0.0.1", "s2")
	s2.Busy() // a request, refused
	s2.Idle()
	for i, want := range []string{"s1", "s2", "peer", "n0"} {
		if _, ev := admit(t, tb, "10.0.0.1", fmt.Sprint("n", i)); ev != want {
			t.Fatalf("newcomer %d evicted %q, want %q", i, ev, want)
		}
	}
	// At the total cap, from another source, alike.
	tb = NewTable[string](Limits{Total: 2})
	admit(t, tb, "10.0.0.1", "peer")
	quiet, _ := admit(t, tb, "10.0.0.9", "quiet")
	quiet.Greeted()
	if _, ev := admit(t, tb, "10.0.0.5", "new"); ev != "quiet" {
		t.Fatalf("at the total cap evicted %q, want the quiet one", ev)
	}
}

// TestReplace: a member replaced from its own source at its caps takes
// its old place, evicting and refusing nobody; a replacement the table
// refuses leaves the old member where it was.
func TestReplace(t *testing.T) {
	tb := NewTable[string](Limits{Total: 2, PerSource: 1})
	a, _ := admit(t, tb, "10.0.0.1", "a")
	own, _ := admit(t, tb, "", "own")
	a2, ev, err := tb.Replace(a, "10.0.0.1", "a2")
	if err != nil || ev != nil || a.Release() {
		t.Fatalf("replacing a from its source at both caps: evicted %v, %v; want a's place taken", ev, err)
	}
	a2.Prove()
	if _, _, err := tb.Replace(own, "10.0.0.1", "b"); err == nil {
		t.Fatal("a replacement past its source's cap was admitted")
	}
	if !own.Busy() || !a2.Busy() {
		t.Fatal("a refused replacement took a member out of the table")
	}
	if st := tb.Stats(); st.Open != 2 || st.Evicted != 0 || st.RefusedPerSource != 1 {
		t.Fatalf("stats %+v", st)
	}
}

// TestReplaceKeepsWhatWasProven: a member that replaces a proven one is
// no newcomer to evict first, though it was used less recently.
func TestReplaceKeepsWhatWasProven(t *testing.T) {
	tb := NewTable[string](Limits{Total: 2})
	own, _ := admit(t, tb, "", "own")
	own.Prove()
	other, _ := admit(t, tb, "10.0.0.9", "other")
	if _, _, err := tb.Replace(own, "10.0.0.1", "back"); err != nil {
		t.Fatal(err)
	}
	other.Idle() // used after back
	if _, ev := admit(t, tb, "10.0.0.8", "new"); ev != "other" {
		t.Fatalf("evicted %q, want other: back took own's proven place", ev)
	}
}

// TestProveSource: a source that proved itself keeps its members past
// unproven ones.
func TestProveSource(t *testing.T) {
	tb := NewTable[string](Limits{Total: 2})
	admit(t, tb, "10.0.0.1", "quiet-legit")
	admit(t, tb, "10.0.0.9", "stranger")
	tb.ProveSource("10.0.0.1")
	if _, ev := admit(t, tb, "10.0.0.8", "new"); ev != "stranger" {
		t.Fatalf("evicted %q, want the stranger", ev)
	}
}

func TestSource(t *testing.T) {
	for _, c := range []struct{ addr, want string }{
		{"10.1.2.3:5", "10.1.2.3"},
		{"[::ffff:10.1.2.3]:5", "10.1.2.3"},
		{"[2001:db8:1:2:3:4:5:6]:5", "2001:db8:1:2::/64"},
	} {
		a, err := net.ResolveTCPAddr("tcp", c.addr)
		if err != nil {
			t.Fatal(err)
		}
		if got := Source(a); got != c.want {
			t.Errorf("Source(%s) = %s, want %s", c.addr, got, c.want)
		}
	}
}

// logs collects log lines.
type logs struct {
	mu    sync.Mutex
	lines []string
}

func (l *logs) logf(format string, args ...any) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.lines = append(l.lines, fmt.Sprintf(format, args...))
}

func (l *logs) all() []string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return append([]string(nil), l.lines...)
}

func (l *logs) has(s string) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	for _, line := range l.lines {
		if strings.Contains(line, s) {
			return true
		}
	}
	return false
}

// dialFrom connects to addr from the loopback address src (127.0.0.0/8
// is all this host's), so one test plays several sources.
func dialFrom(t *testing.T, src, addr string) net.Conn {
	t.Helper()
	d := net.Dialer{LocalAddr: &net.TCPAddr{IP: net.ParseIP(src)}, Timeout: 5 * time.Second}
	c, err := d.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

// closedByServer waits for c's server to close it, failing after 10 s.
func closedByServer(t *testing.T, c net.Conn, what string) {
	t.Helper()
	c.SetReadDeadline(time.Now().Add(10 * time.Second))
	if _, err := c.Read(make([]byte, 1)); err == nil || errors.Is(err, net.ErrClosed) || isTimeout(err) {
		t.Fatalf("%s: read %v, want the server to close the connection", what, err)
	}
}

func isTimeout(err error) bool {
	var ne net.Error
	return errors.As(err, &ne) && ne.Timeout()
}

// listenT runs a Listener whose connections echo a byte back for each
// one read, busy in between, and say which connections it saw.
func listenT(t *testing.T, cfg Config) (*Listener, chan *Conn) {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	seen := make(chan *Conn, 100)
	cfg.Serve = func(c *Conn) {
		seen <- c
		var b [1]byte
		for {
			if _, err := c.Read(b[:]); err != nil {
				if isTimeout(err) {
					c.Closing(ReasonTimeout)
				}
				return
			}
			c.SetDeadline(time.Time{})
			if !c.Busy() {
				return
			}
			c.Write(b[:])
			c.Prove()
			c.Idle()
		}
	}
	if cfg.HandshakeTimeout == 0 {
		cfg.HandshakeTimeout = 10 * time.Second
	}
	l := Listen(ln, cfg)
	t.Cleanup(func() { l.Close() })
	return l, seen
}

func echo(t *testing.T, c net.Conn) {
	t.Helper()
	c.SetDeadline(time.Now().Add(10 * time.Second))
	if _, err := c.Write([]byte{7}); err != nil {
		t.Fatal(err)
	}
	if _, err := io.ReadFull(c, make([]byte, 1)); err != nil {
		t.Fatalf("no echo: %v", err)
	}
	c.SetDeadline(time.Time{})
}

// TestListenerCaps: a source over its cap takes the place of its own
// idle connection that carried no traffic, and is refused at once
// (closed, counted, a WARN line) when its connections all did; at the
// total cap a newcomer from elsewhere takes the place of a stranger's
// idle connection, never of one that carried traffic; the port keeps
// serving.
func TestListenerCaps(t *testing.T) {
	var warn, debug logs
	l, seen := listenT(t, Config{Limits: Limits{Total: 4, PerSource: 2}, Name: "test port", Warnf: warn.logf, Debugf: debug.logf})
	addr := l.Addr().String()
	legit := dialFrom(t, "127.0.0.1", addr)
	<-seen
	echo(t, legit)
	s1 := dialFrom(t, "127.0.0.2", addr)
	s2 := dialFrom(t, "127.0.0.2", addr)
	<-seen
	<-seen
	s3 := dialFrom(t, "127.0.0.2", addr)
	<-seen
	closedByServer(t, s1, "the oldest of three idle connections from one source")
	if !debug.has("closed an idle connection from 127.0.0.2:") {
		t.Fatalf("no debug line for the eviction: %q", debug.all())
	}
	echo(t, s2)
	echo(t, s3)
	over := dialFrom(t, "127.0.0.2", addr)
	closedByServer(t, over, "a third connection from a source whose two carried traffic")
	if !warn.has("test port: refused a connection from 127.0.0.2:") || !warn.has("already holds 2") {
		t.Fatalf("no WARN line for the refusal: %q", warn.all())
	}
	idle := dialFrom(t, "127.0.0.4", addr)
	<-seen
	fresh := dialFrom(t, "127.0.0.3", addr)
	<-seen
	closedByServer(t, idle, "at the total cap, the stranger's idle connection")
	echo(t, fresh)
	echo(t, legit)
	if st := l.Stats(); st.Open != 4 || st.RefusedPerSource != 1 || st.Evicted != 2 || st.RefusedTotal != 0 {
		t.Fatalf("stats %+v, want 4 open, 1 refused per source, 2 evicted", st)
	}
}

// TestListenersSharedCaps: listeners sharing a table hold no more
// connections together than its cap: a newcomer to one takes the place
// of another's idle connection, one that carried no traffic first, then
// the least recently used.
func TestListenersSharedCaps(t *testing.T) {
	var debug logs
	shared := NewShared(Limits{Total: 2})
	a, seenA := listenT(t, Config{Limits: Limits{Total: 10}, Name: "port a", Warnf: t.Logf, Debugf: debug.logf, Shared: shared})
	b, seenB := listenT(t, Config{Limits: Limits{Total: 10}, Name: "port b", Warnf: t.Logf, Debugf: debug.logf, Shared: shared})
	legit := dialFrom(t, "127.0.0.1", a.Addr().String())
	<-seenA
	echo(t, legit)
	idle := dialFrom(t, "127.0.0.2", a.Addr().String())
	<-seenA
	fresh := dialFrom(t, "127.0.0.3", b.Addr().String())
	<-seenB
	closedByServer(t, idle, "at the shared cap, port a's connection that carried nothing, for one to port b")
	if !debug.has("port b: closed an idle connection from 127.0.0.2:") {
		t.Fatalf("no debug line for the eviction: %q", debug.all())
	}
	echo(t, fresh)
	late := dialFrom(t, "127.0.0.4", b.Addr().String())
	<-seenB
	closedByServer(t, legit, "at the shared cap, every connection proven: the least recently used")
	echo(t, fresh)
	echo(t, late)
	if st := shared.Stats(); st.Open != 2 || st.Evicted != 2 || st.RefusedTotal != 0 {
		t.Fatalf("shared stats %+v, want 2 open, 2 evicted", st)
	}
	// The evicted connections leave their own port's table as their
	// Serve returns, after the close the test saw.
	deadline := time.Now().Add(10 * time.Second)
	for a.Stats().Open+b.Stats().Open != 2 {
		if time.Now().After(deadline) {
			t.Fatalf("the ports hold %d connections, want the shared cap's 2", a.Stats().Open+b.Stats().Open)
		}
		time.Sleep(time.Millisecond) // a poll: the release has no event
	}
}

// TestListenerHandshakeDeadline: a connection that says nothing is
// closed after the handshake timeout, whatever Serve does.
func TestListenerHandshakeDeadline(t *testing.T) {
	l, seen := listenT(t, Config{Name: "test port", HandshakeTimeout: 50 * time.Millisecond, Warnf: t.Logf})
	c := dialFrom(t, "127.0.0.1", l.Addr().String())
	<-seen
	closedByServer(t, c, "a silent connection")
	deadline := time.Now().Add(10 * time.Second)
	for l.Stats().Timeout != 1 || l.Stats().Open != 0 {
		if time.Now().After(deadline) {
			t.Fatalf("stats %+v, want 1 handshake timeout and none open", l.Stats())
		}
		time.Sleep(time.Millisecond) // a poll: the count has no event
	}
}

// TestListenerClose: Close closes every connection, marks them dropped
// and waits for their goroutines.
func TestListenerClose(t *testing.T) {
	l, seen := listenT(t, Config{Name: "test port", Warnf: t.Logf})
	var conns []*Conn
	for range 3 {
		dialFrom(t, "127.0.0.1", l.Addr().String())
		conns = append(conns, <-seen)
	}
	if err := l.Close(); err != nil {
		t.Fatal(err)
	}
	for _, c := range conns {
		if !c.Dropped() {
			t.Fatal("a connection Close ended is not marked dropped")
		}
	}
	if n := l.Stats().Open; n != 0 {
		t.Fatalf("%d connections left after Close", n)
	}
	if l.Context().Err() == nil {
		t.Fatal("Context did not end with Close")
	}
}

func TestLimitsOr(t *testing.T) {
	if got, want := (Limits{PerSource: 3}).Or(Limits{Total: 10, PerSource: 5}), (Limits{Total: 10, PerSource: 3}); got != want {
		t.Fatalf("Or gave %+v, want %+v: a cap set stays, a missing one takes the default", got, want)
	}
}
