package mooncake

import (
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
	// Connect answers the RDMA QP setup (type 0). Nil: every request is
	// refused with a reply_msg saying this segment serves no RDMA.
	Connect func(req HandshakeDesc) HandshakeDesc
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
	c.SetDeadline(time.Now().Add(s.cfg.ReceiveTimeout))
	t, body, err := ReadFrame(c)
	if err == io.EOF {
		return nil // a port probe
	}
	if err != nil {
		return fmt.Errorf("%w; connection closed without a reply", err)
	}
	reply, err := s.answer(t, body)
	if err != nil {
		return fmt.Errorf("%s request: %w; connection closed without a reply", t, err)
	}
	out, err := json.Marshal(reply)
	if err != nil {
		return fmt.Errorf("%s reply: %w", t, err)
	}
	if err := WriteFrame(c, t, append(out, '\n')); err != nil {
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

func (s *Server) answer(t MsgType, body []byte) (any, error) {
	switch t {
	case Metadata:
		// The client's own descriptor comes along; it must parse, but
		// the server has no use for it.
		if !json.Valid(body) {
			return nil, errors.New("the client's descriptor is not valid JSON")
		}
		return s.h.Segment(), nil
	case Probe:
		return ProbeReply{Status: "success"}, nil
	case Notify:
		var n NotifyDesc
		if err := json.Unmarshal(body, &n); err != nil {
			return nil, fmt.Errorf("not a notify message ({\"name\",\"notify_msg\"}): %w", err)
		}
		if s.h.Notify != nil {
			s.h.Notify(n)
		}
		return NotifyDesc{NotifyMsg: "success"}, nil
	case Connect:
		var d HandshakeDesc
		if err := json.Unmarshal(body, &d); err != nil {
			return nil, fmt.Errorf("not a connection handshake (local_nic_path, qp_num, ...): %w", err)
		}
		if s.h.Connect == nil {
			s.cfg.Logf("mooncake handshake: refused an RDMA connection request from %s: no RDMA is served here", d.LocalNICPath)
			return HandshakeDesc{PeerNICPath: d.LocalNICPath, LocalNICPath: d.PeerNICPath, ReplyMsg: NoRDMA}, nil
		}
		return s.h.Connect(d), nil
	}
	return nil, fmt.Errorf("unknown message type %d", t)
}
