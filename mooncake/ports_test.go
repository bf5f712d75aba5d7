package mooncake_test

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"net"
	"strings"
	"testing"
	"time"

	"github.com/ferry-project/ferry/internal/connlimit"
	"github.com/ferry-project/ferry/mooncake"
	"github.com/ferry-project/ferry/mooncake/mooncaketest"
	"github.com/ferry-project/ferry/transport/transporttest"
)

// TestDataPortKeepsPooledConnections: no timer closes a data connection
// idle between requests (a Mooncake connection pool reuses them); only
// the port's cap does, at a newcomer's arrival, taking a connection that
// carried no write first, then the least recently used.
func TestDataPortKeepsPooledConnections(t *testing.T) {
	p := startPeer(t, mooncaketest.Config{BufferSize: 1 << 20})
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	var debug transporttest.Logs
	srv := mooncake.ServeData(ln, p, mooncake.DataConfig{
		Limits: connlimit.Limits{Total: 3, PerSource: 3}, HandshakeTimeout: 100 * time.Millisecond, Debugf: debug.Logf, Logf: t.Logf,
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
	a, b := pooled("127.0.0.1"), pooled("127.0.0.5")
	for _, c := range []*mooncaketest.Pooled{a, b} {
		if err := write(c, "first"); err != nil {
			t.Fatal(err)
		}
	}
	// Ten times every timer the port has.
	time.Sleep(time.Second)
	if err := write(a, "after idling"); err != nil {
		t.Fatalf("a pooled connection after idling: %v", err)
	}
	if got := p.Bytes(p.Base()+64, 12); !bytes.Equal(got, []byte("after idling")) {
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
	// All left carried writes: the least recently used (b) goes.
	m := pooled("127.0.0.4")
	if err := write(m, "another"); err != nil {
		t.Fatalf("another newcomer: %v", err)
	}
	if err := write(b, "evicted"); err == nil || !strings.Contains(err.Error(), "failed to read WRITE ack frame") {
		t.Fatalf("the least recently used connection: %v, want it closed", err)
	}
	for _, c := range []*mooncaketest.Pooled{a, n, m} {
		if err := write(c, "still pooled"); err != nil {
			t.Fatalf("a connection the cap did not take: %v", err)
		}
	}
	if st := srv.Stats(); st.Evicted != 2 || st.Open != 3 {
		t.Fatalf("port stats %+v: want 2 evicted, 3 open", st)
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
