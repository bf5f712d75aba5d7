package tcp

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"time"

	"golang.org/x/sys/unix"

	"github.com/ferry-project/ferry/internal/pool"
	"github.com/ferry-project/ferry/transport"
)

// lateReplyWait is how long a sender whose body write failed looks for
// the refusal that explains it; such a reply is already queued if sent.
const lateReplyWait = 200 * time.Millisecond

// Dial opens a session to the peer listening at addr, with one connection
// that has completed the handshake.
func (t *Transport) Dial(ctx context.Context, addr string) (transport.Session, error) {
	if t.isClosed() {
		return nil, fmt.Errorf("tcp dial %s: %w", addr, transport.ErrClosed)
	}
	c, instance, err := t.dial(ctx, addr, kindData)
	if err != nil {
		return nil, fmt.Errorf("tcp dial %s: %w", addr, err)
	}
	s := &session{t: t, peer: addr, instance: instance}
	s.pool = pool.New(t.cfg.MaxConnsPerPeer, s.open, func(c *conn) { c.nc.Close() })
	s.pool.Add(c)
	t.mu.Lock()
	if t.closed {
		t.mu.Unlock()
		s.pool.Close()
		return nil, fmt.Errorf("tcp dial %s: %w", addr, transport.ErrClosed)
	}
	t.sessions[s] = struct{}{}
	t.mu.Unlock()
	return s, nil
}

// ErrNoRDMA is DialRDMA's answer from a peer that serves no RDMA (it runs
// the tcp transport, or found no usable NIC): use data connections.
var ErrNoRDMA = errors.New("the peer serves no RDMA")

// DialRDMA opens the control connection of an RDMA session to the peer at
// addr: the handshake of the peer port, asking for kind rdma. The rdma
// transport continues the exchange on the returned connection. A peer
// without RDMA answers with ErrNoRDMA.
func (t *Transport) DialRDMA(ctx context.Context, addr string) (*net.TCPConn, uint64, error) {
	if t.isClosed() {
		return nil, 0, transport.ErrClosed
	}
	c, instance, err := t.dial(ctx, addr, kindRDMA)
	if err != nil {
		return nil, 0, err
	}
	return c.nc, instance, nil
}

// dial opens one connection of the given kind to addr and runs the client
// side of the handshake, returning the peer's instance.
func (t *Transport) dial(ctx context.Context, addr string, kind uint32) (*conn, uint64, error) {
	hctx, cancel := context.WithTimeout(ctx, t.cfg.HandshakeTimeout)
	defer cancel()
	d := net.Dialer{KeepAliveConfig: keepAlive}
	nc, err := d.DialContext(hctx, "tcp", addr)
	if err != nil {
		// Keep the cause only: the caller names addr and the step already.
		if op := (*net.OpError)(nil); errors.As(err, &op) {
			err = op.Err
		}
		if sc := (*os.SyscallError)(nil); errors.As(err, &sc) {
			err = sc.Err
		}
		return nil, 0, t.dialErr(ctx, hctx, "connect", err)
	}
	c := &conn{nc: nc.(*net.TCPConn)}
	tune(c.nc)
	instance, err := c.greet(hctx, t.cfg.Instance, kind, t.cfg.Secret)
	if err == ErrNoRDMA {
		c.nc.Close()
		return nil, 0, err
	}
	if err != nil {
		c.nc.Close()
		return nil, 0, t.dialErr(ctx, hctx, "handshake", err)
	}
	return c, instance, nil
}

// dialErr says whether the caller's ctx or the handshake timeout cut a
// dial short, as the socket error alone does not.
func (t *Transport) dialErr(ctx, hctx context.Context, step string, err error) error {
	if cerr := transport.ContextErr(ctx); cerr != nil {
		return fmt.Errorf("%s: %w: %w", step, cerr, err)
	}
	if transport.ContextErr(hctx) != nil {
		return fmt.Errorf("%s: no answer within %s: %w", step, t.cfg.HandshakeTimeout, err)
	}
	return fmt.Errorf("%s: %w", step, err)
}

// conn is one dialed connection and the buffers a write on it needs, so
// a write allocates no buffers of its own.
type conn struct {
	nc *net.TCPConn
	// reused is set once a write on nc has completed: from then on nc
	// waits in the pool between writes, where the receiver may close it
	// (idle, or to make room).
	reused   bool
	answered bool // the last readReply got a byte

	hdr  [HeaderSize]byte
	rep  [ReplySize]byte
	bufs [2][]byte
	vec  net.Buffers
}

func (c *conn) greet(ctx context.Context, instance uint64, kind uint32, secret []byte) (uint64, error) {
	stop := context.AfterFunc(ctx, func() { c.nc.Close() })
	defer stop()
	deadline, _ := ctx.Deadline()
	c.nc.SetDeadline(deadline)
	var hb [helloSize]byte
	h := ours(instance, kind, secret)
	h.encode(&hb)
	if _, err := c.nc.Write(hb[:]); err != nil {
		return 0, fmt.Errorf("sending the hello: %w", err)
	}
	var wb [welcomeSize]byte
	if err := c.read(wb[:], "welcome"); err != nil {
		return 0, err
	}
	var w welcome
	w.decode(&wb)
	if _, err := w.check(); err != nil {
		return 0, fmt.Errorf("%w: %v", transport.ErrIncompatible, err)
	}
	switch w.status {
	case statusOK:
	case statusNoRDMA:
		return 0, ErrNoRDMA
	case statusNeedSecret:
		return 0, authErr("the peer requires a peer secret, and this daemon has none: give both daemons the same peer secret")
	case statusNoSecret:
		return 0, authErr("the peer has no peer secret, and this daemon requires one: give both daemons the same peer secret")
	default:
		return 0, fmt.Errorf("peer refused the handshake with status %d", w.status)
	}
	if w.kind != kind {
		return 0, fmt.Errorf("peer welcomed connection kind %d, this daemon asked for kind %d", w.kind, kind)
	}
	if w.auth() != h.auth() {
		// A server that skips the secret it should have checked is no
		// ferryd of this version, or an impostor.
		return 0, authErr("the peer accepted the handshake without the challenge both sides owe (peer flags %#x, ours %#x)", w.flags, h.flags)
	}
	if h.auth() {
		if err := c.prove(secret, kind, instance, w.instance); err != nil {
			return 0, err
		}
	}
	if !stop() {
		return 0, ctx.Err() // ctx ended just now, and closed the connection
	}
	c.nc.SetDeadline(time.Time{})
	return w.instance, nil
}

// prove answers the server's challenge with a challenge of its own and
// checks the server's proof in turn.
func (c *conn) prove(secret []byte, kind uint32, clientInstance, serverInstance uint64) error {
	server := party{instance: serverInstance}
	if err := c.read(server.nonce[:], "nonce"); err != nil {
		return err
	}
	client := party{instance: clientInstance, nonce: newNonce()}
	p := proof(secret, roleClient, kind, client, server)
	if _, err := c.nc.Write(append(client.nonce[:], p[:]...)); err != nil {
		return fmt.Errorf("sending the nonce and proof: %w", err)
	}
	var vb [verdictSize]byte
	if err := c.read(vb[:], "verdict"); err != nil {
		return err
	}
	var v verdict
	v.decode(&vb)
	switch {
	case v.status == statusBadProof:
		return authErr("the peer refused this daemon's proof: the two daemons' peer secrets differ")
	case v.status != statusOK:
		return fmt.Errorf("peer refused the proof with status %d", v.status)
	case !validProof(v.proof, secret, roleServer, kind, client, server):
		return authErr("proof mismatch: the peer does not hold this daemon's secret")
	}
	return nil
}

// read reads one handshake record, naming it when the peer cuts it short.
func (c *conn) read(b []byte, what string) error {
	if n, err := io.ReadFull(c.nc, b); err != nil {
		if transport.PeerGone(err) {
			return fmt.Errorf("peer closed the connection after %d of the %d-byte %s: %w", n, len(b), what, err)
		}
		return fmt.Errorf("read %d of the %d-byte %s: %w", n, len(b), what, err)
	}
	return nil
}

// session is a pool of connections to one peer. A write holds a
// connection for its whole exchange, so concurrent writes use separate
// connections and never wait behind one another's bytes.
type session struct {
	t        *Transport
	peer     string
	instance uint64
	pool     *pool.Pool[*conn]
}

func (s *session) Transport() string { return "tcp" }

func (s *session) Peer() string { return s.peer }

func (s *session) PeerInstance() uint64 { return s.instance }

// Close closes every connection of the session; writes in flight fail.
func (s *session) Close() error {
	s.pool.Close()
	s.t.mu.Lock()
	delete(s.t.sessions, s)
	s.t.mu.Unlock()
	return nil
}

func (s *session) isClosed() bool { return s.pool.Closed() }

func (s *session) Write(ctx context.Context, w transport.Write) error {
	if s.isClosed() {
		return fmt.Errorf("tcp write to %s: %w", s.peer, transport.ErrClosed)
	}
	if err := ctx.Err(); err != nil {
		return fmt.Errorf("tcp write to %s: %w", s.peer, err)
	}
	for {
		c, err := s.get(ctx)
		if err != nil {
			return err
		}
		stale := c.reused
		reuse, unanswered, err := s.send(ctx, c, &w)
		if reuse {
			c.reused = true
			s.pool.Put(c)
		} else {
			s.pool.Drop(c)
		}
		// A receiver closes a pooled connection it finds idle (or needs
		// the room for) without a word, and the close can cross a write
		// just sent on it: such a write took nothing, so it goes again on
		// another connection rather than fail. Each retry drops a pooled
		// connection, so a freshly opened one ends the loop.
		if !stale || !unanswered {
			return err
		}
	}
}

// get takes an idle connection, or opens one while the session is under
// its limit, or waits for one to come back. A pooled connection the
// receiver has closed meanwhile is dropped, and another taken.
func (s *session) get(ctx context.Context) (*conn, error) {
	for {
		c, err := s.getAny(ctx)
		if err != nil || !c.reused || c.alive() {
			return c, err
		}
		s.pool.Drop(c)
	}
}

// alive reports whether a pooled connection is still open and in step:
// between writes the receiver sends nothing, so an end of stream, a
// reset or an unasked byte waiting means it cannot carry a write.
func (c *conn) alive() bool {
	rc, err := c.nc.SyscallConn()
	if err != nil {
		return false
	}
	alive := false
	rc.Read(func(fd uintptr) bool {
		var b [1]byte
		_, _, err := unix.Recvfrom(int(fd), b[:], unix.MSG_PEEK|unix.MSG_DONTWAIT)
		alive = err == unix.EAGAIN
		return true // one look, never wait
	})
	return alive
}

func (s *session) getAny(ctx context.Context) (*conn, error) {
	c, err := s.pool.Get(ctx)
	switch {
	case err == nil:
		return c, nil
	case err == pool.ErrClosed:
		return nil, fmt.Errorf("tcp write to %s: %w", s.peer, transport.ErrClosed)
	case errors.Is(err, pool.ErrClosed): // closed while opening one
		return nil, fmt.Errorf("tcp write to %s: opening a connection: %w: %w", s.peer, transport.ErrClosed, err)
	case err == ctx.Err():
		return nil, fmt.Errorf("tcp write to %s: waiting for a connection: %w", s.peer, err)
	}
	return nil, fmt.Errorf("tcp write to %s: opening a connection: %w", s.peer, err)
}

// open opens one more connection of the session, to the same peer
// process it was dialed to.
func (s *session) open(ctx context.Context) (*conn, error) {
	c, instance, err := s.t.dial(ctx, s.peer, kindData)
	if err == nil && instance != s.instance {
		c.nc.Close()
		err = fmt.Errorf("peer restarted (instance %#x, session opened with %#x); open a new session", instance, s.instance)
	}
	return c, err
}

// send runs one write on c: header and body out, reply in. reuse reports
// whether c is still in step and may carry another write; unanswered,
// that the receiver closed c without a byte of reply while the caller
// was still waiting for it (so the write may go again elsewhere).
func (s *session) send(ctx context.Context, c *conn, w *transport.Write) (reuse, unanswered bool, err error) {
	if ctx.Done() != nil {
		stop := context.AfterFunc(ctx, func() { c.nc.Close() })
		defer func() {
			if !stop() {
				reuse = false // closed by the cancellation
			}
		}()
	}
	body := w.Src
	h := Header{Addr: w.Remote, Len: uint64(len(body)), Key: w.Key, Tag: w.Tag}
	h.Encode(&c.hdr)

	// The header and the first chunk go in one writev; the rest of the
	// body follows in chunks, each with a fresh deadline.
	c.bufs = [2][]byte{c.hdr[:], body[:min(len(body), ioChunk)]}
	c.vec = c.bufs[:]
	c.nc.SetWriteDeadline(s.deadline(ctx))
	n, err := c.vec.WriteTo(c.nc)
	sent := max(int(n)-HeaderSize, 0)
	for err == nil && sent < len(body) {
		c.nc.SetWriteDeadline(s.deadline(ctx))
		var m int
		m, err = c.nc.Write(body[sent:min(sent+ioChunk, len(body))])
		sent += m
	}
	if err != nil {
		if transport.ContextErr(ctx) == nil && transport.PeerGone(err) {
			// A receiver that refuses a write outright replies first and
			// then closes; that reply says why the body could not go.
			c.nc.SetReadDeadline(time.Now().Add(lateReplyWait))
			code, _, msg, rerr := c.readReply()
			if rerr == nil && code != transport.OK {
				return false, false, &transport.Refusal{Code: code, Message: msg}
			}
			unanswered = s.closedUnanswered(ctx, c, rerr)
		}
		return false, unanswered, s.fail(ctx, err, fmt.Sprintf("after %d of %d bytes", sent, len(body)))
	}

	c.nc.SetReadDeadline(s.deadline(ctx))
	code, flags, msg, err := c.readReply()
	if err != nil {
		return false, s.closedUnanswered(ctx, c, err), s.fail(ctx, err, fmt.Sprintf("waiting for the completion of %d bytes", len(body)))
	}
	reuse = flags&FlagClose == 0
	if code != transport.OK {
		return reuse, false, &transport.Refusal{Code: code, Message: msg}
	}
	return reuse, false, nil
}

// closedUnanswered says whether a reply's read failed because the
// receiver closed c before the reply's first byte, while the write was
// neither canceled nor its session closed.
func (s *session) closedUnanswered(ctx context.Context, c *conn, err error) bool {
	return !c.answered && transport.PeerGone(err) && transport.ContextErr(ctx) == nil && !s.isClosed()
}

// deadline is IOTimeout from now, or ctx's deadline if sooner.
func (s *session) deadline(ctx context.Context) time.Time {
	d := time.Now().Add(s.t.cfg.IOTimeout)
	if cd, ok := ctx.Deadline(); ok && cd.Before(d) {
		return cd
	}
	return d
}

// fail explains a broken write: whose doing it was, and how far it got.
func (s *session) fail(ctx context.Context, err error, where string) error {
	switch {
	case s.isClosed():
		return fmt.Errorf("tcp write to %s: %w %s: %w", s.peer, transport.ErrClosed, where, err)
	case transport.ContextErr(ctx) != nil:
		return fmt.Errorf("tcp write to %s: %w %s", s.peer, transport.ContextErr(ctx), where)
	case errors.Is(err, os.ErrDeadlineExceeded):
		return fmt.Errorf("tcp write to %s: peer made no progress for %s %s: %w", s.peer, s.t.cfg.IOTimeout, where, err)
	case transport.PeerGone(err):
		return fmt.Errorf("tcp write to %s: peer closed the connection %s: %w", s.peer, where, err)
	}
	return fmt.Errorf("tcp write to %s: failed %s: %w", s.peer, where, err)
}

// readReply reads a reply; c.answered says whether any byte of it came.
func (c *conn) readReply() (code transport.Code, flags uint16, msg string, err error) {
	got, err := io.ReadFull(c.nc, c.rep[:])
	c.answered = got > 0
	if err != nil {
		return 0, 0, "", err
	}
	code, flags, n, err := DecodeReply(&c.rep)
	if err != nil || n == 0 {
		return code, flags, "", err
	}
	b := make([]byte, n)
	if _, err := io.ReadFull(c.nc, b); err != nil {
		return 0, 0, "", err
	}
	return code, flags, string(b), nil
}
