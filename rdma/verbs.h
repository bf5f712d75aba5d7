// verbs.h: the C side of package rdma. Every libibverbs call that touches a
// macro (ibv_reg_mr, ibv_query_port), a union, or a work-request struct is
// wrapped here as a static inline helper that returns 0 or an errno value
// and hands results back through out-parameters, so Go never reads errno
// or builds a verbs struct itself.
#ifndef FERRY_RDMA_VERBS_H
#define FERRY_RDMA_VERBS_H

#include <infiniband/verbs.h>
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <string.h>

// fv_err is errno after a failed call, never 0: some providers fail
// without setting it.
static inline int fv_err(void) { return errno ? errno : EIO; }

// fv_devices lists the RDMA devices. On a kernel without RDMA support
// libibverbs fails with ENOSYS; the caller turns that into "no devices".
static inline int fv_devices(struct ibv_device ***list, int *n) {
	errno = 0;
	*list = ibv_get_device_list(n);
	return *list ? 0 : fv_err();
}

static inline int fv_open(struct ibv_device *dev, struct ibv_context **ctx) {
	errno = 0;
	*ctx = ibv_open_device(dev);
	return *ctx ? 0 : fv_err();
}

typedef struct {
	uint8_t ports;
	uint8_t mem_window;  // IBV_DEVICE_MEM_WINDOW: type 1 windows
	int max_mw;
	char fw_ver[64];
} fv_device_attr;

static inline int fv_query_device(struct ibv_context *ctx, fv_device_attr *out) {
	struct ibv_device_attr a;
	int rc = ibv_query_device(ctx, &a);
	if (rc) return rc;
	out->ports = a.phys_port_cnt;
	out->mem_window = (a.device_cap_flags & IBV_DEVICE_MEM_WINDOW) != 0;
	out->max_mw = a.max_mw;
	memcpy(out->fw_ver, a.fw_ver, sizeof out->fw_ver);
	out->fw_ver[sizeof out->fw_ver - 1] = 0;
	return 0;
}

typedef struct {
	int state;       // enum ibv_port_state
	int active_mtu;  // enum ibv_mtu
	int max_mtu;
	int gid_tbl_len;
	uint16_t lid;
	uint8_t link_layer; // IBV_LINK_LAYER_*
	uint8_t active_width;
	uint8_t active_speed;
} fv_port;

// ibv_query_port is a macro over a compat struct; cgo cannot call it.
static inline int fv_query_port(struct ibv_context *ctx, uint8_t port, fv_port *out) {
	struct ibv_port_attr a;
	memset(&a, 0, sizeof a);
	int rc = ibv_query_port(ctx, port, &a);
	if (rc) return rc;
	out->state = a.state;
	out->active_mtu = a.active_mtu;
	out->max_mtu = a.max_mtu;
	out->gid_tbl_len = a.gid_tbl_len;
	out->lid = a.lid;
	out->link_layer = a.link_layer;
	out->active_width = a.active_width;
	out->active_speed = a.active_speed;
	return 0;
}

typedef struct {
	uint8_t raw[16];
	uint32_t type;     // enum ibv_gid_type
	uint32_t ifindex;  // netdev of a RoCE GID, 0 for IB
} fv_gid;

// fv_query_gid reads one GID table entry; an unused entry is ENODATA.
static inline int fv_query_gid(struct ibv_context *ctx, uint8_t port, uint32_t index, fv_gid *out) {
	struct ibv_gid_entry e;
	int rc = ibv_query_gid_ex(ctx, port, index, &e, 0);
	if (rc) return rc;
	memcpy(out->raw, e.gid.raw, 16);
	out->type = e.gid_type;
	out->ifindex = e.ndev_ifindex;
	return 0;
}

static inline int fv_alloc_pd(struct ibv_context *ctx, struct ibv_pd **pd) {
	errno = 0;
	*pd = ibv_alloc_pd(ctx);
	return *pd ? 0 : fv_err();
}

// ibv_reg_mr is a macro (it picks __ibv_reg_mr by the access flags).
static inline int fv_reg_mr(struct ibv_pd *pd, void *addr, size_t len, int access, struct ibv_mr **mr) {
	errno = 0;
	*mr = ibv_reg_mr(pd, addr, len, access);
	return *mr ? 0 : fv_err();
}

// fv_reg_dmabuf registers len bytes at offset of the dmabuf fd, reached
// by work requests at addresses from iova on.
static inline int fv_reg_dmabuf(struct ibv_pd *pd, uint64_t offset, size_t len, uint64_t iova, int fd, int access, struct ibv_mr **mr) {
	errno = 0;
	*mr = ibv_reg_dmabuf_mr(pd, offset, len, iova, fd, access);
	return *mr ? 0 : fv_err();
}

// fv_reg_iova registers len bytes at addr, reached by work requests (and
// named by peers' writes) at addresses from iova on: an engine's region,
// which ferryd maps at addr and its owner at iova (rdma-core >= 22).
static inline int fv_reg_iova(struct ibv_pd *pd, void *addr, size_t len, uint64_t iova, int access, struct ibv_mr **mr) {
	errno = 0;
	*mr = ibv_reg_mr_iova(pd, addr, len, iova, access);
	return *mr ? 0 : fv_err();
}

// fv_reg_addr registers len bytes at addr, an address Go does not hold
// as a pointer: a GPU arena's device pointer, which the NIC pins through
// nvidia-peermem (EFAULT, "Bad address", without it), reached at
// addresses from iova on (addr for ferryd's own memory; an engine's
// address of its GPU memory, IPC-opened at addr here).
static inline int fv_reg_addr(struct ibv_pd *pd, uint64_t addr, size_t len, uint64_t iova, int access, struct ibv_mr **mr) {
	if (iova == addr)
		return fv_reg_mr(pd, (void *)(uintptr_t)addr, len, access, mr);
	return fv_reg_iova(pd, (void *)(uintptr_t)addr, len, iova, access, mr);
}

// fv_cq_open makes a completion channel whose fd is non-blocking (Go's
// poller waits on it) and a CQ that reports to it, armed.
static inline int fv_cq_open(struct ibv_context *ctx, int depth, struct ibv_comp_channel **ch, struct ibv_cq **cq) {
	errno = 0;
	*cq = NULL;
	*ch = ibv_create_comp_channel(ctx);
	if (!*ch) return fv_err();
	int fl = fcntl((*ch)->fd, F_GETFL);
	if (fl < 0 || fcntl((*ch)->fd, F_SETFL, fl | O_NONBLOCK) < 0) {
		int e = fv_err();
		ibv_destroy_comp_channel(*ch);
		return e;
	}
	*cq = ibv_create_cq(ctx, depth, NULL, *ch, 0);
	if (!*cq) {
		int e = fv_err();
		ibv_destroy_comp_channel(*ch);
		return e;
	}
	int rc = ibv_req_notify_cq(*cq, 0);
	if (rc) {
		ibv_destroy_cq(*cq);
		ibv_destroy_comp_channel(*ch);
		return rc;
	}
	return 0;
}

static inline int fv_cq_arm(struct ibv_cq *cq) { return ibv_req_notify_cq(cq, 0); }

// fv_cq_event takes one event off the channel and acknowledges it (a CQ
// with unacknowledged events cannot be destroyed). EAGAIN: none pending.
static inline int fv_cq_event(struct ibv_comp_channel *ch) {
	struct ibv_cq *cq;
	void *cq_ctx;
	errno = 0;
	if (ibv_get_cq_event(ch, &cq, &cq_ctx)) return fv_err();
	ibv_ack_cq_events(cq, 1);
	return 0;
}

typedef struct {
	uint64_t wr_id;
	uint32_t status;  // enum ibv_wc_status
	uint32_t opcode;  // enum ibv_wc_opcode
	uint32_t byte_len;
	uint32_t imm;     // host order
	uint32_t has_imm;
	uint32_t vendor_err;
} fv_wc;

static inline int fv_poll(struct ibv_cq *cq, fv_wc *out, int max, int *n) {
	struct ibv_wc wc[16];
	if (max > 16) max = 16;
	int got = ibv_poll_cq(cq, max, wc);
	if (got < 0) {
		*n = 0;
		return EIO;  // ibv_poll_cq says only "failed"
	}
	for (int i = 0; i < got; i++) {
		out[i].wr_id = wc[i].wr_id;
		out[i].status = wc[i].status;
		out[i].opcode = wc[i].opcode;
		out[i].byte_len = wc[i].byte_len;
		out[i].has_imm = (wc[i].wc_flags & IBV_WC_WITH_IMM) != 0;
		out[i].imm = out[i].has_imm ? ntohl(wc[i].imm_data) : 0;
		out[i].vendor_err = wc[i].vendor_err;
	}
	*n = got;
	return 0;
}

// fv_qp_create makes an RC QP whose send and receive completions both go
// to cq.
static inline int fv_qp_create(struct ibv_pd *pd, struct ibv_cq *cq, int send_depth, int recv_depth, struct ibv_qp **qp) {
	struct ibv_qp_init_attr a;
	memset(&a, 0, sizeof a);
	a.send_cq = cq;
	a.recv_cq = cq;
	a.qp_type = IBV_QPT_RC;
	a.cap.max_send_wr = send_depth;
	a.cap.max_recv_wr = recv_depth;
	a.cap.max_send_sge = 1;
	a.cap.max_recv_sge = 1;
	errno = 0;
	*qp = ibv_create_qp(pd, &a);
	return *qp ? 0 : fv_err();
}

static inline int fv_qp_init(struct ibv_qp *qp, uint8_t port) {
	struct ibv_qp_attr a;
	memset(&a, 0, sizeof a);
	a.qp_state = IBV_QPS_INIT;
	a.port_num = port;
	// Peers may write, never read (see access in verbs.go).
	a.qp_access_flags = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE;
	return ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS);
}

// fv_path is where a QP sends: the peer QP and how to reach its port.
typedef struct {
	uint32_t qpn;
	uint32_t psn;
	uint16_t dlid;
	uint8_t dgid[16];
	int global;     // RoCE: route by GID (GRH)
	int sgid_index; // local GID table index
	int mtu;        // enum ibv_mtu, agreed by both ends
	uint8_t port;
} fv_path;

// The RTR timer follows perftest's for RC. max_dest_rd_atomic is 0: the
// QP answers no RDMA READs (its access flags refuse them too).
static inline int fv_qp_rtr(struct ibv_qp *qp, const fv_path *p) {
	struct ibv_qp_attr a;
	memset(&a, 0, sizeof a);
	a.qp_state = IBV_QPS_RTR;
	a.path_mtu = p->mtu;
	a.dest_qp_num = p->qpn;
	a.rq_psn = p->psn;
	a.max_dest_rd_atomic = 0;
	a.min_rnr_timer = 14; // 1.28 ms between a sender's RNR retries
	a.ah_attr.dlid = p->dlid;
	a.ah_attr.port_num = p->port;
	if (p->global) {
		a.ah_attr.is_global = 1;
		memcpy(a.ah_attr.grh.dgid.raw, p->dgid, 16);
		a.ah_attr.grh.sgid_index = p->sgid_index;
		a.ah_attr.grh.hop_limit = 64; // RoCE v2 may cross routers
	}
	return ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN |
	                     IBV_QP_RQ_PSN | IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER);
}

// fv_qp_rts: timeout 14 (4.096 us * 2^14 = 67 ms) with 7 retries bounds a
// dead peer to about half a second before RETRY_EXC_ERR on a NIC that
// honours them (rxe in Debian 12's kernel does not retire the request:
// ferry bounds the wait itself). rnr_retry 6 rather than 7 ("forever"):
// receivers keep receives posted, so running out is a failure to report.
static inline int fv_qp_rts(struct ibv_qp *qp, uint32_t psn) {
	struct ibv_qp_attr a;
	memset(&a, 0, sizeof a);
	a.qp_state = IBV_QPS_RTS;
	a.sq_psn = psn;
	a.timeout = 14;
	a.retry_cnt = 7;
	a.rnr_retry = 6;
	a.max_rd_atomic = 1;
	return ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT |
	                     IBV_QP_RNR_RETRY | IBV_QP_SQ_PSN | IBV_QP_MAX_QP_RD_ATOMIC);
}

// fv_qp_error moves a QP to the error state: the NIC stops working on it
// and flushes what is posted.
static inline int fv_qp_error(struct ibv_qp *qp) {
	struct ibv_qp_attr a;
	memset(&a, 0, sizeof a);
	a.qp_state = IBV_QPS_ERR;
	return ibv_modify_qp(qp, &a, IBV_QP_STATE);
}

enum { FV_SIGNALED = 1, FV_WITH_IMM = 2, FV_READ = 4 };

// fv_op is one RDMA write (or read) of a local range to a remote one.
typedef struct {
	uint64_t wr_id;
	uint64_t laddr;
	uint64_t raddr;
	uint32_t len;
	uint32_t lkey;
	uint32_t rkey;
	uint32_t imm; // host order
	uint32_t flags;
} fv_op;

#define FV_MAX_POST 64

// fv_post chains up to FV_MAX_POST operations into one ibv_post_send.
// *bad is the index of the first one not posted.
static inline int fv_post(struct ibv_qp *qp, const fv_op *ops, int n, int *bad) {
	struct ibv_sge sge[FV_MAX_POST];
	struct ibv_send_wr wr[FV_MAX_POST], *badwr = NULL;
	if (n < 1 || n > FV_MAX_POST) {
		*bad = 0;
		return EINVAL;
	}
	memset(wr, 0, sizeof(wr[0]) * n);
	for (int i = 0; i < n; i++) {
		sge[i].addr = ops[i].laddr;
		sge[i].length = ops[i].len;
		sge[i].lkey = ops[i].lkey;
		wr[i].wr_id = ops[i].wr_id;
		wr[i].sg_list = &sge[i];
		wr[i].num_sge = ops[i].len ? 1 : 0;
		if (ops[i].flags & FV_READ)
			wr[i].opcode = IBV_WR_RDMA_READ;
		else if (ops[i].flags & FV_WITH_IMM)
			wr[i].opcode = IBV_WR_RDMA_WRITE_WITH_IMM;
		else
			wr[i].opcode = IBV_WR_RDMA_WRITE;
		wr[i].send_flags = (ops[i].flags & FV_SIGNALED) ? IBV_SEND_SIGNALED : 0;
		wr[i].imm_data = htonl(ops[i].imm);
		wr[i].wr.rdma.remote_addr = ops[i].raddr;
		wr[i].wr.rdma.rkey = ops[i].rkey;
		wr[i].next = i + 1 < n ? &wr[i + 1] : NULL;
	}
	int rc = ibv_post_send(qp, wr, &badwr);
	*bad = rc ? (int)(badwr - wr) : n;
	return rc;
}

// fv_post_recvs posts n receives without buffers: a WRITE WITH IMM
// consumes one to deliver its immediate, and places no bytes through it.
// They go chained, 16 to an ibv_post_recv.
static inline int fv_post_recvs(struct ibv_qp *qp, uint64_t wr_id, int n) {
	struct ibv_recv_wr wr[16], *bad;
	while (n > 0) {
		int k = n < 16 ? n : 16;
		memset(wr, 0, k * sizeof wr[0]);
		for (int i = 0; i < k; i++) {
			wr[i].wr_id = wr_id;
			wr[i].next = i + 1 < k ? &wr[i + 1] : NULL;
		}
		int rc = ibv_post_recv(qp, wr, &bad);
		if (rc) return rc;
		n -= k;
	}
	return 0;
}

// fv_alloc_mw allocates a type 1 memory window: PD-scoped, so a write
// through it may come on any QP of the PD.
static inline int fv_alloc_mw(struct ibv_pd *pd, struct ibv_mw **mw) {
	errno = 0;
	*mw = ibv_alloc_mw(pd, IBV_MW_TYPE_1);
	return *mw ? 0 : fv_err();
}

// fv_bind_mw posts a signaled bind of mw over [addr, addr+len) of mr,
// allowing remote writes; len 0 invalidates it. mr is named either way:
// rxe's provider reads its lkey even for a zero-length bind. The
// provider sets mw->rkey to the new rkey at once; the bind takes effect
// when its completion (wr_id) comes.
static inline int fv_bind_mw(struct ibv_qp *qp, struct ibv_mw *mw, struct ibv_mr *mr, uint64_t addr, uint64_t len, uint64_t wr_id, uint32_t *rkey) {
	struct ibv_mw_bind b;
	memset(&b, 0, sizeof b);
	b.wr_id = wr_id;
	b.send_flags = IBV_SEND_SIGNALED;
	b.bind_info.mr = mr;
	if (len) {
		b.bind_info.addr = addr;
		b.bind_info.length = len;
		b.bind_info.mw_access_flags = IBV_ACCESS_REMOTE_WRITE;
	}
	int rc = ibv_bind_mw(qp, mw, &b);
	*rkey = mw->rkey;
	return rc;
}

#endif
