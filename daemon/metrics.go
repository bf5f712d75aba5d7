package daemon

import (
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
)

// metrics is the daemon's own registry (never the global one), served on
// GET /metrics. Labels stay low-cardinality: transport, outcome, peer
// session (bounded by the peers that were reached), never req_id.
type metrics struct {
	reg *prometheus.Registry

	transfers       *prometheus.CounterVec
	transferBytes   *prometheus.CounterVec
	transferSeconds *prometheus.HistogramVec
	slowTransfers   *prometheus.CounterVec
	sessionFailures *prometheus.CounterVec
	staged          *prometheus.CounterVec
	swept           *prometheus.CounterVec
}

func newMetrics(arenaStats func() (size, used float64), counts func() (entries, slots int)) *metrics {
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
			Help:    "Time from the first write attempt to its completion, successful sends only.",
			Buckets: prometheus.ExponentialBuckets(50e-6, 2, 18), // 50µs .. ~6.5s
		}, []string{"transport"}),
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
	}
	reg.MustRegister(m.transfers, m.transferBytes, m.transferSeconds, m.slowTransfers,
		m.sessionFailures, m.staged, m.swept,
		collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}),
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name: "ferry_arena_size_bytes", Help: "Size of the arena.",
		}, func() float64 { s, _ := arenaStats(); return s }),
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name: "ferry_arena_used_bytes", Help: "Arena bytes allocated to staged entries and receive slots.",
		}, func() float64 { _, u := arenaStats(); return u }),
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name: "ferry_staged_entries", Help: "Entries staged or reserved on the sending side.",
		}, func() float64 { e, _ := counts(); return float64(e) }),
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name: "ferry_receive_slots", Help: "Live receive slots.",
		}, func() float64 { _, s := counts(); return float64(s) }),
	)
	return m
}
