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
)

// Version is ferryd's version, set at link time.
var Version = "dev"

// Config is everything ferryd is told at start. Zero values mean the
// defaults below; Check reports what is wrong.
type Config struct {
	Socket       string // control socket path
	Listen       string // peer port, host:port
	Advertise    string // what receive slots name as session; default from Listen
	Device       string // "cpu" (CUDA comes later)
	Transport    string // "auto", "rdma" or "tcp"
	RDMADevice   string // RDMA device to use; "" chooses
	RDMAGIDIndex *int   // GID table index; nil chooses by the advertised address
	// RDMARegistration is "shared" (the arena registered once) or
	// "per-send" (a debugging switch: each send registers its range).
	RDMARegistration string
	ArenaSize        int64         // bytes
	ArenaFile        string        // backing file clients map; default Socket+".arena"
	SlowThreshold    time.Duration // transfers slower than this are logged
	SendRetries      int           // re-dials after a failed write
	SendTimeout      time.Duration // bound on one send, retries included
	StageTTL         time.Duration // staged entries older than this are swept
	ReceiveTTL       time.Duration // receive slots older than this are swept
	IOTimeout        time.Duration // deadline on each network read/write
	MaxConns         int           // connections per peer session
	Log              zerolog.Logger
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
	dp        *dataPlane
	sessions  *sessions
	metrics   *metrics
	control   net.Listener
	http      *http.Server
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
	d.dp, err = openTransport(cfg, d.reg, d.instance, d.mem.Host(), d.log)
	if err != nil {
		return nil, err
	}
	d.tr = d.dp.tr
	d.advertise = cfg.Advertise
	if d.advertise == "" {
		d.advertise = advertiseFor(d.tr.Addr(), d.log)
	}
	d.sessions = newSessions(d.tr)
	d.metrics = newMetrics(func() (float64, float64) {
		st := d.arena.Stats()
		return float64(st.Size), float64(st.Used)
	}, d.reg.counts)
	d.metrics.reg.MustRegister(d.dp.collectors()...)
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

// SetSlowThreshold changes the slow-transfer threshold while running.
func (d *Daemon) SetSlowThreshold(t time.Duration) { d.slowNanos.Store(int64(t)) }

func (d *Daemon) slowThreshold() time.Duration { return time.Duration(d.slowNanos.Load()) }

// Serve answers the control API until ctx ends, then shuts down: new
// requests are refused, in-flight ones get up to drain to finish, sessions
// and listeners close, and the arena file is removed.
func (d *Daemon) Serve(ctx context.Context, drain time.Duration) error {
	d.log.Info().
		Str("socket", d.cfg.Socket).Str("listen", d.tr.Addr().String()).Str("advertise", d.advertise).
		Str("transport", d.tr.Name()).Str("device", d.cfg.Device).Int64("arena_size", d.cfg.ArenaSize).
		Str("arena_file", d.cfg.ArenaFile).Str("version", Version).Int("pid", os.Getpid()).
		Msg("ready")
	errc := make(chan error, 1)
	go func() { errc <- d.http.Serve(d.control) }()
	go d.sweepLoop(ctx)

	var err error
	select {
	case <-ctx.Done():
	case err = <-errc:
		err = fmt.Errorf("control socket: %w", err)
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
	if d.sessions != nil {
		d.sessions.closeAll()
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
