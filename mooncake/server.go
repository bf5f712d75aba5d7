package mooncake

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"time"

	"github.com/ferry-project/ferry/internal/connlimit"
	"github.com/ferry-project/ferry/internal/loglimit"
)

// Handlers answer a segment's handshake messages. from is the address
// the request came from.
type Handlers struct {
	// Segment returns the descriptor a metadata request gets. Required.
	Segment func() *Segment
	// Connect answers the RDMA QP setup (type 0) within ctx, which ends
	// with the connection's deadline or the server's Close. undo, if not
	// nil, is run when the reply could not be sent: the initiator never
	// learns of what Connect set up. Nil Connect: every request is refused
	// with a reply_msg saying this segment serves no RDMA.
	Connect func(ctx context.Context, from net.Addr, req HandshakeDesc) (reply HandshakeDesc, undo func())
	// Notify hears notify messages; nil ignores them. An error is
	// logged, rate-limited, with the message cut to loglimit.MaxQuoted
	// bytes; the reply is "success" (as Mooncake answers whatever it
	// does with one) unless the error is an ErrNotifyRefused: then it is
	// a refusal saying why (NotifyReply).
	Notify func(from net.Addr, n NotifyDesc) error
}

// ServerConfig bounds a handshake server. Zero fields take the defaults.
type ServerConfig struct {
	ReceiveTimeout time.Duration // per connection, default HandshakeTimeout
	// Limits caps the connections served at once; zero fields take
	// DefaultServerLimits'.
	Limits connlimit.Limits
	// Logf hears about malformed or failed handshakes, at most
	// loglimit.Burst lines a second.
	Logf func(format string, args ...any)
	// Debugf, if set, hears about connections closed to make room, which
	// strangers can cause: give it a rate-limited logger.
	Debugf func(format string, args ...any)
	// Allow says who may connect; the zero value allows everyone.
	Allow Allow
	// LargeMessages bounds the bytes all connections' messages of over
	// MaxSmallMessage bytes hold at once; default DefaultLargeMessages.
	LargeMessages int64
	// ShareWith, if set, is a server whose budget for large messages
	// this one draws from too (LargeMessages is then its): a daemon's
	// ports together hold no more than one's, however many segments
	// it serves.
	ShareWith *Server
	// Shared, if set, caps this port's connections together with other
	// ports' (connlimit.NewShared), besides Limits.
	Shared *connlimit.Table[*connlimit.Conn]
}

// DefaultLargeMessages is the RPC port's budget for messages over
// MaxSmallMessage bytes (segment descriptors, up to MaxMessage each):
// sixteen of the largest at once. A Mooncake engine's own descriptor,
// sent with its metadata requests, is a few KiB and needs none of it.
// Smaller messages are bounded by the connection cap (256 of 16 KiB).
const DefaultLargeMessages = 16 << 20

// replyDrain is how long a connection is kept after its reply, for the
// client to read it and close: Mooncake's client closes as soon as it has
// read the reply.
const replyDrain = time.Second

// DefaultServerLimits caps the handshake port. A handshake holds its
// connection for a moment (5 s at most), one per QP setup or metadata
// fetch: 64 at once from one address is a host's engines all connecting
// to every NIC at once (8 by 8), and 256 in all leaves room for four
// such hosts at the same instant; past that a newcomer takes the place of
// the oldest pending request of the address holding the most.
var DefaultServerLimits = connlimit.Limits{Total: 256, PerSource: 64}

// Server is a segment's handshake (RPC) port.
type Server struct {
	*port
	h     Handlers
	cfg   ServerConfig
	large *budget
}

// ErrNotifyRefused marks a notify the receiver did not keep, so that
// its sender hears so rather than "success".
var ErrNotifyRefused = errors.New("notify refused")

// NoRDMA is the reply_msg of a connection request to a segment that
// serves no RDMA.
const NoRDMA = "this segment serves no RDMA (its descriptor lists no devices): use its TCP transport (protocol tcp, tcp_data_port)"

// Serve answers handshakes on ln until Close: one request per
// connection, each read within the receive timeout, answered, then the
// write side shut and the connection held until the client closes it
// (for replyDrain at most, and open to eviction meanwhile).
func Serve(ln net.Listener, h Handlers, cfg ServerConfig) *Server {
	if cfg.ReceiveTimeout <= 0 {
		cfg.ReceiveTimeout = HandshakeTimeout
	}
	cfg.Limits = cfg.Limits.Or(DefaultServerLimits)
	if cfg.Logf == nil {
		cfg.Logf = func(string, ...any) {}
	}
	if cfg.LargeMessages <= 0 {
		cfg.LargeMessages = DefaultLargeMessages
	}
	s := &Server{h: h, cfg: cfg}
	if cfg.ShareWith != nil {
		s.large = cfg.ShareWith.large
	} else {
		s.large = newBudget(max(cfg.LargeMessages, MaxMessage))
	}
	s.port = openPort(ln, "mooncake RPC port", cfg.Allow, cfg.Limits, cfg.Shared, cfg.ReceiveTimeout, cfg.Logf, cfg.Debugf, func(c *connlimit.Conn) error {
		if err := s.serve(c); err != nil {
			return fmt.Errorf("mooncake handshake from %s: %w", c.RemoteAddr(), err)
		}
		return nil
	})
	return s
}

func (s *Server) serve(c *connlimit.Conn) error {
	deadline := time.Now().Add(s.cfg.ReceiveTimeout)
	c.SetDeadline(deadline)
	ctx, cancel := context.WithDeadline(c.Context(), deadline)
	defer cancel()
	var held int64
	release := func() {
		if held > 0 {
			s.large.release(held)
			held = 0
		}
	}
	defer release()
	t, body, err := readFrame(c, func(n int) error {
		if n <= MaxSmallMessage {
			return nil
		}
		if err := s.large.acquire(ctx, int64(n)); err != nil {
			return fmt.Errorf("a message of %d bytes waited for its room in the port's %d bytes for messages over %d until the deadline: other connections held them: %w",
				n, s.large.size, MaxSmallMessage, err)
		}
		held = int64(n)
		return nil
	})
	if err == io.EOF {
		return nil // a port probe
	}
	if err != nil {
		if isTimeout(err) {
			c.Closing(connlimit.ReasonTimeout)
		}
		return fmt.Errorf("%w; connection closed without a reply", err)
	}
	if !c.Busy() {
		return nil // the port closed it to make room just now
	}
	reply, undo, err := s.answer(ctx, c.RemoteAddr(), t, body)
	// The message is answered: its room is another's now.
	release()
	if err != nil {
		return fmt.Errorf("%s request: %w; connection closed without a reply", t, err)
	}
	out, err := json.Marshal(reply)
	if err == nil {
		err = WriteFrame(c, t, append(out, '\n'))
	}
	if err != nil {
		if undo != nil {
			undo()
		}
		return fmt.Errorf("sending the %s reply: %w", t, err)
	}
	// Done: a connection that only waits for its client to close may
	// make room for a newcomer, or strangers holding every place open
	// after their replies would lock the port. Marked before the write
	// side is shut: once a client reads the end, its place is open.
	c.Idle()
	// Shut the write side and wait a moment for the client to close, so
	// the reply is not cut by a reset; not the whole deadline, which
	// would let a client that never closes hold its place that long.
	c.CloseWrite()
	if d := time.Now().Add(replyDrain); d.Before(deadline) {
		c.SetDeadline(d)
	}
	var sink [256]byte
	for {
		if _, err := c.Read(sink[:]); err != nil {
			return nil
		}
	}
}

// LargeMessages is what the port's budget for large messages holds,
// and the most it held at once (with the ports sharing it).
func (s *Server) LargeMessages() BudgetStats { return s.large.stats() }

// answer is the reply to a request; undo, if not nil, takes back what a
// connection request set up, should the reply not go out.
func (s *Server) answer(ctx context.Context, from net.Addr, t MsgType, body []byte) (reply any, undo func(), err error) {
	switch t {
	case Metadata:
		// The client's own descriptor comes along; it must parse, but
		// the server has no use for it.
		if !json.Valid(body) {
			return nil, nil, errors.New("the client's descriptor is not valid JSON")
		}
		return s.h.Segment(), nil, nil
	case Probe:
		return ProbeReply{Status: "success"}, nil, nil
	case Notify:
		var n NotifyDesc
		if err := decodeStrict(body, &n); err != nil {
			return nil, nil, fmt.Errorf("not a notify message ({\"name\",\"notify_msg\"}): %w", err)
		}
		if s.h.Notify != nil {
			if err := s.h.Notify(from, n); err != nil {
				s.logf("mooncake notify from %s (name %s, notify_msg %s): %v", from, loglimit.Quote(n.Name), loglimit.Quote(n.NotifyMsg), err)
				if errors.Is(err, ErrNotifyRefused) {
					return NotifyReply{Error: err.Error()}, nil, nil
				}
			}
		}
		return NotifyReply{NotifyMsg: "success"}, nil, nil
	case Connect:
		var d HandshakeDesc
		if err := decodeStrict(body, &d); err != nil {
			return nil, nil, fmt.Errorf("not a connection handshake (local_nic_path, qp_num, ...): %w", err)
		}
		if s.h.Connect == nil {
			s.logf("mooncake handshake: refused an RDMA connection request from %s (%s): no RDMA is served here", loglimit.Quote(d.LocalNICPath), from)
			return HandshakeDesc{PeerNICPath: d.LocalNICPath, LocalNICPath: d.PeerNICPath, ReplyMsg: NoRDMA}, nil, nil
		}
		r, undo := s.h.Connect(ctx, from, d)
		if r.ReplyMsg != "" {
			// Logged here, where the port's rate limit applies.
			s.logf("mooncake handshake: refused an RDMA connection request from %s (%s): %s", loglimit.Quote(d.LocalNICPath), from, loglimit.Clip(r.ReplyMsg))
		}
		return r, undo, nil
	}
	return nil, nil, fmt.Errorf("unknown message type %d", t)
}
