package daemon

import (
	"net/http"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"
)

// metrics is the daemon's own registry (never the global one), served on
// GET /metrics and on --metrics-listen. Labels stay low-cardinality:
// transport, outcome, reason, mode, state, and the peer session (bounded
// by the peers that were reached); never req_id.
type metrics struct {
	reg *prometheus.Registry

	transfers        *prometheus.CounterVec
	transferBytes    *prometheus.CounterVec
	transferSeconds  *prometheus.HistogramVec
	transferFailures *prometheus.CounterVec
	retries          prometheus.Counter
	slowTransfers    *prometheus.CounterVec
	sessionFailures  *prometheus.CounterVec
	staged           *prometheus.CounterVec
	swept            *prometheus.CounterVec
	peerRefusals     *prometheus.CounterVec
}

// gauges are the daemon's live state, read at scrape time.
type gauges struct {
	arena    func() (total, used, free int64)
	counts   func() (entries, slots int)
	sessions func() (connected, down int)
}

func newMetrics(g gauges) *metrics {
	reg := prometheus.NewRegistry()
	m := &metrics{
		reg: reg,
		transfers: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "ferry_transfers_total",
			Help: "Sends by transport and outcome (ok, refused, failed, no_embedding).",
		}, []string{"transport", "outcome"}),
		transferBytes: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "ferry_transfer_bytes_total",
			Help: "Bytes delivered by successful sends.",
		}, []string{"transport"}),
		transferSeconds: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "ferry_transfer_duration_seconds",
			Help:    "Time from a send's first write attempt to its completion or final failure, retries included, by outcome (ok, refused, failed).",
			Buckets: prometheus.ExponentialBuckets(25e-6, 2, 20), // 25µs .. ~13s
		}, []string{"transport", "outcome"}),
		transferFailures: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "ferry_transfer_failures_total",
			Help: "Sends that did not deliver, by reason: no_embedding, the receiver's refusal (no_slot, bad_key, out_of_bounds, slot_busy, shutting_down, internal), or the broken path's code (ECONNREFUSED, ECONNRESET, EPIPE, timeout, eof, closed, error).",
		}, []string{"reason"}),
		retries: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "ferry_transfer_retries_total",
			Help: "Write attempts made again on a re-dialed session after a broken one.",
		}),
		slowTransfers: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "ferry_slow_transfers_total",
			Help: "Sends slower than --slow-threshold.",
		}, []string{"transport"}),
		sessionFailures: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "ferry_session_failures_total",
			Help: "Failed write attempts per peer session (each leads to a teardown).",
		}, []string{"session"}),
		staged: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "ferry_staged_total",
			Help: "Embeddings staged, by method (upload, zero_copy).",
		}, []string{"method"}),
		swept: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "ferry_swept_total",
			Help: "Entries dropped by the TTL sweep, by kind (staged, receive).",
		}, []string{"kind"}),
		peerRefusals: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "ferry_peer_refusals_total",
			Help: "Writes from peers this receiver refused, by reason: no_slot (no live slot with that address and key: a stale slot, or a guess), out_of_bounds, slot_busy.",
		}, []string{"reason"}),
	}
	reg.MustRegister(m.transfers, m.transferBytes, m.transferSeconds, m.transferFailures, m.retries,
		m.slowTransfers, m.sessionFailures, m.staged, m.swept, m.peerRefusals,
		collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}),
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name: "ferry_staged_embeddings", Help: "Entries staged or reserved on the sending side.",
		}, func() float64 { e, _ := g.counts(); return float64(e) }),
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name: "ferry_receive_slots", Help: "Live receive slots.",
		}, func() float64 { _, s := g.counts(); return float64(s) }),
	)
	for state, read := range map[string]func() int64{
		"total": func() int64 { t, _, _ := g.arena(); return t },
		"used":  func() int64 { _, u, _ := g.arena(); return u },
		"free":  func() int64 { _, _, f := g.arena(); return f },
	} {
		reg.MustRegister(prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name: "ferry_arena_bytes", Help: "Arena bytes by state: total, used (staged entries, receive slots, freed slots in quarantine), free.",
			ConstLabels: prometheus.Labels{"state": state},
		}, func() float64 { return float64(read()) }))
	}
	for state, read := range map[string]func() int{
		"connected": func() int { c, _ := g.sessions(); return c },
		"down":      func() int { _, d := g.sessions(); return d },
	} {
		reg.MustRegister(prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name: "ferry_sessions", Help: "Peer sessions by state: connected, or down (torn down; re-dialed on the next send).",
			ConstLabels: prometheus.Labels{"state": state},
		}, func() float64 { return float64(read()) }))
	}
	return m
}

// handler serves the registry in the Prometheus text format.
func (m *metrics) handler() http.Handler {
	return promhttp.HandlerFor(m.reg, promhttp.HandlerOpts{})
}
