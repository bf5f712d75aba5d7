package daemon

import (
	"errors"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/rs/zerolog"

	"github.com/ferry-project/ferry/transport"
)

// registering is a transport that registers memory, standing in beneath
// the transport.Registrar seam for the RDMA transport, whose real
// registrations are tested in its own package. It records what is
// registered and fails the ranges it is told to.
type registering struct {
	transport.Transport
	fail func(addr uint64, n int64) bool
	live map[uint64]int64
}

func (r *registering) Name() string { return "fake-rdma" }

func (r *registering) Register(addr uint64, n int64) (transport.Registration, error) {
	if r.fail(addr, n) {
		return nil, errors.New("cannot allocate memory")
	}
	r.live[addr] = n
	return dereg(func() error { delete(r.live, addr); return nil }), nil
}

type dereg func() error

func (d dereg) Deregister() error { return d() }

func testMetrics() *metrics {
	return newMetrics(gauges{
		arena:    func() (int64, int64, int64) { return 0, 0, 0 },
		counts:   func() (int, int) { return 0, 0 },
		sessions: func() (int, int) { return 0, 0 },
	})
}

func TestMemRegsNoneOnTCPLikeTransports(t *testing.T) {
	m := testMetrics()
	g := newMemRegs(&registerless{}, 0x1000, 1<<20, m, zerolog.Nop())
	if g.mode() != regNone || !strings.Contains(g.reason, "nothing to register") {
		t.Fatalf("mode %q reason %q", g.mode(), g.reason)
	}
	release, shared, err := g.forSend(0x1000, 4096)
	if err != nil || !shared || release() != nil {
		t.Fatalf("forSend: shared %v err %v", shared, err)
	}
	if n := testutil.CollectAndCount(m.registrations); n != 0 {
		t.Fatalf("%d registration series on a transport that registers nothing", n)
	}
}

type registerless struct{ transport.Transport }

func (registerless) Name() string { return "tcp" }

func TestMemRegsSharedOnce(t *testing.T) {
	m := testMetrics()
	r := &registering{fail: func(uint64, int64) bool { return false }, live: map[uint64]int64{}}
	g := newMemRegs(r, 0x1000, 1<<20, m, zerolog.Nop())
	if g.mode() != regShared || r.live[0x1000] != 1<<20 {
		t.Fatalf("mode %q, registered %v", g.mode(), r.live)
	}
	for range 3 {
		release, shared, err := g.forSend(0x2000, 4096)
		if err != nil || !shared || release() != nil {
			t.Fatalf("forSend under the shared registration: shared %v err %v", shared, err)
		}
	}
	if got := testutil.ToFloat64(m.registrations.WithLabelValues("shared")); got != 1 {
		t.Fatalf("ferry_registrations_total{mode=shared} = %v, want 1", got)
	}
	if got := testutil.ToFloat64(m.registrations.WithLabelValues("per_send")); got != 0 {
		t.Fatalf("ferry_registrations_total{mode=per_send} = %v, want 0", got)
	}
	if err := g.close(); err != nil || len(r.live) != 0 {
		t.Fatalf("close: %v, still registered %v", err, r.live)
	}
	if err := g.close(); err != nil {
		t.Fatalf("a second close: %v", err)
	}
}

func TestMemRegsPerSendWhenSharedFails(t *testing.T) {
	m := testMetrics()
	r := &registering{fail: func(_ uint64, n int64) bool { return n > 64<<10 }, live: map[uint64]int64{}}
	g := newMemRegs(r, 0x1000, 1<<20, m, zerolog.Nop())
	if g.mode() != regPerSend || !strings.Contains(g.reason, "LimitMEMLOCK") {
		t.Fatalf("mode %q reason %q", g.mode(), g.reason)
	}
	release, shared, err := g.forSend(0x2000, 4096)
	if err != nil || shared || r.live[0x2000] != 4096 {
		t.Fatalf("forSend: shared %v err %v live %v", shared, err, r.live)
	}
	if err := release(); err != nil || len(r.live) != 0 {
		t.Fatalf("release: %v, still registered %v", err, r.live)
	}
	if _, _, err := g.forSend(0x2000, 1<<20); err == nil {
		t.Fatal("a per-send registration that fails must fail the send")
	}
	if got := testutil.ToFloat64(m.registrations.WithLabelValues("per_send")); got != 1 {
		t.Fatalf("ferry_registrations_total{mode=per_send} = %v, want 1", got)
	}
	if n := testutil.CollectAndCount(m.registerSeconds); n != 1 {
		t.Fatalf("ferry_registration_duration_seconds has %d series, want 1 (per_send)", n)
	}
}
