package daemon

import (
	"net/http"
	"sync"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/ferry-project/ferry/api"
)

// metrics is the daemon's own registry (never the global one), served on
// GET /metrics and on --metrics-listen. Every label takes a bounded set of
// values: transport, outcome, mode, state, fixed by this code; a
// refusal's reason, a code this release does not know (a remote party
// may send any) as "other"; a broken path's errno or completion status,
// and the peer session, the first maxOwnLabels to occur under their own
// label, the rest as "other"; never req_id.
// Every series with label values known at start exists from then on,
// zero-valued, so dashboards and alerts see a fresh daemon.
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
	// regionRegistrations counts regions registered with the NIC, by
	// outcome.
	regionRegistrations *prometheus.CounterVec
	regionDeregFailures prometheus.Counter
	batches             *prometheus.CounterVec
	batchItems          prometheus.Counter
	batchWrites         prometheus.Counter
	// notifiesReceived counts the Mooncake notifies engine segments
	// received, by outcome; notifiesSent those engines sent.
	notifiesReceived *prometheus.CounterVec
	notifiesSent     *prometheus.CounterVec

	// engineGPURegistrations counts GPU memory an engine registered
	// registered for peers' writes, by path and outcome.
	engineGPURegistrations *prometheus.CounterVec

	sessions *labelSet // ferry_session_failures_total's sessions
	reasons  *labelSet // ferry_transfer_failures_total's reasons
}

// maxOwnLabels bounds the label values a set of them takes beyond those
// known at start: sessions are whatever clients send to, and a broken
// path's errno or completion status whatever the kernel or the NIC says.
const maxOwnLabels = 64

// labelSet bounds a label whose values come from outside this code: the
// values known at start, and the first maxOwnLabels others to occur, keep
// their own; later ones count as "other".
type labelSet struct {
	mu    sync.Mutex
	known map[string]bool
	own   int // values given a label beyond those known at start
}

func newLabelSet(known ...string) *labelSet {
	s := &labelSet{known: map[string]bool{"other": true}}
	for _, v := range known {
		s.known[v] = true
	}
	return s
}

// of is v's label.
func (s *labelSet) of(v string) string {
	s.mu.Lock()
	defer s.mu.Unlock()
	if !s.known[v] {
		if s.own == maxOwnLabels {
			return "other"
		}
		s.known[v] = true
		s.own++
	}
	return v
}

// Label values known at start, whose series exist from then on.
var (
	outcomes    = []string{"ok", "refused", "failed", "no_embedding"}
	stageMethod = []string{"upload", "zero_copy"}
	sweptKinds  = []string{"staged", "receive"}
	// failureReasons are the reasons a send can fail with that name no
	// errno or verbs status (those appear when they first happen).
	failureReasons = []string{"no_embedding", "no_slot", "out_of_bounds", "slot_busy", "shutting_down", "internal",
		"timeout", "eof", "closed", "auth", "incompatible", "rejected", "error", "staging", "other"}
	peerRefusalReasons = []string{"no_slot", "out_of_bounds", "slot_busy"}
	batchOutcomes      = []string{"ok", "failed"}
	regionOutcomes     = []string{"registered", "failed"}
	// Mooncake notifies engine segments received, and engines sent.
	notifyReceivedOutcomes = []string{"kept", "refused"}
	notifySentOutcomes     = []string{"ok", "failed"}
)

// gauges are the daemon's live state, read at scrape time.
type gauges struct {
	arena    func() (total, used, free int64)
	counts   func() (entries, slots int)
	sessions func() (connected, down int)
	regions  func() (host, limit int64)
}

// newMetrics builds the registry of a daemon running transport.
func newMetrics(g gauges, transport string) *metrics {
	reg := prometheus.NewRegistry()
	m := &metrics{
		reg:      reg,
		sessions: newLabelSet(),
		reasons:  newLabelSet(failureReasons...),
		transfers: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "ferry_transfers_total",
			Help: "Sends by transport and outcome (ok, refused, failed, no_embedding).",
		}, []string{"transport", "outcome"}),
		transferBytes: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "ferry_transfer_bytes_total",
			Help: "Bytes delivered by successful sends and batch transfers.",
		}, []string{"transport"}),
		transferSeconds: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "ferry_transfer_duration_seconds",
			Help:    "Time from a send's first write attempt to its completion or final failure, retries included, by outcome (ok, refused, failed).",
			Buckets: prometheus.ExponentialBuckets(25e-6, 2, 20), // 25µs .. ~13s
		}, []string{"transport", "outcome"}),
		transferFailures: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "ferry_transfer_failures_total",
			Help: "Sends that did not deliver, by reason: no_embedding, staging, the receiver's refusal (no_slot, out_of_bounds, slot_busy, shutting_down, internal; a code this release does not know as other), or the broken path's code (ECONNREFUSED, ECONNRESET, EPIPE, RETRY_EXC_ERR, timeout, eof, closed, error; past 64 distinct errnos and statuses, other).",
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
			Help: "Failed write attempts per peer session (each leads to a teardown); the first 64 sessions to fail have their own label, later ones count as other.",
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
			Help: "Writes from peers this receiver refused, by reason: no_slot (no live slot with that address and key: a stale slot, or a guess), out_of_bounds, slot_busy, internal (no host memory to stage the write into a GPU arena, or its bytes could not be copied into GPU memory).",
		}, []string{"reason"}),
		regionRegistrations: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "ferry_region_registrations_total",
			Help: "Regions (POST /v1/regions: host and CUDA) registered with the RDMA NIC, by outcome: registered (written from and into without a copy), failed (copied through bounce and staging buffers, a CUDA region's through the pinned bounce area; logged, and GET /v1/regions says why).",
		}, []string{"outcome"}),
		engineGPURegistrations: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "ferry_engine_gpu_registrations_total",
			Help: "GPU memory an engine registered (lent with a mooncake_addr), registered with the RDMA NIC for peers' writes at the engine's addresses, by path (dmabuf, peermem) and outcome: taken, or failed (the next path tried; none left: refused, or staged over tcp segments). GET /v1/regions says why, per region.",
		}, []string{"path", "outcome"}),
		regionDeregFailures: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "ferry_region_deregistration_failures_total",
			Help: "Tries to drop a region's registration with the RDMA NIC (DELETE /v1/regions) that failed: the region stays listed (closing), its pages pinned and counted in ferry_region_host_bytes, until a DELETE tries again or ferryd restarts; logged at ERROR.",
		}),
		batches: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "ferry_batches_total",
			Help: "Batch transfers (POST /v1/transfers) ended, by outcome (ok, failed).",
		}, []string{"outcome"}),
		batchItems: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "ferry_batch_items_total",
			Help: "Items of the batch transfers started.",
		}),
		batchWrites: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "ferry_batch_writes_total",
			Help: "Writes completed for batch transfers, after adjacent items were merged.",
		}),
		notifiesReceived: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "ferry_mooncake_notifies_received_total",
			Help: "Mooncake notifies engine segments received, by outcome: kept (until the engine takes them), refused (the segment held the most unread notifies it keeps; logged, rate-limited).",
		}, []string{"outcome"}),
		notifiesSent: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "ferry_mooncake_notifies_sent_total",
			Help: "Mooncake notifies sent for engines (POST /v1/mooncake/notifies), by outcome: ok (the receiver kept it), failed (refused, or not delivered).",
		}, []string{"outcome"}),
	}
	reg.MustRegister(m.batches, m.batchItems, m.batchWrites, m.notifiesReceived, m.notifiesSent,
		m.transfers, m.transferBytes, m.transferSeconds, m.transferFailures, m.retries,
		m.slowTransfers, m.sessionFailures, m.staged, m.swept, m.peerRefusals, m.regionRegistrations, m.regionDeregFailures, m.engineGPURegistrations,
		collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}),
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name: "ferry_staged_embeddings", Help: "Entries staged or reserved on the sending side.",
		}, func() float64 { e, _ := g.counts(); return float64(e) }),
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name: "ferry_receive_slots", Help: "Live receive slots.",
		}, func() float64 { _, s := g.counts(); return float64(s) }),
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name: "ferry_region_host_bytes", Help: "Host memory the regions clients lent hold (memfds, closing ones until unmapped or while the NIC keeps their registration, and those being registered); CUDA regions hold none.",
		}, func() float64 { h, _ := g.regions(); return float64(h) }),
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name: "ferry_region_host_limit_bytes", Help: "The bound on ferry_region_host_bytes: max_region_bytes on this host (0: no bound).",
		}, func() float64 { _, l := g.regions(); return float64(l) }),
	)
	for _, o := range outcomes {
		m.transfers.WithLabelValues(transport, o)
		if o != "no_embedding" { // no write was timed
			m.transferSeconds.WithLabelValues(transport, o)
		}
	}
	m.transferBytes.WithLabelValues(transport)
	m.slowTransfers.WithLabelValues(transport)
	m.sessionFailures.WithLabelValues("other")
	for _, r := range failureReasons {
		m.transferFailures.WithLabelValues(r)
	}
	for _, v := range stageMethod {
		m.staged.WithLabelValues(v)
	}
	for _, v := range sweptKinds {
		m.swept.WithLabelValues(v)
	}
	for _, r := range peerRefusalReasons {
		m.peerRefusals.WithLabelValues(r)
	}
	for _, o := range batchOutcomes {
		m.batches.WithLabelValues(o)
	}
	for _, o := range regionOutcomes {
		m.regionRegistrations.WithLabelValues(o)
	}
	for _, p := range []api.GPURegistration{api.GPURegistrationDMABuf, api.GPURegistrationPeerMem} {
		for _, o := range []string{"taken", "failed"} {
			m.engineGPURegistrations.WithLabelValues(string(p), o)
		}
	}
	for _, o := range notifyReceivedOutcomes {
		m.notifiesReceived.WithLabelValues(o)
	}
	for _, o := range notifySentOutcomes {
		m.notifiesSent.WithLabelValues(o)
	}
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

// sessionFailed counts a failed write attempt to session, under its own
// label while fewer than maxOwnLabels sessions have one.
func (m *metrics) sessionFailed(session string) {
	m.sessionFailures.WithLabelValues(m.sessions.of(session)).Inc()
}

// transferFailed counts a send that did not deliver, for reason.
func (m *metrics) transferFailed(reason string) {
	m.transferFailures.WithLabelValues(m.reasons.of(reason)).Inc()
}

// handler serves the registry in the Prometheus text format.
func (m *metrics) handler() http.Handler {
	return promhttp.HandlerFor(m.reg, promhttp.HandlerOpts{})
}

// countRefused exports the requests refused for their caller (read: the
// refusals' log limiter's count, logged or not).
func (m *metrics) countRefused(read func() uint64) {
	m.reg.MustRegister(prometheus.NewCounterFunc(prometheus.CounterOpts{
		Name: "ferry_refused_requests_total",
		Help: "Control requests answered 403: the caller is on neither allow_uids nor allow_gids. Each a WARN line, at most 10 a second logged.",
	}, func() float64 { return float64(read()) }))
}
