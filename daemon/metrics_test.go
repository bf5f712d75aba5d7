package daemon

import (
	"bytes"
	"context"
	"encoding/binary"
	"fmt"
	"io"
	"net"
	"net/http"
	"path/filepath"
	"strings"
	"testing"
	"time"

	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"
	"github.com/rs/zerolog"

	"github.com/ferry-project/ferry/api"
	"github.com/ferry-project/ferry/client"
	"github.com/ferry-project/ferry/config"
	"github.com/ferry-project/ferry/transport"
	peerport "github.com/ferry-project/ferry/transport/peer"
	"github.com/ferry-project/ferry/transport/transporttest"
)

// serveTestDaemon runs a real ferryd in this process: its control socket
// in dir, its peer port on loopback. It stops when the test ends.
func serveTestDaemon(t testing.TB, dir, name string, mod func(*Config)) (*Daemon, *client.Client) {
	t.Helper()
	d := newTestDaemon(t, dir, name, mod)
	return d, serveDaemon(t, d)
}

// newTestDaemon makes serveTestDaemon's ferryd, for a test to change
// before serveDaemon runs it.
func newTestDaemon(t testing.TB, dir, name string, mod func(*Config)) *Daemon {
	t.Helper()
	cfg := testConfig(dir, name)
	cfg.ArenaSize = "8MiB"
	if mod != nil {
		mod(&cfg)
	}
	d, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	return d
}

// serveDaemon serves d until the test ends.
func serveDaemon(t testing.TB, d *Daemon) *client.Client {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- d.Serve(ctx, 5*time.Second) }()
	t.Cleanup(func() {
		cancel()
		select {
		case err := <-done:
			if err != nil {
				t.Errorf("%s: Serve: %v", d.cfg.Socket, err)
			}
		case <-time.After(30 * time.Second):
			t.Errorf("%s did not stop within 30s", d.cfg.Socket)
		}
	})
	return &client.Client{Socket: d.cfg.Socket}
}

// scrape fetches and parses a /metrics page with the Prometheus text parser.
func scrape(t *testing.T, hc *http.Client, url string) map[string]*dto.MetricFamily {
	t.Helper()
	resp, err := hc.Get(url)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("GET %s: %s", url, resp.Status)
	}
	parser := expfmt.NewTextParser(model.UTF8Validation)
	fams, err := parser.TextToMetricFamilies(resp.Body)
	if err != nil {
		t.Fatalf("parsing %s: %v", url, err)
	}
	return fams
}

func scrapeSocket(t *testing.T, c *client.Client) map[string]*dto.MetricFamily {
	hc := &http.Client{Transport: &http.Transport{DialContext: client.UnixDialer(c.Socket)}}
	return scrape(t, hc, "http://ferryd/metrics")
}

// value is a sample's value (a histogram's count) whose labels include
// want; 0 when there is none, as for a counter not yet touched.
func value(fams map[string]*dto.MetricFamily, name string, want ...string) float64 {
	f := fams[name]
	if f == nil {
		return 0
	}
next:
	for _, m := range f.GetMetric() {
		have := map[string]string{}
		for _, l := range m.GetLabel() {
			have[l.GetName()] = l.GetValue()
		}
		for i := 0; i+1 < len(want); i += 2 {
			if have[want[i]] != want[i+1] {
				continue next
			}
		}
		switch {
		case m.Counter != nil:
			return m.Counter.GetValue()
		case m.Gauge != nil:
			return m.Gauge.GetValue()
		case m.Histogram != nil:
			return float64(m.Histogram.GetSampleCount())
		}
	}
	return 0
}

type expect struct {
	name   string
	labels []string
	want   float64
}

func check(t *testing.T, who string, fams map[string]*dto.MetricFamily, exps ...expect) {
	t.Helper()
	for _, e := range exps {
		if got := value(fams, e.name, e.labels...); got != e.want {
			t.Errorf("%s: %s%v = %v, want %v", who, e.name, e.labels, got, e.want)
		}
	}
}

func TestMetricsMoveWithTransfers(t *testing.T) {
	dir := t.TempDir()
	_, sc := serveTestDaemon(t, dir, "snd", nil)
	_, rc := serveTestDaemon(t, dir, "rcv", nil)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	stage := func(id string) {
		t.Helper()
		if _, err := sc.Stage(ctx, id, []int64{2048}, "u8", bytes.NewReader(make([]byte, 2048)), 2048); err != nil {
			t.Fatal(err)
		}
	}

	before := scrapeSocket(t, sc)
	check(t, "snd before", before,
		expect{"ferry_transfers_total", []string{"outcome", "ok"}, 0},
		expect{"ferry_arena_bytes", []string{"state", "total"}, 8 << 20},
		expect{"ferry_arena_bytes", []string{"state", "free"}, 8 << 20},
		expect{"ferry_arena_bytes", []string{"state", "used"}, 0},
		expect{"ferry_sessions", []string{"state", "connected"}, 0})
	for _, name := range []string{"go_goroutines", "process_resident_memory_bytes"} {
		if before[name] == nil {
			t.Errorf("%s is missing: the Go and process collectors must be registered", name)
		}
	}

	// A send that lands.
	stage("ok-1")
	slot, err := rc.Receive(ctx, "ok-1", 2048)
	if err != nil {
		t.Fatal(err)
	}
	req := api.SendRequest{Session: slot.Session, BufferAddress: slot.BufferAddress, Key: slot.Key}
	if _, err := sc.Send(ctx, "ok-1", req); err != nil {
		t.Fatal(err)
	}
	check(t, "snd after success", scrapeSocket(t, sc),
		expect{"ferry_transfers_total", []string{"transport", "tcp", "outcome", "ok"}, 1},
		expect{"ferry_transfer_bytes_total", []string{"transport", "tcp"}, 2048},
		expect{"ferry_transfer_duration_seconds", []string{"transport", "tcp", "outcome", "ok"}, 1},
		expect{"ferry_staged_total", []string{"method", "upload"}, 1},
		expect{"ferry_staged_embeddings", nil, 0},
		expect{"ferry_sessions", []string{"state", "connected"}, 1},
		expect{"ferry_transfer_retries_total", nil, 0})
	check(t, "rcv after success", scrapeSocket(t, rc),
		expect{"ferry_receive_slots", nil, 1},
		expect{"ferry_arena_bytes", []string{"state", "used"}, 2048},
		expect{"ferry_arena_bytes", []string{"state", "free"}, 8<<20 - 2048})

	// Refused by the receiver: a wrong key for a live slot.
	stage("bad-1")
	if _, err := rc.Receive(ctx, "bad-1", 2048); err != nil {
		t.Fatal(err)
	}
	bad := req
	bad.Key[15] ^= 1
	if _, err := sc.Send(ctx, "bad-1", bad); client.Code(err) != api.CodeRefused {
		t.Fatalf("send with a wrong key: want refused, got %v", err)
	}

	// A broken path: nothing listens at the session, so the dial fails,
	// the daemon retries once, and the send fails.
	gone := closedPort(t)
	failed := req
	failed.Session = gone
	if _, err := sc.Send(ctx, "bad-1", failed); client.Code(err) != api.CodeTransferFailed {
		t.Fatalf("send to a closed port: want transfer_failed, got %v", err)
	}

	// Nothing staged under the req_id.
	if _, err := sc.Send(ctx, "never-staged", req); client.Code(err) != api.CodeNoEmbedding {
		t.Fatalf("send of an unstaged req_id: want no_embedding, got %v", err)
	}

	fams := scrapeSocket(t, sc)
	check(t, "snd after failures", fams,
		expect{"ferry_transfers_total", []string{"outcome", "ok"}, 1},
		expect{"ferry_transfers_total", []string{"outcome", "refused"}, 1},
		expect{"ferry_transfers_total", []string{"outcome", "failed"}, 1},
		expect{"ferry_transfers_total", []string{"outcome", "no_embedding"}, 1},
		expect{"ferry_transfer_failures_total", []string{"reason", "no_slot"}, 1},
		expect{"ferry_transfer_failures_total", []string{"reason", "ECONNREFUSED"}, 1},
		expect{"ferry_transfer_failures_total", []string{"reason", "no_embedding"}, 1},
		expect{"ferry_transfer_retries_total", nil, 1},
		expect{"ferry_session_failures_total", []string{"session", gone}, 2},
		expect{"ferry_transfer_duration_seconds", []string{"outcome", "refused"}, 1},
		expect{"ferry_transfer_duration_seconds", []string{"outcome", "failed"}, 1},
		expect{"ferry_transfer_duration_seconds", []string{"outcome", "ok"}, 1},
		expect{"ferry_transfer_bytes_total", nil, 2048},
		expect{"ferry_staged_embeddings", nil, 1}, // bad-1 is kept for a retry
		expect{"ferry_registrations_total", nil, 0})
	for name, f := range fams {
		for _, m := range f.GetMetric() {
			for _, l := range m.GetLabel() {
				if l.GetName() == "req_id" || l.GetValue() == "ok-1" || l.GetValue() == "bad-1" {
					t.Errorf("%s carries a req_id label (%s=%q): labels must stay low-cardinality", name, l.GetName(), l.GetValue())
				}
			}
		}
	}
	if st, err := sc.Status(ctx); err != nil || st.Registration.Mode != api.RegistrationNone {
		t.Errorf("status registration on tcp: want mode none, got %+v (%v)", st.Registration, err)
	}
}

// closedPort returns a loopback address nothing listens on.
func closedPort(t *testing.T) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	ln.Close()
	return addr
}

func TestMetricsListen(t *testing.T) {
	d, c := serveTestDaemon(t, t.TempDir(), "m", func(cfg *Config) { cfg.MetricsListen = "127.0.0.1:0" })
	addr := d.MetricsAddr()
	if addr == nil {
		t.Fatal("MetricsAddr is nil with MetricsListen set")
	}
	hc := &http.Client{Timeout: 30 * time.Second}
	fams := scrape(t, hc, fmt.Sprintf("http://%s/metrics", addr))
	if value(fams, "ferry_arena_bytes", "state", "total") != 8<<20 {
		t.Errorf("ferry_arena_bytes{state=total} over --metrics-listen: got %v", value(fams, "ferry_arena_bytes", "state", "total"))
	}
	// The TCP listener serves metrics only; the control API stays on the
	// socket.
	resp, err := hc.Get(fmt.Sprintf("http://%s/v1/status", addr))
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusNotFound {
		t.Errorf("GET /v1/status on the metrics listener: %s, want 404", resp.Status)
	}
	if _, err := c.Status(t.Context()); err != nil {
		t.Fatal(err)
	}
}

// testConfig is the defaults with the control socket in dir, the peer port
// on loopback and the arena in host memory.
func testConfig(dir, name string) Config {
	s := config.Defaults()
	s.Socket, s.Listen, s.Device = filepath.Join(dir, name+".sock"), "127.0.0.1:0", config.DeviceCPU
	return Config{Settings: s, Log: zerolog.Nop()}
}

// TestUnknownRefusalCodesFoldIntoOther: a receiver answering each write
// with a refusal code of its own invention (any of 2^32) makes no new
// series: ferry_transfer_failures_total keeps the series it started with,
// the refusals counted under other.
func TestUnknownRefusalCodesFoldIntoOther(t *testing.T) {
	const sends = 200
	_, sc := serveTestDaemon(t, t.TempDir(), "snd", nil)
	rcv := transporttest.FakePeer(t, func(c net.Conn) {
		c.SetDeadline(time.Now().Add(30 * time.Second))
		var hb [24]byte // the hello (transport/peer/wire.go), answered in kind
		if _, err := io.ReadFull(c, hb[:]); err != nil {
			return
		}
		binary.LittleEndian.PutUint64(hb[8:], 0xfe11) // the receiver's instance
		if _, err := c.Write(binary.LittleEndian.AppendUint32(hb[:], 0)); err != nil {
			return
		}
		for code := transport.Code(1000); ; code++ {
			var b [peerport.HeaderSize]byte
			if _, err := io.ReadFull(c, b[:]); err != nil {
				return
			}
			var h peerport.Header
			h.Decode(&b)
			if _, err := io.CopyN(io.Discard, c, int64(h.Len)); err != nil {
				return
			}
			var rb [peerport.ReplySize + peerport.MaxMessage]byte
			if _, err := c.Write(peerport.EncodeReply(&rb, code, 0, "a code of my own")); err != nil {
				return
			}
		}
	})
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	if _, err := sc.Stage(ctx, "e", []int64{2048}, "u8", bytes.NewReader(make([]byte, 2048)), 2048); err != nil {
		t.Fatal(err)
	}
	req := api.SendRequest{Session: rcv, BufferAddress: 4096, Key: transport.NewKey()}
	for i := range sends {
		if _, err := sc.Send(ctx, "e", req); client.Code(err) != api.CodeRefused || !strings.Contains(err.Error(), fmt.Sprintf("code_%d", 1000+i)) {
			t.Fatalf("send %d to a receiver refusing with code %d: %v, want refused naming code_%d", i, 1000+i, err, 1000+i)
		}
	}
	fams := scrapeSocket(t, sc)
	if n := len(fams["ferry_transfer_failures_total"].GetMetric()); n != len(failureReasons) {
		t.Errorf("ferry_transfer_failures_total has %d series after %d distinct refusal codes, want the %d it started with", n, sends, len(failureReasons))
	}
	check(t, "snd", fams, expect{"ferry_transfer_failures_total", []string{"reason", "other"}, sends})
}

// TestLabelSetBounds: a label fed from outside this code takes the values
// known at start and the first maxOwnLabels others; the rest are other.
func TestLabelSetBounds(t *testing.T) {
	s := newLabelSet("timeout")
	if got := s.of("timeout"); got != "timeout" {
		t.Fatalf("a value known at start labelled %q", got)
	}
	for i := range maxOwnLabels {
		if v := fmt.Sprint("errno ", i); s.of(v) != v {
			t.Fatalf("value %d of %d labelled other", i, maxOwnLabels)
		}
	}
	if got := s.of("errno 999"); got != "other" {
		t.Fatalf("value %d labelled %q, want other", maxOwnLabels+1, got)
	}
	if got := s.of("errno 3"); got != "errno 3" {
		t.Fatalf("a value labelled before became %q", got)
	}
}
