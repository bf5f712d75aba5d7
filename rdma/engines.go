package rdma

import (
	"errors"
	"fmt"

	"github.com/ferry-project/ferry/transport"
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
// only the queue pairs of Mooncake endpoints (mcverbs.go) and ferry's
// read connections (reads.go, each read granted per piece) answer: a
// Mooncake peer reads an engine's registered memory as it reads a
// Mooncake engine's. It is rail 0's NIC's, whose PD those queue pairs
// share.

// GPU memory an engine registered (a CUDA region, IPC-opened here at a
// device pointer of the daemon's own) is registered the same way where
// the NIC reaches GPU memory itself: by that device pointer under the
// engine's address (ibv_reg_mr_iova, which needs nvidia-peermem, as a
// CUDA region's own registration does; an IPC-opened range has no
// dmabuf export of its own here). A ferry peer's write into it is then
// placed by the NIC where its engine's key and address say (the Sink's
// AcceptEngine, in receive.go), again with no copy. Where the GPU arena
// went by the bounce path the NIC reaches no GPU memory: the daemon
// refuses the region to Mooncake peers over RDMA (their one-sided
// writes could land nowhere), and writes over TCP go through staging.

// EngineRegion is a region's registration for peers' writes at its
// owner's addresses. Close drops it: only once no write into it can be
// in flight that the daemon waits for (the region's own uses).
type EngineRegion struct {
	RKey, LKey uint32
	h          lentHandle
}

func (e *EngineRegion) Close() error { return e.h.Close() }

// engineUse is what an engine registration lets peers do: write, and
// read (Mooncake peers, and ferry peers granted a read).
const engineUse = peerReadsWrites

// RegisterEngineRegion registers mem (mapped by the daemon, never Go
// memory) for peers' writes and reads at addresses
// from iova on.
func (t *Transport) RegisterEngineRegion(mem []byte, iova uint64) (*EngineRegion, error) {
	return t.registerEngine(&lentRegion{addr: addrOf(mem), size: uint64(len(mem)), iova: iova}, "",
		func(u use) (region, error) { return t.nic.RegisterAt(mem, iova, u) },
		func(error) string { return memlockLimit() })
}

// RegisterEngineDevice registers GPU memory an engine registered, r at
// its device pointer here, for peers' writes and reads
// at addresses from iova on: by its device pointer, only where the NIC
// reaches the GPU arena itself (dmabuf or peermem).
func (t *Transport) RegisterEngineDevice(r transport.Range, iova uint64) (*EngineRegion, error) {
	if err := t.deviceUnreached(); err != nil {
		return nil, fmt.Errorf("rdma: GPU memory an engine registered is registered with the NIC for peers' writes only where the NIC reaches the GPU arena itself (dmabuf or peermem), and %v", err)
	}
	return t.registerEngine(&lentRegion{addr: r.Addr, size: r.Len, device: true, iova: iova}, fmt.Sprintf(" of GPU memory at %#x by its device pointer (peermem)", r.Addr),
		func(u use) (region, error) { return t.nic.RegisterDevice(r.Addr, r.Len, iova, u) },
		peermemAdvice)
}

// registerEngine registers g (what: how, in words) by register, and
// lists it; advice says what to do when the NIC refuses.
func (t *Transport) registerEngine(g *lentRegion, what string, register func(use) (region, error), advice func(error) string) (*EngineRegion, error) {
	switch {
	case g.size == 0:
		return nil, errors.New("rdma: registering an engine region of no bytes")
	case g.iova+g.size < g.iova:
		return nil, fmt.Errorf("rdma: an engine region of %d bytes at %#x passes the end of the address space", g.size, g.iova)
	}
	mr, err := register(engineUse)
	if err != nil {
		return nil, fmt.Errorf("rdma: registering %d bytes%s with the NIC for peers' writes at the engine's address %#x failed with %s (%w); %s",
			g.size, what, g.iova, errnoName(err), err, advice(err))
	}
	g.mr = mr
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

// engineDeviceTarget is where a write of n bytes landing at at, the
// daemon's device address in GPU memory an engine registered, is
// granted: on rail 0, whose NIC registered it, at the engine's address
// under that registration; on another rail, at at under a registration
// of its bytes made for the write.
func (t *Transport) engineDeviceTarget(at, n uint64, ri int) (*target, error) {
	g := t.engines.holdingDevice(at, n)
	if g == nil {
		// AcceptEngine pinned the region, which keeps its registration.
		return nil, fmt.Errorf("no GPU memory an engine registered holds %d bytes at %#x", n, at)
	}
	if ri == 0 {
		return &target{addr: g.iova + (at - g.addr), rkey: g.mr.RKey()}, nil
	}
	tg := &target{addr: at}
	nic := t.rails[ri].nic
	return tg, t.registerFor(tg, func() (region, error) { return nic.RegisterDevice(at, n, at, peerWrites) })
}
