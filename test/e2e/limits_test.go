package e2e

import (
	"encoding/binary"
	"fmt"
	"io"
	"net"
	"os"
	"strconv"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/ferry-project/ferry/api"
	"github.com/ferry-project/ferry/mooncake/mooncaketest"
	"github.com/ferry-project/ferry/transport/transporttest"
)

// The ports anyone may reach (the peer port, the Mooncake RPC and data
// ports) hold a bounded number of connections whatever strangers do, a
// legitimate peer still gets through, and what strangers make them log
// is rate-limited. Strangers connect from other loopback addresses than
// the daemons (127.0.0.0/8 is all this host's), as from other hosts.

// The peer port's caps (transport/peer.DefaultLimits).
const (
	peerPortTotal     = 1024
	peerPortPerSource = 64
)

// raiseFileLimit lets this process hold n more descriptors than it has.
func raiseFileLimit(t *testing.T, n uint64) {
	t.Helper()
	var lim unix.Rlimit
	if err := unix.Getrlimit(unix.RLIMIT_NOFILE, &lim); err != nil {
		t.Fatal(err)
	}
	if lim.Cur >= n {
		return
	}
	if lim.Max < n {
		t.Skipf("RLIMIT_NOFILE's hard limit is %d; this test needs %d descriptors", lim.Max, n)
	}
	old := lim.Cur
	lim.Cur = n
	if err := unix.Setrlimit(unix.RLIMIT_NOFILE, &lim); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		lim.Cur = old
		unix.Setrlimit(unix.RLIMIT_NOFILE, &lim)
	})
}

// openFDs counts a process's open file descriptors.
func openFDs(t *testing.T, pid int) int {
	t.Helper()
	ents, err := os.ReadDir(fmt.Sprintf("/proc/%d/fd", pid))
	if err != nil {
		t.Fatal(err)
	}
	return len(ents)
}

// peerHello is a ferry hello of protocol version 8 for a data
// connection (transport/peer/wire.go), written from the notes.
func peerHello() []byte {
	b := []byte("FERY")
	b = binary.LittleEndian.AppendUint32(b, 8)
	b = binary.LittleEndian.AppendUint64(b, 0x5eed)
	b = binary.LittleEndian.AppendUint32(b, 0) // kind: data
	return binary.LittleEndian.AppendUint32(b, 0)
}

// metric reads one series of the daemon's /metrics, e.g.
// `ferry_port_connections{port="peer"}`; -1 when it is not there.
func (d *daemon) metric(t *testing.T, series string) float64 {
	t.Helper()
	if v, ok := d.metrics(t)[series]; ok {
		return v
	}
	return -1
}

// TestPeerPortLimitsIdleConnections: 2,000 connections that say hello
// and nothing more, from 40 addresses, leave ferryd holding at most the
// peer port's cap of them (its open files say so), and a peer's send
// still goes through within a second.
func TestPeerPortLimitsIdleConnections(t *testing.T) {
	raiseFileLimit(t, 8192)
	snd, rcv := pair(t)
	pid := rcv.cmd.Process.Pid
	base := openFDs(t, pid)
	hello := peerHello()
	const strangers, perAddr = 2000, 50 // under the per-address cap
	for i := range strangers {
		c := transporttest.DialFrom(t, fmt.Sprintf("127.0.0.%d", 2+i/perAddr), rcv.listen)
		c.SetDeadline(time.Now().Add(10 * time.Second))
		c.Write(hello)
		// The welcome, or the end of a connection ferryd closed to make
		// room: either way ferryd has taken this one in.
		io.ReadFull(c, make([]byte, 28))
	}
	fds := openFDs(t, pid)
	t.Logf("ferryd's open files: %d before, %d with %d idle strangers connected", base, fds, strangers)
	if fds > base+peerPortTotal+16 {
		t.Fatalf("ferryd holds %d open files with %d idle connections to its peer port, %d before: more than the port's cap of %d",
			fds, strangers, base, peerPortTotal)
	}

	ctx := ctxT(t)
	req := slotFor(t, rcv, "limits-legit", embBytes)
	stageOn(t, snd, "limits-legit", embBytes, 51)
	start := time.Now()
	if _, err := snd.c.Send(ctx, "limits-legit", req); err != nil {
		t.Fatalf("a peer's send to a port full of strangers: %v", err)
	}
	if took := time.Since(start); took > time.Second {
		t.Fatalf("a peer's send to a port full of strangers took %s, want under a second", took)
	}
	if ev := rcv.metric(t, `ferry_port_closed_connections_total{port="peer",reason="evicted"}`); ev < strangers-peerPortTotal {
		t.Fatalf("ferry_port_closed_connections_total{evicted} = %v, want at least %d", ev, strangers-peerPortTotal)
	}
	if open := rcv.metric(t, `ferry_port_connections{port="peer"}`); open > peerPortTotal {
		t.Fatalf("ferry_port_connections{port=\"peer\"} = %v, over the cap", open)
	}
	rcv.alive(t)
}

// TestPeerPortLimitsPerAddress: one address gets at most its share of
// the peer port: past it, each of its newcomers takes the place of its
// own oldest connection that carried nothing (closed and counted, a
// debug line), never another address's.
func TestPeerPortLimitsPerAddress(t *testing.T) {
	rcv := startDaemon(t, t.TempDir(), "rcv")
	for range peerPortPerSource + 5 {
		c := transporttest.DialFrom(t, "127.0.0.2", rcv.listen)
		c.SetDeadline(time.Now().Add(10 * time.Second))
		c.Write(peerHello())
		io.ReadFull(c, make([]byte, 28))
	}
	rcv.log.wait(t, 5*time.Second, "the eviction's debug line", logSays("debug", "peer port: closed an idle connection from 127.0.0.2", "to make room for one from 127.0.0.2"))
	if n := rcv.metric(t, `ferry_port_closed_connections_total{port="peer",reason="evicted"}`); n != 5 {
		t.Fatalf("ferry_port_closed_connections_total{evicted} = %v, want 5", n)
	}
	if n := rcv.metric(t, `ferry_port_connections{port="peer"}`); n != peerPortPerSource {
		t.Fatalf("ferry_port_connections{port=\"peer\"} = %v, want %d", n, peerPortPerSource)
	}
}

// TestPeerPortStrangerOnPeerAddress: a stranger on the peer's own
// address (127.0.0.1: the same host; behind one NAT alike) fills that
// address's quota with connections that only said hello, again before
// each send; the peer's sends all land, with or without a peer secret
// (with one, the stranger claims it and stalls where its proof is due).
func TestPeerPortStrangerOnPeerAddress(t *testing.T) {
	for _, c := range []struct {
		name   string
		secret bool
	}{{"NoSecret", false}, {"Secret", true}} {
		t.Run(c.name, func(t *testing.T) {
			const sends = 5
			dir := t.TempDir()
			var extra []string
			hello := peerHello()
			if c.secret {
				extra = []string{"--peer-secret-file", secretFile(t, dir, "peer.secret", "cluster-secret-0123456789abcdef")}
				binary.LittleEndian.PutUint32(hello[20:], 1) // flagAuth
			}
			snd, rcv := startDaemon(t, dir, "snd", extra...), startDaemon(t, dir, "rcv", extra...)
			flood := func() {
				for range peerPortPerSource {
					s := transporttest.DialFrom(t, "127.0.0.1", rcv.listen)
					s.Write(hello)
					if _, err := io.ReadFull(s, make([]byte, 28)); err != nil {
						t.Fatalf("a stranger's hello from the peer's address: %v", err)
					}
				}
			}
			ok := 0
			for i := range sends {
				flood()
				id := fmt.Sprintf("shared-addr-%d", i)
				data := stageOn(t, snd, id, 64<<10, uint64(80+i))
				if _, err := snd.c.Send(ctxT(t), id, slotFor(t, rcv, id, int64(len(data)))); err != nil {
					t.Errorf("send %d of %d with its address's quota full of strangers: %v", i+1, sends, err)
					continue
				}
				received(t, rcv, id, data)
				ok++
			}
			t.Logf("peer_ok=%d/%d", ok, sends)
			if n := rcv.metric(t, `ferry_port_refused_connections_total{port="peer",reason="per_source"}`); n != 0 {
				t.Fatalf("ferry_port_refused_connections_total{per_source} = %v, want 0: the strangers' places were the peer's to take", n)
			}
		})
	}
}

// countLines counts the daemon's log lines match accepts so far.
func (l *logLines) count(match func(map[string]any) bool) int {
	n := 0
	for _, m := range l.snapshot() {
		if m != nil && match(m) {
			n++
		}
	}
	return n
}

// suppressed sums the "N more lines" of the summary lines of limiter
// name ("peer port", "mooncake") logged so far.
func (l *logLines) suppressed(name string) int {
	total := 0
	for _, m := range l.snapshot() {
		s, _ := m["message"].(string)
		var n int
		if _, err := fmt.Sscanf(s, name+": suppressed %d more lines", &n); err == nil {
			total += n
		}
	}
	return total
}

// waitAccounted waits (10 s at most) until logged and suppressed lines
// add up to want, and returns the logged ones.
func (l *logLines) waitAccounted(t *testing.T, name string, want int, match func(map[string]any) bool) (logged, suppressed int) {
	t.Helper()
	deadline := time.After(10 * time.Second)
	for {
		l.mu.Lock()
		ch := l.changed
		l.mu.Unlock()
		logged, suppressed = l.count(match), l.suppressed(name)
		if logged+suppressed >= want {
			return logged, suppressed
		}
		select {
		case <-ch:
		case <-deadline:
			t.Fatalf("%d lines logged and %d suppressed, want %d in all", logged, suppressed, want)
		}
	}
}

// TestPeerPortLimitsHandshakeWarnings: 500 connections that fail the
// handshake (a scanner, a broken peer) are WARN lines at most 10 a
// second; the summary lines account for the rest.
func TestPeerPortLimitsHandshakeWarnings(t *testing.T) {
	rcv := startDaemon(t, t.TempDir(), "rcv")
	const probes = 500
	start := time.Now()
	for range probes {
		c := transporttest.DialFrom(t, "127.0.0.2", rcv.listen)
		c.SetDeadline(time.Now().Add(10 * time.Second))
		c.Write([]byte("GET / HTTP/1.1\r\nHost: x\r\n\r\n"))
		io.Copy(io.Discard, c) // ferryd refuses and closes
		c.Close()
	}
	elapsed := time.Since(start)
	failed := logSays("warn", "tcp: handshake from 127.0.0.2")
	logged, suppressed := rcv.log.waitAccounted(t, "peer port", probes, failed)
	if windows := int(elapsed/time.Second) + 2; logged > 10*windows || suppressed == 0 {
		t.Fatalf("%d failed handshakes in %s: %d WARN lines, %d suppressed; want at most %d lines (10 a second) and a summary of the rest",
			probes, elapsed, logged, suppressed, 10*windows)
	}
	if n := rcv.metric(t, `ferry_port_failures_total{port="peer"}`); n < probes {
		t.Fatalf("ferry_port_failures_total{port=\"peer\"} = %v after %d failed handshakes", n, probes)
	}
	rcv.alive(t)
}

// TestMooncakeLimitsIdleConnectionsDoNotStallAWrite: strangers holding
// idle connections to both Mooncake ports (more than a data port's
// former 32 workers and an RPC port's 64) do not hold up a Mooncake
// initiator: its descriptor fetch and WRITE go through at once.
func TestMooncakeLimitsIdleConnectionsDoNotStallAWrite(t *testing.T) {
	rcv, seg := startMooncakeSegment(t)
	ctx := ctxT(t)
	st, err := rcv.c.Status(ctx)
	if err != nil {
		t.Fatal(err)
	}
	host, _, _ := net.SplitHostPort(seg)
	data := net.JoinHostPort(host, strconv.Itoa(st.Mooncake.DataPort))
	for i := range 40 {
		transporttest.DialFrom(t, "127.0.0.2", data)
		transporttest.DialFrom(t, fmt.Sprintf("127.0.0.%d", 3+i%2), seg)
		transporttest.DialFrom(t, fmt.Sprintf("127.0.0.%d", 5+i%2), seg)
	}
	slot, err := rcv.c.ReceiveWith(ctx, api.ReceiveRequest{ReqID: "mc-idle", NBytes: embBytes, Mooncake: true})
	if err != nil {
		t.Fatal(err)
	}
	bytes := randomBytes(embBytes, 52)
	start := time.Now()
	if _, err := mooncaketest.WriteTo(ctx, seg, slot.BufferAddress, bytes, false); err != nil {
		t.Fatalf("a Mooncake write past idle connections: %v", err)
	}
	if took := time.Since(start); took > 2*time.Second {
		t.Fatalf("a Mooncake write past idle connections took %s: they stalled it", took)
	}
	if _, err := rcv.c.Wait(ctx, "mc-idle", 10*time.Second); err != nil {
		t.Fatal(err)
	}
	rcv.alive(t)
}
