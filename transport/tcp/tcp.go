// Package tcp is ferry's data plane where there is no RDMA NIC: one-sided
// writes with RDMA semantics over plain TCP connections. The receiver
// reads each write's body straight into the receive slot's memory and
// enforces what a NIC would: a live slot and the right key. Its data
// connections open with the peer port's handshake (package peer), and
// each write is a peer.Header, its body, and the receiver's reply.
package tcp

import (
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"sync"
	"time"

	"github.com/ferry-project/ferry/internal/connlimit"
	"github.com/ferry-project/ferry/transport"
	"github.com/ferry-project/ferry/transport/peer"
)

// lingerBytes bounds what a receiver drains while its last reply to a
// connection it is closing travels.
const lingerBytes = 4 << 20

// Transport is the TCP data plane on a peer port, and a dialer of
// sessions of data connections. It implements transport.Transport.
type Transport struct {
	cfg  peer.Config
	port *peer.Port
	done chan struct{} // closed by Close

	mu       sync.Mutex
	closed   bool
	sessions map[*session]struct{}
}

var _ transport.Transport = (*Transport)(nil)

// Listen starts a Transport on a peer port of its own at cfg.Addr. It
// serves data connections only: a hello asking for RDMA is answered "no
// RDMA here".
func Listen(cfg peer.Config) (*Transport, error) {
	port, err := peer.Listen(cfg)
	if err != nil {
		return nil, err
	}
	t := Over(port)
	port.Serve(peer.Handlers{Data: t.ServeData})
	return t, nil
}

// Over makes the TCP data plane on port, which it owns from then on:
// Close closes it. Whoever serves the port hands it the data connections
// (ServeData).
func Over(port *peer.Port) *Transport {
	return &Transport{
		cfg:      port.Config(),
		port:     port,
		done:     make(chan struct{}),
		sessions: make(map[*session]struct{}),
	}
}

func (t *Transport) Name() string { return "tcp" }

func (t *Transport) Addr() net.Addr { return t.port.Addr() }

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

// quiet says whether c's failure is no news: the port closed it (to
// make room, or closing), or the transport is closing.
func (t *Transport) quiet(c *connlimit.Conn) bool { return c.Dropped() || t.isClosed() }

// ServeData serves the writes of a data connection the port accepted,
// until it ends.
func (t *Transport) ServeData(c *connlimit.Conn, _ uint64) {
	c.Greeted() // the handshake is done; a peer's first header follows at once
	r := receiver{t: t, c: c, gate: t.port.Gate("connection")}
	if err := r.run(); err != nil && !t.quiet(c) {
		t.port.Warnf("tcp: connection from %s: %v", c.RemoteAddr(), err)
	}
}

// errIdle ends a connection that carried no write for IdleTimeout.
var errIdle = errors.New("idle")

// errUnskipped ends a connection after a refusal whose body was too big
// to skip (maxSkip): the sender has its answer, so it is no news.
var errUnskipped = errors.New("refused body not skipped")

// receiver serves the writes arriving on one accepted connection.
type receiver struct {
	t    *Transport
	c    *connlimit.Conn
	gate *peer.Gate
	hdr  [peer.HeaderSize]byte
	rep  [peer.ReplySize + peer.MaxMessage]byte
	bin  []byte // for bodies that are refused; allocated on first use
}

// run serves writes until the connection ends; a clean close between
// writes, or one idle for IdleTimeout, returns nil.
func (r *receiver) run() error {
	for {
		var h peer.Header
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
		if err == errUnskipped {
			return nil
		}
		if err != nil {
			return err
		}
	}
}

func (r *receiver) readHeader(h *peer.Header) error {
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
	if n < peer.HeaderSize {
		r.c.SetReadDeadline(time.Now().Add(r.t.cfg.IOTimeout))
		if m, err := io.ReadFull(r.c, r.hdr[n:]); err != nil {
			return fmt.Errorf("read %d of a %d-byte write header: %w", n+m, peer.HeaderSize, err)
		}
	}
	h.Decode(&r.hdr)
	return nil
}

func (r *receiver) serveWrite(h *peer.Header) error {
	body, done, no := r.gate.AdmitBody(h)
	if no != nil {
		return r.refuse(h, no)
	}
	if err := transport.ReadBody(r.c, h.Len, body, r.t.cfg.IOTimeout); err != nil {
		done(err)
		var pe *transport.PlaceError
		if errors.As(err, &pe) {
			// The stream is in step and the sender waits for its reply:
			// it learns why, and the connection closes, the rest of the
			// body unread.
			code, msg := peer.Refusal(err)
			r.reply(code, peer.FlagClose, msg)
			r.c.Idle()
			r.linger()
		}
		return err
	}
	done(nil)
	r.c.Prove() // it held a live slot's key
	return r.reply(transport.OK, 0, "")
}

// maxSkip is the most of a refused write's body a receiver reads and
// drops to keep the connection for the sender's next write: refusals of
// small writes (a slot gone stale) then cost no redial. A bigger body is
// not read at all: its connection closes after the refusal, which costs
// a sender one handshake instead of moving up to MaxWrite bytes for
// nothing, and leaves a stranger no body to trickle.
const maxSkip = 64 << 10

// refuse answers a write the gate turned away, then skips its body or
// closes the connection. From the refusal on the connection does nothing
// for anyone, so it holds no place (Idle): a newcomer may evict it.
// Otherwise strangers sending bogus headers and their bodies at a crawl
// could hold every place of the peer port.
func (r *receiver) refuse(h *peer.Header, no *peer.Refused) error {
	// Idle once the refusal is out: evicted before, the sender would see
	// its connection closed unanswered, and send again.
	if no.End == nil && h.Len <= maxSkip {
		err := r.reply(no.Code, 0, no.Msg)
		r.c.Idle()
		if err != nil {
			return err
		}
		return r.skip(h.Len)
	}
	r.reply(no.Code, peer.FlagClose, no.Msg)
	r.c.Idle()
	r.linger()
	if no.End != nil {
		return no.End
	}
	return errUnskipped
}

// skip reads and drops the body of a refused write (n <= maxSkip),
// keeping the stream in step for the next write. One deadline bounds it
// all, where a deadline per read would let a trickle run forever.
func (r *receiver) skip(n uint64) error {
	r.c.SetReadDeadline(time.Now().Add(r.t.cfg.IOTimeout))
	if m, err := io.ReadFull(r.c, r.scratch()[:n]); err != nil {
		return fmt.Errorf("skipped %d of a refused %d-byte write body: %w", m, n, err)
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
		r.bin = make([]byte, maxSkip)
	}
	return r.bin
}

func (r *receiver) reply(code transport.Code, flags uint16, msg string) error {
	b := peer.EncodeReply(&r.rep, code, flags, msg)
	r.c.SetWriteDeadline(time.Now().Add(r.t.cfg.IOTimeout))
	if _, err := r.c.Write(b); err != nil {
		return fmt.Errorf("sending a %s reply: %w", code, err)
	}
	return nil
}
