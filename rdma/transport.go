// Package rdma is ferry's RDMA data plane over libibverbs (cgo): NIC
// discovery and GID choice, one shared registration of the daemon's
// arena (per-send registration when that fails), and a transport.Transport
// whose sessions are pools of RC queue pairs carrying RDMA WRITE WITH IMM,
// the immediate being the write's tag.
//
// The transport shares the peer port and its handshake (package peer)
// with transport/tcp: an RDMA lane is a TCP control connection (hello of
// kind rdma) plus an RC QP set up over it (wire.go). A peer without RDMA
// answers the hello with "no RDMA here", and the session falls back to
// TCP data connections, which the port serves too (Config.TCP).
//
// It also makes the queue pairs of Mooncake's RDMA endpoints (mcqp.go),
// which package mooncake keeps.
package rdma

import (
	"context"
	"errors"
	"fmt"
	"net"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/sys/unix"

	"github.com/ferry-project/ferry/api"
	"github.com/ferry-project/ferry/internal/connlimit"
	"github.com/ferry-project/ferry/internal/loglimit"
	"github.com/ferry-project/ferry/transport"
	"github.com/ferry-project/ferry/transport/peer"
)

// Config configures a Transport.
type Config struct {
	// Peer is the peer port: address, Sink, instance, timeouts, and
	// MaxConnsPerPeer, which bounds each session's lanes.
	Peer peer.Config
	// TCP makes the data plane for peers without RDMA on the port
	// (transport/tcp's Over), which it owns from then on. Required.
	TCP func(*peer.Port) Fallback
	// Memory is the daemon's NIC-safe memory (its mmap'd arena, never Go
	// heap), registered once at start as the shared registration. Writes
	// from and into it go straight through the NIC; anything else is
	// copied through buffers the transport maps.
	Memory []byte
	// Device is a GPU arena (Memory is then nil), registered once by the
	// first path that works (gpu.go). Writes from it name their source
	// by device address (transport.Write.Device), and a Sink that is a
	// transport.InPlaceSink takes writes into it in place.
	Device *DeviceMemory
	// PerSend skips the shared registration, so that every write from
	// Memory registers its range for that write (a debugging and
	// benchmarking switch; the daemon's --rdma-registration per-send).
	PerSend bool
	// StripeMin is the size from which a write from the host arena is
	// striped over every rail pair (rails.go); 0 never stripes.
	StripeMin int
	// MooncakeQPs caps the Mooncake queue pairs open at once, across
	// every endpoint table made on this transport (mcqp.go); 0:
	// DefaultMooncakeQPs.
	MooncakeQPs int
	// ReadQPs caps the queue pairs of RDMA read connections open at
	// once, served and this daemon's own (reads.go); 0: DefaultReadQPs.
	ReadQPs int
}

// Fallback is the data plane for peers without RDMA, on the same port:
// it serves the data connections the port accepts, and dials sessions
// of data connections to a peer that answers "no RDMA here".
type Fallback interface {
	ServeData(c *connlimit.Conn, peerInstance uint64)
	Dial(ctx context.Context, addr string) (transport.Session, error)
	Close() error
}

// Queue depths. A write keeps at most sendDepth work requests in flight;
// besides the write holding a lane, up to flyingMax writes of at most
// flyingChunks messages each may wait on it for their completions, so a
// sending QP holds sendDepth+flyingMax*flyingChunks work requests. A
// receiving lane grants at most recvDepth writes at a time, and keeps
// recvPosted receives posted for immediates, one for each WRITE WITH IMM
// (granted or direct). It reposts them recvBatch at a time (one
// ibv_post_recv) and returns them to the sender as credits (wire.go): a
// sender starts with recvPosted and posts a WRITE WITH IMM only while it
// holds one, so it never runs the receiver's queue dry however long the
// receiving daemon is descheduled (docs/rdma.md, "Flow control").
const (
	sendDepth    = 64
	flyingMax    = 7
	flyingChunks = signalEvery
	recvDepth    = 16
	recvPosted   = 256
	recvBatch    = 32
	// directMax is the largest direct write: one work request, within
	// every RDMA NIC's max_msg_sz (mlx5 1 GiB, soft-RoCE 2 GiB). A
	// longer write asks for a grant and goes in chunks.
	directMax = 1 << 30
	// chunk is the size of a write's messages (the last one shorter),
	// part of the protocol: the receiver checks the length of the last.
	// signalEvery is how many go between signaled ones from registered
	// memory: enough completions to see progress, few enough to cost
	// nothing.
	chunk       = 1 << 20
	signalEvery = 8
	// drainWait bounds the wait for the flush completion after a lane is
	// broken mid-write.
	drainWait = 2 * time.Second
)

var (
	errLaneClosed = errors.New("lane closed")
	errCanceled   = errors.New("canceled")
	errNoProgress = errors.New("no progress")
	errDead       = errors.New("the receiver gave up on the lane")
)

// Registration says how Memory is registered with the NIC.
type Registration struct {
	// Mode is "shared" (registered once), "per-send" (each write
	// registers its range) or "none" (no Memory: every write is copied).
	Mode  api.RegistrationMode `json:"mode"`
	Bytes int64                `json:"bytes"`
	Took  time.Duration        `json:"took"` // the shared registration's time
	// Err is why the shared registration failed, with the fix.
	Err error `json:"-"`
	// GPU is how a GPU arena (Config.Device) was registered.
	GPU *GPURegistration `json:"-"`
}

// Stats counts how writes met the NIC, each where the work is done.
type Stats struct {
	PerSend    uint64 `json:"per_send_registrations"`    // sources registered for one write
	PerReceive uint64 `json:"per_receive_registrations"` // destinations registered for one write
	Bounced    uint64 `json:"bounced_sends"`             // sources copied through a bounce buffer
	Staged     uint64 `json:"staged_receives"`           // destinations written through a staging buffer
	Rejected   uint64 `json:"rejected_completions"`      // receive completions that did not match their grant
	// Failed is granted writes the receiver gave up on (a receive
	// completed in error, a rejected completion, the lane or transport
	// closing first): none delivered, each lane closed.
	Failed uint64 `json:"failed_receives"`

	// The sending side's work, per write it completed (Sends):
	Sends  uint64 `json:"sends"`  // writes that completed, direct or granted
	Direct uint64 `json:"direct"` // of them, direct writes (no header)
	// ControlMessages is the messages on lanes' control connections for
	// writes, both ways and both roles: a header and its reply each
	// count one where they are sent and where they are read.
	ControlMessages uint64 `json:"control_messages"`
	Posts           uint64 `json:"posts"`         // ibv_post_send calls
	WorkRequests    uint64 `json:"work_requests"` // work requests posted
	Signaled        uint64 `json:"signaled"`      // of them, signaled
	CopiedBytes     uint64 `json:"copied_bytes"`  // bytes the CPU copied: into bounce buffers, out of staging buffers

	// Flow control (docs/rdma.md): credit messages, sent as a receiver
	// reposts receives and read as a sender; the writes that found
	// their lane without a credit and waited for one, and how long.
	CreditMessages  uint64        `json:"credit_messages"`
	CreditStalls    uint64        `json:"credit_stalls"`
	CreditStallTime time.Duration `json:"credit_stall_ns"`

	// The receiving side's direct writes: their completions, and those
	// that counted for nothing (each also logged, rate-limited).
	DirectCompletions uint64 `json:"direct_completions"`
	DirectRefused     uint64 `json:"direct_refused"`

	// Windows mode: windows bound over slots, and invalidated.
	WindowBinds         uint64 `json:"window_binds"`
	WindowInvalidations uint64 `json:"window_invalidations"`

	// Rails (rails.go): of Sends, those striped over several NICs, and
	// the rails that failed under a striped write, whose pieces went on
	// the others.
	Striped   uint64 `json:"striped"`
	Failovers uint64 `json:"failovers"`
	// Of Sends, those from a region registered on rails other than 0
	// that went out through them (RegisterRegionOn): in pieces, or as
	// one write out of its home rail.
	RegionRails uint64 `json:"region_rails"`
}

type counters struct {
	perSend, perReceive, bounced, staged, rejected, failed atomic.Uint64
	sends, direct, control, posts, wrs, signaled, copied   atomic.Uint64
	credits, creditStalls, creditWait                      atomic.Uint64 // creditWait in ns
	directCompletions, directRefused                       atomic.Uint64
	windowBinds, windowInvalidations                       atomic.Uint64
	striped, failovers, railed                             atomic.Uint64
}

// Transport is the RDMA data plane. It implements transport.Transport.
type Transport struct {
	cfg Config
	// warn limits the WARN lines a peer's failures cause here (a lost
	// rail, a write canceled mid-flight, a peer without RDMA): one per
	// send, and a failing peer fails many.
	warn   *loglimit.Limiter
	port   *peer.Port
	tcp    Fallback
	nic    nic
	shared region
	reg    Registration
	// rails are the NICs the transport drives, rail 0 being nic and
	// shared (rails.go).
	rails []*rail
	// mem is the host memory writes reach the NIC from and land in
	// without a copy: Config.Memory, or a GPU arena's bounce area. dev
	// is a GPU arena the NIC reaches itself (dmabuf or peer memory).
	mem   []byte
	dev   transport.Range
	stats counters
	// windows binds the windows over slots in windows mode (windows.go),
	// rail 0's; nil in the other modes, and noWindows says why. The other
	// rails' are their rail's (rails.go), made under winMu.
	windows   *windows
	noWindows error
	winMu     sync.Mutex
	// lent is the clients' regions the daemon registered (regions.go).
	lent lentRegions
	// engines is engine regions' registrations for peers' writes
	// (engines.go).
	engines lentRegions
	// mooncakePool is the part of Memory registered for Mooncake peers'
	// writes (MooncakePool); under mu.
	mooncakePool region
	// direct is the Sink when this transport takes direct writes (see
	// wire.go): the shared registration, a DirectSink, and windows or an
	// authenticated port. Nil otherwise.
	direct transport.DirectSink

	closing  chan struct{} // closed when Close starts
	mu       sync.Mutex
	closed   bool
	sessions map[*session]struct{}
	accepted map[*lane]struct{} // served by serveLane
	// The queue pairs of Mooncake endpoints and of read connections,
	// each kind under its cap (mcqp.go).
	mcQPs, readQPs qpCap
	closeOnce      sync.Once
	closeErr       error
}

var _ transport.Transport = (*Transport)(nil)

// Listen opens the port and GID of choice (see Discover and Choose),
// registers cfg.Memory, and listens on the peer port.
func Listen(cfg Config, choice Choice) (*Transport, error) {
	return ListenRails(cfg, []Choice{choice})
}

// listen runs a Transport over n, and more NICs as rails 1 and on, which
// it owns from here on.
func listen(cfg Config, n nic, more ...nic) (*Transport, error) {
	if cfg.TCP == nil {
		return nil, errors.New("rdma: Config.TCP is required")
	}
	t := &Transport{
		cfg: cfg, nic: n,
		closing:  make(chan struct{}),
		sessions: make(map[*session]struct{}),
		accepted: make(map[*lane]struct{}),
	}
	if cfg.MooncakeQPs <= 0 {
		t.cfg.MooncakeQPs = DefaultMooncakeQPs
	}
	if cfg.ReadQPs <= 0 {
		t.cfg.ReadQPs = DefaultReadQPs
	}
	t.mcQPs = qpCap{open: map[*MooncakeQP]struct{}{}, limit: t.cfg.MooncakeQPs,
		full: "this ferryd holds %d Mooncake queue pairs, the most it keeps across all its Mooncake segments (ferryd's own and every engine's): no more until endpoints close"}
	t.readQPs = qpCap{open: map[*MooncakeQP]struct{}{}, limit: t.cfg.ReadQPs,
		full: "this ferryd holds %d queue pairs of RDMA read connections (served and its own), the most it keeps: no more until reads end"}
	if cfg.Peer.Logf != nil {
		t.warn = loglimit.New("rdma", cfg.Peer.Logf)
	}
	ws, windowed := cfg.Peer.Sink.(transport.WindowSink)
	var err error
	if cfg.Device != nil {
		err = t.registerDevice(windowed)
	} else {
		t.registerShared(windowed)
	}
	if err == nil {
		err = t.openRails(more)
	}
	if err != nil {
		t.closeRails(false)
		t.closeShared()
		return nil, fmt.Errorf("rdma: %w", err)
	}
	if t.port, err = peer.Listen(cfg.Peer); err != nil {
		t.closeRails(false)
		t.closeShared()
		return nil, fmt.Errorf("rdma: %w", err)
	}
	t.cfg.Peer = t.port.Config()
	// Direct writes land at a slot's address under its window or the
	// shared rkey: not on a GPU arena's bounce area, which holds no slot.
	slotsRegistered := t.shared != nil && (cfg.Device == nil || t.dev.Len > 0)
	if ds, ok := cfg.Peer.Sink.(transport.DirectSink); ok && slotsRegistered && (t.windows != nil || t.cfg.Peer.Secret != nil) {
		t.direct = ds
	}
	if t.windows != nil {
		ws.UseWindows(slotWindows{t})
	}
	t.tcp = cfg.TCP(t.port)
	h := peer.Handlers{Data: t.tcp.ServeData, RDMA: t.serveLane}
	if _, ok := cfg.Peer.Sink.(ReadGranter); ok {
		h.RDMARead = t.serveReads
	}
	t.port.Serve(h)
	return t, nil
}

// registerShared registers Memory once, timing it: for windows when
// the Sink makes them (windowed) and the NIC has them, else for remote
// writes. A failure leaves the transport in per-send mode with the
// reason and the fix.
func (t *Transport) registerShared(windowed bool) {
	mem := t.cfg.Memory
	t.mem = mem
	t.reg = Registration{Mode: api.RegistrationNone, Bytes: int64(len(mem))}
	t.noWindows = errors.New("the transport has no memory of its own to put windows over")
	if len(mem) == 0 {
		return
	}
	t.reg.Mode = api.RegistrationPerSend
	t.noWindows = errors.New("windows need the memory registered once, and it is registered per send")
	if t.cfg.PerSend {
		return
	}
	start := time.Now()
	if windowed {
		t.shared, t.windows, t.noWindows = t.registerWindowed(func() (region, error) { return t.nic.Register(mem, windowBinding) }, addrOf(mem), uint64(len(mem)))
	} else {
		t.noWindows = errors.New("the receiving Sink puts no windows over its slots")
	}
	var err error
	if t.shared == nil {
		t.shared, err = t.nic.Register(mem, peerWrites)
	}
	t.reg.Took = time.Since(start)
	if err != nil {
		t.reg.Err = memlockAdvice(err, len(mem))
		return
	}
	t.reg.Mode = api.RegistrationShared
}

// registerWindowed registers the size bytes at base for windows
// (register) and makes the windows, or says why not.
func (t *Transport) registerWindowed(register func() (region, error), base, size uint64) (region, *windows, error) {
	if err := t.nic.Windows(); err != nil {
		return nil, nil, err
	}
	reg, err := register()
	if err != nil {
		return nil, nil, fmt.Errorf("registering the memory for windows (IBV_ACCESS_MW_BIND): %w", err)
	}
	w, err := newWindows(t.nic, 0, reg, base, size, &t.lent, &t.stats)
	if err != nil {
		reg.Close()
		return nil, nil, err
	}
	return reg, w, nil
}

// closeShared drops the windows, then the registrations under them:
// regions' left registered, and the arena's.
func (t *Transport) closeShared() error {
	var errs []error
	if t.mooncakePool != nil {
		errs = append(errs, t.mooncakePool.Close())
	}
	if t.windows != nil {
		errs = append(errs, t.windows.close())
	}
	errs = append(errs, t.closeRailWindows())
	errs = append(errs, t.lent.close(), t.engines.close())
	if t.shared != nil {
		errs = append(errs, t.shared.Close())
	}
	return errors.Join(errs...)
}

// memlockAdvice explains a failed shared registration: nearly always the
// locked-memory limit, which the NIC's page pinning counts against.
func memlockAdvice(err error, n int) error {
	return fmt.Errorf("the shared registration of %d bytes failed with %s (%w); %s so the arena registers once; until then each send registers its range and deregisters it after (per-send mode)", n, errnoName(err), err, memlockLimit())
}

// memlockLimit says what the locked-memory limit is and how to lift it.
func memlockLimit() string {
	var lim unix.Rlimit
	limit := "unknown"
	if unix.Getrlimit(unix.RLIMIT_MEMLOCK, &lim) == nil {
		limit = fmt.Sprintf("%d bytes", lim.Cur)
		if lim.Cur == unix.RLIM_INFINITY {
			limit = "unlimited"
		}
	}
	return fmt.Sprintf("the locked-memory limit (RLIMIT_MEMLOCK) is %s: set LimitMEMLOCK=infinity in ferryd's systemd unit (or ulimit -l unlimited)", limit)
}

func (t *Transport) Name() string { return "rdma" }

func (t *Transport) Addr() net.Addr { return t.port.Addr() }

// PortStats is what the peer port's caps and timeouts did, its RDMA
// lanes included.
func (t *Transport) PortStats() connlimit.Stats { return t.port.Stats() }

// Registration says how Memory is registered.
func (t *Transport) Registration() Registration { return t.reg }

// Stats returns the transport's counters.
func (t *Transport) Stats() Stats {
	c := &t.stats
	return Stats{
		PerSend: c.perSend.Load(), PerReceive: c.perReceive.Load(),
		Bounced: c.bounced.Load(), Staged: c.staged.Load(), Rejected: c.rejected.Load(),
		Failed: c.failed.Load(),
		Sends:  c.sends.Load(), Direct: c.direct.Load(), ControlMessages: c.control.Load(),
		Posts: c.posts.Load(), WorkRequests: c.wrs.Load(), Signaled: c.signaled.Load(), CopiedBytes: c.copied.Load(),
		CreditMessages: c.credits.Load(), CreditStalls: c.creditStalls.Load(), CreditStallTime: time.Duration(c.creditWait.Load()),
		DirectCompletions: c.directCompletions.Load(), DirectRefused: c.directRefused.Load(),
		WindowBinds: c.windowBinds.Load(), WindowInvalidations: c.windowInvalidations.Load(),
		Striped: c.striped.Load(), Failovers: c.failovers.Load(),
		RegionRails: c.railed.Load(),
	}
}

// Protection modes: how a peer's write reaches a slot.
const (
	// ModeWindows: each slot has a memory window over exactly its bytes,
	// named in its key; any peer writes a whole slot directly through
	// it, and the NIC refuses a byte outside it (windows.go).
	ModeWindows = "windows"
	// ModeArenaRKey: direct writes under the arena's rkey, no message
	// per write; between authenticated peers only (see wire.go).
	ModeArenaRKey = "arena-rkey"
	// ModeGrant: each write's header is answered with a grant first.
	ModeGrant = "grant"
)

// Mode is how peers' writes reach this transport's slots: ModeWindows
// when it has windows, else ModeArenaRKey when it takes direct writes,
// else ModeGrant. A session's own writes go direct when the peer's
// transport is in ModeWindows, or in ModeArenaRKey between
// authenticated peers.
func (t *Transport) Mode() string {
	switch {
	case t.windows != nil:
		return ModeWindows
	case t.direct != nil:
		return ModeArenaRKey
	}
	return ModeGrant
}

// ModeWhy says why Mode is not a better one: "" in ModeWindows.
func (t *Transport) ModeWhy() string {
	switch {
	case t.windows != nil:
		return ""
	case t.direct != nil:
		return fmt.Sprintf("no memory windows: %v", t.noWindows)
	case t.shared == nil:
		return fmt.Sprintf("no memory windows: %v; no direct writes under the arena's rkey without a shared registration", t.noWindows)
	case t.cfg.Device != nil && t.dev.Len == 0:
		return fmt.Sprintf("no memory windows: %v; no direct writes: the NIC does not reach the GPU arena's slots (the bounce path asks for a grant per write)", t.noWindows)
	}
	return fmt.Sprintf("no memory windows: %v; no direct writes under the arena's rkey without a peer secret", t.noWindows)
}

func (t *Transport) logf(format string, args ...any) {
	if t.warn != nil {
		t.warn.Printf(format, args...)
	}
}

func (t *Transport) debugf(format string, args ...any) {
	if t.cfg.Peer.Debugf != nil {
		t.cfg.Peer.Debugf(format, args...)
	}
}

func (t *Transport) isClosing() bool {
	select {
	case <-t.closing:
		return true
	default:
		return false
	}
}

// Close ends every session and every accepted lane (writes in flight
// fail on both sides), stops the listener, then drops the shared
// registration and the NIC, in that order.
func (t *Transport) Close() error {
	t.closeOnce.Do(func() {
		t.mu.Lock()
		t.closed = true
		close(t.closing)
		sessions := make([]*session, 0, len(t.sessions))
		for s := range t.sessions {
			sessions = append(sessions, s)
		}
		// Accepted lanes stop at once (their receives flush); their
		// goroutines end with their control connections, which the port
		// closes and waits out (the TCP side's Close closes it).
		for l := range t.accepted {
			l.abort()
		}
		qps := make([]*MooncakeQP, 0, len(t.mcQPs.open)+len(t.readQPs.open))
		for q := range t.mcQPs.open {
			qps = append(qps, q)
		}
		for q := range t.readQPs.open {
			qps = append(qps, q)
		}
		t.mu.Unlock()
		for _, s := range sessions {
			s.Close()
		}
		// Those of endpoints and reads their owners left open.
		for _, q := range qps {
			q.Close()
		}
		if t.warn != nil {
			t.warn.Stop()
		}
		// The windows and regions go before the rails' NICs they are on.
		errs := []error{t.tcp.Close(), t.closeShared(), t.closeRails(true), t.nic.Close()}
		if err := errors.Join(errs...); err != nil {
			t.closeErr = fmt.Errorf("rdma close: %w", err)
		}
	})
	return t.closeErr
}
