package tcp

import (
	"context"
	"fmt"
	"net"
	"time"

	"golang.org/x/sys/unix"

	"github.com/ferry-project/ferry/internal/pool"
	"github.com/ferry-project/ferry/transport"
	"github.com/ferry-project/ferry/transport/peer"
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
	nc, instance, err := t.port.Dial(ctx, addr, peer.KindData)
	if err != nil {
		return nil, fmt.Errorf("tcp dial %s: %w", addr, err)
	}
	s := &session{Session: peer.NewSession("tcp", "connection", addr, instance, t.cfg.IOTimeout), t: t}
	s.pool = pool.New(t.cfg.MaxConnsPerPeer, s.open, func(c *conn) { c.nc.Close() })
	s.pool.Add(&conn{nc: nc})
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

// conn is one dialed connection and the buffers a write on it needs, so
// a write allocates no buffers of its own.
type conn struct {
	nc *net.TCPConn
	// reused is set once a write on nc has completed: from then on nc
	// waits in the pool between writes, where the receiver may close it
	// (idle, or to make room).
	reused   bool
	answered bool      // the last readReply got a byte
	idled    time.Time // when it went back to the pool

	hdr  [peer.HeaderSize]byte
	rep  [peer.ReplySize]byte
	bufs [2][]byte
	vec  net.Buffers
}

// session is a pool of connections to one peer. A write holds a
// connection for its whole exchange, so concurrent writes use separate
// connections and never wait behind one another's bytes.
type session struct {
	peer.Session
	t    *Transport
	pool *pool.Pool[*conn]
}

// Close closes every connection of the session; writes in flight fail.
func (s *session) Close() error {
	s.pool.Close()
	s.t.mu.Lock()
	delete(s.t.sessions, s)
	s.t.mu.Unlock()
	return nil
}

func (s *session) isClosed() bool { return s.pool.Closed() }

// Read reads over a read connection of the peer port (peer/read.go),
// from memory the peer serves under a key.
func (s *session) Read(ctx context.Context, reads []transport.Read) error {
	return s.t.port.Read(ctx, s.Peer(), reads)
}

// Write carries w on a connection of its own; the kernel reads the
// source where it lies.
func (s *session) Write(ctx context.Context, w transport.Write) (transport.Report, error) {
	if err := s.Begin(ctx, s.isClosed()); err != nil {
		return transport.Report{}, err
	}
	if w.Src == nil && w.Device.Len > 0 {
		return transport.Report{}, fmt.Errorf("tcp write to %s: %w", s.Peer(), transport.ErrHostOnly)
	}
	for {
		c, err := s.get(ctx)
		if err != nil {
			return transport.Report{}, err
		}
		stale := c.reused
		reuse, unanswered, err := s.send(ctx, c, &w)
		if reuse {
			c.reused, c.idled = true, time.Now()
			s.pool.Put(c)
		} else {
			s.pool.Drop(c)
		}
		// A receiver closes a pooled connection it finds idle (or needs
		// the room for) without a word, and the close can cross a write
		// just sent on it: such a write took nothing, so it goes again on
		// another connection rather than fail. Each retry drops a pooled
		// connection, so a freshly opened one ends the loop.
		if err != nil && stale && unanswered {
			continue
		}
		if err != nil {
			return transport.Report{}, err
		}
		return transport.Report{Messages: peer.Messages}, nil
	}
}

// get takes an idle connection, or opens one while the session is under
// its limit, or waits for one to come back. A pooled connection the
// receiver has closed meanwhile is dropped, and another taken.
func (s *session) get(ctx context.Context) (*conn, error) {
	for {
		c, err := s.getAny(ctx)
		if err != nil || !c.reused || time.Since(c.idled) < freshIdle || c.alive() {
			return c, err
		}
		s.pool.Drop(c)
	}
}

// freshIdle is how long a connection back in the pool is taken again
// without a look at its state (a syscall a write): a receiver closes
// idle connections only after minutes, and a close that crosses a write
// anyway is retried on another connection (see Write).
const freshIdle = time.Second

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
	if err != nil {
		return nil, s.Take(ctx, err, "connection")
	}
	return c, nil
}

// open opens one more connection of the session, to the same peer
// process it was dialed to.
func (s *session) open(ctx context.Context) (*conn, error) {
	nc, instance, err := s.t.port.Dial(ctx, s.Peer(), peer.KindData)
	if err != nil {
		return nil, err
	}
	if err := s.Restarted(instance); err != nil {
		nc.Close()
		return nil, err
	}
	return &conn{nc: nc}, nil
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
	h := peer.Header{Addr: w.Remote, Len: uint64(len(body)), Key: w.Key, Tag: w.Tag}
	h.Encode(&c.hdr)

	// The header and the first chunk go in one writev; the rest of the
	// body follows in chunks, each with a fresh deadline.
	c.bufs = [2][]byte{c.hdr[:], body[:min(len(body), transport.IOChunk)]}
	c.vec = c.bufs[:]
	c.nc.SetWriteDeadline(s.Deadline(ctx))
	n, err := c.vec.WriteTo(c.nc)
	sent := max(int(n)-peer.HeaderSize, 0)
	for err == nil && sent < len(body) {
		c.nc.SetWriteDeadline(s.Deadline(ctx))
		var m int
		m, err = c.nc.Write(body[sent:min(sent+transport.IOChunk, len(body))])
		sent += m
	}
	if err != nil {
		if transport.ContextErr(ctx) == nil && transport.PeerGone(err) {
			// A receiver that refuses a write outright replies first and
			// then closes; that reply says why the body could not go.
			c.nc.SetReadDeadline(time.Now().Add(lateReplyWait))
			r, rerr := c.readReply()
			if rerr == nil && r.Code != transport.OK {
				return false, false, &transport.Refusal{Code: r.Code, Message: r.Msg}
			}
			unanswered = s.closedUnanswered(ctx, c, rerr)
		}
		return false, unanswered, s.fail(ctx, err, fmt.Sprintf("after %d of %d bytes", sent, len(body)))
	}

	c.nc.SetReadDeadline(s.Deadline(ctx))
	r, err := c.readReply()
	if err != nil {
		return false, s.closedUnanswered(ctx, c, err), s.fail(ctx, err, fmt.Sprintf("waiting for the completion of %d bytes", len(body)))
	}
	reuse = r.Flags&peer.FlagClose == 0
	if r.Code != transport.OK {
		return reuse, false, &transport.Refusal{Code: r.Code, Message: r.Msg}
	}
	return reuse, false, nil
}

// closedUnanswered says whether a reply's read failed because the
// receiver closed c before the reply's first byte, while the write was
// neither canceled nor its session closed.
func (s *session) closedUnanswered(ctx context.Context, c *conn, err error) bool {
	return !c.answered && transport.PeerGone(err) && transport.ContextErr(ctx) == nil && !s.isClosed()
}

// fail explains a broken write: whose doing it was, and how far it got.
func (s *session) fail(ctx context.Context, err error, where string) error {
	return s.Fail(ctx, s.isClosed(), err, where)
}

// readReply reads a reply; c.answered says whether any byte of it came.
func (c *conn) readReply() (peer.Reply, error) {
	r, got, err := peer.ReadReply(c.nc, &c.rep, nil)
	c.answered = got > 0
	return r, err
}
