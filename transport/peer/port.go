// Package peer is the protocol ferry daemons speak to each other on the
// peer port, below both transports: the hello and its HMAC
// challenge-response (wire.go, auth.go), the listening port with its
// caps (Port), dialing with the handshake (Port.Dial), the write header
// and reply codec, and what a session of either transport shares
// (Session, Gate). transport/tcp carries a write's body on a data
// connection; rdma moves it by RDMA over a lane set up on a control
// connection. Both kinds of connection open with this handshake on the
// one port.
package peer

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"os"
	"sync"
	"time"

	"github.com/ferry-project/ferry/internal/connlimit"
	"github.com/ferry-project/ferry/internal/loglimit"
	"github.com/ferry-project/ferry/transport"
)

// Config configures a peer port and the writes on it, in both
// directions. Zero fields take the defaults noted.
type Config struct {
	// Addr is the host:port to listen on; ":0" picks a free port.
	Addr string
	// Sink receives incoming writes. Required.
	Sink transport.Sink
	// Instance identifies this daemon's process to its peers; 0 picks a
	// random one.
	Instance uint64
	// MaxConnsPerPeer bounds each session's connections (an RDMA
	// session's lanes), and so how many of its writes travel at once.
	// Default 8.
	MaxConnsPerPeer int
	// IOTimeout bounds every read and write on a connection: a peer that
	// makes no progress for this long is taken as gone. Default 10s.
	IOTimeout time.Duration
	// HandshakeTimeout bounds opening a connection, in both directions.
	// Default 5s.
	HandshakeTimeout time.Duration
	// IdleTimeout closes an accepted connection (a data connection, an
	// RDMA lane with its queue pair) that carried no write for this long;
	// its sender opens a new one when it next writes. Default
	// DefaultIdleTimeout.
	IdleTimeout time.Duration
	// Limits caps the connections the peer port holds, in total and per
	// source address (connlimit). Zero fields take DefaultLimits'.
	Limits connlimit.Limits
	// MaxWrite is the largest write accepted; a bigger one is refused and
	// its connection closed. Default 1<<36.
	MaxWrite uint64
	// Logf, if set, hears about connections that failed on the listening
	// side, where no caller is there to return an error to. What a remote
	// party can cause reaches it through a rate limit (Port.Warnf).
	Logf func(format string, args ...any)
	// Debugf, if set, hears about connections closed idle or to make
	// room.
	Debugf func(format string, args ...any)
	// Secret, if set, is the peer secret (at least MinSecret bytes): every
	// connection, both ways, then proves that both ends hold it, and a
	// peer that cannot is refused (wire.go's handshake).
	Secret []byte
	// Advertise is the host:port peers dial to reach this daemon. With a
	// Secret, a dialer proves the address it dialed, and the port takes
	// only this one or Addr; left empty, Addr or the address the
	// connection arrived on. Set it where peers dial a DNS name, or
	// through NAT or port forwarding.
	Advertise string
	// SendBuffer, when above zero, is each connection's kernel send
	// buffer (SO_SNDBUF); zero leaves it to the kernel's autotuning.
	SendBuffer int
}

// DefaultLimits caps the peer port. A peer daemon needs at most
// MaxConnsPerPeer (8) connections per session, so 64 per address leaves
// room for several daemons behind one address and for redials; 1024 in
// all is 128 such peers at full width, at a few hundred KiB of kernel
// buffers each (and on RDMA a queue pair each). Past them a stranger's
// connections that carried no write go first (connlimit).
var DefaultLimits = connlimit.Limits{Total: 1024, PerSource: 64}

// DefaultSendBuffer is the send buffer ferryd gives peer connections
// (see tune).
const DefaultSendBuffer = 256 << 10

// DefaultIdleTimeout closes connections idle this long: long past the
// gaps between a busy peer's writes, short enough that peers gone quiet
// give back what they hold. A sender finds its connection closed and
// opens another without failing a write.
const DefaultIdleTimeout = 2 * time.Minute

var keepAlive = net.KeepAliveConfig{Enable: true, Idle: 15 * time.Second, Interval: 5 * time.Second, Count: 3}

// Handler serves one accepted connection past the handshake; it owns c
// until it returns, and Port.Close closes c and waits for it.
type Handler func(c *connlimit.Conn, peerInstance uint64)

// Handlers are what a port serves, by the kind a hello asks for.
type Handlers struct {
	Data Handler // required
	// RDMA, if set, serves the control connections of RDMA lanes.
	// Without it such a hello is answered "no RDMA here", and the dialer
	// falls back to data connections.
	RDMA Handler
	// RDMARead, if set, serves the control connections of RDMA READs;
	// without it such a hello is answered "no RDMA here", and the dialer
	// reads over a read connection (read.go).
	RDMARead Handler
}

// Port is a listening peer port: the connection caps, the handshake, and
// the transports' handlers behind it. It dials as this daemon too.
type Port struct {
	cfg  Config
	ln   net.Listener
	l    *connlimit.Listener // made by Serve
	h    Handlers
	warn *loglimit.Limiter

	mu     sync.Mutex
	closed bool
}

// Listen opens the peer port on cfg.Addr. It serves nothing until Serve.
func Listen(cfg Config) (*Port, error) {
	if cfg.Sink == nil {
		return nil, errors.New("tcp listen: Config.Sink is required")
	}
	if cfg.Secret != nil {
		if err := CheckSecret(cfg.Secret); err != nil {
			return nil, fmt.Errorf("tcp listen: %w", err)
		}
	}
	for cfg.Instance == 0 {
		cfg.Instance = rand.Uint64()
	}
	if cfg.MaxConnsPerPeer <= 0 {
		cfg.MaxConnsPerPeer = 8
	}
	if cfg.IOTimeout <= 0 {
		cfg.IOTimeout = 10 * time.Second
	}
	if cfg.HandshakeTimeout <= 0 {
		cfg.HandshakeTimeout = 5 * time.Second
	}
	if cfg.IdleTimeout <= 0 {
		cfg.IdleTimeout = DefaultIdleTimeout
	}
	cfg.Limits = cfg.Limits.Or(DefaultLimits)
	if cfg.MaxWrite == 0 {
		cfg.MaxWrite = 1 << 36
	}
	lc := net.ListenConfig{KeepAliveConfig: keepAlive}
	ln, err := lc.Listen(context.Background(), "tcp", cfg.Addr)
	if err != nil {
		return nil, fmt.Errorf("tcp listen %s: %w", cfg.Addr, err)
	}
	logf := cfg.Logf
	if logf == nil {
		logf = func(string, ...any) {}
	}
	return &Port{cfg: cfg, ln: ln, warn: loglimit.New("peer port", logf)}, nil
}

// Serve starts accepting connections for h. Call it once.
func (p *Port) Serve(h Handlers) {
	p.h = h
	p.l = connlimit.Listen(p.ln, connlimit.Config{
		Limits: p.cfg.Limits, Name: "peer port", HandshakeTimeout: p.cfg.HandshakeTimeout,
		Serve: p.serve, Warnf: p.warn.Printf, Debugf: p.cfg.Debugf,
	})
}

// Addr is the listening address.
func (p *Port) Addr() net.Addr { return p.ln.Addr() }

// Config is the configuration in force, defaults filled in.
func (p *Port) Config() Config { return p.cfg }

// Instance is the identity this daemon announces to its peers.
func (p *Port) Instance() uint64 { return p.cfg.Instance }

// Stats is what the port's caps and timeouts did.
func (p *Port) Stats() connlimit.Stats {
	s := p.l.Stats()
	s.Failures = p.warn.Count()
	return s
}

// Warnf logs a failure a remote party can cause at will (a handshake
// that failed, a connection that broke), rate-limited together with the
// port's others.
func (p *Port) Warnf(format string, args ...any) { p.warn.Printf(format, args...) }

// Closed reports whether Close has begun.
func (p *Port) Closed() bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.closed
}

// Close stops the listener, closes every accepted connection, and waits
// for their handlers to return.
func (p *Port) Close() error {
	p.mu.Lock()
	p.closed = true
	p.mu.Unlock()
	var err error
	if p.l != nil {
		err = p.l.Close()
	} else {
		err = p.ln.Close()
	}
	p.warn.Stop()
	return err
}

func (p *Port) serve(c *connlimit.Conn) {
	p.tune(c.TCPConn)
	h, err := p.welcome(c.TCPConn)
	if err != nil {
		if errors.Is(err, os.ErrDeadlineExceeded) {
			c.Closing(connlimit.ReasonTimeout)
		}
		// A bare connect and close is a port probe, and a dialer that
		// finds no RDMA here falls back and says so: neither is worth a
		// line. Nor is a connection the port closed itself.
		if err != io.EOF && err != errNoRDMAHere && !c.Dropped() && !p.Closed() {
			p.Warnf("tcp: handshake from %s: %v", c.RemoteAddr(), err)
		}
		return
	}
	if p.cfg.Secret != nil {
		c.Prove() // only a holder of the secret gets here
	}
	switch h.kind {
	case KindRDMA:
		p.h.RDMA(c, h.instance)
		return
	case KindRead:
		p.serveReads(c)
		return
	case KindRDMARead:
		p.h.RDMARead(c, h.instance)
		return
	}
	p.h.Data(c, h.instance)
}

var errNoRDMAHere = errors.New("asked for RDMA, which this transport does not serve")

// welcome runs the server side of the handshake and returns the
// client's hello.
func (p *Port) welcome(c *net.TCPConn) (hello, error) {
	c.SetDeadline(time.Now().Add(p.cfg.HandshakeTimeout))
	var b [helloSize]byte
	var h hello
	if n, err := io.ReadFull(c, b[:]); err != nil {
		if n == 0 && err == io.EOF {
			return h, err
		}
		return h, fmt.Errorf("read %d of the %d-byte hello: %w", n, helloSize, err)
	}
	h.decode(&b)
	status, herr := h.check()
	secret := p.cfg.Secret
	switch {
	case herr != nil:
	case secret != nil && !h.auth():
		status, herr = statusNeedSecret, authErr("peer has no secret, and this daemon requires one: give both daemons the same peer secret")
	case secret == nil && h.auth():
		status, herr = statusNoSecret, authErr("peer has a secret, and this daemon has none: give both daemons the same peer secret")
	case h.kind == KindRDMA && p.h.RDMA == nil, h.kind == KindRDMARead && p.h.RDMARead == nil:
		status, herr = statusNoRDMA, errNoRDMAHere
	case h.kind == KindRead && p.source() == nil:
		status, herr = statusBadKind, errors.New("asked for a read connection, and this daemon serves no reads")
	}
	server := party{instance: p.cfg.Instance, nonce: newNonce()}
	w := welcome{hello: ours(p.cfg.Instance, h.kind, secret), status: status}
	var wb [welcomeSize + nonceSize]byte
	w.encode((*[welcomeSize]byte)(wb[:welcomeSize]))
	out := wb[:welcomeSize]
	if w.auth() {
		out = append(out, server.nonce[:]...)
	}
	if _, err := c.Write(out); err != nil && herr == nil {
		return h, fmt.Errorf("sending the welcome: %w", err)
	}
	if herr != nil {
		return h, herr
	}
	if secret != nil {
		if err := p.verify(c, h, server); err != nil {
			return h, err
		}
	}
	c.SetDeadline(time.Time{})
	return h, nil
}

// verify takes the client's nonce, dialed address and proof and answers
// with a verdict: the server's own proof, or a refusal.
func (p *Port) verify(c *net.TCPConn, h hello, server party) error {
	// A peer that went away or stalled proved nothing either way: not an
	// authentication failure.
	var b [nonceSize + 2]byte
	if n, err := io.ReadFull(c, b[:]); err != nil {
		return fmt.Errorf("read %d of the peer's %d-byte nonce and dialed address length: %w", n, len(b), err)
	}
	n := int(binary.LittleEndian.Uint16(b[nonceSize:]))
	if err := checkDialedLen(n); err != nil {
		return p.answer(c, verdict{status: statusBadDialed}, err)
	}
	var rb [maxDialed + proofSize]byte
	rest := rb[:n+proofSize]
	if got, err := io.ReadFull(c, rest); err != nil {
		return fmt.Errorf("read %d of the peer's %d-byte dialed address and proof: %w", got, len(rest), err)
	}
	dialed := string(rest[:n])
	if err := checkDialed(dialed); err != nil {
		return p.answer(c, verdict{status: statusBadDialed}, err)
	}
	client := party{instance: h.instance, nonce: [nonceSize]byte(b[:nonceSize])}
	v := verdict{proof: proof(p.cfg.Secret, roleServer, h.kind, dialed, client, server)}
	var verr error
	// The proof first: only a dialer that holds the secret learns that
	// it dialed the wrong address rather than that the secrets differ.
	switch {
	case !validProof([proofSize]byte(rest[n:]), p.cfg.Secret, roleClient, h.kind, dialed, client, server):
		v, verr = verdict{status: statusBadProof}, authErr("proof mismatch: the peer's secret differs from this daemon's")
	case !p.names(dialed, c.LocalAddr()):
		v, verr = verdict{status: statusNotHere}, authErr("the peer dialed %q, which is not this daemon's address (%s): something between the two (a relay, NAT or port forwarding) led the connection here; if peers reach this daemon this way, advertise the address they dial", dialed, p.addrs(c.LocalAddr()))
	}
	return p.answer(c, v, verr)
}

// names says whether dialed, the address a client proved it dialed,
// names this port: its listen address, and its advertised address where
// it has one, else the address the connection reached. A relay the
// client dialed is none of them. An advertised port does not take the
// address connections reach it at: behind NAT or port forwarding that
// is a private address, which another host (a container on the
// dialer's side, a tunnel's end) may hold as well.
func (p *Port) names(dialed string, local net.Addr) bool {
	if p.cfg.Advertise != "" {
		return sameAddr(dialed, p.cfg.Advertise) || sameAddr(dialed, p.cfg.Addr)
	}
	return sameAddr(dialed, local.String()) || sameAddr(dialed, p.cfg.Addr)
}

// addrs lists the addresses names takes, for a refusal.
func (p *Port) addrs(local net.Addr) string {
	if p.cfg.Advertise != "" {
		return fmt.Sprintf("advertised as %q, listening on %q", p.cfg.Advertise, p.cfg.Addr)
	}
	return fmt.Sprintf("listening on %q, reached at %s", p.cfg.Addr, local)
}

// answer sends the verdict v, and returns verr, the refusal it carries.
func (p *Port) answer(c *net.TCPConn, v verdict, verr error) error {
	var vb [verdictSize]byte
	v.encode(&vb)
	if _, err := c.Write(vb[:]); err != nil && verr == nil {
		return fmt.Errorf("sending the verdict: %w", err)
	}
	return verr
}

// tune sets a connection's socket options. A small send buffer makes a
// write's two copies overlap: with the kernel's autotuning a sender's
// buffer grew to hold a whole multi-MiB write, which it then copied in
// while the receiver waited, and the receiver copied out while the next
// write waited for its completion (loopback, one stream, 4 MiB writes:
// 25 Gbit/s autotuned, 45 Gbit/s with 256 KiB; 1 and 4 MiB measured no
// faster than autotuning). A fixed size turns autotuning off, so long fat
// links want it raised (Config.SendBuffer, or 0).
func (p *Port) tune(c *net.TCPConn) {
	c.SetNoDelay(true) // a reply or a header must not wait for more bytes
	if p.cfg.SendBuffer > 0 {
		c.SetWriteBuffer(p.cfg.SendBuffer)
	}
}
