package daemon

import (
	"fmt"
	"net"
	"slices"
	"strings"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/rs/zerolog"

	"github.com/ferry-project/ferry/api"
	"github.com/ferry-project/ferry/config"
	"github.com/ferry-project/ferry/internal/loglimit"
	"github.com/ferry-project/ferry/mooncake"
	"github.com/ferry-project/ferry/rdma"
	"github.com/ferry-project/ferry/transport"
	peerport "github.com/ferry-project/ferry/transport/peer"
	"github.com/ferry-project/ferry/transport/tcp"
)

// dataPlane is the transport the daemon runs, why, and what status and
// metrics say about it.
type dataPlane struct {
	tr       transport.Transport
	rdma     *rdma.Transport    // nil on TCP
	mooncake *mooncakeEndpoints // on rdma's NIC; nil on TCP
	reason   string
	nics     *api.RDMAStatus // nil with --transport tcp
	reg      rdma.Registration
	// debug limits the DEBUG lines peers can cause (an idle lane or
	// connection closed, one closed to make room for a newcomer).
	debug *loglimit.Limiter
}

// mooncakeEndpoints are the RDMA endpoints to Mooncake NICs, made on the
// RDMA transport's.
type mooncakeEndpoints = mooncake.Endpoints[*rdma.MooncakeQP]

// openTransport starts the data plane on cfg.Listen: RDMA when asked for
// (--transport rdma, failing with what is missing) or when auto finds a
// usable port, else TCP; mem is the arena, registered once with the NIC.
func openTransport(cfg Config, sink transport.Sink, instance uint64, mem *memory, log zerolog.Logger) (*dataPlane, error) {
	dp := &dataPlane{reason: "--transport tcp", debug: loglimit.New("transport", func(format string, args ...any) {
		log.Debug().Str("component", "transport").Msg(fmt.Sprintf(format, args...))
	})}
	pc := peerport.Config{
		// An --advertise left to its default is one of this host's own
		// addresses, which the port takes as the address connections
		// arrive on.
		Addr: cfg.Listen, Advertise: cfg.Advertise, Sink: sink, Instance: instance,
		MaxConnsPerPeer: cfg.MaxConns, IOTimeout: cfg.IOTimeout.D(), MaxWrite: uint64(cfg.ArenaSize.Max()),
		SendBuffer: int(cfg.TCPSendBuffer.Bytes()),
		// The peer port rate-limits the WARNs a remote party can make it
		// log; dp.debug its DEBUG lines.
		Logf: func(format string, args ...any) {
			log.Warn().Str("component", "transport").Msg(fmt.Sprintf(format, args...))
		},
		Debugf: dp.debug.Printf,
	}
	if cfg.PeerSecretFile != "" {
		secret, err := config.ReadPeerSecret(cfg.PeerSecretFile)
		if err != nil {
			return nil, fmt.Errorf("--peer-secret-file: %w", err)
		}
		pc.Secret = secret
		log.Info().Str("peer_secret_file", cfg.PeerSecretFile).Msg("peer authentication on: peers must prove they hold the same secret")
	}
	if cfg.Transport != config.TransportTCP {
		err := dp.openRDMA(cfg, pc, mem, log)
		if err != nil && cfg.Transport == config.TransportRDMA {
			return nil, fmt.Errorf("--transport rdma: %w; run with --transport auto or tcp to go without RDMA", err)
		}
		if err != nil {
			dp.reason = fmt.Sprintf("--transport auto: %v; using tcp", err)
		}
	}
	if dp.tr == nil {
		tr, err := tcp.Listen(pc)
		if err != nil {
			return nil, fmt.Errorf("peer port %s: %w", cfg.Listen, err)
		}
		dp.tr = tr
	}
	log.Info().Str("transport", dp.tr.Name()).Str("why", dp.reason).Msg("transport chosen")
	dp.logRegistration(log)
	return dp, nil
}

// openRDMA discovers the NICs, chooses a port and GID, and starts the
// RDMA transport over them.
func (dp *dataPlane) openRDMA(cfg Config, pc peerport.Config, mem *memory, log zerolog.Logger) error {
	inv, err := rdma.Discover()
	dp.nics = &api.RDMAStatus{NICs: append([]api.NIC{}, inv.NICs...), Why: inv.Why}
	if err != nil {
		return fmt.Errorf("RDMA discovery failed: %w", err)
	}
	choices, skipped, err := rdma.ChooseRails(inv, cfg.RDMADevice, rdma.Want{GIDIndex: cfg.RDMAGIDIndex, Addr: advertisedIP(cfg)})
	if err != nil && (len(cfg.RDMADevice) > 0 || cfg.RDMAGIDIndex >= 0) {
		return fmt.Errorf("--rdma-device %q, --rdma-gid-index %d: %w", strings.Join(cfg.RDMADevice, ","), cfg.RDMAGIDIndex, err)
	}
	if err != nil {
		return err
	}
	infof := func(format string, args ...any) {
		log.Info().Str("component", "transport").Msg(fmt.Sprintf(format, args...))
	}
	rc := rdma.Config{Peer: pc, TCP: overTCP, Memory: mem.Host(), PerSend: cfg.RDMARegistration == api.RegistrationPerSend,
		StripeMin: int(cfg.RDMAStripeMin.Bytes())}
	if mem.gpu != nil {
		rc.Device = mem.nicView(cfg.GPURegistration)
	}
	rt, err := rdma.ListenRails(rc, choices)
	if err != nil {
		return err
	}
	choice := choices[0]
	for _, c := range choices {
		dp.nics.Rails = append(dp.nics.Rails, api.Rail{NICChoice: c})
	}
	dp.nics.Skipped, dp.nics.StripeMin = skipped, int64(cfg.RDMAStripeMin.Bytes())
	if len(choices) > 1 {
		log.Info().Strs("rails", rt.RailNames()).Int64("stripe_min_bytes", int64(cfg.RDMAStripeMin.Bytes())).Strs("skipped", skipped).
			Msg("RDMA rails: sends below rdma_stripe_min go through the first, larger ones are striped over all")
	}
	dp.tr, dp.rdma, dp.reg = rt, rt, rt.Registration()
	dp.mooncake = mooncake.NewEndpoints(rt, mooncake.EndpointConfig{MTU: cfg.MooncakeMTU, Infof: infof})
	dp.nics.Chosen = &choice
	dp.reason = fmt.Sprintf("--transport %s: %s port %d (%s), GID %d %s: %s", cfg.Transport, choice.Device, choice.Port,
		choice.LinkLayer, choice.GIDIndex, choice.GID, choice.Why)
	return nil
}

// direct reports whether peers write into the arena without asking
// under its rkey (rdma's arena-rkey mode, between authenticated peers),
// which nothing but time keeps from a freed slot's memory. Writes
// through windows need no quarantine: a slot's window is invalidated
// before its memory goes back.
func (dp *dataPlane) direct() bool {
	return dp.rdma != nil && dp.rdma.Mode() == rdma.ModeArenaRKey
}

// inPlace reports whether the NIC reaches the GPU arena itself (dmabuf
// or peer memory): sends from it name device addresses.
func (dp *dataPlane) inPlace() bool { return dp.rdma != nil && dp.reg.GPU.InPlace() }

// close closes the Mooncake endpoints, whose queue pairs are the
// transport's, then the transport.
func (dp *dataPlane) close() error {
	if dp.mooncake != nil {
		dp.mooncake.Close()
	}
	err := dp.tr.Close()
	dp.debug.Stop()
	return err
}

// overTCP serves the peers without RDMA on the RDMA transport's port.
func overTCP(p *peerport.Port) rdma.Fallback { return tcp.Over(p) }

// advertisedIP is the address peers reach this daemon on, which picks
// the RoCE GID: the --advertise or --listen host, or for a wildcard the
// host's first IPv4 address (what the receive slots will name).
func advertisedIP(cfg Config) net.IP {
	hostport := cfg.Advertise
	if hostport == "" {
		hostport = cfg.Listen
	}
	host, _, _ := net.SplitHostPort(hostport)
	ip := net.ParseIP(host)
	if ip == nil || ip.IsUnspecified() {
		return firstIPv4()
	}
	return ip
}

func (dp *dataPlane) logRegistration(log zerolog.Logger) {
	if dp.rdma == nil {
		return
	}
	r := dp.reg
	if g := r.GPU; g != nil {
		ev := log.Info()
		if g.Path == "" {
			ev = log.Warn().AnErr("error", r.Err)
		}
		for _, n := range g.NotTaken {
			why := n.Reason
			if n.Err != nil {
				why = n.Err.Error()
			}
			ev = ev.Str(string(n.Path), why)
		}
		ev.Str("path", string(g.Path)).Str("asked", string(g.Asked)).Int64("bytes", r.Bytes).Dur("took", r.Took).
			Msg("GPU arena registration with the NIC (the other paths: why not)")
		return
	}
	switch {
	case r.Mode == api.RegistrationShared:
		log.Info().Str("mode", string(r.Mode)).Int64("bytes", r.Bytes).Dur("took", r.Took).Msg("arena registered with the NIC once")
	case r.Err != nil:
		log.Warn().Str("mode", string(r.Mode)).Int64("bytes", r.Bytes).Err(r.Err).Msg("arena registration failed; running in per-send mode")
	default:
		log.Info().Str("mode", string(r.Mode)).Msg("shared registration skipped (--rdma-registration per-send): each send registers its range")
	}
}

// rdmaStatus is status's account of the NICs, with fresh port counters.
func (dp *dataPlane) rdmaStatus() *api.RDMAStatus {
	if dp.nics == nil {
		return nil
	}
	st := *dp.nics
	st.NICs = rdma.WithCounters(st.NICs)
	if dp.rdma != nil {
		st.WriteMode, st.WriteModeWhy = dp.rdma.Mode(), dp.rdma.ModeWhy()
		st.Rails = slices.Clone(st.Rails)
		for i, r := range dp.rdma.Rails() {
			st.Rails[i].Sends, st.Rails[i].Bytes = r.Sends, r.Bytes
			st.Rails[i].Received, st.Rails[i].ReceivedBytes = r.Received, r.ReceivedBytes
		}
	}
	return &st
}

// registration is status's account of the arena's registration.
func (dp *dataPlane) registration() api.Registration {
	if dp.rdma == nil {
		return api.Registration{Mode: api.RegistrationNone, Reason: "the tcp transport reads and writes the arena directly; there is nothing to register with a NIC"}
	}
	r := dp.reg
	st := dp.rdma.Stats()
	out := api.Registration{Mode: r.Mode, Bytes: r.Bytes, Millis: float64(r.Took.Microseconds()) / 1000, PerSend: st.PerSend + st.PerReceive}
	out.GPU = gpuStatus(r.GPU)
	switch {
	case r.GPU != nil && r.Mode == api.RegistrationShared:
		out.Reason = gpuReasons[r.GPU.Path]
	case r.Mode == api.RegistrationShared:
		out.Reason = "the arena was registered once at start"
	case r.Err != nil:
		out.Reason = r.Err.Error()
	default:
		out.Reason = "--rdma-registration per-send: each send registers its range and deregisters it after"
	}
	return out
}

// gpuReasons say what each GPU registration path means for a transfer.
var gpuReasons = map[api.GPURegistration]string{
	api.GPURegistrationDMABuf:  "the GPU arena was registered once through its dmabuf: the NIC reads and writes GPU memory directly, no copy",
	api.GPURegistrationPeerMem: "the GPU arena was registered once by its device pointer (peer memory): the NIC reads and writes GPU memory directly, no copy",
	api.GPURegistrationBounce:  "the GPU arena's pinned bounce area was registered once: each transfer is copied between GPU and bounce area (cuMemcpy), never registered per write",
}

// gpuStatus is status's account of a GPU arena's registration.
func gpuStatus(g *rdma.GPURegistration) *api.GPURegistrationStatus {
	if g == nil {
		return nil
	}
	st := &api.GPURegistrationStatus{Asked: g.Asked, Path: g.Path, NotTaken: make([]api.GPUPathNotTaken, 0, len(g.NotTaken))}
	for _, n := range g.NotTaken {
		nt := api.GPUPathNotTaken{Path: n.Path, Reason: n.Reason}
		if n.Err != nil {
			nt.Failed, nt.Reason = true, n.Err.Error()
		}
		st.NotTaken = append(st.NotTaken, nt)
	}
	return st
}

// collectors are the data plane's metrics. A TCP daemon shows the RDMA
// ones too, at zero, so one dashboard fits every host.
func (dp *dataPlane) collectors() []prometheus.Collector {
	mode := prometheus.NewGaugeVec(prometheus.GaugeOpts{
		Name: "ferry_registration_mode",
		Help: "1 for the arena's registration mode (shared, per-send or none), 0 for the others.",
	}, []string{"mode"})
	for _, m := range []api.RegistrationMode{api.RegistrationShared, api.RegistrationPerSend, api.RegistrationNone} {
		mode.WithLabelValues(string(m))
	}
	mode.WithLabelValues(string(dp.registration().Mode)).Set(1)
	gpu := prometheus.NewGaugeVec(prometheus.GaugeOpts{
		Name: "ferry_gpu_registration",
		Help: "How a GPU arena met the RDMA NIC: 1 for each path's outcome (taken, failed, or not tried), 0 for the others; all 0 for a host arena or without RDMA. GET /v1/status says why.",
	}, []string{"path", "outcome"})
	for _, p := range api.GPURegistrationPaths {
		for _, o := range []string{"taken", "failed", "not_tried"} {
			gpu.WithLabelValues(string(p), o)
		}
	}
	if g := dp.reg.GPU; g != nil {
		if g.Path != "" {
			gpu.WithLabelValues(string(g.Path), "taken").Set(1)
		}
		for _, n := range g.NotTaken {
			outcome := "not_tried"
			if n.Err != nil {
				outcome = "failed"
			}
			gpu.WithLabelValues(string(n.Path), outcome).Set(1)
		}
	}
	took := dp.reg.Took.Seconds()
	shared := 0.0
	if dp.rdma != nil && dp.reg.Mode == api.RegistrationShared {
		shared = 1
	}
	stats := func() rdma.Stats {
		if dp.rdma == nil {
			return rdma.Stats{}
		}
		return dp.rdma.Stats()
	}
	const registrationsHelp = "Memory registrations with the NIC by mode: shared (the whole arena, once at start) or per-send."
	out := []prometheus.Collector{mode, gpu,
		prometheus.NewCounterFunc(prometheus.CounterOpts{
			Name: "ferry_registrations_total", ConstLabels: prometheus.Labels{"mode": string(api.RegistrationShared)}, Help: registrationsHelp,
		}, func() float64 { return shared }),
		prometheus.NewCounterFunc(prometheus.CounterOpts{
			Name: "ferry_registrations_total", ConstLabels: prometheus.Labels{"mode": string(api.RegistrationPerSend)}, Help: registrationsHelp,
		}, func() float64 { st := stats(); return float64(st.PerSend + st.PerReceive) }),
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name: "ferry_registration_duration_seconds",
			Help: "Time the arena's shared registration took at start (0 without one).",
		}, func() float64 { return took }),
		prometheus.NewCounterFunc(prometheus.CounterOpts{
			Name: "ferry_rejected_completions_total",
			Help: "RDMA receive completions that did not match their grant; never delivered.",
		}, func() float64 { return float64(stats().Rejected) }),
		prometheus.NewCounterFunc(prometheus.CounterOpts{
			Name: "ferry_failed_receives_total",
			Help: "Granted RDMA writes the receiver gave up on (a receive completed in error, a rejected completion, the lane closing first), each closing its lane; never delivered.",
		}, func() float64 { return float64(stats().Failed) })}
	// The sending side's work per write, counted where it is done
	// (docs/rdma.md, "Counters"): dividing by sends gives the per-send
	// figures make test-rdma asserts.
	for _, c := range []struct {
		name, help string
		of         func(rdma.Stats) uint64
	}{
		{"ferry_rdma_sends_total", "RDMA writes this daemon completed as sender, direct or granted.", func(s rdma.Stats) uint64 { return s.Sends }},
		{"ferry_rdma_direct_sends_total", "Of them, direct writes: no control message (through a window, or between peers holding the peer secret).", func(s rdma.Stats) uint64 { return s.Direct }},
		{"ferry_rdma_control_messages_total", "Messages on RDMA lanes' control connections for writes, sent or read, in both roles.", func(s rdma.Stats) uint64 { return s.ControlMessages }},
		{"ferry_rdma_posts_total", "ibv_post_send calls.", func(s rdma.Stats) uint64 { return s.Posts }},
		{"ferry_rdma_work_requests_total", "RDMA work requests posted.", func(s rdma.Stats) uint64 { return s.WorkRequests }},
		{"ferry_rdma_signaled_total", "Of them, signaled.", func(s rdma.Stats) uint64 { return s.Signaled }},
		{"ferry_rdma_bounced_sends_total", "RDMA writes whose source lay in no registration (not the arena, not a region the NIC registered), copied through a lane's bounce buffer.", func(s rdma.Stats) uint64 { return s.Bounced }},
		{"ferry_rdma_staged_receives_total", "Granted RDMA writes into a slot in no registration, landed in a staging buffer mapped and registered for the write, then copied.", func(s rdma.Stats) uint64 { return s.Staged }},
		{"ferry_rdma_copied_bytes_total", "Bytes the CPU copied for RDMA writes: into bounce buffers, out of staging buffers.", func(s rdma.Stats) uint64 { return s.CopiedBytes }},
		{"ferry_rdma_direct_completions_total", "Receive completions of peers' direct writes.", func(s rdma.Stats) uint64 { return s.DirectCompletions }},
		{"ferry_rdma_direct_refused_total", "Of them, those that counted for nothing (no live slot with that tag, a slot already full, a length not the slot's); each also logged, rate-limited.", func(s rdma.Stats) uint64 { return s.DirectRefused }},
		{"ferry_rdma_window_binds_total", "Memory windows bound over receive slots (windows mode).", func(s rdma.Stats) uint64 { return s.WindowBinds }},
		{"ferry_rdma_window_invalidations_total", "Memory windows invalidated as their slots were freed (windows mode).", func(s rdma.Stats) uint64 { return s.WindowInvalidations }},
		{"ferry_rdma_credit_messages_total", "Receive credits returned on RDMA lanes (one per 32 writes a receiver took), sent as receiver or read as sender.", func(s rdma.Stats) uint64 { return s.CreditMessages }},
		{"ferry_rdma_credit_stalls_total", "RDMA writes that found their lane out of receive credits and waited for the receiving daemon to take the writes before (it was descheduled, stopped or busy).", func(s rdma.Stats) uint64 { return s.CreditStalls }},
		{"ferry_rdma_striped_sends_total", "Of the RDMA writes, those striped in pieces over several RDMA devices (rdma_device, rdma_stripe_min).", func(s rdma.Stats) uint64 { return s.Striped }},
		{"ferry_rdma_stripe_failovers_total", "RDMA devices that failed under a striped write, whose pieces left went through the others.", func(s rdma.Stats) uint64 { return s.Failovers }},
		{"ferry_rdma_arena_rail_sends_total", "Of the RDMA writes, those from a device's arena after the first that went out through its own NICs (the affinity table).", func(s rdma.Stats) uint64 { return s.RegionRails }},
	} {
		out = append(out, prometheus.NewCounterFunc(prometheus.CounterOpts{Name: c.name, Help: c.help},
			func() float64 { return float64(c.of(stats())) }))
	}
	// Per RDMA device, named as the host names it, fixed at start; a
	// daemon without RDMA shows nic="none" at zero, so that one
	// dashboard fits every host.
	rails := func() []rdma.RailStats { return []rdma.RailStats{{NIC: "none"}} }
	if dp.rdma != nil {
		rails = dp.rdma.Rails
	}
	for i := range rails() {
		rail := func() rdma.RailStats { return rails()[i] }
		labels := prometheus.Labels{"nic": rail().NIC}
		out = append(out,
			prometheus.NewCounterFunc(prometheus.CounterOpts{Name: "ferry_rdma_nic_sends_total", ConstLabels: labels,
				Help: "RDMA writes and striped pieces this daemon completed as sender, per RDMA device (rdma_device)."},
				func() float64 { return float64(rail().Sends) }),
			prometheus.NewCounterFunc(prometheus.CounterOpts{Name: "ferry_rdma_nic_sent_bytes_total", ConstLabels: labels,
				Help: "Their bytes, per RDMA device."},
				func() float64 { return float64(rail().Bytes) }),
			prometheus.NewCounterFunc(prometheus.CounterOpts{Name: "ferry_rdma_nic_received_total", ConstLabels: labels,
				Help: "RDMA writes and striped pieces this daemon took in as receiver (completed into a grant or a window), per RDMA device they came in by."},
				func() float64 { return float64(rail().Received) }),
			prometheus.NewCounterFunc(prometheus.CounterOpts{Name: "ferry_rdma_nic_received_bytes_total", ConstLabels: labels,
				Help: "Their bytes, per RDMA device."},
				func() float64 { return float64(rail().ReceivedBytes) }))
	}
	out = append(out, prometheus.NewCounterFunc(prometheus.CounterOpts{
		Name: "ferry_rdma_credit_stall_seconds_total",
		Help: "Time RDMA writes spent waiting for receive credits.",
	}, func() float64 { return stats().CreditStallTime.Seconds() }))
	return out
}
