package mooncake_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"strings"
	"testing"
	"time"

	"github.com/ferry-project/ferry/internal/connlimit"
	"github.com/ferry-project/ferry/mooncake"
	"github.com/ferry-project/ferry/mooncake/mooncaketest"
	"github.com/ferry-project/ferry/transport/transporttest"
)

// TestDataPortKeepsPooledConnections: only the port's cap closes a data
// connection idle between requests (a Mooncake connection pool reuses
// them; TestDataPortKeepsAPoolsLanes shows no timer does), at a
// newcomer's arrival, taking a connection that carried no write first,
// then one of the address holding the most.
func TestDataPortKeepsPooledConnections(t *testing.T) {
	p := startPeer(t, mooncaketest.Config{BufferSize: 1 << 20})
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	var debug transporttest.Logs
	srv := mooncake.ServeData(ln, p, mooncake.DataConfig{
		Limits: connlimit.Limits{Total: 4, PerSource: 4}, Debugf: debug.Logf, Logf: t.Logf,
	})
	defer srv.Close()
	data := srv.Addr().String()
	pooled := func(src string) *mooncaketest.Pooled {
		t.Helper()
		c, err := mooncaketest.DialPooled(ctxT(t), data, src)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { c.Close() })
		return c
	}
	write := func(c *mooncaketest.Pooled, what string) error {
		return c.Write(p.Base()+64, []byte(what), 10*time.Second)
	}
	// A write proves its connection before its status comes back, so
	// each step below finds the port's table as the writes left it.
	a, b, b2 := pooled("127.0.0.1"), pooled("127.0.0.5"), pooled("127.0.0.5")
	for _, c := range []*mooncaketest.Pooled{a, b, b2, a} {
		if err := write(c, "first"); err != nil {
			t.Fatal(err)
		}
	}
	if got := p.Bytes(p.Base()+64, 5); !bytes.Equal(got, []byte("first")) {
		t.Fatalf("the segment holds %q", got)
	}

	// A stranger that begins a header and stops takes the last place,
	// and loses it to the next newcomer before any connection that
	// carried a write does.
	d := net.Dialer{LocalAddr: &net.TCPAddr{IP: net.ParseIP("127.0.0.2")}}
	stranger, err := d.Dial("tcp", data)
	if err != nil {
		t.Fatal(err)
	}
	defer stranger.Close()
	stranger.Write([]byte{1})
	n := pooled("127.0.0.3")
	if err := write(n, "newcomer"); err != nil {
		t.Fatalf("a newcomer into a full port: %v", err)
	}
	stranger.SetReadDeadline(time.Now().Add(5 * time.Second))
	if _, err := stranger.Read(make([]byte, 1)); err == nil || isTimeout(err) {
		t.Fatalf("the stranger's connection: %v, want it closed to make room", err)
	}
	// All left carried writes: one of the address holding two goes.
	m := pooled("127.0.0.4")
	if err := write(m, "another"); err != nil {
		t.Fatalf("another newcomer: %v", err)
	}
	closed := 0
	for _, c := range []*mooncaketest.Pooled{b, b2} {
		if err := write(c, "evicted?"); err != nil {
			if !strings.Contains(err.Error(), "failed to read WRITE ack frame") {
				t.Fatalf("a connection of the address holding the most: %v", err)
			}
			closed++
		}
	}
	if closed != 1 {
		t.Fatalf("%d of the two connections from the address holding the most were closed, want 1", closed)
	}
	for _, c := range []*mooncaketest.Pooled{a, n, m} {
		if err := write(c, "still pooled"); err != nil {
			t.Fatalf("a connection the cap did not take: %v", err)
		}
	}
	if st := srv.Stats(); st.Evicted != 2 || st.Open != 4 || st.Timeout != 0 {
		t.Fatalf("port stats %+v: want 2 evicted, 4 open, none timed out", st)
	}
	found := 0
	for _, line := range debug.Lines() {
		if strings.Contains(line, "mooncake data port: closed an idle connection from 127.0.0.") {
			found++
		}
	}
	if found != 2 {
		t.Fatalf("debug lines %q: want one per connection closed to make room", debug.Lines())
	}
}

// waitPastTimers returns once every deadline the data port at data set
// on a connection made before the call has passed, without a sleep: a
// connection from src begins a header and stops, and the port closes it
// when its read times out (the port's IOTimeout, the longest timer it
// has). src is an address of its own, so it takes no place of the
// test's connections' addresses.
func waitPastTimers(t *testing.T, data, src string) {
	t.Helper()
	d := net.Dialer{LocalAddr: &net.TCPAddr{IP: net.ParseIP(src)}}
	c, err := d.Dial("tcp", data)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if _, err := c.Write([]byte{1}); err != nil {
		t.Fatal(err)
	}
	c.SetReadDeadline(time.Now().Add(20 * time.Second))
	if _, err := c.Read(make([]byte, 1)); err == nil || isTimeout(err) {
		t.Fatalf("a header begun and not finished: %v, want the port to close it at its I/O timeout", err)
	}
}

// TestDataPortKeepsAPoolsLanes: a Mooncake connection pool opens its
// lanes one at a time, so a lane may connect after the writes that
// wanted it went out on another and wait, idle, with no request ever
// sent; it keeps every lane for reuse, one that carried a refused write
// included. No timer of the port closes such a lane: the pool's next
// writes, after a gap past every timer the port has, go out on it.
func TestDataPortKeepsAPoolsLanes(t *testing.T) {
	p := startPeer(t, mooncaketest.Config{BufferSize: 1 << 20})
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	var logs transporttest.Logs
	// Short timers, so the gap below outlasts them soon.
	srv := mooncake.ServeData(ln, p, mooncake.DataConfig{IOTimeout: 200 * time.Millisecond, Logf: logs.Logf})
	defer srv.Close()
	data := srv.Addr().String()
	gates := map[int]chan struct{}{1: make(chan struct{}), 2: make(chan struct{})}
	pool := mooncaketest.NewPool(data, 2, func(ctx context.Context, n int) (net.Conn, error) {
		select {
		case <-gates[n]:
		case <-ctx.Done():
			return nil, ctx.Err()
		}
		var d net.Dialer
		return d.DialContext(ctx, "tcp", data)
	})
	defer pool.Close()
	waitFor := func(what string, ok func(mooncaketest.PoolStats) bool) {
		t.Helper()
		for deadline := time.Now().Add(20 * time.Second); !ok(pool.Stats()); time.Sleep(5 * time.Millisecond) {
			if time.Now().After(deadline) {
				t.Fatalf("pool %+v: no %s", pool.Stats(), what)
			}
		}
	}
	write := func(off uint64, what string) error {
		return pool.Write(ctxT(t), p.Base()+off, []byte(what), 10*time.Second)
	}

	// A batch of two writes: the first lane carries both, the second
	// is dialed meanwhile and connects once the queue is empty.
	errs := make(chan error, 2)
	for i := range 2 {
		go func() { errs <- write(uint64(64*i), fmt.Sprintf("batch-%d", i)) }()
	}
	waitFor("two writes waiting", func(s mooncaketest.PoolStats) bool { return s.Waiting == 2 })
	close(gates[1])
	for range 2 {
		if err := <-errs; err != nil {
			t.Fatal(err)
		}
	}
	close(gates[2])
	waitFor("second lane idle", func(s mooncaketest.PoolStats) bool { return s.Idle == 2 })
	if s := pool.Stats(); s.Dials != 2 {
		t.Fatalf("pool %+v: want two lanes dialed", s)
	}

	// The gap: longer than every timer of the port.
	waitPastTimers(t, data, "127.0.0.7")
	// The lane that never carried a request goes first (it went idle
	// last), then it again.
	if err := write(256, "after the gap"); err != nil {
		t.Fatalf("a write on the lane that connected after its queue emptied, after an idle gap: %v", err)
	}
	if got := p.Bytes(p.Base()+256, 13); string(got) != "after the gap" {
		t.Fatalf("the segment holds %q", got)
	}
	// A refused write keeps its lane: the next write goes out on it.
	if err := write(1<<20, "outside"); !mooncake.IsRejected(err) {
		t.Fatalf("a write outside the buffer: %v, want it rejected", err)
	}
	if err := write(512, "same lane"); err != nil {
		t.Fatalf("a write on the lane that carried a refused write: %v", err)
	}
	if got := p.Bytes(p.Base()+512, 9); string(got) != "same lane" {
		t.Fatalf("the segment holds %q", got)
	}
	if s := pool.Stats(); s.Dials != 2 || s.Open != 2 {
		t.Fatalf("pool %+v: want its two lanes kept, no more dialed", s)
	}
	if st := srv.Stats(); st.Timeout != 0 || st.Evicted != 0 {
		t.Fatalf("port stats %+v: want none timed out or evicted", st)
	}
	logs.Wait(t, "rejected a WRITE of 7 bytes")
}

// TestPortsRefuseAddressesNotAllowed: with an allow-list, a connection
// from any other address is closed at accept on both ports, counted and
// logged naming the setting; an allowed writer lands.
func TestPortsRefuseAddressesNotAllowed(t *testing.T) {
	p := startPeer(t, mooncaketest.Config{BufferSize: 1 << 20})
	allow := mooncake.Allow{Prefixes: []netip.Prefix{netip.MustParsePrefix("127.0.0.1/32")}, Setting: "mooncake_allow"}
	listen := func() net.Listener {
		ln, err := net.Listen("tcp", "0.0.0.0:0")
		if err != nil {
			t.Fatal(err)
		}
		return ln
	}
	var logs transporttest.Logs
	data := mooncake.ServeData(listen(), p, mooncake.DataConfig{Allow: allow, Logf: logs.Logf})
	defer data.Close()
	rpc := mooncake.Serve(listen(), mooncake.Handlers{Segment: p.Segment}, mooncake.ServerConfig{Allow: allow, Logf: logs.Logf})
	defer rpc.Close()
	port := func(a net.Addr) string { return fmt.Sprintf("127.0.0.1:%d", a.(*net.TCPAddr).Port) }
	writeFrom := func(src, what string) error {
		c, err := mooncaketest.DialPooled(ctxT(t), port(data.Addr()), src)
		if err != nil {
			return err // the reset may come before the dial returns
		}
		defer c.Close()
		return c.Write(p.Base(), []byte(what), 10*time.Second)
	}
	if err := writeFrom("127.0.0.2", "stranger"); err == nil || mooncake.IsRejected(err) {
		t.Fatalf("a write from an address not allowed: %v, want the connection closed", err)
	}
	if err := writeFrom("127.0.0.1", "allowed"); err != nil {
		t.Fatalf("a write from an allowed address: %v", err)
	}
	if got := p.Bytes(p.Base(), 7); string(got) != "allowed" {
		t.Fatalf("the segment holds %q", got)
	}
	d := net.Dialer{LocalAddr: &net.TCPAddr{IP: net.ParseIP("127.0.0.3")}}
	if c, err := d.Dial("tcp", port(rpc.Addr())); err == nil {
		defer c.Close()
		c.SetDeadline(time.Now().Add(20 * time.Second))
		c.Write(mooncake.AppendFrame(nil, mooncake.Metadata, []byte("{}\n")))
		if _, _, err := mooncake.ReadFrame(c); err == nil || isTimeout(err) {
			t.Fatalf("a metadata request from an address not allowed: %v, want the connection closed", err)
		}
	}
	if _, err := mooncake.FetchSegment(ctxT(t), port(rpc.Addr()), &mooncake.Segment{Name: "x", Buffers: []mooncake.Buffer{}}); err != nil {
		t.Fatalf("a metadata request from an allowed address: %v", err)
	}
	if d, r := data.Stats(), rpc.Stats(); d.RefusedNotAllowed != 1 || r.RefusedNotAllowed != 1 || d.Open+r.Open > 2 {
		t.Fatalf("data port %+v, RPC port %+v: want one refused on each, holding no place", d, r)
	}
	logs.Wait(t, "mooncake data port: refused a connection from 127.0.0.2:")
	logs.Wait(t, "mooncake RPC port: refused a connection from 127.0.0.3:")
	for _, line := range logs.Lines() {
		if strings.Contains(line, "refused a connection") && !strings.Contains(line, "its address is not on mooncake_allow") {
			t.Fatalf("a refusal that does not name the setting: %q", line)
		}
	}
}

// TestRPCPortBoundsLargeMessages: connections sending the largest
// messages at once, to two ports sharing one budget (ferryd's segment
// and an engine's), hold no more than that budget between them; each
// waits its turn and is answered, and the budget is given back.
func TestRPCPortBoundsLargeMessages(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	const budget, senders = 2 * mooncake.MaxMessage, 16
	h := mooncake.Handlers{Segment: func() *mooncake.Segment { return &mooncake.Segment{Name: "s", Buffers: []mooncake.Buffer{}} }}
	srv := mooncake.Serve(ln, h, mooncake.ServerConfig{LargeMessages: budget, ReceiveTimeout: time.Minute, Logf: t.Logf})
	defer srv.Close()
	// A second port (an engine's segment) draws from the first's budget.
	ln2, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv2 := mooncake.Serve(ln2, h, mooncake.ServerConfig{ShareWith: srv, ReceiveTimeout: time.Minute, Logf: t.Logf})
	defer srv2.Close()
	addrs := []string{ln.Addr().String(), ln2.Addr().String()}
	// The largest descriptor a metadata request may carry: a JSON string.
	body := append(append([]byte{'"'}, bytes.Repeat([]byte{'x'}, mooncake.MaxMessage-4)...), '"', '\n')
	frame := mooncake.AppendFrame(nil, mooncake.Metadata, body)
	errs := make(chan error, senders)
	for i := range senders {
		go func() {
			c, err := net.Dial("tcp", addrs[i%2])
			if err != nil {
				errs <- err
				return
			}
			defer c.Close()
			c.SetDeadline(time.Now().Add(time.Minute))
			if _, err := c.Write(frame); err != nil {
				errs <- err
				return
			}
			_, _, err = mooncake.ReadFrame(c)
			errs <- err
		}()
	}
	for range senders {
		if err := <-errs; err != nil {
			t.Fatalf("a sender of a %d-byte descriptor: %v", len(body), err)
		}
	}
	if st := srv.LargeMessages(); st.Peak > budget || st.Peak < mooncake.MaxMessage-1 || st.Held != 0 {
		t.Fatalf("budget %+v: want at most %d held at once, and all given back", st, budget)
	}
	if st, st2 := srv.LargeMessages(), srv2.LargeMessages(); st2 != st {
		t.Fatalf("the second port's budget %+v is not the first's %+v", st2, st)
	}
}

// TestNotifyWarningsAreLimited: a notify the handler refuses is a WARN
// line, at most a burst a second with the rest counted, its notify_msg
// cut to 256 bytes however long it came.
func TestNotifyWarningsAreLimited(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	var warn transporttest.Logs
	srv := mooncake.Serve(ln, mooncake.Handlers{
		Segment: func() *mooncake.Segment { return &mooncake.Segment{} },
		Notify: func(net.Addr, mooncake.NotifyDesc) error {
			return fmt.Errorf("completed no receive slot")
		},
	}, mooncake.ServerConfig{Logf: warn.Logf})
	long := strings.Repeat("9", 8<<10)
	start := time.Now()
	const flood = 50
	for range flood {
		if err := mooncake.SendNotify(ctxT(t), ln.Addr().String(), mooncake.NotifyDesc{Name: "x", NotifyMsg: long}); err != nil {
			t.Fatal(err)
		}
	}
	elapsed := time.Since(start)
	srv.Close()
	logged, suppressed := 0, 0
	for _, line := range warn.Lines() {
		var n int
		if _, err := fmt.Sscanf(line, "mooncake: suppressed %d more lines", &n); err == nil {
			suppressed += n
			continue
		}
		logged++
		if len(line) > 512 || !strings.Contains(line, "completed no receive slot") || !strings.Contains(line, fmt.Sprintf("(%d bytes)", len(long))) {
			t.Fatalf("a %d-byte line %.300q: want the notify named, its message cut to 256 bytes with its length", len(line), line)
		}
	}
	if windows := int(elapsed/time.Second) + 1; logged > 10*windows || logged+suppressed != flood {
		t.Fatalf("%d refused notifies in %s: %d logged, %d suppressed", flood, elapsed, logged, suppressed)
	}
}

func isTimeout(err error) bool {
	var ne net.Error
	return errors.As(err, &ne) && ne.Timeout()
}

// TestAnsweredConnectionsMakeRoom: connections whose request was
// answered and whose clients never close hold no place against a
// newcomer (strangers probing from every place could otherwise lock the
// port out for the whole receive timeout), and the server closes them
// itself a moment after the reply, not at the receive timeout.
func TestAnsweredConnectionsMakeRoom(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv := mooncake.Serve(ln, mooncake.Handlers{Segment: func() *mooncake.Segment { return &mooncake.Segment{} }},
		mooncake.ServerConfig{Limits: connlimit.Limits{Total: 4}, ReceiveTimeout: time.Minute, Logf: t.Logf})
	defer srv.Close()
	addr := ln.Addr().String()
	deadline := time.Now().Add(20 * time.Second)
	for i := range 4 {
		c, err := net.Dial("tcp", addr)
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		c.SetDeadline(deadline)
		if _, err := c.Write(mooncake.AppendFrame(nil, mooncake.Probe, []byte("{}\n"))); err != nil {
			t.Fatal(err)
		}
		if typ, _, err := mooncake.ReadFrame(c); err != nil || typ != mooncake.Probe {
			t.Fatalf("holder %d's probe: %v %v", i, typ, err)
		}
		// The server's end of the stream: the reply is all out.
		if n, err := c.Read(make([]byte, 1)); n != 0 || err != io.EOF {
			t.Fatalf("holder %d after the reply: %d bytes, %v; want the server's end", i, n, err)
		}
	}
	if err := mooncake.ProbeSegment(ctxT(t), addr); err != nil {
		t.Fatalf("a probe while answered connections fill the port: %v", err)
	}
	for srv.Stats().Open != 0 {
		if time.Now().After(deadline) {
			t.Fatalf("port stats %+v: the answered connections are still held", srv.Stats())
		}
		time.Sleep(10 * time.Millisecond)
	}
}
