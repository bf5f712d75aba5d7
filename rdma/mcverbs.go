package rdma

/*
#include "verbs.h"

// fv_mc_connect takes an INIT QP to RTS the way Mooncake's RDMA endpoint
// does (doSetupConnection), which its peers rely on: PSN 0 both ways
// (nothing exchanges a PSN), always a GRH (is_global, hop limit 16, also
// on IB), RNR timer 12, timeout 14, 7 retries, rnr_retry 7, and 16
// outstanding RDMA READs each way (clamped to the device). access is the
// QP's own access flags, set at RTR over fv_qp_init's: what a peer may
// do through it at all (a Mooncake endpoint: write and read; a ferry
// read connection's: read, or nothing on the reader's side), the
// registrations then saying where: only an engine region's allow READs
// (peerReadsWrites); the arena's refuse them (REM_ACCESS_ERR).
static inline int fv_mc_connect(struct ibv_qp *qp, const fv_path *p, int access) {
	struct ibv_device_attr d;
	int rc = ibv_query_device(qp->context, &d);
	if (rc) return rc;
	int init_rd = 16, dest_rd = 16;
	if (d.max_qp_init_rd_atom < init_rd) init_rd = d.max_qp_init_rd_atom;
	if (d.max_qp_rd_atom < dest_rd) dest_rd = d.max_qp_rd_atom;

	struct ibv_qp_attr a;
	memset(&a, 0, sizeof a);
	a.qp_state = IBV_QPS_RTR;
	a.path_mtu = p->mtu;
	a.dest_qp_num = p->qpn;
	a.rq_psn = 0;
	a.max_dest_rd_atomic = dest_rd;
	a.qp_access_flags = IBV_ACCESS_LOCAL_WRITE | access;
	a.min_rnr_timer = 12;
	a.ah_attr.dlid = p->dlid;
	a.ah_attr.port_num = p->port;
	a.ah_attr.is_global = 1;
	memcpy(a.ah_attr.grh.dgid.raw, p->dgid, 16);
	a.ah_attr.grh.sgid_index = p->sgid_index;
	a.ah_attr.grh.hop_limit = 16;
	rc = ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN |
	                   IBV_QP_RQ_PSN | IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER | IBV_QP_ACCESS_FLAGS);
	if (rc) return rc;

	memset(&a, 0, sizeof a);
	a.qp_state = IBV_QPS_RTS;
	a.sq_psn = 0;
	a.timeout = 14;
	a.retry_cnt = 7;
	a.rnr_retry = 7;
	a.max_rd_atomic = init_rd;
	return ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT |
	                     IBV_QP_RNR_RETRY | IBV_QP_SQ_PSN | IBV_QP_MAX_QP_RD_ATOMIC);
}
*/
import "C"

import "fmt"

// mooncakeQP is a queue pair that can connect the way Mooncake's RDMA
// transport does: the verbs QP, and the simulated NIC's (simnic.go); the
// real exchange runs in the soft-RoCE VM.
type mooncakeQP interface {
	connectMooncake(remote endpoint, peers peerAccess) error
}

// peerAccess is what a peer may ask of a Mooncake-style queue pair.
type peerAccess int

const (
	qpWrites peerAccess = 1 << iota // RDMA WRITEs through it (a Mooncake endpoint's)
	qpReads                         // RDMA READs through it (a Mooncake endpoint's, a ferry read connection's)
)

// connectMooncake connects to remote (its GID, LID and QPN) with
// Mooncake's attributes. The path MTU is the smaller of this port's active
// MTU and remote.MTU, the cap Mooncake peers are configured with: Mooncake
// exchanges none, so both ends must come to the same (the same netdev MTU
// on RoCE, the same cap). peers is what remote may do through it.
func (q *verbsQP) connectMooncake(remote endpoint, peers peerAccess) error {
	m := q.n.local.MTU
	if remote.MTU != 0 {
		m = min(m, remote.MTU)
	}
	p := C.fv_path{
		qpn: C.uint32_t(remote.QPN), dlid: C.uint16_t(remote.LID),
		sgid_index: C.int(q.n.gidIndex), mtu: C.int(m), port: C.uint8_t(q.n.port), global: 1,
	}
	for i, b := range remote.GID {
		p.dgid[i] = C.uint8_t(b)
	}
	if err := verbsErr("ibv_modify_qp to RTR and RTS (Mooncake's attributes)", C.fv_mc_connect(q.qp, &p, peers.flags())); err != nil {
		return fmt.Errorf("connecting QP %d to peer QP %d: %w", q.QPN(), remote.QPN, err)
	}
	return nil
}

// flags are a's verbs access flags.
func (a peerAccess) flags() C.int {
	var f C.int
	if a&qpWrites != 0 {
		f |= C.IBV_ACCESS_REMOTE_WRITE
	}
	if a&qpReads != 0 {
		f |= C.IBV_ACCESS_REMOTE_READ
	}
	return f
}

// deviceName is the verbs device's name, as Mooncake NIC paths carry it.
func (n *verbsNIC) deviceName() string { return n.dev.name }
