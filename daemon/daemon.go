// Package daemon is ferryd: the control API on a Unix socket, the staging
// and receive registry over one arena, sessions to peer daemons, the send
// path with its retry policy, the slow-transfer log and metrics.
package daemon

import (
	"context"
	"crypto/rand"
	"encoding/binary"
	"errors"
	"fmt"
	"net"
	"net/http"
	"os"
	"sync/atomic"
	"time"

	"github.com/rs/zerolog"

	"github.com/ferry-project/ferry/api"
	"github.com/ferry-project/ferry/arena"
	"github.com/ferry-project/ferry/mooncake"
	"github.com/ferry-project/ferry/transport"
)

// Version is ferryd's version, set at link time.
var Version = "dev"

// Config is everything ferryd is told at start. Zero values mean the
// defaults below; Check reports what is wrong.
type Config struct {
	Socket        string        // control socket path
	Listen        string        // peer port, host:port
	Advertise     string        // what receive slots name as session; default from Listen
	Device        string        // "auto", "cpu" or "cuda:N"
	Transport     string        // "auto", "rdma" or "tcp"
	ArenaSize     int64         // bytes
	ArenaFile     string        // backing file clients map; default Socket+".arena"
	BounceSize    int64         // pinned host memory copies to and from a GPU arena are staged in
	SlowThreshold time.Duration // transfers slower than this are logged
	SendRetries   int           // re-dials after a failed write
	SendTimeout   time.Duration // bound on one send, retries included
	StageTTL      time.Duration // staged entries older than this are swept
	ReceiveTTL    time.Duration // receive slots older than this are swept
	IOTimeout     time.Duration // deadline on each network read/write
	MaxConns      int           // connections per peer session
	RDMADevice    string        // RDMA device to use; "" chooses
	RDMAGIDIndex  *int          // GID table index; nil chooses by the advertised address
	// RDMARegistration is "shared" (the arena registered once) or
	// "per-send" (a debugging switch: each send registers its range).
	RDMARegistration string
	MetricsListen    string // optional TCP host:port serving GET /metrics; "" for none
	PeerSecretFile   string // file holding the secret peers must share; "" for none
	MooncakeListen   string // optional host:port serving as a Mooncake segment; "" for none
	MooncakeQPs      int    // QPs per RDMA endpoint to a Mooncake segment (the peers' MC_NUM_QP_PER_EP); 0 is mooncake.DefaultQPs
	MooncakeMTU      int    // path MTU cap of Mooncake RDMA QPs in bytes (the peers' MC_MTU); 0 is mooncake.DefaultMTU
	Log              zerolog.Logger

	// The control socket's access and limits.
	SocketGroup    string        // group (name or gid) owning the control socket and arena file; "" keeps ferryd's own
	AllowUIDs      []uint32      // with AllowGIDs, who may call the API; both empty: anyone who can open the socket
	AllowGIDs      []uint32      // matched against the caller's primary and supplementary groups
	RequestTimeout time.Duration // bound on one control request, from its headers to its answer
	MaxHeaderBytes int           // bound on a request's headers
	MaxBodyBytes   int64         // bound on a JSON request body (uploads are bounded by the arena)
	// ControlListener, when set, is the control socket already listening
	// (systemd socket activation): ferryd serves on it and leaves the file,
	// its mode and group to whoever created it.
	ControlListener net.Listener
}

// Defaults.
const (
	DefaultArenaSize      = 1 << 30
	DefaultBounceSize     = 256 << 20
	DefaultSlowThreshold  = 200 * time.Millisecond
	DefaultSendTimeout    = 60 * time.Second
	DefaultTTL            = 10 * time.Minute
	DefaultIOTimeout      = 10 * time.Second
	DefaultMaxConns       = 8
	DefaultRequestTimeout = 15 * time.Minute // above the longest wait a request may ask for
	DefaultMaxHeaderBytes = 64 << 10
	DefaultMaxBodyBytes   = 64 << 10
	arenaAlign            = 256
)

func (c *Config) applyDefaults() {
	if c.Socket == "" {
		c.Socket = api.DefaultSocket
	}
	if c.Listen == "" {
		c.Listen = fmt.Sprintf(":%d", api.DefaultPeerPort)
	}
	if c.Device == "" {
		c.Device = "auto"
	}
	if c.Transport == "" {
		c.Transport = "auto"
	}
	if c.RDMARegistration == "" {
		c.RDMARegistration = "shared"
	}
	if c.ArenaSize == 0 {
		c.ArenaSize = DefaultArenaSize
	}
	if c.ArenaFile == "" {
		c.ArenaFile = c.Socket + ".arena"
	}
	if c.BounceSize == 0 {
		c.BounceSize = DefaultBounceSize
	}
	if c.SlowThreshold == 0 {
		c.SlowThreshold = DefaultSlowThreshold
	}
	if c.SendTimeout == 0 {
		c.SendTimeout = DefaultSendTimeout
	}
	if c.StageTTL == 0 {
		c.StageTTL = DefaultTTL
	}
	if c.ReceiveTTL == 0 {
		c.ReceiveTTL = DefaultTTL
	}
	if c.IOTimeout == 0 {
		c.IOTimeout = DefaultIOTimeout
	}
	if c.MaxConns == 0 {
		c.MaxConns = DefaultMaxConns
	}
	if c.MooncakeQPs == 0 {
		c.MooncakeQPs = mooncake.DefaultQPs
	}
	if c.MooncakeMTU == 0 {
		c.MooncakeMTU = mooncake.DefaultMTU
	}
	if c.RequestTimeout == 0 {
		c.RequestTimeout = DefaultRequestTimeout
	}
	if c.MaxHeaderBytes == 0 {
		c.MaxHeaderBytes = DefaultMaxHeaderBytes
	}
	if c.MaxBodyBytes == 0 {
		c.MaxBodyBytes = DefaultMaxBodyBytes
	}
}

// Check says what is wrong with the configuration, one sentence per field.
func (c *Config) Check() error {
	c.applyDefaults()
	var errs []error
	if _, err := parseDevice(c.Device); err != nil {
		errs = append(errs, err)
	}
	switch c.Transport {
	case "auto", "rdma", "tcp":
	default:
		errs = append(errs, fmt.Errorf("--transport %q: use auto (RDMA when a usable RDMA port exists, else TCP), rdma or tcp", c.Transport))
	}
	if c.RDMARegistration != "shared" && c.RDMARegistration != "per-send" {
		errs = append(errs, fmt.Errorf("--rdma-registration %q: use shared or per-send", c.RDMARegistration))
	}
	if c.RDMAGIDIndex != nil && *c.RDMAGIDIndex < 0 {
		errs = append(errs, fmt.Errorf("--rdma-gid-index %d is negative: give a GID table index (see /sys/class/infiniband/*/ports/*/gids) or leave it out to choose by the advertised address", *c.RDMAGIDIndex))
	}
	if c.ArenaSize < arenaAlign {
		errs = append(errs, fmt.Errorf("--arena-size %d is too small: give at least %d bytes, e.g. 64MiB", c.ArenaSize, arenaAlign))
	}
	if c.BounceSize < 0 {
		errs = append(errs, fmt.Errorf("--bounce-size %d is negative", c.BounceSize))
	}
	if c.SendRetries < 0 || c.SendRetries > 10 {
		errs = append(errs, fmt.Errorf("--send-retries %d is outside 0..10", c.SendRetries))
	}
	for name, d := range map[string]time.Duration{
		"--slow-threshold": c.SlowThreshold, "--send-timeout": c.SendTimeout, "--stage-ttl": c.StageTTL,
		"--receive-ttl": c.ReceiveTTL, "--io-timeout": c.IOTimeout, "--request-timeout": c.RequestTimeout,
	} {
		if d < 0 {
			errs = append(errs, fmt.Errorf("%s %s is negative", name, d))
		}
	}
	if _, _, err := net.SplitHostPort(c.Listen); err != nil {
		errs = append(errs, fmt.Errorf("--listen %q is not host:port (e.g. :17100 or 10.0.0.5:17100)", c.Listen))
	}
	if _, _, err := net.SplitHostPort(c.MetricsListen); c.MetricsListen != "" && err != nil {
		errs = append(errs, fmt.Errorf("--metrics-listen %q is not host:port (e.g. 127.0.0.1:9464 or :9464)", c.MetricsListen))
	}
	if _, _, err := net.SplitHostPort(c.MooncakeListen); c.MooncakeListen != "" && err != nil {
		errs = append(errs, fmt.Errorf("--mooncake-listen %q is not host:port (e.g. 0.0.0.0:15302): the Mooncake RPC port senders name as the segment", c.MooncakeListen))
	}
	if c.MooncakeQPs < 1 || c.MooncakeQPs > mooncake.MaxQPs {
		errs = append(errs, fmt.Errorf("--mooncake-qps-per-endpoint %d is outside 1..%d: give the Mooncake peers' MC_NUM_QP_PER_EP (their default is %d)", c.MooncakeQPs, mooncake.MaxQPs, mooncake.DefaultQPs))
	}
	switch c.MooncakeMTU {
	case 512, 1024, 2048, 4096: // the MC_MTU values Mooncake takes
	default:
		errs = append(errs, fmt.Errorf("--mooncake-mtu %d: use 512, 1024, 2048 or 4096, the Mooncake peers' MC_MTU (their default is %d)", c.MooncakeMTU, mooncake.DefaultMTU))
	}
	if c.Advertise != "" {
		if err := checkSession(c.Advertise); err != nil {
			errs = append(errs, fmt.Errorf("--advertise: %v", err))
		}
	}
	if c.RequestTimeout <= c.SendTimeout {
		errs = append(errs, fmt.Errorf("--request-timeout %s must be longer than --send-timeout %s: a send must be able to use its whole time", c.RequestTimeout, c.SendTimeout))
	}
	if c.MaxHeaderBytes < 1<<10 || c.MaxBodyBytes < 1<<10 {
		errs = append(errs, fmt.Errorf("--max-header-bytes %d and --max-body-bytes %d must each be at least 1KiB", c.MaxHeaderBytes, c.MaxBodyBytes))
	}
	if _, err := lookupGroup(c.SocketGroup); err != nil {
		errs = append(errs, err)
	}
	if c.PeerSecretFile != "" {
		if _, err := readPeerSecret(c.PeerSecretFile); err != nil {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}

// Daemon is one running ferryd.
type Daemon struct {
	cfg      Config
	log      zerolog.Logger
	instance uint64
	started  time.Time

	arena     *arena.Arena
	mem       *memory
	reg       *registry
	tr        transport.Transport
	dp        *dataPlane
	mooncake  *mooncakeSegment // --mooncake-listen, or nil
	sessions  *sessions
	metrics   *metrics
	control   net.Listener
	http      *http.Server
	metricsLn net.Listener // --metrics-listen, or nil
	metricsHS *http.Server
	advertise string
	slowNanos atomic.Int64

	inflight       inflight                // control requests being served
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
	if err := cfg.Check(); err != nil {
		return nil, err
	}
	d := &Daemon{cfg: cfg, log: cfg.Log, started: time.Now(), instance: randomInstance()}
	d.slowNanos.Store(int64(cfg.SlowThreshold))
	gid, _ := lookupGroup(cfg.SocketGroup) // Check resolved it

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
	d.control = ln
	ok := false
	defer func() {
		if !ok {
			d.closeAll()
		}
	}()

	var err error
	d.mem, err = openMemory(cfg, d.log)
	if err != nil {
		return nil, err
	}
	// Clients map a host arena's file for zero-copy: it goes to the group
	// that may use the socket.
	if d.mem.host != nil {
		if err := chownGroup(cfg.ArenaFile, gid, "arena file"); err != nil {
			return nil, err
		}
	}
	d.arena, err = arena.New(d.mem.Memory, arenaAlign)
	if err != nil {
		return nil, err
	}
	d.reg = newRegistry(d.arena)
	d.reg.discarded = func(reqID string, n uint64) {
		d.log.Warn().Str("req_id", reqID).Uint64("nbytes", n).
			Msg("a write finished landing in a receive slot freed meanwhile: its bytes were discarded, though its sender was told it completed")
	}
	d.dp, err = openTransport(cfg, d.reg, d.instance, d.mem.Host(), d.log)
	if err != nil {
		return nil, err
	}
	d.tr = d.dp.tr
	d.advertise = cfg.Advertise
	if d.advertise == "" {
		d.advertise = advertiseFor(d.tr.Addr(), d.log)
	}
	mc := &mooncake.Dialer{IOTimeout: cfg.IOTimeout, MaxConns: cfg.MaxConns, QPs: cfg.MooncakeQPs,
		Self: &mooncake.Segment{Name: d.advertise, Protocol: "tcp", Buffers: []mooncake.Buffer{}}}
	if d.dp.rdma != nil {
		mc.RDMA = d.dp.rdma
	}
	d.sessions = newSessions(d.tr, mc)
	if cfg.MooncakeListen != "" {
		host, _, _ := net.SplitHostPort(d.advertise)
		d.mooncake, err = openMooncake(cfg, d.reg, d.dp.rdma, d.arena.Addr(arena.Slice{}), d.mem.Size(), host, d.sessions.sentToMooncake, d.log)
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
	})
	d.metrics.reg.MustRegister(d.dp.collectors()...)
	d.metrics.reg.MustRegister(d.limits())
	for _, c := range []transport.Code{transport.NoSlot, transport.OutOfBounds, transport.SlotBusy} {
		d.metrics.peerRefusals.WithLabelValues(c.String())
	}
	d.reg.mu.Lock() // the peer port is open already
	d.reg.onRefusal = func(c transport.Code) { d.metrics.peerRefusals.WithLabelValues(c.String()).Inc() }
	d.reg.mu.Unlock()
	if cfg.MetricsListen != "" {
		// Only /metrics here: the control API stays on the socket, whose
		// file mode is its access control.
		d.metricsLn, err = net.Listen("tcp", cfg.MetricsListen)
		if err != nil {
			return nil, fmt.Errorf("--metrics-listen %s: %w", cfg.MetricsListen, err)
		}
		mux := http.NewServeMux()
		mux.Handle("GET /metrics", d.metrics.handler())
		d.metricsHS = &http.Server{Handler: mux, ReadHeaderTimeout: 10 * time.Second, ErrorLog: newStdLogger(d.log)}
	}
	d.reqCtx, d.cancelRequests = context.WithCancelCause(context.Background())
	d.http = &http.Server{
		Handler:           d.routes(),
		ReadHeaderTimeout: 10 * time.Second,
		// The server's own limits sit a little above RequestTimeout, so the
		// handler's deadline ends a request first, with an answer that says so.
		ReadTimeout:    cfg.RequestTimeout + requestGrace,
		WriteTimeout:   cfg.RequestTimeout + requestGrace,
		MaxHeaderBytes: cfg.MaxHeaderBytes,
		ErrorLog:       newStdLogger(d.log),
		BaseContext:    func(net.Listener) context.Context { return d.reqCtx },
		ConnContext:    withCaller,
	}
	ok = true
	return d, nil
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
		Str("transport", d.tr.Name()).Str("device", d.mem.device).Int64("arena_size", d.mem.Size()).
		Str("arena_file", d.mem.Path()).Str("registration", d.dp.registration().Mode)
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
	if d.sessions != nil {
		d.sessions.closeAll()
	}
	if d.mooncake != nil {
		d.mooncake.close()
	}
	if d.tr != nil {
		_ = d.tr.Close()
	}
	if d.control != nil {
		_ = d.control.Close() // unlinks the socket file, unless systemd passed it
	}
	if d.mem != nil {
		_ = d.mem.close()
	}
}

// sweepLoop drops what outlived its TTL, naming each req_id at WARN: staged
// data is never lost without a line that says so.
func (d *Daemon) sweepLoop(ctx context.Context) {
	every := min(d.cfg.StageTTL, d.cfg.ReceiveTTL) / 10
	every = max(every, 100*time.Millisecond)
	t := time.NewTicker(every)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case now := <-t.C:
			drops := d.reg.sweep(now, d.cfg.StageTTL, d.cfg.ReceiveTTL)
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
