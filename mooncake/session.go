package mooncake

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"net"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/sys/unix"

	"github.com/ferry-project/ferry/transport"
)

// Scheme prefixes a send's session when its peer is a Mooncake segment:
// "mooncake://ip:rpcport", the segment name sglang hands to senders.
const Scheme = "mooncake://"

// TransportName is what sessions to Mooncake segments report;
// RDMATransportName when the segment speaks RDMA.
const (
	TransportName     = "mooncake-tcp"
	RDMATransportName = "mooncake-rdma"
)

// RDMAWrite is one write into an RDMA segment.
type RDMAWrite struct {
	Self   string // the writer's segment name, for its NIC path
	RPC    string // the target segment's RPC port
	Target RDMATarget
	Remote uint64 // inside Target.Buffer
	Src    []byte
	QPs    int // QPs per endpoint; 0 is DefaultQPs
}

// RDMARead is one read from an RDMA segment: the bytes at Remote, inside
// Target.Buffer, into Dst.
type RDMARead struct {
	Self   string // the reader's segment name, for its NIC path
	RPC    string // the target segment's RPC port
	Target RDMATarget
	Remote uint64
	Dst    []byte
	QPs    int // QPs per endpoint; 0 is DefaultQPs
}

// RDMAInitiator carries writes into, and reads from, segments whose
// descriptor says protocol "rdma": the connection handshake and plain
// RDMA WRITEs and READs (Endpoints).
type RDMAInitiator interface {
	WriteRDMA(ctx context.Context, w RDMAWrite) (transport.Report, error)
	ReadRDMA(ctx context.Context, r RDMARead) (transport.Report, error)
}

// RPCAddr returns the handshake address of a "mooncake://host:port"
// session, and whether session is one.
func RPCAddr(session string) (string, bool, error) {
	rest, ok := strings.CutPrefix(session, Scheme)
	if !ok {
		return "", false, nil
	}
	host, port, err := net.SplitHostPort(rest)
	if err != nil || host == "" {
		return "", true, fmt.Errorf("session %q is not %sHOST:PORT of a Mooncake segment's RPC port (its segment name, e.g. %s10.0.0.5:15302)", session, Scheme, Scheme)
	}
	if p, err := strconv.ParseUint(port, 10, 16); err != nil || p == 0 {
		return "", true, fmt.Errorf("session %q: port %q is not a port number from 1 to 65535", session, port)
	}
	return rest, true, nil
}

// Dialer opens sessions to Mooncake segments; its Dial has the shape of
// transport.Transport's.
type Dialer struct {
	// Self is the descriptor sent with each metadata request (Mooncake's
	// client always sends its own; the server ignores it). Give it no
	// buffers: their addresses and keys would go to every segment dialed.
	Self      *Segment
	IOTimeout time.Duration // per data-plane chunk; default 10s
	MaxConns  int           // data connections at once per session; default 8
	// RDMA writes into and reads from rdma segments; nil refuses them.
	RDMA RDMAInitiator
	// Ferry, if set, opens a session to a ferry peer port: a segment
	// whose descriptor names one (Segment.Ferry, a ferry engine's) is
	// written over ferry's peer protocol with its key, not over
	// Mooncake's wire.
	Ferry func(ctx context.Context, peer string) (transport.Session, error)
	QPs   int // QPs per RDMA endpoint (the peers' MC_NUM_QP_PER_EP); 0 is DefaultQPs
}

// Dial fetches the segment's descriptor from its RPC port and returns a
// session that writes into its buffers over the TCP data plane.
func (d *Dialer) Dial(ctx context.Context, session string) (transport.Session, error) {
	rpc, ok, err := RPCAddr(session)
	if !ok && err == nil {
		err = fmt.Errorf("session %q does not start with %s", session, Scheme)
	}
	if err != nil {
		return nil, err
	}
	conns := d.MaxConns
	if conns <= 0 {
		conns = 8
	}
	s := &Session{d: d, peer: session, rpc: rpc, sem: make(chan struct{}, conns)}
	s.ctx, s.cancel = context.WithCancel(context.Background())
	seg, err := s.refresh(ctx)
	if err != nil {
		s.cancel()
		return nil, err
	}
	if seg.Ferry != nil && d.Ferry != nil && sameHost(rpc, seg.Ferry.Peer) {
		s.cancel()
		fs, err := d.Ferry(ctx, seg.Ferry.Peer)
		if err != nil {
			return nil, fmt.Errorf("mooncake segment %s (session %s) is a ferry engine's, served on ferry's peer port %s: %w", seg.Name, session, seg.Ferry.Peer, err)
		}
		return &ferrySession{Session: fs, key: seg.Ferry.Key, rpc: rpc, self: d.Self}, nil
	}
	return s, nil
}

// sameHost says whether a ferry engine segment's peer port lies on the
// host its RPC port was reached on. A descriptor naming another host is
// not followed: whoever serves the segment could otherwise send this
// ferryd's writes, and its connections, to any address it likes; such a
// segment is written over Mooncake's wire, to the host dialed.
func sameHost(rpc, peer string) bool {
	a, _, err1 := net.SplitHostPort(rpc)
	b, _, err2 := net.SplitHostPort(peer)
	return err1 == nil && err2 == nil && a == b
}

// ferrySession writes into a ferry engine's segment over ferry's peer
// protocol: each write carries the segment's key and lands at its
// Mooncake address (its owner's own); the receiver checks the range.
type ferrySession struct {
	transport.Session
	rpc  string   // the segment's RPC port, where its descriptor is fetched
	self *Segment // sent with the fetch

	mu  sync.Mutex
	key transport.Key
}

func (f *ferrySession) Write(ctx context.Context, w transport.Write) (transport.Report, error) {
	w.Tag, w.Whole = 0, false
	var rep transport.Report
	err := f.underKey(ctx, func(key transport.Key) (err error) {
		w.Key = key
		rep, err = f.Session.Write(ctx, w)
		return err
	})
	return rep, err
}

// Read reads from the segment's registered memory over ferry's peer
// protocol, each piece under the segment's key; the peer checks the
// range (daemon/engines.go).
func (f *ferrySession) Read(ctx context.Context, reads []transport.Read) error {
	r, ok := f.Session.(transport.Reader)
	if !ok {
		return fmt.Errorf("the %s session to %s does not read", f.Session.Transport(), f.Session.Peer())
	}
	return f.underKey(ctx, func(key transport.Key) error {
		for i := range reads {
			reads[i].Key = key
		}
		return r.Read(ctx, reads)
	})
}

// underKey runs op under the segment's key. Refused for want of a segment
// under that key (no_slot: the engine on that RPC port closed, and one
// opened there since has a key of its own), it runs op once more under
// the new key: the one a call beside it fetched meanwhile, else one it
// fetches from the descriptor itself. Mooncake peers would fetch a
// restarted segment afresh too.
func (f *ferrySession) underKey(ctx context.Context, op func(transport.Key) error) error {
	f.mu.Lock()
	key := f.key
	f.mu.Unlock()
	err := op(key)
	var refused *transport.Refusal
	if !errors.As(err, &refused) || refused.Code != transport.NoSlot {
		return err
	}
	f.mu.Lock()
	now := f.key
	f.mu.Unlock()
	if now == key { // the pieces of one batch in flight fetch it once, not each
		seg, ferr := FetchSegment(ctx, f.rpc, f.self)
		if ferr != nil || seg.Ferry == nil || seg.Ferry.Key == key || seg.Ferry.Peer != f.Session.Peer() {
			return err
		}
		now = seg.Ferry.Key
		f.mu.Lock()
		f.key = now
		f.mu.Unlock()
	}
	return op(now)
}

// Session writes into, and reads from, one Mooncake segment. Its
// descriptor is cached and fetched again when a range lies outside it
// (the peer may have restarted with new buffers); a broken write makes
// the daemon tear the session down, and the next Dial fetches it afresh.
type Session struct {
	d      *Dialer
	peer   string
	rpc    string
	sem    chan struct{}
	ctx    context.Context // ended by Close
	cancel context.CancelFunc

	mu  sync.Mutex
	seg *Segment
	// stale: a read failed; the next fetches the descriptor first (its
	// engine may have restarted with the same buffers under new rkeys).
	stale bool
	idle  []*net.TCPConn // v2 data connections kept for the next write (at most cap(sem))
}

var (
	_ transport.Session = (*Session)(nil)
	_ transport.Reader  = (*Session)(nil)
)

func (s *Session) Transport() string {
	if s.segment().Protocol == "rdma" {
		return RDMATransportName
	}
	return TransportName
}
func (s *Session) Peer() string { return s.peer }

// PeerInstance is the descriptor's fingerprint: it changes when the peer
// restarts.
func (s *Session) PeerInstance() uint64 { return s.segment().Identity() }

// Segment is the cached descriptor.
func (s *Session) Segment() *Segment { return s.segment() }

func (s *Session) segment() *Segment {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.seg
}

func (s *Session) Close() error {
	s.cancel()
	s.mu.Lock()
	idle := s.idle
	s.idle = nil
	s.mu.Unlock()
	for _, c := range idle {
		c.Close()
	}
	return nil
}

func (s *Session) refresh(ctx context.Context) (*Segment, error) {
	seg, err := FetchSegment(ctx, s.rpc, s.d.Self)
	if err != nil {
		return nil, err
	}
	if seg.Protocol == "rdma" && s.d.RDMA == nil && seg.Offers("tcp") {
		seg.Protocol = "tcp" // a multi-protocol segment
	}
	switch {
	case seg.Protocol == "tcp" && (seg.TCPDataPort <= 0 || seg.TCPDataPort > 65535):
		return nil, fmt.Errorf("mooncake segment %s (session %s) offers protocol tcp, and its tcp_data_port %d is not a port number from 1 to 65535: its engine serves no TCP data port, so reach it from a ferryd on the rdma transport, or start its engine with the TCP transport", seg.Name, s.peer, seg.TCPDataPort)
	case seg.Protocol == "rdma" && s.d.RDMA == nil:
		return nil, fmt.Errorf("mooncake segment %s (session %s) speaks protocol rdma, and this ferryd has no RDMA data plane: run ferryd on the rdma transport on an RDMA host, or start the peer's engine with the TCP transport", seg.Name, s.peer)
	case seg.Protocol != "tcp" && seg.Protocol != "rdma":
		return nil, fmt.Errorf("mooncake segment %s (session %s) speaks protocol %q; ferry reaches Mooncake segments over tcp or rdma: start its engine with one of those", seg.Name, s.peer, seg.Protocol)
	}
	s.mu.Lock()
	s.seg, s.stale = seg, false
	s.mu.Unlock()
	return seg, nil
}

// Write writes w.Src to w.Remote in the segment (w.Key and w.Tag have no
// place on Mooncake's wire). A range outside every buffer of the segment,
// even after fetching its descriptor again, is a Refusal naming the
// range and the buffers.
func (s *Session) Write(ctx context.Context, w transport.Write) (transport.Report, error) {
	if s.ctx.Err() != nil {
		return transport.Report{}, fmt.Errorf("mooncake write to %s: %w", s.peer, transport.ErrClosed)
	}
	if w.Src == nil && w.Device.Len > 0 {
		return transport.Report{}, fmt.Errorf("mooncake write to %s: %w", s.peer, transport.ErrHostOnly)
	}
	n := uint64(len(w.Src))
	seg := s.segment()
	if _, ok := seg.Buffer(w.Remote, n); !ok {
		var err error
		if seg, err = s.refresh(ctx); err != nil {
			return transport.Report{}, fmt.Errorf("mooncake write to %s: the range is outside the cached descriptor, and fetching it again failed: %w", s.peer, err)
		}
		if _, ok := seg.Buffer(w.Remote, n); !ok {
			return transport.Report{}, &transport.Refusal{Code: transport.OutOfBounds, Message: fmt.Sprintf(
				"[%#x, %#x) (%d bytes) lies in none of the buffers of Mooncake segment %s: %s; use a buffer_address the receiver registered",
				w.Remote, w.Remote+n, n, seg.Name, seg.DescribeBuffers())}
		}
	}
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	stop := context.AfterFunc(s.ctx, cancel)
	defer stop()
	if seg.Protocol == "rdma" {
		tg, _, err := seg.RDMATarget(w.Remote, n)
		var rep transport.Report
		if err == nil {
			rep, err = s.d.RDMA.WriteRDMA(ctx, RDMAWrite{Self: s.d.Self.Name, RPC: s.rpc, Target: tg, Remote: w.Remote, Src: w.Src, QPs: s.d.QPs})
		}
		if err != nil {
			return transport.Report{}, s.fail(ctx, err)
		}
		return rep, nil
	}
	select {
	case s.sem <- struct{}{}:
	case <-ctx.Done():
		return transport.Report{}, s.fail(ctx, fmt.Errorf("waiting for a data connection: %w", ctx.Err()))
	}
	defer func() { <-s.sem }()
	v2 := seg.TCPProtoVersion >= 2
	req := Request{Data: seg.DataAddr(s.rpc), Addr: w.Remote, Buf: w.Src, V2: v2, IOTimeout: s.d.IOTimeout}
	if err := s.tcp(ctx, OpWrite, req); err != nil {
		return transport.Report{}, s.fail(ctx, err)
	}
	// The header, and in v2 the status word.
	rep := transport.Report{Messages: 1}
	if v2 {
		rep.Messages = 2
	}
	return rep, nil
}

// Read fills each piece's Dst from its Addr in the segment's buffers
// (Key has no place on Mooncake's wire): on an rdma segment by plain RDMA
// READs under the rkey its descriptor lists for the buffer (over the
// endpoint writes take), on a tcp one by READs on its data port. Every
// piece is checked against the descriptor's buffers before any is read
// (fetched again once when one lies outside them): a piece outside all is
// a Refusal naming it, its range and the buffers. The pieces then go
// several at once, ReadsPerQP per queue pair of the endpoint (or one per
// session data connection), so that a batch of small pages is not one
// round trip per page; the first piece to fail ends the read.
func (s *Session) Read(ctx context.Context, reads []transport.Read) error {
	if s.ctx.Err() != nil {
		return fmt.Errorf("mooncake read from %s: %w", s.peer, transport.ErrClosed)
	}
	s.mu.Lock()
	seg, stale := s.seg, s.stale
	s.mu.Unlock()
	i := outside(seg, reads)
	if i >= 0 || stale {
		var err error
		if seg, err = s.refresh(ctx); err != nil {
			return fmt.Errorf("mooncake read from %s: fetching the segment's descriptor again: %w", s.peer, err)
		}
		i = outside(seg, reads)
	}
	if i >= 0 {
		r, n := reads[i], uint64(len(reads[i].Dst))
		return &transport.Refusal{Code: transport.OutOfBounds, Message: fmt.Sprintf(
			"piece %d, [%#x, %#x) (%d bytes), lies in none of the buffers of Mooncake segment %s: %s; read memory its engine registered",
			i, r.Addr, r.Addr+n, n, seg.Name, seg.DescribeBuffers())}
	}
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	stop := context.AfterFunc(s.ctx, cancel)
	defer stop()
	workers := cap(s.sem)
	if seg.Protocol == "rdma" {
		workers = cmp.Or(s.d.QPs, DefaultQPs) * ReadsPerQP
	}
	var (
		next  atomic.Int64
		wg    sync.WaitGroup
		once  sync.Once
		first error
	)
	for range min(workers, len(reads)) {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for ctx.Err() == nil {
				i := int(next.Add(1)) - 1
				if i >= len(reads) {
					return
				}
				if err := s.readPiece(ctx, seg, i, reads[i]); err != nil {
					// The pieces the cancel cuts short fail too: only the
					// first failure says what went wrong.
					once.Do(func() { first = err; cancel() })
					return
				}
			}
		}()
	}
	wg.Wait()
	return first
}

// readPiece reads piece i, r, of a Read from seg.
func (s *Session) readPiece(ctx context.Context, seg *Segment, i int, r transport.Read) error {
	if len(r.Dst) == 0 {
		return nil
	}
	var err error
	if seg.Protocol == "rdma" {
		var tg RDMATarget
		if tg, _, err = seg.RDMATarget(r.Addr, uint64(len(r.Dst))); err == nil {
			_, err = s.d.RDMA.ReadRDMA(ctx, RDMARead{Self: s.d.Self.Name, RPC: s.rpc, Target: tg, Remote: r.Addr, Dst: r.Dst, QPs: s.d.QPs})
		}
	} else {
		select {
		case s.sem <- struct{}{}:
			err = s.tcp(ctx, OpRead, Request{Data: seg.DataAddr(s.rpc), Addr: r.Addr, Buf: r.Dst, V2: seg.TCPProtoVersion >= 2, IOTimeout: s.d.IOTimeout})
			<-s.sem
		case <-ctx.Done():
			err = fmt.Errorf("waiting for a data connection: %w", ctx.Err())
		}
	}
	switch {
	case err == nil:
		return nil
	case s.ctx.Err() != nil:
		return fmt.Errorf("mooncake read from %s: piece %d, %d bytes at %#x: %w: %w", s.peer, i, len(r.Dst), r.Addr, transport.ErrClosed, err)
	}
	s.mu.Lock()
	s.stale = true
	s.mu.Unlock()
	return fmt.Errorf("mooncake read from %s: piece %d, %d bytes at %#x: %w", s.peer, i, len(r.Dst), r.Addr, err)
}

// outside is the index of the first read lying in none of seg's buffers,
// or -1.
func outside(seg *Segment, reads []transport.Read) int {
	for i, r := range reads {
		if _, ok := seg.Buffer(r.Addr, uint64(len(r.Dst))); !ok {
			return i
		}
	}
	return -1
}

func (s *Session) fail(ctx context.Context, err error) error {
	if s.ctx.Err() != nil {
		return fmt.Errorf("mooncake write to %s: %w: %w", s.peer, transport.ErrClosed, err)
	}
	return fmt.Errorf("mooncake write to %s: %w", s.peer, err)
}

// tcp carries out r on the data port: in v1 on a connection of its own;
// in v2 (pooled) on a data connection kept from an earlier request, or a
// new one, kept again once the status said the bytes are in memory (a
// WRITE's) or they all came (a READ's). Mooncake's data port (and ferry's) reads the
// next header on a connection after its status word, as a Mooncake
// connection pool has it do, so a write in a row pays no connect, no
// accept and no new goroutine at either end. A kept connection the peer
// closed meanwhile (a restart, a port making room) reads EOF and is
// dropped before use; one it closes in the instant after that fails the
// write as a broken path does (the daemon re-dials and retries). A
// connection whose write failed, or was rejected (Mooncake's port closes
// after a rejection), is not kept.
func (s *Session) tcp(ctx context.Context, op Opcode, r Request) error {
	if !r.V2 {
		return do(ctx, op, r)
	}
	c := s.takeIdle()
	if c == nil {
		var err error
		if c, err = dialData(ctx, r); err != nil {
			return err
		}
	}
	err := request(ctx, c, op, r)
	if err != nil || !s.putIdle(c) {
		c.Close()
	}
	return err
}

// takeIdle is a kept data connection that is still open and in step
// (nothing waits to be read on it: a closed one reads EOF), or nil.
func (s *Session) takeIdle() *net.TCPConn {
	for {
		s.mu.Lock()
		var c *net.TCPConn
		if n := len(s.idle); n > 0 {
			c, s.idle = s.idle[n-1], s.idle[:n-1]
		}
		s.mu.Unlock()
		if c == nil || quiet(c) {
			return c
		}
		c.Close()
	}
}

// putIdle keeps c for the next write, unless the session closed or
// keeps as many as it may have in flight.
func (s *Session) putIdle(c *net.TCPConn) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.ctx.Err() != nil || len(s.idle) >= cap(s.sem) {
		return false
	}
	s.idle = append(s.idle, c)
	return true
}

// quiet reports whether c is open with nothing to read: a peek that
// would block.
func quiet(c *net.TCPConn) bool {
	rc, err := c.SyscallConn()
	if err != nil {
		return false
	}
	ok := false
	err = rc.Read(func(fd uintptr) bool {
		var b [1]byte
		_, _, rerr := unix.Recvfrom(int(fd), b[:], unix.MSG_PEEK|unix.MSG_DONTWAIT)
		ok = rerr == unix.EAGAIN
		return true
	})
	return err == nil && ok
}
