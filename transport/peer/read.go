package peer

// Read connections (kind 2, additive in version 8: a server that serves
// no reads answers the hello with status 4, unknown kind). A daemon
// reads from a peer's memory that the peer serves under a key: a ferry
// engine segment's registered memory under the segment's key
// (daemon/engines.go), never its arena or slots, whose keys name no
// readable memory. The handshake, and with a peer secret its
// challenge-response, is a data connection's; then any number of reads,
// one at a time:
//
//	client → server  header, 40 bytes (Header): addr, len (at least 1),
//	                 key, tag (0)
//	server → client  reply, 8 bytes and its message, as a write's; after
//	                 code 0 (OK), len bytes: the memory at addr
//
// A refusal (out_of_bounds: the range lies outside the memory the key
// names; no_slot: no memory has that key; shutting_down) keeps the
// connection, but for a read above the port's MaxWrite and the
// MaxUnmatched-th no_slot, which close it (FlagClose): a reader guessing
// keys pays a handshake per MaxUnmatched guesses.
//
// The server holds the memory it answers from (an engine's unregistering
// waits for it) until the answer is sent, and a reader that takes the
// bytes slowly holds it that long: so the whole answer, the reply and
// every byte, has one deadline (AnswerTimeout: IOTimeout, and a second
// more per MinReadRate bytes), past which the server closes the
// connection, the answer cut short.

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"syscall"
	"time"

	"github.com/ferry-project/ferry/internal/connlimit"
	"github.com/ferry-project/ferry/transport"
)

// KindRead is a read connection's kind; KindRDMARead that of the
// control connection of RDMA READs (rdma/reads.go), served by
// Handlers.RDMARead.
const (
	KindRead     Kind = 2
	KindRDMARead Kind = 3
)

// MinReadRate is the slowest a reader may take an answer's bytes, on
// average, before the answer's deadline cuts it (AnswerTimeout): 16 MiB
// a second, far below any link ferry runs on, so that a read of 64 GiB
// (the largest arena's size bounds a read: MaxWrite) holds its memory
// about 68 minutes at most, and one of 1 GiB about 74 s with the
// default IOTimeout.
const MinReadRate = 16 << 20

// AnswerTimeout is how long the server of a read connection takes to
// send the answer to a read of n bytes, at most, with per-I/O timeout
// io: io, and a second more per MinReadRate bytes.
func AnswerTimeout(n uint64, io time.Duration) time.Duration {
	// In whole seconds and the rest apart: n seconds' worth of
	// nanoseconds overflows past 8 GiB.
	return io + time.Duration(n/MinReadRate)*time.Second + time.Duration(n%MinReadRate)*time.Second/MinReadRate
}

// source is the Sink's reads, or nil when it serves none.
func (p *Port) source() transport.Source {
	src, _ := p.cfg.Sink.(transport.Source)
	return src
}

// serveReads serves the reads of one accepted read connection until it
// ends: a clean close between reads, or IdleTimeout without one.
func (p *Port) serveReads(c *connlimit.Conn) {
	c.Greeted()
	src, g := p.source(), p.Gate("read connection")
	var hdr [HeaderSize]byte
	var rep [ReplySize + MaxMessage]byte
	reply := func(code transport.Code, flags uint16, msg string) error {
		c.SetWriteDeadline(time.Now().Add(p.cfg.IOTimeout))
		_, err := c.Write(EncodeReply(&rep, code, flags, msg))
		return err
	}
	for {
		c.SetReadDeadline(time.Now().Add(p.cfg.IdleTimeout))
		n, err := io.ReadAtLeast(c, hdr[:], 1)
		if n == 0 && errors.Is(err, os.ErrDeadlineExceeded) {
			c.Closing(connlimit.ReasonIdle)
			return
		}
		if err == nil && n < HeaderSize {
			c.SetReadDeadline(time.Now().Add(p.cfg.IOTimeout))
			_, err = io.ReadFull(c, hdr[n:])
		}
		if err != nil {
			if err != io.EOF && !c.Dropped() && !p.Closed() {
				p.Warnf("peer: read connection from %s: reading a header: %v", c.RemoteAddr(), err)
			}
			return
		}
		if !c.Busy() {
			return // the port closed it to make room just now
		}
		var h Header
		h.Decode(&hdr)
		err = p.serveRead(c, g, src, &h, reply)
		c.Idle()
		if err != nil {
			if !c.Dropped() && !p.Closed() {
				p.Warnf("peer: read connection from %s: %v", c.RemoteAddr(), err)
			}
			return
		}
	}
}

// serveRead answers one read: a refusal, or OK and the bytes. An error
// ends the connection.
func (p *Port) serveRead(c *connlimit.Conn, g *Gate, src transport.Source, h *Header, reply func(transport.Code, uint16, string) error) error {
	if msg, end := ReadTooLarge(h.Len, p.cfg.MaxWrite); end != nil {
		reply(transport.OutOfBounds, FlagClose, msg)
		return end
	}
	b, done, err := src.ReadKeyed(h.Addr, h.Len, h.Key)
	if err == nil && uint64(len(b)) != h.Len {
		done()
		err = fmt.Errorf("the daemon lent %d bytes for a read of %d", len(b), h.Len)
	}
	if err != nil {
		code, flags, msg, end := g.Refusing(err)
		if rerr := reply(code, flags, msg); rerr != nil {
			return fmt.Errorf("sending a %s reply: %w", code, rerr)
		}
		return end
	}
	defer done()
	c.Prove() // it held a key to readable memory
	limit := AnswerTimeout(h.Len, p.cfg.IOTimeout)
	last := time.Now().Add(limit)
	if err := reply(transport.OK, 0, ""); err != nil { // within IOTimeout: before last
		return fmt.Errorf("sending an ok reply: %w", err)
	}
	for at := 0; at < len(b); {
		end := min(at+transport.IOChunk, len(b))
		// Each write within IOTimeout, all of them by last.
		c.SetWriteDeadline(time.Now().Add(min(p.cfg.IOTimeout, time.Until(last))))
		if _, err := c.Write(b[at:end]); err != nil {
			if errors.Is(err, os.ErrDeadlineExceeded) && !time.Now().Before(last) {
				return fmt.Errorf("closed the connection after %d of the %d bytes of a read: the reader did not take the answer within its %v (the io timeout, and a second per %d MiB)", at, len(b), limit, MinReadRate>>20)
			}
			return fmt.Errorf("sending %d bytes of a %d-byte read after %d: %w", end-at, len(b), at, err)
		}
		at = end
	}
	return nil
}

// Read reads each piece from the peer port at addr over one read
// connection: returns once all are in their Dst, or with the first
// piece's error (a *transport.Refusal when the peer would not serve it).
func (p *Port) Read(ctx context.Context, addr string, reads []transport.Read) error {
	c, _, err := p.Dial(ctx, addr, KindRead)
	if err != nil {
		return fmt.Errorf("reading from %s: %w", addr, err)
	}
	// ctx ending closes the connection, whatever deadline is set on it.
	stop := context.AfterFunc(ctx, func() { c.Close() })
	defer func() {
		stop()
		c.Close()
	}()
	var hdr [HeaderSize]byte
	var rep [ReplySize]byte
	var msg [MaxMessage]byte
	for i, r := range reads {
		n := uint64(len(r.Dst))
		if n == 0 {
			continue
		}
		h := Header{Addr: r.Addr, Len: n, Key: r.Key}
		h.Encode(&hdr)
		c.SetDeadline(time.Now().Add(p.cfg.IOTimeout))
		if _, err := c.Write(hdr[:]); err != nil {
			return p.readErr(ctx, addr, i, r, "sending its header", err)
		}
		if _, err := io.ReadFull(c, rep[:]); err != nil {
			return p.readErr(ctx, addr, i, r, "reading its reply", err)
		}
		code, _, msglen, err := DecodeReply(&rep)
		if err != nil {
			return p.readErr(ctx, addr, i, r, "its reply", err)
		}
		if code != transport.OK {
			if _, err := io.ReadFull(c, msg[:msglen]); err != nil {
				return p.readErr(ctx, addr, i, r, "reading its refusal", err)
			}
			return &transport.Refusal{Code: code, Message: string(msg[:msglen])}
		}
		for at := 0; at < len(r.Dst); {
			end := min(at+transport.IOChunk, len(r.Dst))
			c.SetReadDeadline(time.Now().Add(p.cfg.IOTimeout))
			if _, err := io.ReadFull(c, r.Dst[at:end]); err != nil {
				if errors.Is(err, io.ErrUnexpectedEOF) || errors.Is(err, io.EOF) || errors.Is(err, syscall.ECONNRESET) {
					err = fmt.Errorf("%w (the peer cuts an answer not taken within its io timeout and a second per %d MiB)", err, MinReadRate>>20)
				}
				return p.readErr(ctx, addr, i, r, fmt.Sprintf("receiving its bytes (%d of %d in)", at, n), err)
			}
			at = end
		}
	}
	return nil
}

func (p *Port) readErr(ctx context.Context, addr string, i int, r transport.Read, step string, err error) error {
	if ctx.Err() != nil {
		err = fmt.Errorf("%w (%v)", ctx.Err(), err)
	}
	return fmt.Errorf("reading %d bytes at %#x from %s (piece %d): %s: %w", len(r.Dst), r.Addr, addr, i, step, err)
}
