package rdma

// RDMA READs of engine memory (docs/rdma.md, "Reads"). A daemon reads
// a peer's engine memory (what a ferry.mooncake engine registered) by
// RDMA READ from the engine region's registration for peers
// (RegisterEngineRegion: at the engine's addresses, remote read
// allowed), on a queue pair of its own set up over a control connection
// of kind 3 (peer.KindRDMARead; the peer port's handshake first, with a
// peer secret its challenge-response). Integers are little-endian.
//
//	client → server  connect, 32 bytes: the client QP's endpoint (as a
//	                 lane's connect, rdma/wire.go; flags, rail and rails 0)
//	server → client  a reply (peer.EncodeReply): code 0 and its QP's
//	                 endpoint, 32 bytes, on rail 0 (whose protection
//	                 domain holds the engine registrations); or a
//	                 refusal, and the connection closes
//
// Both QPs connect as Mooncake endpoints' do (PSN 0: mcverbs.go); the
// client's at once, letting the server do nothing through it. The
// server's stays in INIT, where the NIC drops every packet sent to it,
// until the first read whose key checks out and gets a grant: only then
// does it go to RTR and RTS, with REMOTE_READ (no WRITE), so a stranger
// who opened the connection without a key READs nothing, whatever rkey
// it guesses. Ferry's lanes keep refusing READs. Then any number of
// reads, one at a time:
//
//	client → server  peer.Header, 40 bytes: addr, len (at least 1), the
//	                 key of the memory (an engine segment's), tag 0
//	server → client  a reply: a refusal (out_of_bounds: the range lies
//	                 outside the memory the key names, or spans two
//	                 registered ranges; no_slot: no memory has that key),
//	                 or code 0 and a grant, 16 bytes (grant, wire.go):
//	                 the address to READ from and the rkey of the
//	                 engine region's registration holding the whole
//	                 range. With flags bit 3 (flagOverTCP) the grant is
//	                 zero: the range has no registration to read from
//	                 (GPU memory not registered for peers), and the
//	                 client reads it over a read connection (kind 2,
//	                 transport/peer/read.go)
//
// The client posts RDMA READs of the granted range into registered
// memory of its own (1 MiB each, every one signaled), waits for their
// completions, and sends the next header or closes the connection: the
// server keeps the region pinned (its unregistering waits) until then,
// so a granted READ never reaches memory an engine unregistered, or
// until the answer's deadline of a TCP read connection
// (peer.AnswerTimeout) has passed, when it closes the connection and
// its queue pair. The
// grant's rkey is the region's, as the engine segment's descriptor
// lists it for Mooncake peers: it reaches the region and nothing else.
// A refusal keeps the connection, but for a read above MaxWrite and the
// MaxUnmatched-th no_slot, which close it.

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"time"

	"github.com/ferry-project/ferry/internal/connlimit"
	"github.com/ferry-project/ferry/transport"
	"github.com/ferry-project/ferry/transport/peer"
)

// flagOverTCP in a read's reply: no grant, read the range over TCP.
const flagOverTCP = 8

// ReadGranter is a Sink whose daemon grants RDMA READs of the memory it
// serves under a key (peer.Port serves reads of it over TCP: it is a
// transport.Source too).
type ReadGranter interface {
	transport.Source
	// GrantRead checks a read of n bytes at addr carrying key, as
	// ReadKeyed does, and returns where to READ the range from, under
	// which rkey (an engine region's registration: EngineRegion), the
	// region pinned until done is called. ErrNoGrant: the range is
	// readable, and has no registration to READ it from.
	GrantRead(addr, n uint64, key transport.Key) (iova uint64, rkey uint32, done func(), err error)
}

// ErrNoGrant is GrantRead's answer for readable memory with no
// registration for peers' READs.
var ErrNoGrant = errors.New("no registration for peers' reads")

// serveReads serves a control connection of RDMA READs.
func (t *Transport) serveReads(c *connlimit.Conn, _ uint64) {
	err := t.grantReads(c)
	if errors.Is(err, os.ErrDeadlineExceeded) {
		c.Closing(connlimit.ReasonTimeout)
	}
	if err != nil && err != io.EOF && !c.Dropped() && !t.isClosing() {
		t.port.Warnf("rdma: read connection from %s: %v", c.RemoteAddr(), err)
	}
}

func (t *Transport) grantReads(c *connlimit.Conn) error {
	g := t.cfg.Peer.Sink.(ReadGranter) // serveReads is set up only then
	ioTimeout := t.cfg.Peer.IOTimeout
	c.SetDeadline(time.Now().Add(ioTimeout))
	var b [endpointSize]byte
	if _, err := readFull(c, b[:], "connect"); err != nil {
		return err
	}
	var remote endpoint
	remote.decode(b[:])
	q, err := t.newReadQP()
	if err != nil {
		writeReply(c, transport.Internal, 0, fmt.Sprintf("no queue pair for RDMA reads: %v", err), nil)
		return err
	}
	defer q.Close()
	// In INIT until a key checks out (grantRead): no READ reaches
	// anything before.
	rq := &readQP{q: q, remote: remote}
	e := t.nic.Endpoint()
	e.QPN, e.PSN = q.QPN(), 0
	e.encode(b[:])
	if err := writeReply(c, transport.OK, 0, "", b[:]); err != nil {
		return err
	}
	c.Greeted()
	gate := t.port.Gate("read connection")
	var release func()
	defer func() {
		if release != nil {
			release()
		}
	}()
	var hb [peer.HeaderSize]byte
	var granted uint64 // bytes of the grant out, 0 when none is
	for {
		// A grant pins its region until the next header: the client's
		// READs of it, and that header, come within the answer's
		// deadline a TCP read connection has (peer.AnswerTimeout), so a
		// reader cannot hold the pin for the idle timeout or longer.
		wait := t.cfg.Peer.IdleTimeout
		if release != nil {
			wait = peer.AnswerTimeout(granted, ioTimeout)
		}
		c.SetDeadline(time.Now().Add(wait))
		held := release != nil
		var n int
		var err error
		if held { // the whole header within the grant's deadline
			n, err = io.ReadFull(c, hb[:])
		} else {
			n, err = readHeader(c, hb[:], ioTimeout)
		}
		if held { // the client's READs of the last grant are done
			release()
			release = nil
		}
		if errors.Is(err, os.ErrDeadlineExceeded) && (held || n == 0) {
			if held {
				return fmt.Errorf("closed the connection: the reader held its grant of %d bytes past %v (the io timeout, and a second per %d MiB) without its next header: %w", granted, wait, peer.MinReadRate>>20, err)
			}
			c.Closing(connlimit.ReasonIdle)
			return nil
		}
		if err != nil {
			return err
		}
		if !c.Busy() {
			return nil // the port closed it to make room just now
		}
		var h peer.Header
		h.Decode(&hb)
		c.SetDeadline(time.Now().Add(ioTimeout))
		err = t.grantRead(c, g, gate, rq, &h, &release)
		granted = h.Len
		c.Idle()
		if err != nil {
			return err
		}
	}
}

// readQP is the queue pair of a read connection on the serving side,
// connected to remote once a read's key has checked out.
type readQP struct {
	q         *MooncakeQP
	remote    endpoint
	connected bool
}

// connect takes the queue pair to RTS, once: the reader may READ
// through it and nothing else, and what it reads is still only what a
// grant names (the registrations in this PD that allow READs are
// engine regions').
func (r *readQP) connect() error {
	if r.connected {
		return nil
	}
	// Under the lane's lock, and not once it closed: the transport's
	// Close destroys read QPs before its port's connections end.
	l := r.q.l
	l.use.Lock()
	defer l.use.Unlock()
	select {
	case <-l.quit:
		return errLaneClosed
	default:
	}
	if err := l.qp.(mooncakeQP).connectMooncake(r.remote, qpReads); err != nil {
		return err
	}
	r.connected = true
	return nil
}

// grantRead answers one read; an error ends the connection.
func (t *Transport) grantRead(c *connlimit.Conn, g ReadGranter, gate *peer.Gate, rq *readQP, h *peer.Header, release *func()) error {
	if msg, end := peer.ReadTooLarge(h.Len, t.cfg.Peer.MaxWrite); end != nil {
		writeReply(c, transport.OutOfBounds, peer.FlagClose, msg, nil)
		return end
	}
	iova, rkey, done, err := g.GrantRead(h.Addr, h.Len, h.Key)
	var gb [grantSize]byte
	switch {
	case err == ErrNoGrant:
		return writeReply(c, transport.OK, flagOverTCP, "", gb[:])
	case err != nil:
		code, flags, msg, end := gate.Refusing(err)
		if werr := writeReply(c, code, flags, msg, nil); werr != nil {
			return werr
		}
		return end
	}
	if err := rq.connect(); err != nil {
		done()
		writeReply(c, transport.Internal, peer.FlagClose, fmt.Sprintf("no queue pair for RDMA reads: %v", err), nil)
		return err
	}
	*release = done
	c.Prove() // it held a key to readable memory
	gr := grant{Addr: iova, RKey: rkey}
	gr.encode(&gb)
	t.stats.control.Add(1)
	return writeReply(c, transport.OK, 0, "", gb[:])
}

// readHeader reads a header: its first byte within the deadline set, the rest
// within timeout of it.
func readHeader(c *connlimit.Conn, b []byte, timeout time.Duration) (int, error) {
	n, err := io.ReadAtLeast(c, b, 1)
	if err == nil && n < len(b) {
		c.SetReadDeadline(time.Now().Add(timeout))
		var m int
		m, err = io.ReadFull(c, b[n:])
		n += m
	}
	return n, err
}

func readFull(c io.Reader, b []byte, what string) (int, error) {
	n, err := io.ReadFull(c, b)
	if err != nil && n > 0 {
		err = fmt.Errorf("read %d of the %d-byte %s: %w", n, len(b), what, err)
	}
	return n, err
}

// Read reads each piece from the peer by RDMA READ where the peer
// grants one, over a read connection (TCP) where it does not, or where
// it serves no RDMA reads.
func (s *session) Read(ctx context.Context, reads []transport.Read) error {
	t := s.t
	c, _, err := t.port.Dial(ctx, s.Peer(), peer.KindRDMARead)
	if errors.Is(err, peer.ErrNoRDMA) || errors.Is(err, peer.ErrUnknownKind) {
		return t.port.Read(ctx, s.Peer(), reads)
	}
	if err != nil {
		return fmt.Errorf("rdma read from %s: %w", s.Peer(), err)
	}
	// ctx ending closes the connection, whatever deadline is set on it.
	stop := context.AfterFunc(ctx, func() { c.Close() })
	defer func() {
		stop()
		c.Close()
	}()
	fail := func(step string, err error) error {
		if ctx.Err() != nil {
			err = fmt.Errorf("%w (%v)", ctx.Err(), err)
		}
		return fmt.Errorf("rdma read from %s: %s: %w", s.Peer(), step, err)
	}
	q, err := t.newReadQP()
	if err != nil {
		return fail("a queue pair", err)
	}
	defer q.Close()
	e := t.nic.Endpoint()
	e.QPN, e.PSN = q.QPN(), 0
	var b [endpointSize]byte
	e.encode(b[:])
	c.SetDeadline(time.Now().Add(t.cfg.Peer.IOTimeout))
	if _, err := c.Write(b[:]); err != nil {
		return fail("sending the connect", err)
	}
	r, err := readReply(c, b[:])
	if err != nil {
		return fail("its connect reply", err)
	}
	if r.Code != transport.OK {
		return fail("its connect reply", fmt.Errorf("%s: %s", r.Code, r.Msg))
	}
	var remote endpoint
	remote.decode(b[:])
	// The reader's queue pair only posts READs: the peer may do nothing
	// through it.
	if err := q.l.qp.(mooncakeQP).connectMooncake(remote, 0); err != nil {
		return fail("connecting the queue pair", err)
	}
	var hb [peer.HeaderSize]byte
	var gb [grantSize]byte
	for i, rd := range reads {
		if len(rd.Dst) == 0 {
			continue
		}
		h := peer.Header{Addr: rd.Addr, Len: uint64(len(rd.Dst)), Key: rd.Key}
		h.Encode(&hb)
		c.SetDeadline(time.Now().Add(t.cfg.Peer.IOTimeout))
		if _, err := c.Write(hb[:]); err != nil {
			return fail(fmt.Sprintf("piece %d's header", i), err)
		}
		r, err := readReply(c, gb[:])
		if err != nil {
			return fail(fmt.Sprintf("piece %d's reply", i), err)
		}
		t.stats.control.Add(1)
		if r.Code != transport.OK {
			return &transport.Refusal{Code: r.Code, Message: r.Msg}
		}
		if r.Flags&flagOverTCP != 0 {
			if err := t.port.Read(ctx, s.Peer(), reads[i:i+1]); err != nil {
				return err
			}
			continue
		}
		var g grant
		g.decode(&gb)
		if _, err := q.Read(ctx, rd.Dst, g.Addr, g.RKey); err != nil {
			return fail(fmt.Sprintf("piece %d: %d bytes at %#x", i, len(rd.Dst), rd.Addr), err)
		}
	}
	return nil
}
