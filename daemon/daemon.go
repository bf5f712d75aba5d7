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
	"path/filepath"
	"sync/atomic"
	"time"

	"github.com/rs/zerolog"

	"github.com/ferry-project/ferry/api"
	"github.com/ferry-project/ferry/arena"
	"github.com/ferry-project/ferry/transport"
	"github.com/ferry-project/ferry/transport/tcp"
)

// Version is ferryd's version, set at link time.
var Version = "dev"

// Config is everything ferryd is told at start. Zero values mean the
// defaults below; Check reports what is wrong.
type Config struct {
	Socket        string        // control socket path
	Listen        string        // peer port, host:port
	Advertise     string        // what receive slots name as session; default from Listen
	Device        string        // "cpu" (CUDA comes later)
	Transport     string        // "tcp" (RDMA comes later)
	ArenaSize     int64         // bytes
	ArenaFile     string        // backing file clients map; default Socket+".arena"
	SlowThreshold time.Duration // transfers slower than this are logged
	SendRetries   int           // re-dials after a failed write
	SendTimeout   time.Duration // bound on one send, retries included
	StageTTL      time.Duration // staged entries older than this are swept
	ReceiveTTL    time.Duration // receive slots older than this are swept
	IOTimeout     time.Duration // deadline on each network read/write
	MaxConns      int           // connections per peer session
	MetricsListen string        // optional TCP host:port serving GET /metrics; "" for none
	Log           zerolog.Logger
}

// Defaults.
const (
	DefaultArenaSize     = 1 << 30
	DefaultSlowThreshold = 200 * time.Millisecond
	DefaultSendTimeout   = 60 * time.Second
	DefaultTTL           = 10 * time.Minute
	DefaultIOTimeout     = 10 * time.Second
	DefaultMaxConns      = 8
	arenaAlign           = 256
)

func (c *Config) applyDefaults() {
	if c.Socket == "" {
		c.Socket = api.DefaultSocket
	}
	if c.Listen == "" {
		c.Listen = fmt.Sprintf(":%d", api.DefaultPeerPort)
	}
	if c.Device == "" {
		c.Device = "cpu"
	}
	if c.Transport == "" {
		c.Transport = "tcp"
	}
	if c.ArenaSize == 0 {
		c.ArenaSize = DefaultArenaSize
	}
	if c.ArenaFile == "" {
		c.ArenaFile = c.Socket + ".arena"
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
}

// Check says what is wrong with the configuration, one sentence per field.
func (c *Config) Check() error {
	c.applyDefaults()
	var errs []error
	if c.Device != "cpu" {
		errs = append(errs, fmt.Errorf("--device %q is not available in this build: only \"cpu\" (host memory) is supported so far", c.Device))
	}
	if c.Transport != "tcp" {
		errs = append(errs, fmt.Errorf("--transport %q is not available in this build: only \"tcp\" is supported so far", c.Transport))
	}
	if c.ArenaSize < arenaAlign {
		errs = append(errs, fmt.Errorf("--arena-size %d is too small: give at least %d bytes, e.g. 64MiB", c.ArenaSize, arenaAlign))
	}
	if c.SendRetries < 0 || c.SendRetries > 10 {
		errs = append(errs, fmt.Errorf("--send-retries %d is outside 0..10", c.SendRetries))
	}
	for name, d := range map[string]time.Duration{
		"--slow-threshold": c.SlowThreshold, "--send-timeout": c.SendTimeout, "--stage-ttl": c.StageTTL,
		"--receive-ttl": c.ReceiveTTL, "--io-timeout": c.IOTimeout,
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
	if c.Advertise != "" {
		if err := checkSession(c.Advertise); err != nil {
			errs = append(errs, fmt.Errorf("--advertise: %v", err))
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
	mem       *arena.HostFile
	reg       *registry
	tr        transport.Transport
	sessions  *sessions
	metrics   *metrics
	regs      *memRegs
	control   net.Listener
	http      *http.Server
	metricsLn net.Listener // --metrics-listen, or nil
	metricsHS *http.Server
	advertise string
	slowNanos atomic.Int64
}

// New allocates the arena, opens the peer port and the control socket.
// Nothing is served until Serve.
func New(cfg Config) (*Daemon, error) {
	if err := cfg.Check(); err != nil {
		return nil, err
	}
	d := &Daemon{cfg: cfg, log: cfg.Log, started: time.Now(), instance: randomInstance()}
	d.slowNanos.Store(int64(cfg.SlowThreshold))

	// Claim the control socket first: if another ferryd answers there, stop
	// before touching its arena file.
	ln, err := listenControl(cfg.Socket)
	if err != nil {
		return nil, err
	}
	d.control = ln
	ok := false
	defer func() {
		if !ok {
			d.closeAll()
		}
	}()

	if err := os.MkdirAll(filepath.Dir(cfg.ArenaFile), 0o755); err != nil {
		return nil, fmt.Errorf("arena file directory: %w", err)
	}
	d.mem, err = arena.CreateHostFile(cfg.ArenaFile, cfg.ArenaSize)
	if err != nil {
		return nil, err
	}
	d.arena, err = arena.New(d.mem, arenaAlign)
	if err != nil {
		return nil, err
	}
	d.reg = newRegistry(d.arena)
	d.tr, err = tcp.Listen(tcp.Config{
		Addr: cfg.Listen, Sink: d.reg, Instance: d.instance,
		MaxConnsPerPeer: cfg.MaxConns, IOTimeout: cfg.IOTimeout,
		MaxWrite: uint64(cfg.ArenaSize),
	})
	if err != nil {
		return nil, fmt.Errorf("peer port %s: %w", cfg.Listen, err)
	}
	d.advertise = cfg.Advertise
	if d.advertise == "" {
		d.advertise = advertiseFor(d.tr.Addr(), d.log)
	}
	d.sessions = newSessions(d.tr)
	d.metrics = newMetrics(gauges{
		arena: func() (int64, int64, int64) {
			st := d.arena.Stats()
			return st.Size, st.Used, st.Free
		},
		counts:   d.reg.counts,
		sessions: d.sessions.states,
	})
	d.regs = newMemRegs(d.tr, d.mem.Base(), d.mem.Size(), d.metrics, d.log)
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
	d.http = &http.Server{
		Handler:           d.routes(),
		ReadHeaderTimeout: 10 * time.Second,
		MaxHeaderBytes:    64 << 10,
		ErrorLog:          newStdLogger(d.log),
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
	if addrs, err := net.InterfaceAddrs(); err == nil {
		for _, a := range addrs {
			if ipn, ok := a.(*net.IPNet); ok && !ipn.IP.IsLoopback() && ipn.IP.To4() != nil {
				return net.JoinHostPort(ipn.IP.String(), fmt.Sprint(port))
			}
		}
	}
	log.Warn().Int("port", port).Msg("no non-loopback IPv4 address to advertise; receive slots name 127.0.0.1: set --advertise HOST:PORT for peers on other hosts")
	return net.JoinHostPort("127.0.0.1", fmt.Sprint(port))
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
// requests are refused, in-flight ones get up to drain to finish, sessions
// and listeners close, and the arena file is removed.
func (d *Daemon) Serve(ctx context.Context, drain time.Duration) error {
	ev := d.log.Info().
		Str("socket", d.cfg.Socket).Str("listen", d.tr.Addr().String()).Str("advertise", d.advertise).
		Str("transport", d.tr.Name()).Str("device", d.cfg.Device).Int64("arena_size", d.cfg.ArenaSize).
		Str("arena_file", d.cfg.ArenaFile).Str("registration", d.regs.mode())
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
	d.log.Info().Dur("drain", drain).Msg("shutting down")
	sctx, cancel := context.WithTimeout(context.Background(), drain)
	defer cancel()
	d.reg.stop()
	if serr := d.http.Shutdown(sctx); serr != nil {
		d.log.Warn().Err(serr).Msg("drain timed out; closing the remaining requests")
	}
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
	if d.regs != nil {
		if err := d.regs.close(); err != nil {
			d.log.Warn().Err(err).Msg("deregistering the arena")
		}
	}
	if d.tr != nil {
		_ = d.tr.Close()
	}
	if d.control != nil {
		_ = d.control.Close() // unlinks the socket file
	}
	if d.arena != nil {
		_ = d.arena.Close()
	} else if d.mem != nil {
		_ = d.mem.Close()
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
			for _, x := range d.reg.sweep(now, d.cfg.StageTTL, d.cfg.ReceiveTTL) {
				d.metrics.swept.WithLabelValues(x.kind).Inc()
				d.log.Warn().Str("req_id", x.reqID).Str("kind", x.kind).Str("state", x.state).
					Int64("nbytes", x.nbytes).Dur("age", x.age).
					Msg("dropped after its TTL: it was never sent, read or deleted")
			}
		}
	}
}
