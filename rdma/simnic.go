package rdma

import (
	"errors"
	"fmt"
	"os"
	"sync"
	"sync/atomic"
	"syscall"
)

// A simulated NIC in memory beneath the nic seam, for measuring ferry's
// own CPU per send (SendCPU, which ferrybench rdma-cpu runs) and for the
// unit tests on hosts without RDMA (make unit). ferryd never uses it: it
// opens a real device (verbs.go). It does what an RC NIC does that the
// transport relies on: it checks lkeys and rkeys against registrations
// and their bounds, moves bytes in order per QP, consumes a posted
// receive per WRITE WITH IMM (with none posted it fails the sender's QP
// with RNR_RETRY_EXC_ERR at once, as a NIC whose RNR retries ran out:
// credits, wire.go, must make that impossible), reports RETRY_EXC_ERR
// when the peer QP is gone, fails both
// ends on a remote access error, refuses RDMA READs as ferry's lanes do
// (REM_INV_REQ_ERR) and answers them on Mooncake QPs from registrations
// that allow them (else REM_ACCESS_ERR), and flushes posted work when a
// QP breaks. With
// windows set it has type 1 memory windows: a bind (on a QP in RTS)
// gives a window a new rkey and a range of a registration made for
// windows, whose own rkey allows no remote write; a write through a
// window must lie inside its range, else REM_ACCESS_ERR. The knobs on
// fabric below are the tests' faults. The real verbs path runs the same
// tests inside the soft-RoCE VM (test/rxevm).

// fabric joins the simulated NICs of one run or test: QPs by number,
// registrations by key.
type fabric struct {
	// mu guards the maps; the send engines read them, and copy, under
	// its read lock, so that they run side by side.
	mu   sync.RWMutex
	qps  map[uint32]*fakeQP
	mrs  map[uint32]*fakeMR
	mws  map[uint32]*fakeMW // by their current rkey
	next uint32
	// windows gives the NICs type 1 memory windows; refuseBinds fails
	// every bind, as a NIC that lists windows and cannot bind them.
	windows, refuseBinds bool
	// failRegister, if set, fails registrations of at least that many
	// bytes, as a low RLIMIT_MEMLOCK does.
	failRegister int
	// hold, if set, keeps every work request from executing until it is
	// closed: a write stays in flight for as long as a test needs.
	hold chan struct{}
	// gather, if set, keeps each QP from executing any work request
	// until that many were posted on it: a test sees calls sharing a QP
	// all in flight at once.
	gather int
	// posted, if set, gets a token for each batch of work requests posted
	// (none when it is full): a test sees a write reach the NIC.
	posted chan struct{}
	// inline, if set, has Post carry out its work requests before it
	// returns, as soft-RoCE does on a loopback QP.
	inline bool
	// device is the memory tests declare to be a GPU's: RegisterDevice
	// and RegisterDMABuf reach only it (the fake's stand-in for device
	// memory is mapped host memory, as the fake CUDA driver's is).
	// noDMABuf and noPeerMem, if set, are how those fail, as on a NIC
	// without dmabuf support or a host without nvidia-peermem;
	// noDeviceMWBind, how either fails when asked to allow binding
	// windows, checked first.
	device                              [][]byte
	noDMABuf, noPeerMem, noDeviceMWBind error
	// dmabufs are the descriptors tests hand out as dmabufs, each with
	// the device address of its offset 0: RegisterDMABuf reaches the
	// declared device memory through them.
	dmabufs map[int]uint64
}

func newFabric() *fabric {
	return &fabric{qps: make(map[uint32]*fakeQP), mrs: make(map[uint32]*fakeMR), mws: make(map[uint32]*fakeMW), dmabufs: make(map[int]uint64), next: 0x100}
}

func (f *fabric) id() uint32 {
	f.next++
	return f.next
}

type fakeNIC struct {
	f    *fabric
	gid  [16]byte
	mu   sync.Mutex
	open int          // registrations and QPs not yet closed
	arms atomic.Int32 // completion channels armed, by all its QPs
	// held, while set, keeps its QPs' Poll from returning until it is
	// closed: the daemon on this NIC descheduled, taking no completions,
	// while the NIC goes on placing writes.
	held atomic.Pointer[chan struct{}]
	// wrote counts the bytes its QPs' writes placed (what left through
	// each rail, rails.go).
	wrote atomic.Uint64
}

// holdPolls holds every Poll on n's QPs until the returned func is
// called.
func (n *fakeNIC) holdPolls() (release func()) {
	h := make(chan struct{})
	n.held.Store(&h)
	return sync.OnceFunc(func() {
		n.held.Store(nil)
		close(h)
	})
}

func (f *fabric) nic(n byte) *fakeNIC {
	return &fakeNIC{f: f, gid: [16]byte{10: 0xff, 11: 0xff, 12: 10, 15: n}}
}

func (n *fakeNIC) hold(d int) {
	n.mu.Lock()
	n.open += d
	n.mu.Unlock()
}

func (n *fakeNIC) Endpoint() endpoint { return endpoint{GID: n.gid, MTU: 3} }

func (n *fakeNIC) Register(mem []byte, u use) (region, error) {
	return n.RegisterAt(mem, addrOf(mem), u)
}

// RegisterAt registers mem reached at addresses from iova on: its lkey
// and rkey name it there, never where it lies.
func (n *fakeNIC) RegisterAt(mem []byte, iova uint64, u use) (region, error) {
	n.f.mu.Lock()
	defer n.f.mu.Unlock()
	if n.f.failRegister > 0 && len(mem) >= n.f.failRegister {
		return nil, fmt.Errorf("ibv_reg_mr of %d bytes: %w", len(mem), syscall.ENOMEM)
	}
	if page := uint64(os.Getpagesize()); iova%page != addrOf(mem)%page {
		// As the kernel's uverbs: the NIC maps whole pages.
		return nil, fmt.Errorf("ibv_reg_mr_iova of %d bytes at %#x, at I/O address %#x, another offset in the page: %w", len(mem), addrOf(mem), iova, syscall.EINVAL)
	}
	m := &fakeMR{n: n, key: n.f.id(), mem: mem, addr: iova, use: u}
	n.f.mrs[m.key] = m
	n.hold(1)
	return m, nil
}

func (n *fakeNIC) RegisterDevice(addr, size, iova uint64, u use) (region, error) {
	if u == windowBinding && n.f.noDeviceMWBind != nil {
		return nil, fmt.Errorf("ibv_reg_mr of %d bytes of device memory at %#x with IBV_ACCESS_MW_BIND: %w", size, addr, n.f.noDeviceMWBind)
	}
	if n.f.noPeerMem != nil {
		return nil, fmt.Errorf("ibv_reg_mr of %d bytes of device memory at %#x: %w", size, addr, n.f.noPeerMem)
	}
	return n.registerDevice(addr, size, iova, u)
}

func (n *fakeNIC) RegisterDMABuf(fd int, offset, size, iova uint64, u use) (region, error) {
	if u == windowBinding && n.f.noDeviceMWBind != nil {
		return nil, fmt.Errorf("ibv_reg_dmabuf_mr of %d bytes of dmabuf fd %d with IBV_ACCESS_MW_BIND: %w", size, fd, n.f.noDeviceMWBind)
	}
	if n.f.noDMABuf != nil {
		return nil, fmt.Errorf("ibv_reg_dmabuf_mr of %d bytes of dmabuf fd %d: %w", size, fd, n.f.noDMABuf)
	}
	n.f.mu.RLock()
	base, ok := n.f.dmabufs[fd]
	n.f.mu.RUnlock()
	if !ok {
		return nil, fmt.Errorf("ibv_reg_dmabuf_mr of %d bytes of fd %d, which is no dmabuf: %w", size, fd, syscall.EINVAL)
	}
	return n.registerDevice(base+offset, size, iova, u)
}

// registerDevice registers [addr, addr+size) of the declared device
// memory, reached at addresses from iova on; anything else is EFAULT,
// as ibv_reg_mr of an address nothing maps.
func (n *fakeNIC) registerDevice(addr, size, iova uint64, u use) (region, error) {
	for _, d := range n.f.device {
		if spans(addrOf(d), uint64(len(d)), addr, size) {
			off := addr - addrOf(d)
			return n.RegisterAt(d[off:off+size], iova, u)
		}
	}
	return nil, fmt.Errorf("ibv_reg_mr of %d bytes at %#x: %w", size, addr, syscall.EFAULT)
}

// Close fails like ibv_dealloc_pd when something made from the NIC is
// still open.
func (n *fakeNIC) Close() error {
	n.mu.Lock()
	defer n.mu.Unlock()
	if n.open != 0 {
		return fmt.Errorf("ibv_dealloc_pd: %d registrations or queue pairs still open: %w", n.open, syscall.EBUSY)
	}
	return nil
}

type fakeMR struct {
	n      *fakeNIC
	key    uint32
	mem    []byte
	addr   uint64
	use    use
	closed bool
}

func (n *fakeNIC) Windows() error {
	if !n.f.windows {
		return errors.New("the fake NIC has no memory windows")
	}
	return nil
}

// fakeMW is a type 1 memory window: [addr, addr+len) of mr, len 0 when
// unbound or invalidated.
type fakeMW struct {
	n         *fakeNIC
	rkey      uint32
	mr        *fakeMR
	addr, len uint64
}

func (n *fakeNIC) AllocWindow() (window, error) {
	n.f.mu.Lock()
	defer n.f.mu.Unlock()
	w := &fakeMW{n: n, rkey: n.f.id() << 8}
	n.f.mws[w.rkey] = w
	n.hold(1)
	return w, nil
}

func (w *fakeMW) Close() error {
	w.n.f.mu.Lock()
	defer w.n.f.mu.Unlock()
	delete(w.n.f.mws, w.rkey)
	w.n.hold(-1)
	return nil
}

func (m *fakeMR) LKey() uint32 { return m.key }
func (m *fakeMR) RKey() uint32 { return m.key }

func (m *fakeMR) Close() error {
	m.n.f.mu.Lock()
	defer m.n.f.mu.Unlock()
	if m.closed {
		return errors.New("ibv_dereg_mr: already deregistered")
	}
	// As rxe (and the IB spec): not while a window is bound over it.
	for _, w := range m.n.f.mws {
		if w.mr == m {
			return fmt.Errorf("ibv_dereg_mr: a memory window is bound over it: %w", syscall.EBUSY)
		}
	}
	m.closed = true
	delete(m.n.f.mrs, m.key)
	m.n.hold(-1)
	return nil
}

// remote returns [addr, addr+n) of what rkey lets a peer write (or
// read) on nic p: a window bound over that range (writes only), or a
// registration for remote writes (or reads); false otherwise. f.mu is
// held.
func (f *fabric) remote(p *fakeNIC, rkey uint32, addr uint64, n uint32, read bool) ([]byte, bool) {
	if n == 0 {
		return nil, true
	}
	if w := f.mws[rkey]; w != nil {
		if read || w.n != p || w.mr == nil || !spans(w.addr, w.len, addr, uint64(n)) {
			return nil, false
		}
		return f.bytes(w.mr.key, addr, n)
	}
	if m := f.mrs[rkey]; m == nil || !(m.use == peerReadsWrites || m.use == peerWrites && !read) || m.n != p {
		return nil, false // a key is its own NIC's: another NIC knows none
	}
	return f.bytes(rkey, addr, n)
}

// bytes returns [addr, addr+n) of the registration key names, or false
// when the key is unknown or the range runs outside it; f.mu is held.
func (f *fabric) bytes(key uint32, addr uint64, n uint32) ([]byte, bool) {
	if n == 0 {
		return nil, true // zero-length accesses check no key, as on a NIC
	}
	m := f.mrs[key]
	if m == nil || !spans(m.addr, uint64(len(m.mem)), addr, uint64(n)) {
		return nil, false
	}
	off := addr - m.addr
	return m.mem[off : off+uint64(n)], true
}

type qpState int

const (
	qpInit qpState = iota
	qpRTS
	qpErr
	qpGone
)

type fakeQP struct {
	n   *fakeNIC
	num uint32

	mu      sync.Mutex
	work    sync.Cond // signaled when ops or recvs arrive, or the state changes
	state   qpState
	peer    uint32
	dgid    *[16]byte // set by connectMooncake: packets go to this GID
	mcMTU   mtu       // set by connectMooncake: the MTU cap it was given
	reads   bool      // set by connectMooncake: it answers RDMA READs
	writes  bool      // it takes RDMA WRITEs: a lane, or connectMooncake's qpWrites
	ops     []op
	wrs     int // work requests posted, ever
	most    int // the most queued at once, unexecuted (len(ops))
	recvs   int
	cq      []completion
	armed   bool
	events  chan struct{}
	stopped chan struct{}
	stop    sync.Once
	worker  sync.WaitGroup
}

func (n *fakeNIC) NewQP(sendDepth, recvDepth int) (queuePair, error) {
	q := &fakeQP{n: n, events: make(chan struct{}, 1), stopped: make(chan struct{})}
	q.work.L = &q.mu
	n.f.mu.Lock()
	q.num = n.f.id()
	n.f.qps[q.num] = q
	n.f.mu.Unlock()
	n.hold(1)
	q.worker.Add(1)
	go q.run()
	return q, nil
}

func (q *fakeQP) QPN() uint32 { return q.num }

func (q *fakeQP) Connect(psn uint32, remote endpoint) error {
	q.mu.Lock()
	defer q.mu.Unlock()
	if q.state != qpInit {
		return fmt.Errorf("ibv_modify_qp to RTR: %w", syscall.EINVAL)
	}
	q.peer, q.state, q.writes = remote.QPN, qpRTS, true
	return nil
}

// connectMooncake connects as Connect does, routed by the peer's GID as
// Mooncake's QPs always are: a peer QP on a NIC of another GID never sees
// the packets.
func (q *fakeQP) connectMooncake(remote endpoint, peers peerAccess) error {
	if err := q.Connect(0, remote); err != nil {
		return err
	}
	q.mu.Lock()
	q.dgid, q.mcMTU = &remote.GID, remote.MTU
	q.reads, q.writes = peers&qpReads != 0, peers&qpWrites != 0
	q.mu.Unlock()
	return nil
}

func (n *fakeNIC) deviceName() string { return fmt.Sprintf("fake%d", n.gid[15]) }

func (q *fakeQP) Post(ops []op) error {
	q.mu.Lock()
	defer q.mu.Unlock()
	if q.state != qpRTS && q.state != qpErr {
		return fmt.Errorf("ibv_post_send: %w", syscall.EINVAL)
	}
	if q.state == qpErr {
		for _, o := range ops {
			q.complete(completion{WRID: o.WRID, Status: wcWRFlushErr})
		}
		return nil
	}
	if q.n.f.inline {
		for _, o := range ops {
			if q.state != qpRTS {
				q.complete(completion{WRID: o.WRID, Status: wcWRFlushErr})
				continue
			}
			q.mu.Unlock()
			status, opcode := q.execute(o)
			q.mu.Lock()
			q.retire(o, status, opcode)
		}
		return nil
	}
	q.ops = append(q.ops, ops...)
	q.wrs += len(ops)
	q.most = max(q.most, len(q.ops))
	q.work.Broadcast()
	if q.n.f.posted != nil {
		select {
		case q.n.f.posted <- struct{}{}:
		default:
		}
	}
	return nil
}

// Bind binds at once, as a local operation, and completes signaled: a
// window over a registration not made for windows, or outside it,
// fails the bind (MW_BIND_ERR) and the QP.
func (q *fakeQP) Bind(w window, r region, addr, n, wrid uint64) (uint32, error) {
	q.mu.Lock()
	defer q.mu.Unlock()
	if q.state != qpRTS {
		return 0, fmt.Errorf("ibv_bind_mw: %w", syscall.EINVAL)
	}
	mw := w.(*fakeMW)
	f := q.n.f
	f.mu.Lock()
	defer f.mu.Unlock()
	delete(f.mws, mw.rkey)
	mw.rkey = mw.rkey&^0xff | (mw.rkey+1)&0xff
	f.mws[mw.rkey] = mw
	mw.mr, mw.addr, mw.len = nil, 0, 0
	if n > 0 {
		m := r.(*fakeMR)
		if f.refuseBinds || m.use != windowBinding || !spans(m.addr, uint64(len(m.mem)), addr, n) {
			q.complete(completion{WRID: wrid, Status: wcMWBindErr})
			q.fail()
			return mw.rkey, nil
		}
		mw.mr, mw.addr, mw.len = m, addr, n
	}
	q.complete(completion{WRID: wrid, Status: wcSuccess})
	return mw.rkey, nil
}

func (q *fakeQP) PostRecvs(n int) error {
	q.mu.Lock()
	defer q.mu.Unlock()
	if q.state == qpErr {
		for range n {
			q.complete(completion{Status: wcWRFlushErr, Opcode: opcodeRecvRDMAWithImm})
		}
		return nil
	}
	q.recvs += n
	q.work.Broadcast()
	return nil
}

// complete adds c to the CQ and raises an event if armed; q.mu is held.
func (q *fakeQP) complete(c completion) {
	q.cq = append(q.cq, c)
	if q.armed {
		q.armed = false
		select {
		case q.events <- struct{}{}:
		default:
		}
	}
}

func (q *fakeQP) Poll(into []completion) (int, error) {
	if held := q.n.held.Load(); held != nil {
		select {
		case <-*held:
		case <-q.stopped:
		}
	}
	q.mu.Lock()
	defer q.mu.Unlock()
	n := copy(into, q.cq)
	// Shifted, not resliced: appends reuse the array.
	q.cq = q.cq[:copy(q.cq, q.cq[n:])]
	return n, nil
}

func (q *fakeQP) Arm() error {
	q.n.arms.Add(1)
	q.mu.Lock()
	q.armed = true
	q.mu.Unlock()
	return nil
}

func (q *fakeQP) Wait() error {
	select {
	case <-q.events:
		return nil
	case <-q.stopped:
		return errStopped
	}
}

func (q *fakeQP) Stop() { q.stop.Do(func() { close(q.stopped) }) }

// Break flushes posted receives and unexecuted work requests.
func (q *fakeQP) Break() error {
	q.mu.Lock()
	defer q.mu.Unlock()
	q.fail()
	return nil
}

// fail moves q to the error state and flushes its work; q.mu is held.
func (q *fakeQP) fail() {
	if q.state == qpErr || q.state == qpGone {
		return
	}
	q.state = qpErr
	for _, o := range q.ops {
		q.complete(completion{WRID: o.WRID, Status: wcWRFlushErr})
	}
	q.ops = nil
	for range q.recvs {
		q.complete(completion{Status: wcWRFlushErr, Opcode: opcodeRecvRDMAWithImm})
	}
	q.recvs = 0
	q.work.Broadcast()
}

func (q *fakeQP) Close() error {
	q.Stop()
	q.n.f.mu.Lock()
	delete(q.n.f.qps, q.num)
	q.n.f.mu.Unlock()
	q.mu.Lock()
	q.state = qpGone
	q.work.Broadcast()
	q.mu.Unlock()
	q.worker.Wait()
	q.n.hold(-1)
	return nil
}

// run executes posted work requests in order, as the NIC's send engine.
func (q *fakeQP) run() {
	defer q.worker.Done()
	q.mu.Lock()
	defer q.mu.Unlock()
	for {
		for (len(q.ops) == 0 || q.wrs < q.n.f.gather) && q.state != qpGone {
			q.work.Wait()
		}
		if q.state == qpGone {
			return
		}
		o := q.ops[0]
		q.ops = q.ops[:copy(q.ops, q.ops[1:])] // as in Poll
		q.mu.Unlock()
		status, opcode := q.execute(o)
		q.mu.Lock()
		if q.state == qpGone {
			return
		}
		q.retire(o, status, opcode)
	}
}

// retire completes o as it ended: an error completes it and fails q, a
// success completes it when it was signaled; q.mu is held.
func (q *fakeQP) retire(o op, status wcStatus, opcode uint32) {
	if status != wcSuccess {
		q.complete(completion{WRID: o.WRID, Status: status})
		q.fail()
		return
	}
	if o.Signaled {
		q.complete(completion{WRID: o.WRID, Status: wcSuccess, Opcode: opcode, ByteLen: o.Len})
	}
}

// execute carries out one work request against the peer QP.
func (q *fakeQP) execute(o op) (wcStatus, uint32) {
	f := q.n.f
	if f.hold != nil {
		<-f.hold
	}
	q.mu.Lock()
	peerNum, dgid := q.peer, q.dgid
	q.mu.Unlock()
	f.mu.RLock()
	peer := f.qps[peerNum]
	f.mu.RUnlock()
	if peer == nil || dgid != nil && peer.n.gid != *dgid {
		return wcRetryExcErr, 0
	}
	// A responder in the error state drops the packets: the requester
	// retries until it gives up.
	peer.mu.Lock()
	defer peer.mu.Unlock()
	if peer.state != qpRTS {
		return wcRetryExcErr, 0
	}
	f.mu.RLock()
	local, ok := f.bytes(o.LKey, o.Local, o.Len)
	if m := f.mrs[o.LKey]; o.Len > 0 && m != nil && m.n != q.n {
		ok = false // an lkey is its own NIC's, as an rkey is
	}
	if !ok {
		f.mu.RUnlock()
		return wcLocProtErr, 0
	}
	if o.Read && !peer.reads || !o.Read && !peer.writes {
		// ferry's lanes allow no remote reads, a read connection's
		// queue pair no writes: the responder NAKs the opcode (invalid
		// request) and goes to the error state.
		f.mu.RUnlock()
		peer.fail()
		return wcRemInvReqErr, 0
	}
	remote, ok := f.remote(peer.n, o.RKey, o.Remote, o.Len, o.Read)
	if !ok {
		f.mu.RUnlock()
		// An RC responder that NAKs an access goes to the error state.
		peer.fail()
		return wcRemAccessErr, 0
	}
	if o.Read {
		copy(local, remote)
		f.mu.RUnlock()
		return wcSuccess, opcodeRDMARead
	}
	copy(remote, local)
	f.mu.RUnlock()
	q.n.wrote.Add(uint64(o.Len))
	if !o.WithImm {
		return wcSuccess, opcodeRDMAWrite
	}
	// The immediate needs a posted receive. A NIC answers RNR and the
	// sender retries, for about 8 ms with ferry's QPs, then fails; here
	// the retries are spent at once, so a sender that outruns its
	// credits fails every time, not only when its peer is descheduled.
	if peer.recvs == 0 {
		return wcRNRRetryExcErr, 0
	}
	peer.recvs--
	peer.complete(completion{Status: wcSuccess, Opcode: opcodeRecvRDMAWithImm, ByteLen: o.Len, Imm: o.Imm, HasImm: true})
	return wcSuccess, opcodeRDMAWrite
}
