package mooncake

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"time"
)

// Handlers answer a segment's handshake messages.
type Handlers struct {
	// Segment returns the descriptor a metadata request gets. Required.
	Segment func() *Segment
	// Connect answers the RDMA QP setup (type 0) within ctx, which ends
	// with the connection's deadline or the server's Close. undo, if not
	// nil, is run when the reply could not be sent: the initiator never
	// learns of what Connect set up. Nil Connect: every request is refused
	// with a reply_msg saying this segment serves no RDMA.
	Connect func(ctx context.Context, req HandshakeDesc) (reply HandshakeDesc, undo func())
	// Notify hears notify messages; nil ignores them (the reply is
	// "success" either way, as Mooncake answers).
	Notify func(n NotifyDesc)
}

// ServerConfig bounds a handshake server. Zero fields take the defaults.
type ServerConfig struct {
	ReceiveTimeout time.Duration // per connection, default HandshakeTimeout
	MaxConns       int           // connections served at once, default 64
	// Logf hears about malformed or failed handshakes.
	Logf func(format string, args ...any)
}

// Server is a segment's handshake (RPC) port.
type Server struct {
	listener
	h   Handlers
	cfg ServerConfig
}

// NoRDMA is the reply_msg of a connection request to a segment that
// serves no RDMA.
const NoRDMA = "this segment serves no RDMA (its descriptor lists no devices): use its TCP transport (protocol tcp, tcp_data_port)"

// Serve answers handshakes on ln until Close: one request per
// connection, each read within the receive timeout, answered, then the
// write side shut and the connection held until the client closes it.
func Serve(ln net.Listener, h Handlers, cfg ServerConfig) *Server {
	if cfg.ReceiveTimeout <= 0 {
		cfg.ReceiveTimeout = HandshakeTimeout
	}
	if cfg.MaxConns <= 0 {
		cfg.MaxConns = 64
	}
	if cfg.Logf == nil {
		cfg.Logf = func(string, ...any) {}
	}
	s := &Server{h: h, cfg: cfg}
	s.listener = listener{ln: ln, logf: cfg.Logf, serve: func(c net.Conn) error {
		if err := s.serve(c); err != nil {
			return fmt.Errorf("mooncake handshake from %s: %w", c.RemoteAddr(), err)
		}
		return nil
	}}
	s.start(cfg.MaxConns)
	return s
}

func (s *Server) serve(c net.Conn) error {
	deadline := time.Now().Add(s.cfg.ReceiveTimeout)
	c.SetDeadline(deadline)
	ctx, cancel := context.WithDeadline(s.ctx, deadline)
	defer cancel()
	t, body, err := ReadFrame(c)
	if err == io.EOF {
		return nil // a port probe
	}
	if err != nil {
		return fmt.Errorf("%w; connection closed without a reply", err)
	}
	reply, undo, err := s.answer(ctx, t, body)
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
	// Shut the write side and wait (within the deadline) for the client
	// to close, so the reply is not cut by a reset.
	if tc, ok := c.(*net.TCPConn); ok {
		tc.CloseWrite()
	}
	var sink [256]byte
	for {
		if _, err := c.Read(sink[:]); err != nil {
			return nil
		}
	}
}

// answer is the reply to a request; undo, if not nil, takes back what a
// connection request set up, should the reply not go out.
func (s *Server) answer(ctx context.Context, t MsgType, body []byte) (reply any, undo func(), err error) {
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
		if err := json.Unmarshal(body, &n); err != nil {
			return nil, nil, fmt.Errorf("not a notify message ({\"name\",\"notify_msg\"}): %w", err)
		}
		if s.h.Notify != nil {
			s.h.Notify(n)
		}
		return NotifyDesc{NotifyMsg: "success"}, nil, nil
	case Connect:
		var d HandshakeDesc
		if err := json.Unmarshal(body, &d); err != nil {
			return nil, nil, fmt.Errorf("not a connection handshake (local_nic_path, qp_num, ...): %w", err)
		}
		if s.h.Connect == nil {
			s.logf("mooncake handshake: refused an RDMA connection request from %s: no RDMA is served here", d.LocalNICPath)
			return HandshakeDesc{PeerNICPath: d.LocalNICPath, LocalNICPath: d.PeerNICPath, ReplyMsg: NoRDMA}, nil, nil
		}
		r, undo := s.h.Connect(ctx, d)
		if r.ReplyMsg != "" {
			// Logged here, where the port's rate limit applies.
			s.logf("mooncake handshake: refused an RDMA connection request from %s: %s", d.LocalNICPath, r.ReplyMsg)
		}
		return r, undo, nil
	}
	return nil, nil, fmt.Errorf("unknown message type %d", t)
}
