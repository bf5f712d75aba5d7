package rdma

import (
	"fmt"
)

// wcStatus is a work completion's status (enum ibv_wc_status).
type wcStatus uint32

// wcStatusInfo names each status the way ibv_wc_status's constants do,
// and says in a sentence what it means for a ferry transfer.
var wcStatusInfo = map[wcStatus]struct{ name, meaning string }{
	wcSuccess:        {"SUCCESS", "success"},
	wcLocLenErr:      {"LOC_LEN_ERR", "local length error: a work request is longer than the port or the queue pair allows"},
	wcLocQPOpErr:     {"LOC_QP_OP_ERR", "local queue pair operation error: a malformed work request"},
	wcLocProtErr:     {"LOC_PROT_ERR", "local protection error: the source range is not inside the registration its lkey names"},
	wcWRFlushErr:     {"WR_FLUSH_ERR", "flushed: the queue pair had already failed or was being torn down"},
	wcBadRespErr:     {"BAD_RESP_ERR", "the peer's NIC sent an unexpected response"},
	wcLocAccessErr:   {"LOC_ACCESS_ERR", "local access error: the local registration does not allow this access"},
	wcMWBindErr:      {"MW_BIND_ERR", "memory window bind error: the registration does not allow binding, or the range lies outside it"},
	wcRemInvReqErr:   {"REM_INV_REQ_ERR", "the peer's NIC found the request invalid (a length or opcode it does not accept)"},
	wcRemAccessErr:   {"REM_ACCESS_ERR", "the peer's NIC refused the access: wrong rkey (or a memory window since invalidated), or a range outside the memory or window it names"},
	wcRemOpErr:       {"REM_OP_ERR", "the peer's NIC could not carry out the operation"},
	wcRetryExcErr:    {"RETRY_EXC_ERR", "transport retries exhausted: the peer is unreachable or its queue pair is gone"},
	wcRNRRetryExcErr: {"RNR_RETRY_EXC_ERR", "receiver-not-ready retries exhausted: the peer posted no receive for the immediate"},
	wcRemAbortErr:    {"REM_ABORT_ERR", "the peer's NIC aborted the operation"},
	wcFatalErr:       {"FATAL_ERR", "fatal NIC error"},
	wcRespTimeoutErr: {"RESP_TIMEOUT_ERR", "no response from the peer's NIC in time"},
	wcGeneralErr:     {"GENERAL_ERR", "general NIC error"},
}

func (s wcStatus) String() string {
	if i, ok := wcStatusInfo[s]; ok {
		return i.name
	}
	return fmt.Sprintf("STATUS_%d", uint32(s))
}

// CompletionError is a work request that completed in error.
type CompletionError struct {
	Status    wcStatus
	VendorErr uint32
	Op        string // "rdma write", "rdma read", "receive"
}

func (e *CompletionError) Error() string {
	meaning := "unknown status"
	if i, ok := wcStatusInfo[e.Status]; ok {
		meaning = i.meaning
	}
	return fmt.Sprintf("%s completed with %s (status %d, vendor error %#x): %s", e.Op, e.Status, uint32(e.Status), e.VendorErr, meaning)
}

// StatusName is the completion's ibv_wc_status name ("RETRY_EXC_ERR"),
// which transport.StatusName finds in an error's chain.
func (e *CompletionError) StatusName() string { return e.Status.String() }

// mtu is a path MTU as verbs encode it (enum ibv_mtu: 1 is 256 bytes ... 5
// is 4096).
type mtu uint8

func (m mtu) Bytes() int {
	if m < 1 || m > 5 {
		return 0
	}
	return 128 << m
}

// mtuOf encodes n bytes (256, 512, 1024, 2048 or 4096) as an mtu; 0 for
// any other n.
func mtuOf(n int) mtu {
	for m := mtu(1); m <= 5; m++ {
		if m.Bytes() == n {
			return m
		}
	}
	return 0
}
