package mooncake

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"syscall"
	"time"

	"github.com/ferry-project/ferry/transport"
)

// RejectedError is a data port's refusal of a request: the v2 rejected
// status, or for v1 the silent close Mooncake answers with.
type RejectedError struct {
	Op         Opcode
	Addr, Size uint64
	V2         bool
}

func (e *RejectedError) Error() string {
	if e.V2 {
		return fmt.Sprintf("the peer rejected the %s of %d bytes at %#x (status \"rejected\": the range lies in none of its registered buffers, or it could not place the bytes there)", e.Op, e.Size, e.Addr)
	}
	return fmt.Sprintf("the peer closed the connection on the %s of %d bytes at %#x without a word (TCP protocol v1 has no status: most likely it rejected the range)", e.Op, e.Size, e.Addr)
}

// IsRejected reports whether err is a data port's refusal.
func IsRejected(err error) bool {
	var r *RejectedError
	return errors.As(err, &r)
}

// Request is one data-plane request an initiator makes.
type Request struct {
	Data      string // the data port, host:port
	Addr      uint64 // in the target's memory
	Buf       []byte // the bytes to write, or the room to read into
	V2        bool
	IOTimeout time.Duration // per chunk of up to 1 MiB; default 10s
}

// lateStatusWait is how long a writer whose body was cut looks for the
// rejected status that explains it.
const lateStatusWait = 200 * time.Millisecond

// Write moves r.Buf to r.Addr on its own connection (Mooncake's default:
// one request per connection). With v2 it returns once the target said
// the bytes are in memory; with v1, once the target closed the connection
// after taking them (v1 says no more).
func Write(ctx context.Context, r Request) error {
	return do(ctx, OpWrite, r)
}

// Read fills r.Buf from r.Addr on its own connection.
func Read(ctx context.Context, r Request) error {
	return do(ctx, OpRead, r)
}

func do(ctx context.Context, op Opcode, r Request) error {
	c, err := dialData(ctx, r)
	if err != nil {
		return err
	}
	defer c.Close()
	return request(ctx, c, op, r)
}

// ioTimeout is r.IOTimeout, or its default.
func (r *Request) ioTimeout() time.Duration {
	if r.IOTimeout <= 0 {
		return 10 * time.Second
	}
	return r.IOTimeout
}

// dialData opens a data connection to r.Data, within r's I/O timeout.
func dialData(ctx context.Context, r Request) (*net.TCPConn, error) {
	var d net.Dialer
	dctx, cancel := context.WithTimeout(ctx, r.ioTimeout())
	nc, err := d.DialContext(dctx, "tcp", r.Data)
	cancel()
	if err != nil {
		return nil, fmt.Errorf("connecting to the data port %s: %w", r.Data, err)
	}
	c := nc.(*net.TCPConn)
	c.SetNoDelay(true)
	return c, nil
}

// request carries out one request on c; ctx's end closes c. A v2 WRITE
// or READ that returns nil leaves c in step for the next request (a v1
// WRITE has shut c's write side).
func request(ctx context.Context, c *net.TCPConn, op Opcode, r Request) (err error) {
	r.IOTimeout = r.ioTimeout()
	stop := context.AfterFunc(ctx, func() { c.Close() })
	defer func() {
		if !stop() && err != nil {
			err = fmt.Errorf("%w: %w", ctx.Err(), err)
		}
	}()
	h := Header{Size: uint64(len(r.Buf)), Addr: r.Addr, Op: op, V2: r.V2}
	rejected := &RejectedError{Op: op, Addr: r.Addr, Size: h.Size, V2: r.V2}
	var hb [HeaderSize]byte
	h.Encode(&hb)
	deadline := func() time.Time {
		d := time.Now().Add(r.IOTimeout)
		if cd, ok := ctx.Deadline(); ok && cd.Before(d) {
			return cd
		}
		return d
	}
	if op == OpRead {
		c.SetWriteDeadline(deadline())
		if _, err := c.Write(hb[:]); err != nil {
			return fmt.Errorf("sending the READ header: %w", err)
		}
		if r.V2 {
			if err := readStatus(c, deadline(), rejected); err != nil {
				return err
			}
		}
		for off := 0; off < len(r.Buf); {
			c.SetReadDeadline(deadline())
			n, err := io.ReadFull(c, r.Buf[off:min(off+transport.IOChunk, len(r.Buf))])
			off += n
			if err != nil {
				if !r.V2 && off == 0 && transport.PeerGone(err) {
					return rejected
				}
				return fmt.Errorf("read %d of %d bytes: %w", off, len(r.Buf), err)
			}
		}
		return nil
	}

	// The header and the first chunk go in one writev.
	bufs := net.Buffers{hb[:], r.Buf[:min(len(r.Buf), transport.IOChunk)]}
	c.SetWriteDeadline(deadline())
	n, err := bufs.WriteTo(c)
	sent := max(int(n)-HeaderSize, 0)
	for err == nil && sent < len(r.Buf) {
		c.SetWriteDeadline(deadline())
		var m int
		m, err = c.Write(r.Buf[sent:min(sent+transport.IOChunk, len(r.Buf))])
		sent += m
	}
	if err != nil {
		if transport.PeerGone(err) {
			if !r.V2 {
				return rejected
			}
			if readStatus(c, time.Now().Add(lateStatusWait), rejected) == rejected {
				return rejected
			}
		}
		return fmt.Errorf("sent %d of %d bytes: %w", sent, len(r.Buf), err)
	}
	if r.V2 {
		return readStatus(c, deadline(), rejected)
	}
	// v1: shut our side; the target closes once it has read everything
	// (a clean EOF here). A target that rejected the request closed with
	// our bytes unread, which the kernel answers with a reset.
	c.CloseWrite()
	c.SetReadDeadline(deadline())
	var one [1]byte
	switch _, err := c.Read(one[:]); {
	case err == io.EOF:
		return nil
	case errors.Is(err, syscall.ECONNRESET):
		return rejected
	case err == nil:
		return fmt.Errorf("the target sent data after a v1 WRITE of %d bytes: it does not speak v1", len(r.Buf))
	default:
		return fmt.Errorf("waiting for the target to close after %d bytes (v1): %w", len(r.Buf), err)
	}
}

// readStatus reads a v2 status word: OK is nil, rejected is rejected.
func readStatus(c *net.TCPConn, deadline time.Time, rejected *RejectedError) error {
	c.SetReadDeadline(deadline)
	var b [StatusSize]byte
	if n, err := io.ReadFull(c, b[:]); err != nil {
		if transport.PeerGone(err) {
			return fmt.Errorf("the peer closed the connection after %d of the %d bytes of the status word: %w", n, StatusSize, err)
		}
		if errors.Is(err, os.ErrDeadlineExceeded) {
			return fmt.Errorf("no status word within the I/O timeout: %w", err)
		}
		return fmt.Errorf("reading the status word: %w", err)
	}
	st, err := DecodeStatus(b)
	switch {
	case err != nil:
		return err
	case st == StatusRejected:
		return rejected
	case st != StatusOK:
		return fmt.Errorf("the peer answered with unknown %s", st)
	}
	return nil
}
