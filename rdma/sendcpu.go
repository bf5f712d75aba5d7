package rdma

import (
	"bytes"
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/sys/unix"

	"github.com/ferry-project/ferry/transport"
	"github.com/ferry-project/ferry/transport/peer"
)

// SendCPU measures ferry's own CPU per send: two transports in this
// process, a sender and a receiver on loopback, over the simulated NIC
// (simnic.go). Both sides' work counts; the simulated NIC's work
// requests do not: what its send engine does to carry one out (check the
// keys, copy the bytes, consume a receive, place both completions:
// fakeQP.execute and retire), work a real NIC does in hardware, is timed
// alone in the same run, over the same memory, and left out once per
// work request. The rest of the NIC counts as ferry's: its Post, Poll,
// Arm and Wait, which ferry's goroutines call (standing in for a
// doorbell, reading CQ entries, a completion channel), the wake-ups and
// parking of its send engines' goroutines, and whatever the work
// requests cost in the run beyond their cost alone (contention, colder
// caches). The figure is thus an upper bound of what ferry costs the two
// hosts per send. ferrybench rdma-cpu and BenchmarkSendCPU run it.
//
// Timing each engine's stretches of work by its thread's CPU clock
// instead (the goroutine locked to its thread meanwhile) was tried: a
// clock_gettime of CLOCK_THREAD_CPUTIME_ID costs 1.2-1.6 µs on the VMs
// this runs on, and the two per stretch added more to the process than
// they took out.

// CPUConfig is one SendCPU run.
type CPUConfig struct {
	Size     int // bytes per send
	Sends    int // sends measured, after a warm-up round of InFlight
	InFlight int // sends in flight, each from its own goroutine
	Lanes    int // lanes (RC QPs) the sends share
	// Direct makes the peers authenticated (a peer secret): sends go
	// direct under the arena's rkey (ModeArenaRKey), with no control
	// message, as in windows mode. Otherwise each asks for a grant
	// (ModeGrant).
	Direct bool
	// Inline has the simulated NIC carry out each work request inside
	// Post, as soft-RoCE does on a loopback QP: no send engine wakes for
	// it, and a write finds its completion in the CQ the moment it looks,
	// so it never sleeps for one. A hardware NIC completes later, and its
	// writes do sleep: this run is a lower bound of ferry's CPU per send,
	// the default one (a send engine per QP, woken per post) an upper one.
	Inline bool
	// TCP is the transports' fallback for peers without RDMA
	// (transport/tcp's Over, as Config.TCP): a simulated pair never uses
	// it, but a transport needs one. Required.
	TCP func(*peer.Port) Fallback
}

// CPUResult is what a SendCPU run measured, per send.
type CPUResult struct {
	Mode  string // the receiver's: ModeArenaRKey or ModeGrant
	Sends int
	// CPU is the process's user+system CPU in µs per send, from the
	// first measured send until the receiver has taken the last one,
	// less NIC.
	CPU float64
	// NIC is the simulated NIC's CPU in µs per send, left out of CPU:
	// a work request's cost timed alone (see SendCPU), times the work
	// requests per send.
	NIC float64
	// The sender's control messages (headers sent, grants read) and
	// posts (ibv_post_send calls) per send.
	Control, Posts float64
	// Credit messages read per send (flow control, wire.go), and the
	// sends that waited for a credit, in all.
	Credits float64
	Stalls  uint64
	Wall    time.Duration
}

// SendCPU runs c over the simulated NIC. ctx bounds the run.
func SendCPU(ctx context.Context, c CPUConfig) (CPUResult, error) {
	if c.Size <= 0 || c.Sends <= 0 || c.InFlight <= 0 || c.Lanes <= 0 {
		return CPUResult{}, fmt.Errorf("rdma: send CPU: size %d, sends %d, in flight %d and lanes %d must all be positive", c.Size, c.Sends, c.InFlight, c.Lanes)
	}
	var secret []byte
	if c.Direct {
		secret = make([]byte, 32)
		rand.Read(secret)
	}
	p, closeAll, err := simPair(ctx, c, secret)
	if err != nil {
		return CPUResult{}, err
	}
	res, err := p.measure(ctx, c)
	if cerr := closeAll(); err == nil {
		err = cerr
	}
	return res, err
}

// simPair starts a sender and a receiver on two simulated NICs and
// dials the sender's session; closeAll closes them and unmaps their
// memory, reporting a leak as an error.
func simPair(ctx context.Context, c CPUConfig, secret []byte) (_ *sendPair, closeAll func() error, err error) {
	var closers []func() error
	closeAll = func() error {
		var errs []error
		for i := len(closers) - 1; i >= 0; i-- {
			errs = append(errs, closers[i]())
		}
		return errors.Join(errs...)
	}
	defer func() {
		if err != nil {
			closeAll()
		}
	}()
	mapped := func(n int) ([]byte, error) {
		b, err := mapAnon(n)
		if err == nil {
			closers = append(closers, func() error { unmap(b); return nil })
		}
		return b, err
	}
	src, err := mapped(c.Size)
	if err != nil {
		return nil, nil, err
	}
	dst, err := mapped(c.Lanes * c.Size)
	if err != nil {
		return nil, nil, err
	}
	f := newFabric()
	f.inline = c.Inline
	start := func(id byte, sink *countSink, mem []byte) (*Transport, error) {
		cfg := Config{Peer: peer.Config{Addr: "127.0.0.1:0", Sink: sink, Secret: secret, MaxConnsPerPeer: c.Lanes}, Memory: mem, TCP: c.TCP}
		t, err := listen(cfg, f.nic(id))
		if err == nil {
			closers = append(closers, t.Close)
		}
		return t, err
	}
	// The sender's sink has no memory: it takes nothing.
	tx, err := start(1, &countSink{}, src)
	if err != nil {
		return nil, nil, err
	}
	p := newSendPair(src, dst, c.Lanes, c.InFlight)
	rx, err := start(2, p.sink, dst)
	if err != nil {
		return nil, nil, err
	}
	s, err := tx.Dial(ctx, rx.Addr().String())
	if err != nil {
		return nil, nil, fmt.Errorf("rdma: send CPU: dialing the receiver: %w", err)
	}
	closers = append(closers, s.Close)
	p.sess, p.tx, p.rx = s, tx, rx
	return p, closeAll, nil
}

// measure sends a warm-up round, as ferryd's lanes are dialed before
// the sends that reuse them, then c.Sends under the CPU clock, which
// stops when the receiver has taken them all.
func (p *sendPair) measure(ctx context.Context, c CPUConfig) (CPUResult, error) {
	p.sink.expect(int64(c.InFlight + c.Sends))
	if err := p.send(ctx, c.InFlight); err != nil {
		return CPUResult{}, err
	}
	before := p.tx.Stats()
	start := time.Now()
	var err error
	cpu := cpuPer(func() {
		if err = p.send(ctx, c.Sends); err == nil {
			err = p.landed(ctx)
		}
	}, c.Sends)
	wall := time.Since(start)
	if err != nil {
		return CPUResult{}, err
	}
	after := p.tx.Stats()
	per := func(a, b uint64) float64 { return float64(a-b) / float64(c.Sends) }
	wrs := per(after.WorkRequests, before.WorkRequests)
	perWR, err := nicCPU(p.src, p.sink.mem, int(float64(c.Size)/wrs))
	if err != nil {
		return CPUResult{}, err
	}
	nic := wrs * perWR
	return CPUResult{
		Mode: p.rx.Mode(), Sends: c.Sends, CPU: cpu - nic, NIC: nic,
		Control: per(after.ControlMessages, before.ControlMessages), Posts: per(after.Posts, before.Posts),
		Credits: per(after.CreditMessages, before.CreditMessages), Stalls: after.CreditStalls - before.CreditStalls,
		Wall: wall,
	}, nil
}

// nicCPU is the CPU in µs of the simulated NIC's send engine carrying
// out one signaled WRITE WITH IMM of size bytes from src into dst,
// timed alone on a pair of QPs of their own, over enough work requests
// (about 1.3 GB) for getrusage's resolution.
func nicCPU(src, dst []byte, size int) (float64, error) {
	n := max(100, 20000*(64<<10)/size)
	f := newFabric()
	a, b := f.nic(1), f.nic(2)
	sr, err := a.Register(src[:size], localUse)
	if err != nil {
		return 0, err
	}
	defer sr.Close()
	dr, err := b.Register(dst[:size], peerWrites)
	if err != nil {
		return 0, err
	}
	defer dr.Close()
	qa, _ := a.NewQP(1, 0)
	defer qa.Close()
	qb, _ := b.NewQP(0, n)
	defer qb.Close()
	qa.Connect(0, endpoint{QPN: qb.QPN()})
	qb.Connect(0, endpoint{QPN: qa.QPN()})
	qb.PostRecvs(n)
	q, peer := qa.(*fakeQP), qb.(*fakeQP)
	o := op{Local: addrOf(src), LKey: sr.LKey(), Remote: addrOf(dst), RKey: dr.RKey(), Len: uint32(size), Signaled: true, WithImm: true}
	var status wcStatus
	us := cpuPer(func() {
		for i := range n {
			var opcode uint32
			status, opcode = q.execute(o)
			q.mu.Lock()
			q.retire(o, status, opcode)
			q.mu.Unlock()
			if status != wcSuccess {
				return
			}
			if i%64 == 63 {
				// The run's pollers take them: piled up, they would
				// crowd the copies out of the cache.
				clearCQs(q, peer)
			}
		}
	}, n)
	if status != wcSuccess {
		return 0, fmt.Errorf("rdma: send CPU: timing the simulated NIC's work requests: status %d", status)
	}
	clearCQs(q, peer)
	return us, nil
}

func clearCQs(qps ...*fakeQP) {
	for _, q := range qps {
		q.mu.Lock()
		q.cq = q.cq[:0]
		q.mu.Unlock()
	}
}

// cpuPer is this process's user+system CPU time in µs that f took, per
// one of its n operations.
func cpuPer(f func(), n int) float64 {
	var a, z unix.Rusage
	unix.Getrusage(unix.RUSAGE_SELF, &a)
	f()
	unix.Getrusage(unix.RUSAGE_SELF, &z)
	us := func(r unix.Rusage) float64 {
		return float64(r.Utime.Sec+r.Stime.Sec)*1e6 + float64(r.Utime.Usec+r.Stime.Usec)
	}
	return (us(z) - us(a)) / float64(n)
}

// sendPair is a sender's session to a receiver whose countSink takes
// every send: writers goroutines send the same source bytes, writer i
// into the size bytes of region i%lanes of the receiver's memory, as
// ib_write_bw has a buffer per QP (writers sharing a region leave it as
// they found it). SendCPU and the rdma benchmarks run it.
type sendPair struct {
	src            []byte
	sink           *countSink
	sess           transport.Session
	tx, rx         *Transport // SendCPU's, for their counters; nil in the benchmarks
	lanes, writers int
	wrote          []bool // the writers that sent
}

func newSendPair(src, dst []byte, lanes, writers int) *sendPair {
	for i := range src {
		src[i] = byte(i * 7)
	}
	return &sendPair{
		src: src, sink: &countSink{mem: dst, base: addrOf(dst)},
		lanes: lanes, writers: writers, wrote: make([]bool, writers),
	}
}

// send makes total sends from p.writers goroutines.
func (p *sendPair) send(ctx context.Context, total int) error {
	size := len(p.src)
	var next atomic.Int64
	var wg sync.WaitGroup
	errs := make([]error, p.writers)
	for i := range p.writers {
		wg.Go(func() {
			// A key whose tag names the writer's region.
			key := transport.Key{0: byte(i), 1: byte(i >> 8), 15: 1}
			w := transport.Write{Src: p.src, Remote: p.sink.base + uint64(i%p.lanes*size), Key: key, Tag: key.Tag(), Whole: true}
			for next.Add(1) <= int64(total) {
				if _, err := p.sess.Write(ctx, w); err != nil {
					errs[i] = err
					return
				}
				p.wrote[i] = true
			}
		})
	}
	wg.Wait()
	return errors.Join(errs...)
}

// landed waits until the receiver has taken every send expected (its
// completion of the last one on each lane may trail the sender's) and
// checks the bytes of each region written.
func (p *sendPair) landed(ctx context.Context) error {
	ctx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	select {
	case <-p.sink.all:
	case <-ctx.Done():
		return fmt.Errorf("rdma: %d of %d sends delivered: %w", p.sink.delivered.Load(), p.sink.want, ctx.Err())
	}
	size := len(p.src)
	for i, w := range p.wrote {
		if w && !bytes.Equal(p.sink.mem[i%p.lanes*size:][:size], p.src) {
			return fmt.Errorf("rdma: writer %d's bytes differ from the source", i)
		}
	}
	return nil
}

// countSink takes every write into its memory at the address it names
// and counts the deliveries, as a receiver that checks nothing would:
// the runs measure the data path, and the writers rewrite their regions
// without waiting for the receiver's bookkeeping. Its addresses are its
// memory's own, so authenticated writers write directly.
type countSink struct {
	mem       []byte
	base      uint64 // the address of mem[0]
	want      int64  // deliveries to wait for; set by expect
	delivered atomic.Int64
	all       chan struct{} // closed at the want-th delivery
}

// expect resets the count: all closes at the n-th delivery from now.
func (s *countSink) expect(n int64) {
	s.want, s.all = n, make(chan struct{})
	s.delivered.Store(0)
}

func (s *countSink) Accept(addr, n uint64, key transport.Key, tag uint32) ([]byte, func(error), error) {
	if !spans(s.base, uint64(len(s.mem)), addr, n) {
		return nil, nil, fmt.Errorf("rdma: %d bytes at %#x lie outside the sink's memory", n, addr)
	}
	addr -= s.base
	return s.mem[addr : addr+n], func(err error) {
		if err == nil {
			s.deliver()
		}
	}, nil
}

// Arrived takes a direct write as delivered.
func (s *countSink) Arrived(tag uint32, n uint64) error {
	s.deliver()
	return nil
}

func (s *countSink) deliver() {
	if s.delivered.Add(1) == s.want {
		close(s.all)
	}
}
