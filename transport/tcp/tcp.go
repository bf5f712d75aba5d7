// Package tcp is ferry's data plane where there is no RDMA NIC: one-sided
// writes with RDMA semantics over plain TCP connections. The receiver
// reads each write's body straight into the receive slot's memory and
// enforces what a NIC would: a live slot and the right key.
package tcp

import (
	"context"
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

// Config configures a Transport. Zero fields take the defaults noted.
type Config struct {
	// Addr is the host:port to listen on; ":0" picks a free port.
	Addr string
	// Sink receives incoming writes. Required.
	Sink transport.Sink
	// Instance identifies this daemon's process to its peers; 0 picks a
	// random one.
	Instance uint64
	// MaxConnsPerPeer bounds each session's connections, and so how many
	// of its writes travel at once. Default 8.
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
	// party can cause reaches it through a rate limit (Warnf).
	Logf func(format string, args ...any)
	// Debugf, if set, hears about connections closed idle or to make
	// room.
	Debugf func(format string, args ...any)
	// RDMA, if set, serves the control connections of RDMA sessions
	// (hellos of kind rdma): it owns c until it returns, and Close closes
	// c and waits for it. Without it such a hello is answered "no RDMA
	// here", and the dialer falls back to data connections.
	RDMA func(c *connlimit.Conn, peerInstance uint64)
	// Secret, if set, is the peer secret (at least MinSecret bytes): every
	// connection, both ways, then proves that both ends hold it, and a
	// peer that cannot is refused (wire.go's handshake).
	Secret []byte
}

// DefaultLimits caps the peer port. A peer daemon needs at most
// MaxConnsPerPeer (8) connections per session, so 64 per address leaves
// room for several daemons behind one address and for redials; 1024 in
// all is 128 such peers at full width, at a few hundred KiB of kernel
// buffers each (and on RDMA a queue pair each). Past them a stranger's
// connections that carried no write go first (connlimit).
var DefaultLimits = connlimit.Limits{Total: 1024, PerSource: 64}

// DefaultIdleTimeout closes connections idle this long: long past the
// gaps between a busy peer's writes, short enough that peers gone quiet
// give back what they hold. A sender finds its connection closed and
// opens another without failing a write (session.get).
const DefaultIdleTimeout = 2 * time.Minute

// ioChunk is how much of a body moves under one deadline, so a long
// write that keeps making progress never times out.
const ioChunk = 1 << 20

// lingerBytes bounds what a receiver drains while its last reply to a
// connection it is closing travels.
const lingerBytes = 4 << 20

var keepAlive = net.KeepAliveConfig{Enable: true, Idle: 15 * time.Second, Interval: 5 * time.Second, Count: 3}

// Transport is a listening TCP data plane and a dialer of sessions to
// peers. It implements transport.Transport.
type Transport struct {
	cfg  Config
	port *connlimit.Listener
	warn *loglimit.Limiter
	done chan struct{} // closed by Close

	mu       sync.Mutex
	closed   bool
	sessions map[*session]struct{}
}

var _ transport.Transport = (*Transport)(nil)

// Listen starts a Transport listening on cfg.Addr.
func Listen(cfg Config) (*Transport, error) {
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
	if cfg.Limits.Total <= 0 {
		cfg.Limits.Total = DefaultLimits.Total
	}
	if cfg.Limits.PerSource <= 0 {
		cfg.Limits.PerSource = DefaultLimits.PerSource
	}
	if cfg.MaxWrite == 0 {
		cfg.MaxWrite = 1 << 36
	}
	lc := net.ListenConfig{KeepAliveConfig: keepAlive}
	ln, err := lc.Listen(context.Background(), "tcp", cfg.Addr)
	if err != nil {
		return nil, fmt.Errorf("tcp listen %s: %w", cfg.Addr, err)
	}
	t := &Transport{
		cfg:      cfg,
		done:     make(chan struct{}),
		sessions: make(map[*session]struct{}),
	}
	logf := cfg.Logf
	if logf == nil {
		logf = func(string, ...any) {}
	}
	t.warn = loglimit.New("peer port", logf)
	t.port = connlimit.Listen(ln, connlimit.Config{
		Limits: cfg.Limits, Name: "peer port", HandshakeTimeout: cfg.HandshakeTimeout,
		Serve: t.serve, Warnf: t.warn.Printf, Debugf: cfg.Debugf,
	})
	return t, nil
}

func (t *Transport) Name() string { return "tcp" }

func (t *Transport) Addr() net.Addr { return t.port.Addr() }

// Instance is the identity this daemon announces to its peers.
func (t *Transport) Instance() uint64 { return t.cfg.Instance }

// Config is the configuration in force, defaults filled in.
func (t *Transport) Config() Config { return t.cfg }

// PortStats is what the peer port's caps and timeouts did.
func (t *Transport) PortStats() connlimit.Stats { return t.port.Stats() }

// Close stops the listener, closes every accepted and dialed connection so
// writes in flight fail on both sides, and waits for the connections'
// goroutines to end (so for any Sink.Accept call in progress to return).
func (t *Transport) Close() error {
	t.mu.Lock()
	if !t.closed {
		t.closed = true
		close(t.done)
	}
	sessions := make([]*session, 0, len(t.sessions))
	for s := range t.sessions {
		sessions = append(sessions, s)
	}
	t.mu.Unlock()
	err := t.port.Close()
	for _, s := range sessions {
		s.Close()
	}
	t.warn.Stop()
	if err != nil {
		return fmt.Errorf("tcp close %s: %w", t.port.Addr(), err)
	}
	return nil
}

func (t *Transport) isClosed() bool {
	select {
	case <-t.done:
		return true
	default:
		return false
	}
}

func (t *Transport) debugf(format string, args ...any) {
	if t.cfg.Debugf != nil {
		t.cfg.Debugf(format, args...)
	}
}

// Warnf logs a failure a remote party can cause at will (a handshake
// that failed, a connection that broke), rate-limited together with the
// peer port's others: the rdma transport logs its lanes' through it.
func (t *Transport) Warnf(format string, args ...any) { t.warn.Printf(format, args...) }

// quiet says whether c's failure is no news: the port closed it (to
// make room, or closing), or the transport is closing.
func (t *Transport) quiet(c *connlimit.Conn) bool { return c.Dropped() || t.isClosed() }

func (t *Transport) serve(c *connlimit.Conn) {
	tune(c.TCPConn)
	h, err := t.welcome(c.TCPConn)
	if err != nil {
		if errors.Is(err, os.ErrDeadlineExceeded) {
			c.Closing(connlimit.ReasonTimeout)
		}
		// A bare connect and close is a port probe, and a dialer that
		// finds no RDMA here falls back and says so: neither is worth a
		// line.
		if err != io.EOF && err != errNoRDMAHere && !t.quiet(c) {
			t.Warnf("tcp: handshake from %s: %v", c.RemoteAddr(), err)
		}
		return
	}
	if t.cfg.Secret != nil {
		c.Prove() // only a holder of the secret gets here
	}
	if h.kind == kindRDMA {
		t.cfg.RDMA(c, h.instance)
		return
	}
	r := receiver{t: t, c: c}
	if err := r.run(); err != nil && !t.quiet(c) {
		t.Warnf("tcp: connection from %s: %v", c.RemoteAddr(), err)
	}
}

var errNoRDMAHere = errors.New("asked for RDMA, which this transport does not serve")

// ErrUnmatched ends a connection that sent MaxUnmatched writes matching no
// receive slot: a sender guessing keys, or one holding many stale slots.
var ErrUnmatched = fmt.Errorf("closed the connection after %d writes that matched no receive slot (keys guessed, or slots long gone)", MaxUnmatched)

// welcome runs the server side of the handshake and returns the
// client's hello.
func (t *Transport) welcome(c *net.TCPConn) (hello, error) {
	c.SetDeadline(time.Now().Add(t.cfg.HandshakeTimeout))
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
	secret := t.cfg.Secret
	switch {
	case herr != nil:
	case secret != nil && !h.auth():
		status, herr = statusNeedSecret, authErr("peer has no secret, and this daemon requires one: give both daemons the same peer secret")
	case secret == nil && h.auth():
		status, herr = statusNoSecret, authErr("peer has a secret, and this daemon has none: give both daemons the same peer secret")
	case h.kind == kindRDMA && t.cfg.RDMA == nil:
		status, herr = statusNoRDMA, errNoRDMAHere
	}
	server := party{instance: t.cfg.Instance, nonce: newNonce()}
	w := welcome{hello: ours(t.cfg.Instance, h.kind, secret), status: status}
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
		if err := t.verify(c, h, server); err != nil {
			return h, err
		}
	}
	c.SetDeadline(time.Time{})
	return h, nil
}

// verify takes the client's nonce and proof and answers with a verdict:
// the server's own proof, or a refusal.
func (t *Transport) verify(c *net.TCPConn, h hello, server party) error {
	var b [nonceSize + proofSize]byte
	if n, err := io.ReadFull(c, b[:]); err != nil {
		// A peer that went away or stalled proved nothing either way:
		// not an authentication failure.
		return fmt.Errorf("read %d of the peer's %d-byte nonce and proof: %w", n, len(b), err)
	}
	client := party{instance: h.instance, nonce: [nonceSize]byte(b[:nonceSize])}
	v := verdict{proof: proof(t.cfg.Secret, roleServer, h.kind, client, server)}
	var verr error
	if !validProof([proofSize]byte(b[nonceSize:]), t.cfg.Secret, roleClient, h.kind, client, server) {
		v, verr = verdict{status: statusBadProof}, authErr("proof mismatch: the peer's secret differs from this daemon's")
	}
	var vb [verdictSize]byte
	v.encode(&vb)
	if _, err := c.Write(vb[:]); err != nil && verr == nil {
		return fmt.Errorf("sending the verdict: %w", err)
	}
	return verr
}

// errIdle ends a connection that carried no write for IdleTimeout.
var errIdle = errors.New("idle")

// receiver serves the writes arriving on one accepted connection.
type receiver struct {
	t   *Transport
	c   *connlimit.Conn
	hdr [HeaderSize]byte
	rep [ReplySize + MaxMessage]byte
	bin []byte // for bodies that are refused; allocated on first use

	unmatched int // writes refused for matching no slot
}

// run serves writes until the connection ends; a clean close between
// writes, or one idle for IdleTimeout, returns nil.
func (r *receiver) run() error {
	for {
		var h Header
		if err := r.readHeader(&h); err != nil {
			switch err {
			case io.EOF:
				return nil
			case errIdle:
				r.c.Closing(connlimit.ReasonIdle)
				r.t.debugf("tcp: closed the connection from %s: no write for %s", r.c.RemoteAddr(), r.t.cfg.IdleTimeout)
				return nil
			}
			return err
		}
		if !r.c.Busy() {
			return nil // the port closed it to make room just now
		}
		err := r.serveWrite(&h)
		r.c.Idle()
		if err != nil {
			return err
		}
	}
}

func (r *receiver) readHeader(h *Header) error {
	// A pooled connection may sit idle between writes up to IdleTimeout;
	// a header that has begun must finish within IOTimeout.
	r.c.SetReadDeadline(time.Now().Add(r.t.cfg.IdleTimeout))
	n, err := io.ReadAtLeast(r.c, r.hdr[:], 1)
	if err != nil {
		if n == 0 && errors.Is(err, os.ErrDeadlineExceeded) {
			return errIdle
		}
		return err
	}
	if n < HeaderSize {
		r.c.SetReadDeadline(time.Now().Add(r.t.cfg.IOTimeout))
		if m, err := io.ReadFull(r.c, r.hdr[n:]); err != nil {
			return fmt.Errorf("read %d of a %d-byte write header: %w", n+m, HeaderSize, err)
		}
	}
	h.Decode(&r.hdr)
	return nil
}

func (r *receiver) serveWrite(h *Header) error {
	if h.Len > r.t.cfg.MaxWrite {
		r.reply(transport.OutOfBounds, FlagClose, fmt.Sprintf("write of %d bytes exceeds this receiver's limit of %d bytes", h.Len, r.t.cfg.MaxWrite))
		r.linger()
		return fmt.Errorf("refused a write of %d bytes (limit %d) and closed the connection", h.Len, r.t.cfg.MaxWrite)
	}
	dst, done, err := r.t.cfg.Sink.Accept(h.Addr, h.Len, h.Key, h.Tag)
	if err == nil && uint64(len(dst)) != h.Len {
		err = fmt.Errorf("sink gave %d bytes of memory for a %d-byte write", len(dst), h.Len)
		done(err)
	}
	if err != nil {
		code, msg := Refusal(err)
		if code == transport.NoSlot {
			if r.unmatched++; r.unmatched >= MaxUnmatched {
				r.reply(code, FlagClose, msg)
				r.linger()
				return ErrUnmatched
			}
		}
		if err := r.reply(code, 0, msg); err != nil {
			return err
		}
		return r.skip(h.Len)
	}
	if err := r.readBody(dst); err != nil {
		done(err)
		return err
	}
	done(nil)
	r.c.Prove() // it held a live slot's key
	return r.reply(transport.OK, 0, "")
}

func (r *receiver) readBody(dst []byte) error {
	for off := 0; off < len(dst); {
		end := min(off+ioChunk, len(dst))
		r.c.SetReadDeadline(time.Now().Add(r.t.cfg.IOTimeout))
		n, err := io.ReadFull(r.c, dst[off:end])
		off += n
		if err != nil {
			return fmt.Errorf("read %d of a %d-byte write body: %w", off, len(dst), err)
		}
	}
	return nil
}

// skip reads and drops the body of a refused write, keeping the stream in
// step for the next write.
func (r *receiver) skip(n uint64) error {
	bin := r.scratch()
	for left := n; left > 0; {
		r.c.SetReadDeadline(time.Now().Add(r.t.cfg.IOTimeout))
		m, err := r.c.Read(bin[:min(left, uint64(len(bin)))])
		left -= uint64(m)
		if err != nil {
			return fmt.Errorf("skipped %d of a refused %d-byte write body: %w", n-left, n, err)
		}
	}
	return nil
}

// linger lets a last reply reach the sender before the connection closes:
// closing with unread bytes makes the kernel send a reset, which can
// destroy a reply still on its way. It reads for a while (a few round
// trips' worth of bytes, at most a second) rather than for a whole body.
func (r *receiver) linger() {
	r.c.CloseWrite()
	r.c.SetReadDeadline(time.Now().Add(min(r.t.cfg.IOTimeout, time.Second)))
	bin := r.scratch()
	for n := 0; n < lingerBytes; {
		m, err := r.c.Read(bin)
		if err != nil {
			return
		}
		n += m
	}
}

func (r *receiver) scratch() []byte {
	if r.bin == nil {
		r.bin = make([]byte, 64<<10)
	}
	return r.bin
}

func (r *receiver) reply(code transport.Code, flags uint16, msg string) error {
	b := EncodeReply(&r.rep, code, flags, msg)
	r.c.SetWriteDeadline(time.Now().Add(r.t.cfg.IOTimeout))
	if _, err := r.c.Write(b); err != nil {
		return fmt.Errorf("sending a %s reply: %w", code, err)
	}
	return nil
}

// tune sets a connection's socket options. Buffer sizes stay with the
// kernel's autotuning: fixed 1 and 4 MiB buffers measured no faster on
// loopback, and a fixed size turns autotuning off for long fat links.
func tune(c *net.TCPConn) {
	c.SetNoDelay(true) // a reply or a header must not wait for more bytes
}
