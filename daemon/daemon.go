// Package daemon is ferryd: the control API on a Unix socket, the staging
// and receive registry over one arena, sessions to peer daemons, the send
// path with its retry policy, the slow-transfer log and metrics.
package daemon

import (
	"context"
	"crypto/rand"
	"encoding/binary"
	"fmt"
	"net"
	"net/http"
	"net/netip"
	"os"
	"slices"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/rs/zerolog"

	"github.com/ferry-project/ferry/api"
	"github.com/ferry-project/ferry/arena"
	"github.com/ferry-project/ferry/config"
	"github.com/ferry-project/ferry/internal/connlimit"
	"github.com/ferry-project/ferry/internal/loglimit"
	"github.com/ferry-project/ferry/mooncake"
	"github.com/ferry-project/ferry/topology"
	"github.com/ferry-project/ferry/transport"
)

// Version is ferryd's version, set at link time.
var Version = "dev"

// Config is everything ferryd is told at start: its settings (whose
// defaults and checks are package config's), where to log, and the
// control socket when systemd passed it.
type Config struct {
	config.Settings
	Log zerolog.Logger
	// ControlListener, when set, is the control socket already listening
	// (systemd socket activation): ferryd serves on it and leaves the file,
	// its mode and group to whoever created it.
	ControlListener net.Listener
}

// Daemon is one running ferryd.
type Daemon struct {
	cfg      Config
	log      zerolog.Logger
	instance uint64
	started  time.Time

	arena     *arena.Arena
	mem       *memory            // the first device's arena's memory
	arenas    []*deviceArena     // one per device --device lists, the first mem's
	affinity  *topology.Affinity // GPUs and their nearest NICs
	reg       *registry
	tr        transport.Transport
	dp        *dataPlane
	mooncake  *mooncakeSegment // --mooncake-listen, or nil
	engines   engines          // ferry.mooncake engines' own segments (engines.go)
	sessions  *sessions
	transfers *transfers // batch transfers, running and recently ended
	events    *eventLog  // arrivals and batch endings, for GET /v1/events
	metrics   *metrics
	control   net.Listener
	http      *http.Server
	metricsLn net.Listener // --metrics-listen, or nil
	metricsHS *http.Server
	// The caps on the two HTTP listeners, and their shared ErrorLog.
	controlGate, metricsGate *connlimit.Gate
	httpLog                  *httpLog

	advertise string
	slowNanos atomic.Int64
	regionLog *loglimit.Limiter // regions the NIC could not register
	// discardLog: writes that landed in a slot freed meanwhile, which a
	// Mooncake stranger guessing a slot's address can keep coming.
	discardLog *loglimit.Limiter
	// refusedLog: callers off the allow-lists, each refused request.
	refusedLog *loglimit.Limiter
	// failLog: failed requests and transfers, which a peer gone down
	// causes for every client request on it (failWarn).
	failLog *loglimit.Limiter

	inflight       inflight                // control requests being served
	streams        writeStreams            // open write streams (writestream.go)
	reqCtx         context.Context         // parent of every request's context
	cancelRequests context.CancelCauseFunc // ends them when a drain runs out
}

// New allocates the arena, opens the peer port and the control socket.
// Nothing is served until Serve.
func New(cfg Config) (*Daemon, error) {
	if cfg.ControlListener != nil {
		// The socket systemd passed is the one clients use, whatever
		// --socket says; defaults that derive from it follow it.
		if p := cfg.ControlListener.Addr().String(); p != cfg.Socket {
			if cfg.Socket != "" {
				cfg.Log.Info().Str("socket", p).Str("configured", cfg.Socket).Msg("serving on the socket systemd passed instead of the configured one")
			}
			cfg.Socket = p
		}
	}
	if err := cfg.Settings.Check(); err != nil {
		return nil, err
	}
	d := &Daemon{cfg: cfg, log: cfg.Log, started: time.Now(), instance: randomInstance()}
	d.slowNanos.Store(int64(cfg.SlowThreshold.D()))
	gid, _ := config.LookupGroup(cfg.SocketGroup) // Check resolved it

	// Claim the control socket first: if another ferryd answers there, stop
	// before touching its arena file.
	ln := cfg.ControlListener
	if ln != nil {
		d.log.Info().Str("socket", cfg.Socket).Msg("control socket passed by systemd (socket activation)")
	} else {
		var err error
		if ln, err = listenControl(cfg.Socket, gid); err != nil {
			return nil, err
		}
	}
	d.httpLog = newHTTPLog(d.log)
	d.controlGate = connlimit.NewGate("control socket", controlLimits, controlSource, d.httpLog.warnf)
	d.control = d.controlGate.Listener(rightsListener{Listener: ln, admit: d.admit})
	ok := false
	defer func() {
		if !ok {
			d.closeAll()
		}
	}()

	mems, err := openMemories(cfg, d.log)
	if err != nil {
		return nil, err
	}
	for _, m := range mems {
		d.arenas = append(d.arenas, &deviceArena{mem: m})
	}
	for _, a := range d.arenas[1:] {
		if a.region, err = arenaRegion(a.mem); err != nil {
			return nil, err
		}
	}
	d.mem = mems[0]
	// The GPUs' table comes from the driver, which the first GPU arena
	// loaded (a first device of cpu loads none).
	gpuMem := d.mem
	if i := slices.IndexFunc(mems, func(m *memory) bool { return m.drv != nil }); i >= 0 {
		gpuMem = mems[i]
	}
	if d.affinity, err = readAffinity(cfg, gpuMem, d.log); err != nil {
		return nil, err
	}
	d.arena, err = arena.New(d.mem.Memory, config.ArenaAlign)
	if err != nil {
		return nil, err
	}
	d.reg = newRegistry(d.arena)
	d.reg.device = d.mem.device
	if d.reg.hostLimit, err = regionLimit(cfg.MaxRegionBytes, func(err error) { d.log.Warn().Err(err).Msg("max_region_bytes") }); err != nil {
		return nil, err
	}
	d.transfers, d.events = newTransfers(), newEventLog()
	d.reg.arrived = func(reqID string, n int64) {
		d.events.add(api.Event{Kind: api.EventArrived, ReqID: reqID, NBytes: n})
	}
	d.discardLog = loglimit.New("discarded writes", func(format string, args ...any) {
		d.log.Warn().Str("component", "receives").Msg(fmt.Sprintf(format, args...))
	})
	d.reg.discarded = func(reqID string, n uint64) {
		if d.discardLog.Allow() {
			d.log.Warn().Str("req_id", reqID).Uint64("nbytes", n).
				Msg("a write finished landing in a receive slot freed meanwhile: its bytes were discarded, though its sender was told it completed")
		}
	}
	d.reg.windowLost = func(reqID string, err error) {
		d.log.Error().Str("req_id", reqID).Err(err).
			Msg("the memory window over a freed receive slot could not be invalidated: its memory stays out of use until ferryd restarts")
	}
	d.dp, err = openTransport(cfg, d.reg, d.instance, d.mem, d.log)
	if err != nil {
		return nil, err
	}
	if d.dp.direct() {
		// Direct writes pin no slot: only time keeps a late one out of
		// memory handed out anew.
		d.reg.quarantineFreedSlots(mooncakeQuarantine)
	}
	d.tr = d.dp.tr
	d.advertise = cfg.Advertise
	if d.advertise == "" {
		d.advertise = advertiseFor(d.tr.Addr(), d.log)
	}
	mc := &mooncake.Dialer{IOTimeout: cfg.IOTimeout.D(), MaxConns: cfg.MaxConns, QPs: cfg.MooncakeQPs,
		Self: &mooncake.Segment{Name: d.advertise, Protocol: "tcp", Buffers: []mooncake.Buffer{}}}
	if d.dp.mooncake != nil {
		mc.RDMA = d.dp.mooncake
	}
	// A ferry engine's segment names this port of its ferryd: written
	// over ferry's peer protocol (engines.go).
	mc.Ferry = d.tr.Dial
	d.sessions = newSessions(d.tr, mc)
	if cfg.MooncakeListen != "" {
		host, _, _ := net.SplitHostPort(d.advertise)
		d.mooncake, err = openMooncake(cfg, d.reg, d.dp, d.arena.Addr(arena.Slice{}), d.mem.Size(), host, d.mayFetchMooncake(), d.log)
		if err != nil {
			return nil, err
		}
		mc.Self = d.mooncake.self()
	}
	d.metrics = newMetrics(gauges{
		arena: func() (int64, int64, int64) {
			st := d.arena.Stats()
			return st.Size, st.Used, st.Free
		},
		counts:   d.reg.counts,
		sessions: d.sessions.states,
		regions: func() (int64, int64) {
			st := d.reg.regionsStatus()
			return st.HostBytes, st.HostLimit
		},
	}, d.tr.Name())
	d.metrics.reg.MustRegister(d.dp.collectors()...)
	d.metrics.reg.MustRegister(d.mem.collectors()...)
	d.metrics.reg.MustRegister(d.limits())
	d.reg.mu.Lock() // the peer port is open already
	d.reg.onRefusal = func(c transport.Code) { d.metrics.peerRefusals.WithLabelValues(c.Label()).Inc() }
	d.reg.registrar, _ = d.tr.(transport.RegionRegistrar)
	d.reg.regionNICLost = func(name string, err error) {
		d.metrics.regionDeregFailures.Inc()
		if !d.regionLog.Allow() { // a client may DELETE a region the NIC keeps again and again
			return
		}
		d.log.Error().Str("region", name).Err(err).Msg("the region's registration with the NIC could not be dropped: it stays registered, pinned and listed (closing) until a DELETE of it tries again or ferryd restarts")
	}
	d.reg.mu.Unlock()
	d.registerArenas()
	d.metrics.reg.MustRegister(d.arenaCollectors()...)
	// Clients cause these: a loop of failing registrations must not
	// flood the log.
	d.regionLog = loglimit.New("regions", func(format string, args ...any) {
		d.log.Warn().Str("component", "regions").Msg(fmt.Sprintf(format, args...))
	})
	d.refusedLog = loglimit.New("refused callers", func(format string, args ...any) {
		d.log.Warn().Str("component", "api").Msg(fmt.Sprintf(format, args...))
	})
	d.metrics.countRefused(d.refusedLog.Count)
	d.failLog = loglimit.New("failed requests", func(format string, args ...any) {
		d.log.Warn().Str("component", "api").Msg(fmt.Sprintf(format, args...))
	})
	d.metrics.reg.MustRegister(prometheus.NewCounterFunc(prometheus.CounterOpts{
		Name: "ferry_panics_total",
		Help: "Panics ferryd's HTTP servers (the control socket, the metrics listener) recovered from, each ending its connection: a bug; the first one's stack is logged, the others one line each, at most 10 a second.",
	}, func() float64 { return float64(d.httpLog.panics.Load()) }))
	d.metrics.reg.MustRegister(prometheus.NewGaugeFunc(prometheus.GaugeOpts{
		Name: "ferry_write_streams",
		Help: fmt.Sprintf("Write streams open (POST /v1/writes/stream), at most %d.", maxWriteStreams),
	}, func() float64 { n, _ := d.streams.stats(); return float64(n) }),
		prometheus.NewCounterFunc(prometheus.CounterOpts{
			Name: "ferry_write_streams_refused_total",
			Help: fmt.Sprintf("Write streams refused (409 busy) because %d were open, the most ferryd keeps.", maxWriteStreams),
		}, func() float64 { _, r := d.streams.stats(); return float64(r) }))
	if cfg.MetricsListen != "" {
		// Only /metrics here: the control API stays on the socket, whose
		// file mode is its access control.
		d.metricsLn, err = net.Listen("tcp", cfg.MetricsListen)
		if err != nil {
			return nil, fmt.Errorf("--metrics-listen %s: %w", cfg.MetricsListen, err)
		}
		d.metricsGate = connlimit.NewGate("metrics listener", metricsLimits, metricsSource, d.httpLog.warnf)
		d.metricsLn = d.metricsGate.Listener(d.metricsLn)
		mux := http.NewServeMux()
		mux.Handle("GET /metrics", d.metrics.handler())
		d.metricsHS = &http.Server{
			Handler:           mux,
			ReadHeaderTimeout: metricsHeaderTimeout,
			ReadTimeout:       metricsReadTimeout,
			WriteTimeout:      metricsWriteTimeout,
			IdleTimeout:       metricsIdleTimeout,
			MaxHeaderBytes:    metricsHeaderBytes,
			ErrorLog:          d.httpLog.logger(),
			ConnState:         d.metricsGate.ConnState,
		}
	}
	d.reqCtx, d.cancelRequests = context.WithCancelCause(context.Background())
	d.http = &http.Server{
		Handler:           d.routes(),
		ReadHeaderTimeout: controlHeaderTimeout,
		IdleTimeout:       controlIdleTimeout,
		// The server's own limits sit a little above RequestTimeout, so the
		// handler's deadline ends a request first, with an answer that says so.
		ReadTimeout:    cfg.RequestTimeout.D() + requestGrace,
		WriteTimeout:   cfg.RequestTimeout.D() + requestGrace,
		MaxHeaderBytes: int(cfg.MaxHeaderBytes.Bytes()),
		ErrorLog:       d.httpLog.logger(),
		BaseContext:    func(net.Listener) context.Context { return d.reqCtx },
		ConnContext:    withCaller,
		ConnState:      d.controlGate.ConnState,
	}
	ok = true
	return d, nil
}

// mayFetchMooncake says which Mooncake segments ferryd may dial to fetch
// a descriptor a handshake did not carry: those it has sent to, and those
// on mooncake_fetch_allow. A stranger naming another address gets no dial.
func (d *Daemon) mayFetchMooncake() func(segment string) bool {
	var allow []netip.Prefix
	for _, s := range d.cfg.MooncakeFetch {
		p, _ := config.ParsePrefix(s) // checked when the setting was read
		allow = append(allow, p)
	}
	return func(segment string) bool {
		if d.sessions.sentToMooncake(segment) {
			return true
		}
		ap, err := netip.ParseAddrPort(segment)
		return err == nil && slices.ContainsFunc(allow, func(p netip.Prefix) bool { return p.Contains(ap.Addr().Unmap()) })
	}
}

func randomInstance() uint64 {
	var b [8]byte
	_, _ = rand.Read(b[:])
	return binary.LittleEndian.Uint64(b[:]) | 1
}

// advertiseFor picks the session name receive slots carry when none was
// given: the listener's own address, or for a wildcard listener the first
// non-loopback IPv4 address of the host.
func advertiseFor(addr net.Addr, log zerolog.Logger) string {
	ta, ok := addr.(*net.TCPAddr)
	if !ok {
		return addr.String()
	}
	if !ta.IP.IsUnspecified() {
		return ta.String()
	}
	port := ta.Port
	if ip := firstIPv4(); ip != nil {
		return net.JoinHostPort(ip.String(), fmt.Sprint(port))
	}
	log.Warn().Int("port", port).Msg("no non-loopback IPv4 address to advertise; receive slots name 127.0.0.1: set --advertise HOST:PORT for peers on other hosts")
	return net.JoinHostPort("127.0.0.1", fmt.Sprint(port))
}

// firstIPv4 is the host's first non-loopback IPv4 address, or nil.
func firstIPv4() net.IP {
	addrs, err := net.InterfaceAddrs()
	if err != nil {
		return nil
	}
	for _, a := range addrs {
		if ipn, ok := a.(*net.IPNet); ok && !ipn.IP.IsLoopback() && ipn.IP.To4() != nil {
			return ipn.IP
		}
	}
	return nil
}

// Advertise is the session name this daemon's receive slots carry.
func (d *Daemon) Advertise() string { return d.advertise }

// MetricsAddr is the --metrics-listen listener's address, or nil.
func (d *Daemon) MetricsAddr() net.Addr {
	if d.metricsLn == nil {
		return nil
	}
	return d.metricsLn.Addr()
}

// SetSlowThreshold changes the slow-transfer threshold while running.
func (d *Daemon) SetSlowThreshold(t time.Duration) { d.slowNanos.Store(int64(t)) }

func (d *Daemon) slowThreshold() time.Duration { return time.Duration(d.slowNanos.Load()) }

// Serve answers the control API until ctx ends, then shuts down: new
// requests are answered 503 unavailable, in-flight ones get up to drain to
// finish, sessions and listeners close, and the arena file is removed.
//
// A request still running when drain runs out is cancelled and answered
// 503 unavailable too; what is still staged is dropped with a WARN line
// per req_id. Serve returns nil after a requested shutdown.
func (d *Daemon) Serve(ctx context.Context, drain time.Duration) error {
	ev := d.log.Info().
		Str("socket", d.cfg.Socket).Str("listen", d.tr.Addr().String()).Str("advertise", d.advertise).
		Str("transport", d.tr.Name()).Str("device", d.mem.device).Int64("arena_size", d.mem.Size()).Int("arenas", len(d.arenas)).
		Str("arena_file", d.mem.Path()).Str("registration", string(d.dp.registration().Mode))
	if d.metricsLn != nil {
		ev = ev.Str("metrics", d.metricsLn.Addr().String())
	}
	ev.Str("version", Version).Int("pid", os.Getpid()).Msg("ready")
	errc := make(chan error, 2)
	go func() { errc <- fmt.Errorf("control socket: %w", d.http.Serve(d.control)) }()
	if d.metricsHS != nil {
		go func() {
			if err := d.metricsHS.Serve(d.metricsLn); err != nil {
				errc <- fmt.Errorf("metrics listener: %w", err)
			}
		}()
	}
	go d.sweepLoop(ctx)

	var err error
	select {
	case <-ctx.Done():
	case err = <-errc:
	}
	d.drain(drain)
	d.logDropped(d.reg.sweep(time.Now(), -1, -1), "dropped at shutdown: it was never sent, read or deleted")
	d.closeAll()
	d.log.Info().Msg("stopped")
	return err
}

// closeAll releases everything New acquired, in reverse order.
func (d *Daemon) closeAll() {
	if d.http != nil {
		_ = d.http.Close()
	}
	if d.metricsHS != nil {
		_ = d.metricsHS.Close()
	} else if d.metricsLn != nil {
		_ = d.metricsLn.Close()
	}
	d.streams.stop()
	if d.sessions != nil {
		d.sessions.closeAll()
	}
	d.closeEngines()
	if d.mooncake != nil {
		d.mooncake.close()
	}
	if d.reg != nil {
		// Not under a region's teardown: a NIC or GPU context closed
		// under its deregistration or unmapping would fail it.
		d.reg.waitEnds(func() {
			d.log.Warn().Dur("waited", slowEnd).Msg("stopping: waiting for the NIC to drop the registrations of regions being unregistered before closing it")
		})
	}
	d.closeArenas()
	if d.dp != nil {
		_ = d.dp.close()
	}
	if d.refusedLog != nil {
		d.refusedLog.Stop()
	}
	if d.httpLog != nil {
		d.httpLog.lim.Stop()
	}
	if d.regionLog != nil {
		d.regionLog.Stop()
	}
	if d.failLog != nil {
		d.failLog.Stop()
	}
	if d.discardLog != nil {
		d.discardLog.Stop()
	}
	if d.control != nil {
		_ = d.control.Close() // unlinks the socket file, unless systemd passed it
	}
	for _, a := range d.arenas {
		_ = a.mem.close()
	}
}

// sweepLoop drops what outlived its TTL, naming each req_id at WARN: staged
// data is never lost without a line that says so.
func (d *Daemon) sweepLoop(ctx context.Context) {
	every := min(d.cfg.StageTTL.D(), d.cfg.ReceiveTTL.D()) / 10
	every = max(every, 100*time.Millisecond)
	t := time.NewTicker(every)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case now := <-t.C:
			drops := d.reg.sweep(now, d.cfg.StageTTL.D(), d.cfg.ReceiveTTL.D())
			for _, x := range drops {
				d.metrics.swept.WithLabelValues(x.kind).Inc()
			}
			d.logDropped(drops, "dropped after its TTL: it was never sent, read or deleted")
		}
	}
}

func (d *Daemon) logDropped(drops []dropped, why string) {
	for _, x := range drops {
		d.log.Warn().Str("req_id", x.reqID).Str("kind", x.kind).Str("state", x.state).
			Int64("nbytes", x.nbytes).Dur("age", x.age).Msg(why)
	}
}

// failWarn is the event a failure line goes out as: at warn level, at
// most loglimit.Burst a second (a peer gone down fails every request a
// client makes toward it, as fast as the client makes them); past that
// at debug level, the limiter's summary saying how many.
func (d *Daemon) failWarn(log *zerolog.Logger) *zerolog.Event {
	if d.failLog == nil || d.failLog.Allow() {
		return log.Warn()
	}
	return log.Debug()
}
