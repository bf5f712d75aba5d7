package rdma

import (
	"errors"
	"fmt"
	"sync/atomic"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/ferry-project/ferry/transport"
)

// Memory the NIC touches is never Go heap memory (the collector owns it
// and C must not keep its address): the shared registration covers the
// memory the daemon declares (its mmap'd arena), per-send registrations
// cover ranges of that same memory, the regions the daemon registers
// (regions.go) cover its clients' memory, and anything else is copied
// through buffers this package maps itself.

// Bounce buffers: a source outside the declared memory (Go memory, say)
// goes through a ring of bounceSlots chunks per lane, each chunk's write
// signaled so its slot can be refilled.
const bounceSlots = 4

// mapAnon maps n bytes of anonymous memory: NIC-safe and page-aligned.
func mapAnon(n int) ([]byte, error) {
	b, err := unix.Mmap(-1, 0, n, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
	if err != nil {
		return nil, fmt.Errorf("mapping %d bytes for the NIC: %w", n, err)
	}
	return b, nil
}

func unmap(b []byte) {
	if b != nil {
		unix.Munmap(b)
	}
}

func addrOf(b []byte) uint64 { return uint64(uintptr(unsafe.Pointer(unsafe.SliceData(b)))) }

// within reports whether inner lies inside outer's memory.
func within(outer, inner []byte) bool {
	return len(outer) > 0 && len(inner) > 0 && spans(addrOf(outer), uint64(len(outer)), addrOf(inner), uint64(len(inner)))
}

// spans reports whether [addr, addr+n) lies inside [base, base+size),
// computed so that no sum can wrap; an empty range counts anywhere from
// base to the end.
func spans(base, size, addr, n uint64) bool {
	return addr >= base && addr-base <= size && n <= size-(addr-base)
}

// How a write's source reaches the NIC.
type sourceKind int

const (
	fromShared  sourceKind = iota // inside the shared registration
	fromPerSend                   // registered for this write, deregistered after
	fromBounce                    // copied through the lane's bounce buffer
)

// source is a write's local side.
type source struct {
	kind sourceKind
	addr uint64 // of its first byte, as the NIC reads it (not fromBounce)
	lkey uint32
	reg  region // fromPerSend: the registration to drop after the write
}

// kindOf says how w's source reaches the NIC: a device source only ever
// from a registration made once, the GPU arena's or a CUDA region's
// (writeSource refuses any other); for a host source, with the lkey
// hostSource gives.
func (t *Transport) kindOf(w *transport.Write) (sourceKind, uint32) {
	if w.Src == nil && w.Device.Len > 0 {
		return fromShared, 0
	}
	return t.hostSource(w.Src)
}

// hostSource says how src reaches the NIC, with the lkey of the
// registration made once that holds it (fromShared): the arena's, or a
// region's (regions.go).
func (t *Transport) hostSource(src []byte) (sourceKind, uint32) {
	switch {
	case len(src) == 0:
		return fromShared, 0
	case t.shared != nil && within(t.mem, src):
		return fromShared, t.shared.LKey()
	case within(t.mem, src):
		return fromPerSend, 0
	}
	if g := t.lent.holdingBytes(src); g != nil {
		return fromShared, g.mr.LKey()
	}
	return fromBounce, 0
}

// writeSource is source for w, whose host source kindOf placed (p.kind,
// p.lkey); a device source must lie in device memory the NIC reaches
// itself, the GPU arena or a registered CUDA region (regions.go), and
// goes under p.lkey where p.railKey says it is the registration on the
// lane's rail (a piece of a region's send, rails.go).
func (t *Transport) writeSource(w *transport.Write, p *plan) (source, error) {
	if w.Src != nil || w.Device.Len == 0 {
		return t.sourceAt(w.Src, p.kind, p.lkey)
	}
	d := w.Device
	if p.railKey {
		return source{kind: fromShared, addr: d.Addr, lkey: p.lkey}, nil
	}
	mr := t.inPlace(d.Addr, d.Len)
	if mr == nil {
		return source{}, fmt.Errorf("%d bytes of device memory at %#x lie outside the device memory the NIC reaches (%s): copy them to host memory first", d.Len, d.Addr, t.reachable())
	}
	return source{kind: fromShared, addr: d.Addr, lkey: mr.LKey()}, nil
}

// reachable names the device memory the NIC reaches, for errors.
func (t *Transport) reachable() string {
	if t.dev.Len == 0 {
		return "none: no GPU arena registered by dmabuf or peer memory"
	}
	return fmt.Sprintf("the GPU arena's %d bytes at %#x, and the CUDA regions registered", t.dev.Len, t.dev.Addr)
}

// report is what a write of n bytes from a source of kind k takes.
func (k sourceKind) report(n int) transport.Report {
	switch k {
	case fromShared:
		return transport.Report{Registration: transport.RegisteredShared}
	case fromPerSend:
		return transport.Report{Registration: transport.RegisteredPerSend}
	}
	return transport.Report{Registration: transport.RegisteredNone, Copied: int64(n)}
}

// source finds how src reaches the NIC, registering it when it lies in
// the declared memory without a shared registration.
func (t *Transport) source(src []byte) (source, error) {
	kind, lkey := t.hostSource(src)
	return t.sourceAt(src, kind, lkey)
}

// sourceAt is source, with hostSource's answer for src already found.
func (t *Transport) sourceAt(src []byte, kind sourceKind, lkey uint32) (source, error) {
	switch kind {
	case fromShared:
		if len(src) == 0 {
			return source{kind: fromShared}, nil
		}
		return source{kind: fromShared, addr: addrOf(src), lkey: lkey}, nil
	case fromPerSend:
		reg, err := t.nic.Register(src, localUse)
		if err != nil {
			return source{}, fmt.Errorf("per-send registration of %d bytes: %w", len(src), err)
		}
		t.stats.perSend.Add(1)
		return source{kind: fromPerSend, addr: addrOf(src), lkey: reg.LKey(), reg: reg}, nil
	}
	t.stats.bounced.Add(1)
	return source{kind: fromBounce}, nil
}

func (s source) release() {
	if s.reg != nil {
		s.reg.Close()
	}
}

// bounceBuffer maps and registers the lane's bounce ring on first use.
func (l *lane) bounceBuffer(n nic) ([]byte, uint32, error) {
	if l.bounceReg == nil {
		b, err := mapAnon(bounceSlots * chunk)
		if err != nil {
			return nil, 0, err
		}
		reg, err := n.Register(b, localUse)
		if err != nil {
			unmap(b)
			return nil, 0, fmt.Errorf("registering a bounce buffer: %w", err)
		}
		l.bounce, l.bounceReg = b, reg
	}
	return l.bounce, l.bounceReg.LKey(), nil
}

// target is where a granted write lands on the receiver, and what to do
// once it has.
type target struct {
	addr  uint64
	rkey  uint32
	reg   region // a registration made for this write
	stage []byte // mapped for this write when dst is not NIC-safe memory
	dst   []byte
	// copied counts the bytes finish copies out of stage: the
	// transport's CPU copy count.
	copied *atomic.Uint64
}

// target finds where the NIC is to put a write meant for dst: dst itself
// when it lies in an engine region (under its registration for peers'
// writes, at the engine's address: engines.go), in the declared memory
// or a region (under the shared registration, or a region's, or a
// window: see reach), or registered for this write; else a buffer mapped
// and registered for this write and copied into dst once the write is
// complete.
//
// A write arriving on rail ri lands under that rail's NIC's
// registrations (a registration, a window, is its NIC's): in windows
// mode under the slot's window when its key names ri (viaKeyRail), else
// under a registration of its bytes alone made for it; in the other
// modes, on rails other than 0, under that rail's registration of the
// arena, or, in a region, one of its bytes alone.
func (t *Transport) target(dst []byte, key transport.Key, ri int) (*target, error) {
	r := t.rails[ri]
	tg := &target{dst: dst, copied: &t.stats.copied}
	if len(dst) == 0 {
		return tg, nil
	}
	tg.addr = addrOf(dst)
	if r == t.rails[0] && t.engineTarget(tg, dst) {
		return tg, nil
	}
	inArena := within(t.mem, dst)
	var mr region // the registration made once that holds dst
	if t.shared != nil && inArena {
		mr = t.shared
	} else if g := t.lent.holdingBytes(dst); g != nil {
		mr = g.mr
	}
	forThisWrite := func() (region, error) { return r.nic.Register(dst, peerWrites) }
	switch {
	case ri != 0 && inArena && t.windows == nil:
		tg.rkey = r.shared.RKey()
		return tg, nil
	case mr != nil && t.viaKeyRail(key, ri):
		return tg, t.reach(tg, key.Window(), mr, forThisWrite)
	case inArena || mr != nil:
		// The slot's window, or mr, is another rail's NIC's.
		return tg, t.registerFor(tg, forThisWrite)
	}
	stage, err := mapAnon(len(dst))
	if err != nil {
		return nil, err
	}
	reg, err := r.nic.Register(stage, peerWrites)
	if err != nil {
		unmap(stage)
		return nil, fmt.Errorf("registering a %d-byte staging buffer: %w", len(dst), err)
	}
	t.stats.staged.Add(1)
	tg.addr, tg.rkey, tg.reg, tg.stage = addrOf(stage), reg.RKey(), reg, stage
	return tg, nil
}

// viaKeyRail reports whether a granted write with key arriving on rail
// ri goes under what reach gives: in windows mode, the slot's window,
// when it is on ri (the rail key names); otherwise, on rail 0, whose
// registrations the arena's and the regions' (mr) are.
func (t *Transport) viaKeyRail(key transport.Key, ri int) bool {
	if t.windows != nil {
		return int(key.Rail()) == ri
	}
	return ri == 0
}

// reach sets the rkey a granted write into a slot inside mr (the
// registration made once that holds it: the arena's or a region's) goes
// under. In windows mode that is the slot's window's (its key's Window).
// Otherwise a slot in the arena goes under the arena's rkey, and a slot
// in a region under a registration of the slot's bytes alone, made by
// register for this write: a region is its client's own memory (a KV
// pool, say), registered for local use only, so that no rkey reaching
// all of it ever leaves the host.
func (t *Transport) reach(tg *target, window uint32, mr region, register func() (region, error)) error {
	switch {
	case t.windows != nil && window == 0:
		return errors.New("the slot has no memory window, and in windows mode nothing else lets a peer write the arena or a region")
	case t.windows != nil:
		tg.rkey = window
	case mr == t.shared:
		tg.rkey = mr.RKey()
	default:
		return t.registerFor(tg, register)
	}
	return nil
}

// registerFor registers tg's bytes for its write alone (register):
// finish deregisters them.
func (t *Transport) registerFor(tg *target, register func() (region, error)) error {
	reg, err := register()
	if err != nil {
		return fmt.Errorf("per-receive registration: %w", err)
	}
	t.stats.perReceive.Add(1)
	tg.rkey, tg.reg = reg.RKey(), reg
	return nil
}

// inPlace is the registration of the device memory the NIC reaches
// itself that holds n bytes at addr, the GPU arena's or a registered
// CUDA region's, or nil.
func (t *Transport) inPlace(addr, n uint64) region {
	if n > 0 && spans(t.dev.Addr, t.dev.Len, addr, n) {
		return t.shared
	}
	if g := t.lent.holdingDevice(addr, n); g != nil {
		return g.mr
	}
	return nil
}

// finish copies a staged write into place when it arrived (ok) and drops
// what was made for it. The NIC must be done with the target: the write
// completed, or the lane's QP is in the error state.
func (tg *target) finish(ok bool) {
	if ok && tg.stage != nil {
		tg.copied.Add(uint64(copy(tg.dst, tg.stage)))
	}
	if tg.reg != nil {
		tg.reg.Close()
	}
	unmap(tg.stage)
}
