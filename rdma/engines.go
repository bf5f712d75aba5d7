package rdma

import (
	"errors"
	"fmt"
)

// Engine regions: memory a Mooncake engine registered
// (ferry.mooncake.TransferEngine's register_memory), lent to the daemon
// as a memfd region that the daemon maps at an address of its own, while
// the engine and its peers name it by the engine's address of it (its
// mooncake_addr). The daemon registers it once more, beside the region's
// own registration (regions.go), under an I/O virtual address equal to
// the engine's address and for remote writes (ibv_reg_mr_iova): a
// Mooncake peer writes into it one-sidedly at the engine's addresses
// under the rkey its segment's descriptor lists per buffer, and a ferry
// peer's write into it is granted that rkey at the engine's address,
// with no registration or copy per write (target, in memory.go). The
// registration covers exactly the region's bytes, so a write past them
// fails at the NIC (REM_ACCESS_ERR). It also allows remote reads, which
// only the queue pairs of Mooncake endpoints answer (mcverbs.go): a
// Mooncake peer reads an engine's registered memory as it reads a
// Mooncake engine's. It is rail 0's NIC's, whose PD the Mooncake
// endpoints' queue pairs share.

// EngineRegion is a region's registration for peers' writes at its
// owner's addresses. Close drops it: only once no write into it can be
// in flight that the daemon waits for (the region's own uses).
type EngineRegion struct {
	RKey, LKey uint32
	h          lentHandle
}

func (e *EngineRegion) Close() error { return e.h.Close() }

// RegisterEngineRegion registers mem (mapped by the daemon, never Go
// memory) for peers' writes, and Mooncake peers' reads, at addresses
// from iova on.
func (t *Transport) RegisterEngineRegion(mem []byte, iova uint64) (*EngineRegion, error) {
	n := uint64(len(mem))
	switch {
	case n == 0:
		return nil, errors.New("rdma: registering an engine region of no bytes")
	case iova+n < iova:
		return nil, fmt.Errorf("rdma: an engine region of %d bytes at %#x passes the end of the address space", n, iova)
	}
	mr, err := t.nic.RegisterAt(mem, iova, peerReadsWrites)
	if err != nil {
		return nil, fmt.Errorf("rdma: registering %d bytes with the NIC for peers' writes at the engine's address %#x failed with %s (%w); %s",
			n, iova, errnoName(err), err, memlockLimit())
	}
	g := &lentRegion{addr: addrOf(mem), size: n, iova: iova, mr: mr}
	c, err := t.engines.add(g)
	if err != nil {
		return nil, err
	}
	return &EngineRegion{RKey: mr.RKey(), LKey: mr.LKey(), h: c.(lentHandle)}, nil
}

// engineTarget points tg, a write into dst, at the engine region holding
// dst under its own rkey, at the engine's address; false when no engine
// region holds dst.
func (t *Transport) engineTarget(tg *target, dst []byte) bool {
	g := t.engines.holdingBytes(dst)
	if g == nil {
		return false
	}
	tg.addr, tg.rkey = g.iova+(addrOf(dst)-g.addr), g.mr.RKey()
	return true
}
