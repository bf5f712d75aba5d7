package rdma

/*
#cgo LDFLAGS: -libverbs
// The calls on a write's path keep no pointer they are given and call no
// Go: said so, their arguments stay on the Go stack instead of moving to
// the heap on every post and every poll (a write polls many times).
#cgo noescape fv_post
#cgo nocallback fv_post
#cgo noescape fv_poll
#cgo nocallback fv_poll
#cgo noescape fv_bind_mw
#cgo nocallback fv_bind_mw
#include <stdlib.h>
#include "verbs.h"
*/
import "C"

import (
	"errors"
	"fmt"
	"os"
	"syscall"
	"unsafe"

	"golang.org/x/sys/unix"
)

// Work completion statuses and opcodes, from verbs.h.
const (
	wcSuccess        = wcStatus(C.IBV_WC_SUCCESS)
	wcLocLenErr      = wcStatus(C.IBV_WC_LOC_LEN_ERR)
	wcLocQPOpErr     = wcStatus(C.IBV_WC_LOC_QP_OP_ERR)
	wcLocProtErr     = wcStatus(C.IBV_WC_LOC_PROT_ERR)
	wcWRFlushErr     = wcStatus(C.IBV_WC_WR_FLUSH_ERR)
	wcBadRespErr     = wcStatus(C.IBV_WC_BAD_RESP_ERR)
	wcLocAccessErr   = wcStatus(C.IBV_WC_LOC_ACCESS_ERR)
	wcRemInvReqErr   = wcStatus(C.IBV_WC_REM_INV_REQ_ERR)
	wcRemAccessErr   = wcStatus(C.IBV_WC_REM_ACCESS_ERR)
	wcMWBindErr      = wcStatus(C.IBV_WC_MW_BIND_ERR)
	wcRemOpErr       = wcStatus(C.IBV_WC_REM_OP_ERR)
	wcRetryExcErr    = wcStatus(C.IBV_WC_RETRY_EXC_ERR)
	wcRNRRetryExcErr = wcStatus(C.IBV_WC_RNR_RETRY_EXC_ERR)
	wcRemAbortErr    = wcStatus(C.IBV_WC_REM_ABORT_ERR)
	wcFatalErr       = wcStatus(C.IBV_WC_FATAL_ERR)
	wcRespTimeoutErr = wcStatus(C.IBV_WC_RESP_TIMEOUT_ERR)
	wcGeneralErr     = wcStatus(C.IBV_WC_GENERAL_ERR)

	opcodeRDMAWrite       = uint32(C.IBV_WC_RDMA_WRITE)
	opcodeRDMARead        = uint32(C.IBV_WC_RDMA_READ)
	opcodeRecvRDMAWithImm = uint32(C.IBV_WC_RECV_RDMA_WITH_IMM)
)

// maxPost is how many work requests one ibv_post_send carries.
const maxPost = C.FV_MAX_POST

// accessFor is a registration's access flags for u. Every registration
// lets the NIC read and write it for local work; only an engine
// region's (peerReadsWrites) allows REMOTE_READ: ferry reads nothing of
// a peer's but its engine regions (reads.go), and a Mooncake segment's
// descriptor hands the arena's rkey to whoever asks, so a readable arena
// would let anyone who reaches the port read all of it, while an
// engine's registered memory is Mooncake's and ferry peers' to read
// (only QPs connected as Mooncake endpoints' answer READs: mcverbs.go).
// peerWrites and peerReadsWrites let a peer write under the
// registration's own rkey; with windowBinding a write under it fails
// with REM_ACCESS_ERR, and only windows bound over it let peers in.
func accessFor(u use) C.int {
	switch u {
	case peerWrites:
		return C.IBV_ACCESS_LOCAL_WRITE | C.IBV_ACCESS_REMOTE_WRITE
	case peerReadsWrites:
		return C.IBV_ACCESS_LOCAL_WRITE | C.IBV_ACCESS_REMOTE_WRITE | C.IBV_ACCESS_REMOTE_READ
	case windowBinding:
		return C.IBV_ACCESS_LOCAL_WRITE | C.IBV_ACCESS_MW_BIND
	}
	return C.IBV_ACCESS_LOCAL_WRITE
}

// verbsErr wraps a helper's errno with the verb that failed; 0 is nil.
func verbsErr(verb string, rc C.int) error {
	if rc == 0 {
		return nil
	}
	return fmt.Errorf("%s: %w", verb, syscall.Errno(rc))
}

// errNoKernelRDMA is libibverbs' ENOSYS: the kernel has no RDMA support
// (no /sys/class/infiniband_verbs), which means no devices.
var errNoKernelRDMA = errors.New("the kernel has no RDMA support: libibverbs reports ENOSYS (no /sys/class/infiniband_verbs); load the NIC's RDMA driver (e.g. mlx5_ib, or rdma_rxe for soft-RoCE)")

// withDevices runs f over the device list. It fails with errNoKernelRDMA
// on a kernel without RDMA.
func withDevices(f func(devs []*C.struct_ibv_device) error) error {
	var list **C.struct_ibv_device
	var n C.int
	rc := C.fv_devices(&list, &n)
	if rc == C.ENOSYS {
		return errNoKernelRDMA
	}
	if err := verbsErr("ibv_get_device_list", rc); err != nil {
		return err
	}
	defer C.ibv_free_device_list(list)
	return f(unsafe.Slice(list, int(n)))
}

// deviceNames lists the RDMA devices.
func deviceNames() ([]string, error) {
	var names []string
	err := withDevices(func(devs []*C.struct_ibv_device) error {
		for _, dev := range devs {
			names = append(names, C.GoString(C.ibv_get_device_name(dev)))
		}
		return nil
	})
	return names, err
}

// device is an open verbs context.
type device struct {
	name string
	ctx  *C.struct_ibv_context
}

// openDevice opens the device called name.
func openDevice(name string) (*device, error) {
	var d *device
	err := withDevices(func(devs []*C.struct_ibv_device) error {
		for _, dev := range devs {
			if C.GoString(C.ibv_get_device_name(dev)) != name {
				continue
			}
			var ctx *C.struct_ibv_context
			if err := verbsErr("ibv_open_device "+name, C.fv_open(dev, &ctx)); err != nil {
				return err
			}
			d = &device{name: name, ctx: ctx}
			return nil
		}
		return fmt.Errorf("no RDMA device %q", name)
	})
	return d, err
}

func (d *device) Close() error {
	return verbsErr("ibv_close_device "+d.name, C.ibv_close_device(d.ctx))
}

type deviceAttr struct {
	ports     int
	fw        string
	memWindow bool // type 1 memory windows
	maxMW     int
}

func (d *device) query() (deviceAttr, error) {
	var a C.fv_device_attr
	if err := verbsErr("ibv_query_device "+d.name, C.fv_query_device(d.ctx, &a)); err != nil {
		return deviceAttr{}, err
	}
	return deviceAttr{ports: int(a.ports), fw: C.GoString(&a.fw_ver[0]), memWindow: a.mem_window != 0, maxMW: int(a.max_mw)}, nil
}

type portAttr struct {
	state     int
	activeMTU mtu
	gidTable  int
	lid       uint16
	linkLayer int
}

func (d *device) queryPort(port int) (portAttr, error) {
	var a C.fv_port
	if err := verbsErr(fmt.Sprintf("ibv_query_port %s port %d", d.name, port), C.fv_query_port(d.ctx, C.uint8_t(port), &a)); err != nil {
		return portAttr{}, err
	}
	return portAttr{state: int(a.state), activeMTU: mtu(a.active_mtu), gidTable: int(a.gid_tbl_len), lid: uint16(a.lid), linkLayer: int(a.link_layer)}, nil
}

type gidEntry struct {
	raw     [16]byte
	typ     int
	ifindex int
}

// queryGID reads GID table entry index; ok is false for an unused one.
func (d *device) queryGID(port, index int) (e gidEntry, ok bool, err error) {
	var g C.fv_gid
	rc := C.fv_query_gid(d.ctx, C.uint8_t(port), C.uint32_t(index), &g)
	if rc == C.ENODATA {
		return e, false, nil
	}
	if err := verbsErr(fmt.Sprintf("ibv_query_gid_ex %s port %d index %d", d.name, port, index), rc); err != nil {
		return e, false, err
	}
	e = gidEntry{raw: *(*[16]byte)(unsafe.Pointer(&g.raw[0])), typ: int(g._type), ifindex: int(g.ifindex)}
	return e, true, nil
}

// Port states, link layers and GID types as verbs number them.
const (
	portActive        = C.IBV_PORT_ACTIVE
	linkLayerIB       = C.IBV_LINK_LAYER_INFINIBAND
	linkLayerEthernet = C.IBV_LINK_LAYER_ETHERNET
	gidTypeIB         = C.IBV_GID_TYPE_IB
	gidTypeRoCEv1     = C.IBV_GID_TYPE_ROCE_V1
	gidTypeRoCEv2     = C.IBV_GID_TYPE_ROCE_V2
)

func portStateName(s int) string {
	return C.GoString(C.ibv_port_state_str(C.enum_ibv_port_state(s)))
}

// verbsNIC is the nic of a real device: one port, one GID, one
// protection domain. It owns the device context and the PD; everything
// made from it (registrations, queue pairs) must be closed first.
type verbsNIC struct {
	dev      *device
	attr     deviceAttr
	pd       *C.struct_ibv_pd
	port     uint8
	gidIndex int
	global   bool // RoCE: packets carry a GRH routed by GID
	local    endpoint
}

// openNIC opens the device, port and GID of c.
func openNIC(c Choice) (n *verbsNIC, err error) {
	dev, err := openDevice(c.Device)
	if err != nil {
		return nil, err
	}
	defer func() {
		if err != nil {
			dev.Close()
		}
	}()
	da, err := dev.query()
	if err != nil {
		return nil, err
	}
	pa, err := dev.queryPort(c.Port)
	if err != nil {
		return nil, err
	}
	if pa.state != portActive {
		return nil, fmt.Errorf("%s port %d is %s, not ACTIVE", c.Device, c.Port, portStateName(pa.state))
	}
	n = &verbsNIC{dev: dev, attr: da, port: uint8(c.Port), gidIndex: c.GIDIndex, global: pa.linkLayer != linkLayerIB}
	n.local.LID, n.local.MTU = pa.lid, pa.activeMTU
	g, ok, err := dev.queryGID(c.Port, c.GIDIndex)
	if err != nil {
		return nil, err
	}
	if !ok && n.global {
		return nil, fmt.Errorf("%s port %d has no GID at index %d", c.Device, c.Port, c.GIDIndex)
	}
	n.local.GID = g.raw
	if err := verbsErr("ibv_alloc_pd "+c.Device, C.fv_alloc_pd(dev.ctx, &n.pd)); err != nil {
		return nil, err
	}
	return n, nil
}

func (n *verbsNIC) Endpoint() endpoint { return n.local }

// Close frees the PD and closes the device. EBUSY from the PD means a
// registration or queue pair of it is still open: a leak to fix.
func (n *verbsNIC) Close() error {
	err := verbsErr("ibv_dealloc_pd", C.ibv_dealloc_pd(n.pd))
	return errors.Join(err, n.dev.Close())
}

// verbsMR is a memory registration.
type verbsMR struct {
	mr *C.struct_ibv_mr
}

func (n *verbsNIC) Register(mem []byte, u use) (region, error) {
	if len(mem) == 0 {
		return nil, errors.New("ibv_reg_mr: nothing to register")
	}
	var mr *C.struct_ibv_mr
	rc := C.fv_reg_mr(n.pd, unsafe.Pointer(unsafe.SliceData(mem)), C.size_t(len(mem)), accessFor(u), &mr)
	if err := verbsErr(fmt.Sprintf("ibv_reg_mr of %d bytes", len(mem)), rc); err != nil {
		return nil, err
	}
	return &verbsMR{mr: mr}, nil
}

func (n *verbsNIC) RegisterDevice(addr, size, iova uint64, u use) (region, error) {
	var mr *C.struct_ibv_mr
	rc := C.fv_reg_addr(n.pd, C.uint64_t(addr), C.size_t(size), C.uint64_t(iova), accessFor(u), &mr)
	verb := fmt.Sprintf("ibv_reg_mr of %d bytes of device memory at %#x", size, addr)
	if iova != addr {
		verb = fmt.Sprintf("ibv_reg_mr_iova of %d bytes of device memory at %#x, at I/O address %#x", size, addr, iova)
	}
	if err := verbsErr(verb, rc); err != nil {
		return nil, err
	}
	return &verbsMR{mr: mr}, nil
}

func (n *verbsNIC) RegisterDMABuf(fd int, offset, size, iova uint64, u use) (region, error) {
	var mr *C.struct_ibv_mr
	rc := C.fv_reg_dmabuf(n.pd, C.uint64_t(offset), C.size_t(size), C.uint64_t(iova), C.int(fd), accessFor(u), &mr)
	if err := verbsErr(fmt.Sprintf("ibv_reg_dmabuf_mr of %d bytes of dmabuf fd %d", size, fd), rc); err != nil {
		return nil, err
	}
	return &verbsMR{mr: mr}, nil
}

func (n *verbsNIC) RegisterAt(mem []byte, iova uint64, u use) (region, error) {
	if len(mem) == 0 {
		return nil, errors.New("ibv_reg_mr_iova: nothing to register")
	}
	var mr *C.struct_ibv_mr
	rc := C.fv_reg_iova(n.pd, unsafe.Pointer(unsafe.SliceData(mem)), C.size_t(len(mem)), C.uint64_t(iova), accessFor(u), &mr)
	if err := verbsErr(fmt.Sprintf("ibv_reg_mr_iova of %d bytes at I/O address %#x", len(mem), iova), rc); err != nil {
		return nil, err
	}
	return &verbsMR{mr: mr}, nil
}

func (n *verbsNIC) Windows() error {
	switch {
	case !n.attr.memWindow:
		return fmt.Errorf("%s does not report IBV_DEVICE_MEM_WINDOW (type 1 memory windows)", n.dev.name)
	case n.attr.maxMW < minWindows:
		return fmt.Errorf("%s allows %d memory windows, fewer than the %d preallocated", n.dev.name, n.attr.maxMW, minWindows)
	}
	return nil
}

// verbsMW is a type 1 memory window.
type verbsMW struct {
	mw *C.struct_ibv_mw
}

func (n *verbsNIC) AllocWindow() (window, error) {
	var mw *C.struct_ibv_mw
	if err := verbsErr("ibv_alloc_mw", C.fv_alloc_mw(n.pd, &mw)); err != nil {
		return nil, err
	}
	return &verbsMW{mw: mw}, nil
}

func (w *verbsMW) Close() error { return verbsErr("ibv_dealloc_mw", C.ibv_dealloc_mw(w.mw)) }

func (m *verbsMR) LKey() uint32 { return uint32(m.mr.lkey) }
func (m *verbsMR) RKey() uint32 { return uint32(m.mr.rkey) }

func (m *verbsMR) Close() error {
	return verbsErr("ibv_dereg_mr", C.ibv_dereg_mr(m.mr))
}

// verbsQP is an RC QP with its own CQ and completion channel. Go's poller
// waits on a duplicate of the channel's (non-blocking) fd, so a waiting
// goroutine holds no thread and Stop can wake it by closing the duplicate.
type verbsQP struct {
	n    *verbsNIC
	qp   *C.struct_ibv_qp
	cq   *C.struct_ibv_cq
	ch   *C.struct_ibv_comp_channel
	wake *os.File
	raw  syscall.RawConn
}

func (n *verbsNIC) NewQP(sendDepth, recvDepth int) (_ queuePair, err error) {
	q := &verbsQP{n: n}
	defer func() {
		if err != nil {
			q.Close()
		}
	}()
	if err := verbsErr("ibv_create_cq", C.fv_cq_open(n.dev.ctx, C.int(sendDepth+recvDepth), &q.ch, &q.cq)); err != nil {
		return nil, err
	}
	fd, err := unix.FcntlInt(uintptr(q.ch.fd), unix.F_DUPFD_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("dup of the completion channel: %w", err)
	}
	q.wake = os.NewFile(uintptr(fd), "ibv_comp_channel")
	if q.raw, err = q.wake.SyscallConn(); err != nil {
		return nil, err
	}
	if err := verbsErr("ibv_create_qp", C.fv_qp_create(n.pd, q.cq, C.int(sendDepth), C.int(recvDepth), &q.qp)); err != nil {
		return nil, err
	}
	if err := verbsErr("ibv_modify_qp to INIT", C.fv_qp_init(q.qp, C.uint8_t(n.port))); err != nil {
		return nil, err
	}
	return q, nil
}

func (q *verbsQP) QPN() uint32 { return uint32(q.qp.qp_num) }

func (q *verbsQP) Connect(psn uint32, remote endpoint) error {
	p := C.fv_path{
		qpn: C.uint32_t(remote.QPN), psn: C.uint32_t(remote.PSN), dlid: C.uint16_t(remote.LID),
		sgid_index: C.int(q.n.gidIndex), mtu: C.int(min(q.n.local.MTU, remote.MTU)), port: C.uint8_t(q.n.port),
	}
	if q.n.global {
		p.global = 1
		for i, b := range remote.GID {
			p.dgid[i] = C.uint8_t(b)
		}
	}
	if err := verbsErr("ibv_modify_qp to RTR", C.fv_qp_rtr(q.qp, &p)); err != nil {
		return err
	}
	return verbsErr("ibv_modify_qp to RTS", C.fv_qp_rts(q.qp, C.uint32_t(psn)))
}

func (q *verbsQP) Post(ops []op) error {
	var cops [maxPost]C.fv_op
	for len(ops) > 0 {
		n := min(len(ops), maxPost)
		for i, o := range ops[:n] {
			c := &cops[i]
			c.wr_id, c.laddr, c.raddr = C.uint64_t(o.WRID), C.uint64_t(o.Local), C.uint64_t(o.Remote)
			c.len, c.lkey, c.rkey, c.imm = C.uint32_t(o.Len), C.uint32_t(o.LKey), C.uint32_t(o.RKey), C.uint32_t(o.Imm)
			c.flags = 0
			if o.Signaled {
				c.flags |= C.FV_SIGNALED
			}
			if o.WithImm {
				c.flags |= C.FV_WITH_IMM
			}
			if o.Read {
				c.flags |= C.FV_READ
			}
		}
		var bad C.int
		if rc := C.fv_post(q.qp, &cops[0], C.int(n), &bad); rc != 0 {
			return fmt.Errorf("ibv_post_send (%d of %d work requests posted): %w", int(bad), n, syscall.Errno(rc))
		}
		ops = ops[n:]
	}
	return nil
}

func (q *verbsQP) Bind(w window, r region, addr, n, wrid uint64) (uint32, error) {
	var rkey C.uint32_t
	rc := C.fv_bind_mw(q.qp, w.(*verbsMW).mw, r.(*verbsMR).mr, C.uint64_t(addr), C.uint64_t(n), C.uint64_t(wrid), &rkey)
	return uint32(rkey), verbsErr("ibv_bind_mw", rc)
}

func (q *verbsQP) PostRecvs(n int) error {
	return verbsErr("ibv_post_recv", C.fv_post_recvs(q.qp, 0, C.int(n)))
}

func (q *verbsQP) Poll(into []completion) (int, error) {
	var wcs [16]C.fv_wc
	var n C.int
	if err := verbsErr("ibv_poll_cq", C.fv_poll(q.cq, &wcs[0], C.int(min(len(into), len(wcs))), &n)); err != nil {
		return 0, err
	}
	for i, w := range wcs[:n] {
		into[i] = completion{
			WRID: uint64(w.wr_id), Status: wcStatus(w.status), Opcode: uint32(w.opcode),
			ByteLen: uint32(w.byte_len), Imm: uint32(w.imm), HasImm: w.has_imm != 0, VendorErr: uint32(w.vendor_err),
		}
	}
	return int(n), nil
}

func (q *verbsQP) Arm() error { return verbsErr("ibv_req_notify_cq", C.fv_cq_arm(q.cq)) }

func (q *verbsQP) Wait() error {
	var rc C.int
	err := q.raw.Read(func(uintptr) bool {
		rc = C.fv_cq_event(q.ch)
		return rc != C.EAGAIN
	})
	if err != nil {
		return errStopped // the duplicate fd was closed by Stop
	}
	return verbsErr("ibv_get_cq_event", rc)
}

func (q *verbsQP) Stop() {
	if q.wake != nil {
		q.wake.Close()
	}
}

func (q *verbsQP) Break() error {
	return verbsErr("ibv_modify_qp to ERR", C.fv_qp_error(q.qp))
}

// Close destroys the QP, then its CQ, then the channel: the order verbs
// requires.
func (q *verbsQP) Close() error {
	q.Stop()
	var errs []error
	if q.qp != nil {
		errs = append(errs, verbsErr("ibv_destroy_qp", C.ibv_destroy_qp(q.qp)))
		q.qp = nil
	}
	if q.cq != nil {
		errs = append(errs, verbsErr("ibv_destroy_cq", C.ibv_destroy_cq(q.cq)))
		q.cq = nil
	}
	if q.ch != nil {
		errs = append(errs, verbsErr("ibv_destroy_comp_channel", C.ibv_destroy_comp_channel(q.ch)))
		q.ch = nil
	}
	return errors.Join(errs...)
}
