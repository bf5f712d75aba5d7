package rdma

import (
	"errors"
	"fmt"
	"os"
	"strings"

	"golang.org/x/sys/unix"

	"github.com/ferry-project/ferry/api"
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
// the NIC reaches GPU memory itself, under the engine's address, by the
// paths the GPU arena may take, in its order (RegisterEngineDevice):
// its dmabuf (the pages holding it, exported from the daemon's mapping
// of the allocation; ibv_reg_dmabuf_mr at its offset in them), else its
// device pointer (ibv_reg_mr_iova, which needs nvidia-peermem);
// --gpu-registration forcing one forces it here too. The bounce path
// is never taken: a peer's one-sided write into GPU memory lands only
// where the NIC reaches that memory. A ferry peer's write into it is
// then placed by the NIC where its engine's key and address say (the
// Sink's AcceptEngine, in receive.go), again with no copy. Where the
// GPU arena went by the bounce path the NIC reaches no GPU memory:
// nothing is registered (RegisterEngineDevice says why), and writes go
// through staging (the daemon's Mooncake segments speak tcp there).

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
	return t.registerEngine(&lentRegion{addr: addrOf(mem), size: uint64(len(mem)), iova: iova}, func(u use) (region, error) {
		mr, err := t.nic.RegisterAt(mem, iova, u)
		if err != nil {
			return nil, fmt.Errorf("rdma: registering %d bytes with the NIC for peers' writes at the engine's address %#x failed with %s (%w); %s",
				len(mem), iova, errnoName(err), err, memlockLimit())
		}
		return mr, nil
	})
}

// EngineDevice is GPU memory an engine registered, as the daemon
// reaches it: at its device pointer here.
type EngineDevice struct {
	transport.Range
	// DMABuf exports it as a dmabuf: fd, which the caller closes, holds
	// its first byte at offset. Nil where it has no export.
	DMABuf func() (fd int, offset uint64, err error)
}

// RegisterEngineDevice registers GPU memory an engine registered for
// peers' writes and reads at addresses from iova on, by the first path
// that works of those the GPU arena may take (dmabuf, then peermem; the
// one --gpu-registration forces), only where the NIC reaches the GPU
// arena itself. The GPURegistration says which path it went by and why
// not the others, also when none worked (nil when none was tried).
func (t *Transport) RegisterEngineDevice(d EngineDevice, iova uint64) (*EngineRegion, *GPURegistration, error) {
	if err := t.deviceUnreached(); err != nil {
		return nil, nil, fmt.Errorf("rdma: GPU memory an engine registered is registered with the NIC for peers' writes only where the NIC reaches the GPU arena itself (dmabuf or peermem), and %v", err)
	}
	g := &GPURegistration{Asked: t.reg.GPU.Asked}
	er, err := t.registerEngine(&lentRegion{addr: d.Addr, size: d.Len, device: true, iova: iova}, func(u use) (region, error) {
		return t.registerEngineDevice(g, d, iova, u)
	})
	return er, g, err
}

// registerEngineDevice registers d at iova for u by the paths g.Asked
// allows, recording each in g.
func (t *Transport) registerEngineDevice(g *GPURegistration, d EngineDevice, iova uint64, u use) (region, error) {
	var mr region
	var failed []string
	for _, p := range api.GPURegistrationPaths {
		var why string
		switch {
		case p == api.GPURegistrationBounce:
			why = "never for GPU memory an engine registered: peers write it one-sidedly at the engine's addresses, which lands only where the NIC reaches the GPU memory itself"
		case g.Path != "":
			why = fmt.Sprintf("not tried: %s was taken first", g.Path)
		case g.Asked != api.GPURegistrationAuto && p != g.Asked:
			why = fmt.Sprintf("not tried: --gpu-registration %s", g.Asked)
		}
		if why != "" {
			g.NotTaken = append(g.NotTaken, PathNotTaken{Path: p, Reason: why})
			continue
		}
		reg, err := t.registerEngineDevicePath(p, d, iova, u)
		if err != nil {
			g.NotTaken = append(g.NotTaken, PathNotTaken{Path: p, Err: err})
			failed = append(failed, fmt.Sprintf("%s: %v", p, err))
			continue
		}
		mr, g.Path = reg, p
	}
	if mr == nil {
		return nil, fmt.Errorf("rdma: registering %d bytes of GPU memory at %#x with the NIC for peers' writes at the engine's address %#x failed (--gpu-registration %s): %s",
			d.Len, d.Addr, iova, g.Asked, strings.Join(failed, "; "))
	}
	return mr, nil
}

// registerEngineDevicePath registers d at iova for u by path p: by its
// dmabuf, whose descriptor it closes once the NIC holds the dmabuf, or
// by its device pointer.
func (t *Transport) registerEngineDevicePath(p api.GPURegistration, d EngineDevice, iova uint64, u use) (region, error) {
	if p == api.GPURegistrationPeerMem {
		return t.registerPeerMem(d.Addr, d.Len, iova, u)
	}
	if d.DMABuf == nil {
		return nil, errors.New("the memory has no dmabuf export here")
	}
	fd, off, err := d.DMABuf()
	if err != nil {
		return nil, fmt.Errorf("%w: %s", err, noDMABufAdvice)
	}
	defer unix.Close(fd)
	return t.registerDMABuf(fd, off, d.Len, iova, u)
}

// pageSize is the host's page size.
var pageSize = uint64(os.Getpagesize())

// registerEngine registers g by register, and lists it.
func (t *Transport) registerEngine(g *lentRegion, register func(use) (region, error)) (*EngineRegion, error) {
	switch {
	case g.size == 0:
		return nil, errors.New("rdma: registering an engine region of no bytes")
	case g.iova+g.size < g.iova:
		return nil, fmt.Errorf("rdma: an engine region of %d bytes at %#x passes the end of the address space", g.size, g.iova)
	case g.iova%pageSize != g.addr%pageSize:
		// The kernel refuses it (EINVAL): the NIC maps whole pages.
		return nil, fmt.Errorf("rdma: an engine region at the engine's address %#x lies %d bytes into its page, and at %#x, %d bytes into its page, where the daemon reaches it: a NIC registers whole pages, so the two must match: lend the memory at the offset of the engine's address in it",
			g.iova, g.iova%pageSize, g.addr, g.addr%pageSize)
	}
	mr, err := register(engineUse)
	if err != nil {
		return nil, err
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
