package mooncake

import (
	"errors"
	"fmt"
	"io"
	"net"
	"time"

	"github.com/ferry-project/ferry/internal/connlimit"
	"github.com/ferry-project/ferry/transport"
)

// Memory is what a data port writes into and reads from: the target's
// registered buffers.
type Memory interface {
	// Write checks a WRITE of n bytes at addr and returns the memory the
	// bytes go to, lent a piece at a time as transport.Body says (host
	// memory in one piece; memory the host cannot address a chunk of
	// host staging at a time). done must be called once: with nil when
	// body has placed all n bytes, else with what stopped them. An
	// error refuses the write (status rejected).
	Write(addr, n uint64) (body transport.Body, done func(error), err error)
	// Read returns the n bytes at addr for a READ, and release for when
	// they have been sent; an error refuses the read.
	Read(addr, n uint64) (src []byte, release func(), err error)
}

// DataConfig bounds a data port. Zero fields take the defaults.
type DataConfig struct {
	IOTimeout time.Duration // per read or write of up to 1 MiB; default 10s
	MaxSize   uint64        // largest request; default 1<<36
	// Limits caps the connections held at once; zero fields take
	// DefaultDataLimits'. No timer closes a connection that waits for a
	// request, its first or a later one: a Mooncake connection pool
	// opens its connections one at a time and keeps each for reuse, one
	// that connected after its queue emptied included, and its next
	// request on a connection that closed fails. The cap is the only
	// limit: at the total cap a newcomer takes the place of a waiting
	// one, those that carried no write first, then the least recently
	// used (connlimit).
	Limits connlimit.Limits
	// Allow says who may connect; the zero value allows everyone.
	Allow Allow
	// Shared, if set, caps this port's connections together with other
	// ports' (connlimit.NewShared), besides Limits.
	Shared *connlimit.Table[*connlimit.Conn]
	// Logf hears about refused requests and broken connections, at most
	// loglimit.Burst lines a second.
	Logf func(format string, args ...any)
	// Debugf, if set, hears about connections closed to make room, which
	// strangers can cause: give it a rate-limited logger.
	Debugf func(format string, args ...any)
}

// DefaultDataLimits caps the data port. Mooncake opens a connection per
// slice in flight (its pool grows with the batch, up to a batch's
// slices), so one address may need a few hundred: 256 per address, 1024
// in all, about a goroutine and a socket's buffers each.
var DefaultDataLimits = connlimit.Limits{Total: 1024, PerSource: 256}

// DataServer is a segment's TCP data port, speaking v1 and v2 (each
// request says which by its opcode's v2 bit).
type DataServer struct {
	*port
	mem Memory
	cfg DataConfig
}

// ServeData serves data requests on ln into mem until Close.
func ServeData(ln net.Listener, mem Memory, cfg DataConfig) *DataServer {
	if cfg.IOTimeout <= 0 {
		cfg.IOTimeout = 10 * time.Second
	}
	if cfg.MaxSize == 0 {
		cfg.MaxSize = 1 << 36
	}
	cfg.Limits = cfg.Limits.Or(DefaultDataLimits)
	if cfg.Logf == nil {
		cfg.Logf = func(string, ...any) {}
	}
	s := &DataServer{mem: mem, cfg: cfg}
	// The listener's first deadline is lifted at once: see Limits.
	s.port = openPort(ln, "mooncake data port", cfg.Allow, cfg.Limits, cfg.Shared, cfg.IOTimeout, cfg.Logf, cfg.Debugf, func(c *connlimit.Conn) error {
		c.SetDeadline(time.Time{})
		c.SetNoDelay(true)
		if err := s.serve(c); err != nil {
			return fmt.Errorf("mooncake data connection from %s: %w", c.RemoteAddr(), err)
		}
		return nil
	})
	return s
}

// serve runs requests until the client closes (nil) or one fails. A
// connection may wait for its first request, or the next, for as long
// as its client likes; once a header has begun, each read has the I/O
// timeout.
func (s *DataServer) serve(c *connlimit.Conn) error {
	var hb [HeaderSize]byte
	for {
		c.SetReadDeadline(time.Time{})
		n, err := io.ReadAtLeast(c, hb[:], 1)
		if err != nil {
			if err == io.EOF {
				return nil
			}
			return fmt.Errorf("waiting for a request: %w", err)
		}
		if n < HeaderSize {
			// A header that has begun must finish in time.
			c.SetReadDeadline(time.Now().Add(s.cfg.IOTimeout))
			if m, err := io.ReadFull(c, hb[n:]); err != nil {
				return fmt.Errorf("read %d of a %d-byte request header: %w", n+m, HeaderSize, err)
			}
		}
		h, err := DecodeHeader(&hb)
		if err != nil {
			return err // nothing sensible to answer: close
		}
		if !c.Busy() {
			return nil // the port closed it to make room just now
		}
		err = s.request(c, h)
		c.Idle()
		if err != nil {
			return err
		}
	}
}

// request serves one request. One carried out proves its connection
// before the answer goes out, so that a client that has the answer finds
// the connection kept as one that did real work. A v2 request that was
// refused, its body read and dropped and the rejected status
// sent, leaves the stream in step: it is logged (err nil) and the
// connection kept, as a Mooncake pool reuses it. An error ends the
// connection.
func (s *DataServer) request(c *connlimit.Conn, h Header) error {
	var (
		src     []byte
		body    transport.Body
		finish  func(error)
		release func()
		err     error
	)
	if h.Size > s.cfg.MaxSize {
		err = fmt.Errorf("%d bytes exceeds this port's limit of %d", h.Size, s.cfg.MaxSize)
	} else if h.Op == OpWrite {
		body, finish, err = s.mem.Write(h.Addr, h.Size)
	} else {
		src, release, err = s.mem.Read(h.Addr, h.Size)
	}
	if err != nil {
		err = fmt.Errorf("rejected a %s of %d bytes at %#x (v2=%t): %v", h.Op, h.Size, h.Addr, h.V2, err)
		if h.Size > s.cfg.MaxSize {
			// Larger than anything here: not worth reading to stay in
			// step.
			return s.rejectAndClose(c, h, err)
		}
		return s.reject(c, h, h.Op == OpWrite, err)
	}
	if h.Op == OpRead {
		defer release()
		c.Prove()
		if h.V2 {
			if err := s.status(c, StatusOK); err != nil {
				return err
			}
		}
		return s.send(c, src)
	}
	if err := transport.ReadBody(c, h.Size, body, s.cfg.IOTimeout); err != nil {
		finish(err)
		err = fmt.Errorf("a WRITE of %d bytes at %#x: %w", h.Size, h.Addr, err)
		if errors.As(err, new(*transport.PlaceError)) {
			// Read but not placed: the stream is in step, so a v2
			// requester hears it was rejected.
			return s.reject(c, h, false, err)
		}
		return err
	}
	finish(nil)
	c.Prove()
	if h.V2 {
		return s.status(c, StatusOK)
	}
	return nil
}

// reject answers a refused request, why: v2 with the rejected status once
// the WRITE's body, if unread, has been read and dropped (drop), the
// connection kept for the client's next request, and why
// logged; v1 as rejectAndClose.
func (s *DataServer) reject(c *connlimit.Conn, h Header, unread bool, why error) error {
	if !h.V2 {
		return s.rejectAndClose(c, h, why)
	}
	if unread {
		if err := s.drop(c, h.Size); err != nil {
			return fmt.Errorf("%w; reading the refused body to drop it: %w", why, err)
		}
	}
	if err := s.status(c, StatusRejected); err != nil {
		return fmt.Errorf("%w; %w", why, err)
	}
	s.logf("mooncake data connection from %s: %v; the connection is kept", c.RemoteAddr(), why)
	return nil
}

// drop reads n bytes and drops them, as fast as a body that lands must
// arrive: transport.IOChunk per I/O timeout. io.Discard reads into a
// small buffer of its own, shared by all: a refused body holds no memory.
func (s *DataServer) drop(c net.Conn, n uint64) error {
	for left := n; left > 0; {
		c.SetReadDeadline(time.Now().Add(s.cfg.IOTimeout))
		m, err := io.CopyN(io.Discard, c, int64(min(left, transport.IOChunk)))
		left -= uint64(m)
		if err != nil {
			return fmt.Errorf("dropped %d of %d bytes: %w", n-left, n, err)
		}
	}
	return nil
}

// rejectAndClose answers a refused request and ends the connection
// (returning why): v1 with a reset, how a v1 client tells a rejection
// from a clean end (a WRITE read whole but not placed leaves no unread
// bytes to make the close one); v2 with the rejected status, after which
// the write side shuts and what the client already sent is drained for
// a moment, so the status is not cut by a reset.
func (s *DataServer) rejectAndClose(c *connlimit.Conn, h Header, why error) error {
	if !h.V2 {
		_ = c.SetLinger(0)
		return why
	}
	_ = s.status(c, StatusRejected)
	c.CloseWrite()
	c.SetReadDeadline(time.Now().Add(min(s.cfg.IOTimeout, time.Second)))
	_, _ = io.CopyN(io.Discard, c, int64(min(h.Size, 4<<20)))
	return why
}

func (s *DataServer) status(c net.Conn, st Status) error {
	b := EncodeStatus(st)
	c.SetWriteDeadline(time.Now().Add(s.cfg.IOTimeout))
	if _, err := c.Write(b[:]); err != nil {
		return fmt.Errorf("sending status %s: %w", st, err)
	}
	return nil
}

// send sends a READ's bytes, a chunk per deadline.
func (s *DataServer) send(c net.Conn, buf []byte) error {
	for off := 0; off < len(buf); {
		c.SetWriteDeadline(time.Now().Add(s.cfg.IOTimeout))
		n, err := c.Write(buf[off:min(off+transport.IOChunk, len(buf))])
		off += n
		if err != nil {
			return fmt.Errorf("sent %d of %d bytes: %w", off, len(buf), err)
		}
	}
	return nil
}

func isTimeout(err error) bool {
	var ne net.Error
	return errors.As(err, &ne) && ne.Timeout()
}
