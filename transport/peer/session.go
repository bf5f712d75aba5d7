package peer

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"time"

	"github.com/ferry-project/ferry/internal/pool"
	"github.com/ferry-project/ferry/transport"
)

// Messages is how many messages of the protocol a write exchanges with
// its receiver besides its bytes: its header and the reply.
const Messages = 2

// Session is what a session of either transport keeps of its peer, and
// how the writes on it fail: each transport's session embeds one.
type Session struct {
	transport string // "tcp" or "rdma": it starts every error
	conn      string // what carries a write's header, as errors name it
	peer      string
	instance  uint64
	ioTimeout time.Duration
}

// NewSession describes a session of transport ("tcp", "rdma") to the
// peer at addr, whose process is instance; conn names the connection a
// write's header goes on ("connection", "control connection").
func NewSession(transport, conn, addr string, instance uint64, ioTimeout time.Duration) Session {
	return Session{transport: transport, conn: conn, peer: addr, instance: instance, ioTimeout: ioTimeout}
}

func (s *Session) Transport() string { return s.transport }

func (s *Session) Peer() string { return s.peer }

func (s *Session) PeerInstance() uint64 { return s.instance }

// Begin says why a write may not start: the session is closed, or ctx
// has ended.
func (s *Session) Begin(ctx context.Context, closed bool) error {
	if closed {
		return fmt.Errorf("%s write to %s: %w", s.transport, s.peer, transport.ErrClosed)
	}
	if err := ctx.Err(); err != nil {
		return fmt.Errorf("%s write to %s: %w", s.transport, s.peer, err)
	}
	return nil
}

// Take explains a failure to take a connection (what: "connection",
// "lane") from the session's pool for a write.
func (s *Session) Take(ctx context.Context, err error, what string) error {
	switch {
	case err == pool.ErrClosed:
		return fmt.Errorf("%s write to %s: %w", s.transport, s.peer, transport.ErrClosed)
	case errors.Is(err, pool.ErrClosed): // closed while opening one
		return fmt.Errorf("%s write to %s: opening a %s: %w: %w", s.transport, s.peer, what, transport.ErrClosed, err)
	case err == ctx.Err():
		return fmt.Errorf("%s write to %s: waiting for a %s: %w", s.transport, s.peer, what, err)
	}
	return fmt.Errorf("%s write to %s: opening a %s: %w", s.transport, s.peer, what, err)
}

// Restarted checks the instance a new connection of the session found:
// another one means the peer daemon restarted, and its slots went with
// the process the session was opened to.
func (s *Session) Restarted(instance uint64) error {
	if instance != s.instance {
		return fmt.Errorf("peer restarted (instance %#x, session opened with %#x); open a new session", instance, s.instance)
	}
	return nil
}

// Deadline is the I/O timeout from now, or ctx's deadline if sooner.
func (s *Session) Deadline(ctx context.Context) time.Time {
	d := time.Now().Add(s.ioTimeout)
	if cd, ok := ctx.Deadline(); ok && cd.Before(d) {
		return cd
	}
	return d
}

// Fail explains a write whose connection broke: whose doing it was (the
// session closed, the caller, a stalled or departed peer), and where
// the write was.
func (s *Session) Fail(ctx context.Context, closed bool, err error, where string) error {
	switch {
	case closed:
		return fmt.Errorf("%s write to %s: %w %s: %w", s.transport, s.peer, transport.ErrClosed, where, err)
	case transport.ContextErr(ctx) != nil:
		return fmt.Errorf("%s write to %s: %w %s", s.transport, s.peer, transport.ContextErr(ctx), where)
	case errors.Is(err, os.ErrDeadlineExceeded):
		return fmt.Errorf("%s write to %s: peer made no progress for %s %s: %w", s.transport, s.peer, s.ioTimeout, where, err)
	case transport.PeerGone(err) || errors.Is(err, net.ErrClosed):
		return fmt.Errorf("%s write to %s: peer closed the %s %s: %w", s.transport, s.peer, s.conn, where, err)
	}
	return fmt.Errorf("%s write to %s: failed %s: %w", s.transport, s.peer, where, err)
}

// Reply is a receiver's answer to a write's header.
type Reply struct {
	Code  transport.Code
	Flags uint16
	Msg   string
}

// ReadReply reads a reply, its fixed part into fixed, and after an OK
// one fills body (the record a transport sends with it; empty for none).
// got is how many bytes of the fixed part came: whether the receiver
// answered at all.
func ReadReply(r io.Reader, fixed *[ReplySize]byte, body []byte) (_ Reply, got int, err error) {
	got, err = io.ReadFull(r, fixed[:])
	if err != nil {
		return Reply{}, got, err
	}
	code, flags, n, err := DecodeReply(fixed)
	if err != nil {
		return Reply{}, got, err
	}
	rep := Reply{Code: code, Flags: flags}
	if n > 0 {
		msg := make([]byte, n)
		if _, err := io.ReadFull(r, msg); err != nil {
			return Reply{}, got, err
		}
		rep.Msg = string(msg)
	}
	if code == transport.OK {
		if _, err := io.ReadFull(r, body); err != nil {
			return Reply{}, got, err
		}
	}
	return rep, got, nil
}
