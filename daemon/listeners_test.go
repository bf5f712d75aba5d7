package daemon

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/rs/zerolog"
	"golang.org/x/sys/unix"

	"github.com/ferry-project/ferry/internal/connlimit"
	"github.com/ferry-project/ferry/internal/loglimit"
)

// logBuffer is a daemon's log, safe to read while it writes.
type logBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *logBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *logBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

// waitClosed reads each connection until ferryd closes it, within 30 s.
func waitClosed(t *testing.T, conns []net.Conn) {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for _, c := range conns {
		c.SetReadDeadline(deadline)
		if _, err := io.Copy(io.Discard, c); err != nil && !errors.Is(err, net.ErrClosed) && !errors.Is(err, unix.ECONNRESET) {
			t.Fatalf("waiting for ferryd to close a connection: %v", err)
		}
		c.Close()
	}
}

// Control connections that stall in their headers are closed at the
// header deadline without a log line each: the read that timed out once
// panicked in bufio, and net/http logged a stack trace per connection.
func TestHeaderTimeoutFloodLogsLittle(t *testing.T) {
	var logs logBuffer
	d, c := serveTestDaemon(t, t.TempDir(), "flood", func(cfg *Config) { cfg.Log = zerolog.New(&logs) })
	const n = 100
	var conns []net.Conn
	for range n {
		conn, err := net.Dial("unix", d.cfg.Socket)
		if err != nil {
			t.Fatal(err)
		}
		conns = append(conns, conn)
		io.WriteString(conn, "GET /v1/status HTTP/1.1\r\nHost: ferr")
	}
	waitClosed(t, conns)
	if _, err := c.Status(context.Background()); err != nil {
		t.Fatal(err)
	}
	out := logs.String()
	if lines := strings.Count(out, "\n"); lines > loglimit.Burst+2 || strings.Contains(out, "goroutine ") {
		t.Fatalf("%d connections reaching the header deadline logged %d lines (stack traces: %v); want at most %d:\n%s",
			n, lines, strings.Contains(out, "goroutine "), loglimit.Burst+2, loglimit.Clip(out))
	}
}

// A recovered panic's stack is logged once and every panic counted; the
// other lines of net/http are rate-limited.
func TestHTTPLogPanicsOnceAndCounted(t *testing.T) {
	var logs logBuffer
	h := newHTTPLog(zerolog.New(&logs))
	for i := range 1000 {
		fmt.Fprintf(h, "http: panic serving @: negative count\ngoroutine %d [running]:\nbufio.(*Reader).Read(...)\n", i)
		fmt.Fprintf(h, "http: Accept error: too many open files; retrying in 5ms\n")
	}
	h.lim.Stop()
	out := logs.String()
	if got := h.panics.Load(); got != 1000 {
		t.Errorf("counted %d panics, want 1000", got)
	}
	if stacks := strings.Count(out, "goroutine "); stacks != 1 {
		t.Errorf("logged %d stacks, want 1", stacks)
	}
	if lines := strings.Count(out, "\n"); lines > loglimit.Burst+2 {
		t.Errorf("2000 lines from net/http logged %d, want at most %d:\n%s", lines, loglimit.Burst+2, out)
	}
}

// capped sets a listener's caps for one test.
func capped(t *testing.T, lim *connlimit.Limits, to connlimit.Limits) {
	old := *lim
	*lim = to
	t.Cleanup(func() { *lim = old })
}

// The control socket holds at most controlLimits.Total connections: an
// idle one makes room for a newcomer, every refusal and eviction is
// counted.
func TestControlSocketIsCapped(t *testing.T) {
	capped(t, &controlLimits, connlimit.Limits{Total: 8, PerSource: 8})
	d, c := serveTestDaemon(t, t.TempDir(), "cap", nil)
	var idle []net.Conn
	for range 20 {
		conn, err := net.Dial("unix", d.cfg.Socket)
		if err != nil {
			t.Fatal(err)
		}
		defer conn.Close()
		idle = append(idle, conn)
	}
	for i := range 5 {
		if _, err := c.Status(context.Background()); err != nil {
			t.Fatalf("call %d beside 20 idle connections: %v", i, err)
		}
	}
	st := d.controlGate.Stats()
	if st.Open > 8 || st.Evicted < 12 {
		t.Fatalf("control socket: %+v; want at most 8 open and the idle ones evicted", st)
	}
}

// A caller the allow-lists refuse holds no descriptor it passes: each is
// closed as it arrives.
func TestRefusedCallerHoldsNoDescriptors(t *testing.T) {
	client, rc := rightsPair(t, true)
	r, w, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	passed := []int{int(r.Fd()), int(w.Fd())}
	if _, _, err := client.WriteMsgUnix([]byte("POST"), unix.UnixRights(passed...), nil); err != nil {
		t.Fatal(err)
	}
	w.Close()
	buf := make([]byte, 16)
	if n, err := rc.Read(buf); err != nil || string(buf[:n]) != "POST" {
		t.Fatalf("read %q, %v", buf[:n], err)
	}
	if fd := rc.take(); fd >= 0 {
		t.Fatalf("a refused caller's descriptor %d was kept", fd)
	}
	// The pipe's write end was passed and closed here; its only other
	// copy is closed too, so the read end sees the end at once.
	r.SetReadDeadline(time.Now().Add(5 * time.Second))
	if _, err := r.Read(buf); !errors.Is(err, io.EOF) {
		t.Fatalf("the pipe's write end is still open somewhere: %v", err)
	}
}

// The metrics listener: capped, a small header limit, and its deadlines.
func TestMetricsListenerIsBounded(t *testing.T) {
	capped(t, &metricsLimits, connlimit.Limits{Total: 4, PerSource: 4})
	d, _ := serveTestDaemon(t, t.TempDir(), "m", func(cfg *Config) { cfg.MetricsListen = "127.0.0.1:0" })
	addr := d.MetricsAddr().String()
	var idle []net.Conn
	for range 10 {
		conn, err := net.Dial("tcp", addr)
		if err != nil {
			t.Fatal(err)
		}
		defer conn.Close()
		idle = append(idle, conn)
	}
	hc := &http.Client{Transport: &http.Transport{DisableKeepAlives: true}, Timeout: 10 * time.Second}
	resp, err := hc.Get("http://" + addr + "/metrics")
	if err != nil || resp.StatusCode != 200 {
		t.Fatalf("a scrape beside 10 idle connections: %v", err)
	}
	resp.Body.Close()
	req, _ := http.NewRequest("GET", "http://"+addr+"/metrics", nil)
	req.Header.Set("X-Big", strings.Repeat("a", 64<<10))
	if resp, err := hc.Do(req); err == nil {
		resp.Body.Close()
		if resp.StatusCode != http.StatusRequestHeaderFieldsTooLarge {
			t.Fatalf("64 KiB of headers: %d, want 431", resp.StatusCode)
		}
	}
	if st := d.metricsGate.Stats(); st.Open > 4 || st.Evicted < 6 {
		t.Fatalf("metrics listener: %+v; want at most 4 open and the idle ones evicted", st)
	}
}

// Engine segments' ports log through one limit, all together: a
// stranger refused at accept by every engine segment's two ports (each
// limiting its own lines) has ferryd log at most loglimit.Burst WARN
// lines a window for them all, not Burst per port.
func TestEngineSegmentPortsShareOneLogLimit(t *testing.T) {
	var logs logBuffer
	d, _ := serveTestDaemon(t, t.TempDir(), "engines", func(cfg *Config) {
		cfg.Log = zerolog.New(&logs)
		cfg.MooncakeListen = "127.0.0.1:0"
		cfg.MooncakeAllow = []string{"192.0.2.1"} // not loopback: the test's connections are strangers
	})
	const segments, each = 4, loglimit.Burst + 1
	var ports []*engineSegment
	for range segments {
		es, err := d.openEngineSegment(int32(os.Getpid()), 0)
		if err != nil {
			t.Fatal(err)
		}
		ports = append(ports, es)
	}
	refused := func() (n uint64) {
		for _, es := range ports {
			n += es.hs.Stats().RefusedNotAllowed + es.data.Stats().RefusedNotAllowed
		}
		return n
	}
	start := time.Now()
	var conns []net.Conn
	for _, es := range ports {
		for _, addr := range []string{es.seg.Name, fmt.Sprintf("127.0.0.1:%d", es.seg.TCPDataPort)} {
			for range each {
				c, err := net.Dial("tcp", addr)
				switch {
				case errors.Is(err, unix.ECONNRESET): // closed at accept before the dial returned
				case err != nil:
					t.Fatal(err)
				default:
					conns = append(conns, c)
				}
			}
		}
	}
	waitClosed(t, conns)
	want := uint64(segments * 2 * each)
	for deadline := time.Now().Add(30 * time.Second); refused() < want; time.Sleep(time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("%d of %d connections counted refused within 30s", refused(), want)
		}
	}
	// Each window the flood spans passes Burst lines (the summaries say "suppressed").
	windows := int(time.Since(start)/loglimit.Window) + 1
	most := windows * loglimit.Burst
	if lines := strings.Count(logs.String(), "is not on mooncake_allow"); lines > most || lines == 0 {
		t.Fatalf("%d refused connections on %d engine segments' ports logged %d lines over %d window(s); want 1 to %d",
			want, segments, lines, windows, most)
	}
}

// Engine segments' ports share one cap on connections besides their
// own: a connection to one segment's data port takes the place of
// another segment's idle one once they hold the cap together.
func TestEngineSegmentPortsShareOneCap(t *testing.T) {
	capped(t, &enginePortLimits, connlimit.Limits{Total: 2})
	d, _ := serveTestDaemon(t, t.TempDir(), "enginecap", func(cfg *Config) { cfg.MooncakeListen = "127.0.0.1:0" })
	var segs []*engineSegment
	for range 2 {
		es, err := d.openEngineSegment(int32(os.Getpid()), 0)
		if err != nil {
			t.Fatal(err)
		}
		segs = append(segs, es)
	}
	dial := func(es *engineSegment) net.Conn {
		c, err := net.Dial("tcp", fmt.Sprintf("127.0.0.1:%d", es.seg.TCPDataPort))
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { c.Close() })
		return c
	}
	shared := d.mooncake.enginePorts
	waitOpen := func(n int) {
		t.Helper()
		for deadline := time.Now().Add(30 * time.Second); shared.Stats().Open != n; time.Sleep(time.Millisecond) {
			if time.Now().After(deadline) {
				t.Fatalf("engine ports hold %d connections, want %d", shared.Stats().Open, n)
			}
		}
	}
	first := dial(segs[0])
	waitOpen(1)
	dial(segs[0])
	waitOpen(2)
	dial(segs[1])
	waitClosed(t, []net.Conn{first})
	if st := shared.Stats(); st.Open != 2 || st.Evicted != 1 {
		t.Fatalf("engine ports' shared stats %+v: want 2 open, 1 evicted", st)
	}
}

// Failed requests log at warn level at most loglimit.Burst a window: a
// peer gone down fails every request a client makes toward it, as fast
// as the client makes them. The rest go at debug level, and a summary
// line says how many.
func TestFailedRequestsLogThroughALimit(t *testing.T) {
	var logs logBuffer
	_, c := serveTestDaemon(t, t.TempDir(), "fails", func(cfg *Config) { cfg.Log = zerolog.New(&logs).Level(zerolog.InfoLevel) })
	ctx := context.Background()
	const n = 10 * loglimit.Burst
	start := time.Now()
	for i := range n {
		if err := c.Delete(ctx, fmt.Sprintf("nothing-%d", i)); err == nil {
			t.Fatal("deleting an entry never staged succeeded")
		}
	}
	windows := int(time.Since(start)/loglimit.Window) + 1
	lines := strings.Count(logs.String(), `"path":"/v1/embeddings/nothing-`)
	if lines == 0 || lines > windows*loglimit.Burst {
		t.Fatalf("%d failed requests over %d window(s) logged %d warn lines; want 1 to %d", n, windows, lines, windows*loglimit.Burst)
	}
	// Those suppressed are summed up once their window ends.
	for deadline := time.Now().Add(30 * time.Second); lines < n && !strings.Contains(logs.String(), "failed requests: suppressed"); time.Sleep(time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("%d lines suppressed and no summary of them within 30s", n-lines)
		}
	}
}
