package rdma

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/ferry-project/ferry/api"
	"github.com/ferry-project/ferry/transport"
	"github.com/ferry-project/ferry/transport/peer"
	"github.com/ferry-project/ferry/transport/transporttest"
)

// engineAddr is where the tests' engine "maps" its region: an address
// nothing maps in this process, as an engine's own address of its
// memory is unrelated to the daemon's mapping of it.
const engineAddr = 0x7e00_0000_0000

// engineOn is a transport on the ferry side of a Mooncake QP pair with
// an engine region of 64 KiB registered at engineAddr as the daemon
// registers each kind: host memory it mapped (RegisterEngineRegion), or
// GPU memory past a stand-in GPU arena (RegisterEngineDevice): by its
// dmabuf on the fake NIC; on soft-RoCE, which registers no dmabuf, by
// its device pointer (the stand-in is plain memory, which ibv_reg_mr
// takes as the peer-memory path takes a GPU's), dmabuf's failure said.
// mem is the region as the daemon reaches it.
func engineOn(t *testing.T, gpu bool) (peer, ferry mcSide, mem []byte, er *EngineRegion) {
	t.Helper()
	f := newFabric()
	if !gpu {
		peer, ferry = mcPair(t, f, 0)
		mem = mapT(t, 1<<16)
		var err error
		if er, err = ferry.tr.RegisterEngineRegion(mem, engineAddr); err != nil {
			t.Fatal(err)
		}
		return peer, ferry, mem, er
	}
	const arenaSize = 1 << 20
	dev := mapT(t, arenaSize+1<<16)
	peer, ferry = mcPairTo(t, f, 0, &Config{Device: gpuArenaIn(t, f, dev, arenaSize, "")})
	if p := ferry.tr.Registration().GPU; !p.InPlace() {
		t.Fatalf("the stand-in GPU arena went by the %q path: %+v", p.Path, p.NotTaken)
	}
	mem = dev[arenaSize:]
	er, g := registerEngineDevice(t, ferry.tr, f, mem, engineAddr)
	wantEnginePath(t, g, onDevice(t))
	return peer, ferry, mem, er
}

// registerEngineDevice registers mem, declared device memory of f, as
// the daemon registers GPU memory an engine registered: at iova, with
// mem's dmabuf export (dmabufOf). The export's descriptor is closed by
// then.
func registerEngineDevice(t *testing.T, tr *Transport, f *fabric, mem []byte, iova uint64) (*EngineRegion, *GPURegistration) {
	t.Helper()
	export, closed := dmabufOf(t, f, mem)
	er, g, err := tr.RegisterEngineDevice(EngineDevice{Range: transport.Range{Addr: addrOf(mem), Len: uint64(len(mem))}, DMABuf: export}, iova)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { er.Close() })
	closed()
	return er, g
}

// dmabufOf is a stand-in for a CUDA region's dmabuf export (its pages'
// dmabuf, the region at an offset in it) of mem, declared device memory
// of f: a memfd, through which the fake NIC reaches mem (soft-RoCE
// refuses every dmabuf alike). closed fails the test unless each
// descriptor exported was closed.
func dmabufOf(t *testing.T, f *fabric, mem []byte) (export func() (int, uint64, error), closed func()) {
	var exported []unix.Stat_t
	var fds []int
	page := uint64(os.Getpagesize())
	start := addrOf(mem) &^ (page - 1)
	export = func() (int, uint64, error) {
		fd, err := unix.MemfdCreate("dmabuf", unix.MFD_CLOEXEC)
		if err != nil {
			return -1, 0, err
		}
		var st unix.Stat_t
		if err := unix.Fstat(fd, &st); err != nil {
			unix.Close(fd)
			return -1, 0, err
		}
		f.mu.Lock()
		f.dmabufs[fd] = start
		f.mu.Unlock()
		exported, fds = append(exported, st), append(fds, fd)
		return fd, addrOf(mem) - start, nil
	}
	return export, func() {
		t.Helper()
		for i, fd := range fds {
			var st unix.Stat_t
			if unix.Fstat(fd, &st) == nil && st.Ino == exported[i].Ino && st.Dev == exported[i].Dev {
				t.Errorf("dmabuf fd %d is still open after the registration", fd)
				unix.Close(fd)
			}
		}
	}
}

// wantEnginePath checks that GPU memory an engine registered went by
// dmabuf, or on soft-RoCE (device) by peermem, dmabuf refused by
// ibv_reg_dmabuf_mr with what to do; bounce never.
func wantEnginePath(t *testing.T, g *GPURegistration, device bool) {
	t.Helper()
	want, notTaken := api.GPURegistrationDMABuf, map[api.GPURegistration]string{
		api.GPURegistrationPeerMem: "not tried: dmabuf was taken first",
		api.GPURegistrationBounce:  "never for GPU memory an engine registered",
	}
	if device {
		want, notTaken[api.GPURegistrationDMABuf] = api.GPURegistrationPeerMem, "ibv_reg_dmabuf_mr of 65536 bytes of dmabuf fd"
		delete(notTaken, api.GPURegistrationPeerMem)
	}
	if g == nil || g.Path != want || len(g.NotTaken) != len(notTaken) {
		t.Fatalf("the engine's GPU memory registered by %+v, want %s with %d paths not taken", g, want, len(notTaken))
	}
	for _, n := range g.NotTaken {
		why := n.Reason
		if n.Err != nil {
			why = n.Err.Error()
		}
		if !strings.Contains(why, notTaken[n.Path]) {
			t.Errorf("%s not taken because %q, want %q", n.Path, why, notTaken[n.Path])
		}
	}
	t.Logf("the engine's GPU memory went by %s; not taken: %+v", g.Path, g.NotTaken)
}

// TestEngineRegionMooncakeWrites: a Mooncake peer writes one-sidedly
// into an engine region, host or GPU memory, at the engine's addresses
// under the engine registration's rkey, and the bytes land in the
// daemon's memory of it; a write running past the region, or naming
// the daemon's own address of it, fails at the NIC with REM_ACCESS_ERR;
// once closed, the registration takes no write.
func TestEngineRegionMooncakeWrites(t *testing.T) {
	for _, gpu := range []bool{false, true} {
		t.Run(map[bool]string{false: "host", true: "gpu"}[gpu], func(t *testing.T) {
			peer, ferry, mem, er := engineOn(t, gpu)
			mooncakeWritesInto(t, peer, ferry, mem, er)
		})
	}
}

func mooncakeWritesInto(t *testing.T, peer, ferry mcSide, mem []byte, er *EngineRegion) {
	ctx := ctxFor(t, 30*time.Second)
	data := bytes.Repeat([]byte("engine "), 3000)
	copy(peer.mem, data)
	if _, err := peer.qp.Write(ctx, peer.mem[:len(data)], engineAddr+100, er.RKey); err != nil {
		t.Fatalf("a write at the engine's address: %v", err)
	}
	if !bytes.Equal(mem[100:100+len(data)], data) {
		t.Fatal("the region does not hold the bytes written at the engine's address")
	}
	reconnect := func() {
		t.Helper()
		var err error
		for _, s := range []*mcSide{&peer, &ferry} {
			if s.qp, err = s.tr.NewMooncakeQP(); err != nil {
				t.Fatal(err)
			}
		}
		for _, c := range [][2]mcSide{{peer, ferry}, {ferry, peer}} {
			_, lid, gid, err := c[1].tr.MooncakeNIC()
			if err != nil {
				t.Fatal(err)
			}
			if err := c[0].qp.Connect(gid, lid, c[1].qp.QPN(), 0); err != nil {
				t.Fatal(err)
			}
		}
	}
	before := bytes.Clone(mem)
	for _, c := range []struct {
		name   string
		remote uint64
	}{
		{"across the region's end", engineAddr + uint64(len(mem)) - 100},
		{"at the daemon's own address of the region", addrOf(mem)},
	} {
		_, err := peer.qp.Write(ctx, peer.mem[:4096], c.remote, er.RKey)
		if transport.StatusName(err) != "REM_ACCESS_ERR" {
			t.Errorf("a write %s: %v, want REM_ACCESS_ERR", c.name, err)
		}
		reconnect()
	}
	if !bytes.Equal(mem, before) {
		t.Error("a refused write changed the region")
	}
	if err := er.Close(); err != nil {
		t.Fatal(err)
	}
	if _, err := peer.qp.Write(ctx, peer.mem[:64], engineAddr, er.RKey); transport.StatusName(err) != "REM_ACCESS_ERR" {
		t.Errorf("a write under the closed registration: %v, want REM_ACCESS_ERR", err)
	}
}

// grantedInPlace runs write, a ferry peer's write of n bytes into an
// engine region, and checks that it was granted at want (the engine's
// address) under er's rkey, with nothing registered per receive, staged
// or copied on the receiver rx: in place.
func grantedInPlace(t *testing.T, txh *hook, rx *Transport, er *EngineRegion, want uint64, write func()) {
	t.Helper()
	rx0 := rx.Stats()
	var remote atomic.Uint64
	var rkey atomic.Uint32
	txh.arm(func(h *hook) {
		h.edit = func(o *op) {
			if remote.CompareAndSwap(0, o.Remote) { // the first chunk's
				rkey.Store(o.RKey)
			}
		}
	})
	write()
	if got := remote.Load(); got != want || rkey.Load() != er.RKey {
		t.Errorf("the write was granted at %#x under rkey %#x, want the engine's address %#x under %#x", got, rkey.Load(), want, er.RKey)
	}
	rs := rx.Stats()
	if rs.PerReceive != rx0.PerReceive || rs.Staged != rx0.Staged || rs.CopiedBytes != rx0.CopiedBytes {
		t.Errorf("receiver: %d registered per receive, %d staged, %d bytes copied; want none",
			rs.PerReceive-rx0.PerReceive, rs.Staged-rx0.Staged, rs.CopiedBytes-rx0.CopiedBytes)
	}
}

// TestEngineRegionGrants: a ferry peer's write into an engine region
// (the daemon's Sink lends the region's bytes, as for engine memory) is
// granted at the engine's address under the engine registration's
// rkey: in place, with no registration per write and no staging copy,
// in grant and windows mode alike (a keyed engine write has no window).
func TestEngineRegionGrants(t *testing.T) {
	modes(t, func(t *testing.T, windows bool) {
		p := newRegionPair(t, windows)
		fill(p.txLent, 9)
		er, err := p.rx.RegisterEngineRegion(p.rxLent, engineAddr)
		if err != nil {
			t.Fatal(err)
		}
		defer er.Close()
		const n = 1<<20 + 7
		grantedInPlace(t, p.txh, p.rx, er, engineAddr+4096, func() { p.write(t, p.txLent[:n], regionHalf+4096, false) })
	})
}

// engineSlots is Slots as a transport.EngineSink lending one GPU engine
// region: n bytes the engine addresses at iova, lying at the device
// address at (in Mem). A write into it lands through AcceptInPlace at
// its device address, under the key of the slot there.
type engineSlots struct {
	*transporttest.Slots
	iova, at, n uint64
}

func (e engineSlots) AcceptEngine(addr, n uint64, key transport.Key, tag uint32) (uint64, func(error), bool, error) {
	if addr < e.iova || addr-e.iova >= e.n || n > e.n-(addr-e.iova) {
		return 0, nil, false, nil
	}
	at := e.at + (addr - e.iova)
	done, err := e.AcceptInPlace(at, n, key, tag)
	return at, done, true, err
}

// TestEngineDeviceGrants: a ferry peer's write into GPU memory an engine
// registered, addressed at the engine's address with its key, is placed
// by the NIC in the daemon's device memory of it (the Sink's
// AcceptEngine says where) under the engine registration's rkey at the
// engine's address: in place, as for host memory; the bytes land. The
// memory is registered by its dmabuf (the pages holding it, the region
// at an offset in them), or, where the NIC refuses dmabufs (soft-RoCE),
// by its device pointer, dmabuf's failure said.
func TestEngineDeviceGrants(t *testing.T) {
	for _, dmabuf := range []bool{true, false} {
		t.Run(map[bool]string{true: "dmabuf", false: "no dmabuf"}[dmabuf], func(t *testing.T) {
			if dmabuf && onDevice(t) {
				t.Skip("soft-RoCE registers no dmabuf: the fake NIC shows the dmabuf path, the case without it soft-RoCE's fallback")
			}
			f := newFabric()
			if !dmabuf {
				f.noDMABuf = syscall.EOPNOTSUPP
			}
			engineDeviceGrants(t, f)
		})
	}
}

func engineDeviceGrants(t *testing.T, f *fabric) {
	rxDev := mapT(t, 2*regionHalf)
	// Lent at an offset inside a page, as a tensor of a caching
	// allocator's segment may be: its dmabuf starts at the page, and the
	// engine's address of it lies as far into its page (both processes
	// map the allocation at page-aligned addresses).
	const lentOff, iova = regionHalf + 100, engineAddr + 100
	lent := transport.Range{Addr: addrOf(rxDev) + lentOff, Len: regionHalf - regionTail}
	slots := transporttest.NewSlots(0)
	slots.Mem, slots.Base = rxDev, addrOf(rxDev)
	txh := &hook{}
	src := mapT(t, regionHalf)
	fill(src, 11)
	tx := listenHooked(t, f, Config{Memory: src}, txh)
	// The arena, registered before the NIC refuses dmabufs, went by
	// dmabuf; the engine's memory tries it again, on its own.
	noDMABuf := f.noDMABuf
	f.noDMABuf = nil
	rx := listenT(t, f, Config{Peer: peer.Config{Sink: engineSlots{Slots: slots, iova: iova, at: lent.Addr, n: lent.Len}}, Device: gpuArenaIn(t, f, rxDev, regionHalf, "")})
	f.noDMABuf = noDMABuf
	// Registered as the daemon registers a CUDA region lent with an
	// engine's address: as a region, then for peers' writes.
	reg, err := rx.RegisterDeviceRegion(lent)
	if err != nil {
		t.Fatal(err)
	}
	defer reg.Close()
	er, g := registerEngineDevice(t, rx, f, rxDev[lentOff:lentOff+lent.Len], iova)
	if noDMABuf != nil {
		if g.Path != api.GPURegistrationPeerMem || g.NotTaken[0].Path != api.GPURegistrationDMABuf || g.NotTaken[0].Err == nil ||
			!strings.Contains(g.NotTaken[0].Err.Error(), "ibv_reg_dmabuf_mr") || !strings.Contains(g.NotTaken[0].Err.Error(), "nvidia-peermem") {
			t.Fatalf("registration %+v: want peermem, dmabuf refused by ibv_reg_dmabuf_mr with what to do", g)
		}
	} else if g.Path != api.GPURegistrationDMABuf {
		t.Fatalf("registration %+v: want dmabuf", g)
	}
	s, err := tx.Dial(ctxFor(t, 30*time.Second), rx.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	const n, off = 1<<20 + 7, 4096
	key := slots.Add(lentOff+off, n)
	grantedInPlace(t, txh, rx, er, iova+off, func() {
		w := transport.Write{Src: src[:n], Remote: iova + off, Key: key, Tag: key.Tag()}
		if _, err := s.Write(ctxFor(t, 60*time.Second), w); err != nil {
			t.Fatalf("a write at the engine's address: %v", err)
		}
		if err := slots.Wait(ctxFor(t, 30*time.Second), w.Tag); err != nil {
			t.Fatal(err)
		}
	})
	if !bytes.Equal(rxDev[lentOff+off:lentOff+off+n], src[:n]) {
		t.Fatal("the write into the engine's GPU memory landed wrong")
	}
}

// TestEngineDevicePaths: GPU memory an engine registered takes the
// paths the GPU arena may: dmabuf, else peermem, each failure said with
// what to do; the one --gpu-registration forces alone; bounce never.
// None working refuses it, naming each path's failure. On the fake NIC,
// whose refusals a test sets.
func TestEngineDevicePaths(t *testing.T) {
	if onDevice(t) {
		t.Skip("the fake NIC's refusals; on soft-RoCE, TestEngineDeviceGrants and the e2e TestEngineMemoryOverRDMA show its own")
	}
	noExport := errors.New("cuda:0 (Fake GPU 0) reports CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED=0: dmabuf export needs NVIDIA's open kernel modules")
	for _, c := range []struct {
		name                string
		asked               api.GPURegistration
		noExport            bool
		noDMABuf, noPeerMem error
		want                api.GPURegistration // "": refused
		why                 []string            // each path's reason, in order
	}{
		{name: "dmabuf", want: api.GPURegistrationDMABuf,
			why: []string{"not tried: dmabuf was taken first", "never for GPU memory an engine registered"}},
		{name: "the NIC refuses dmabufs", noDMABuf: syscall.EOPNOTSUPP, want: api.GPURegistrationPeerMem,
			why: []string{"ibv_reg_dmabuf_mr of 65436 bytes of dmabuf fd", "never"}},
		{name: "no export", noExport: true, want: api.GPURegistrationPeerMem,
			why: []string{"DMA_BUF_SUPPORTED=0: dmabuf export needs NVIDIA's open kernel modules: dmabuf needs Linux 5.12", "never"}},
		{name: "neither", noDMABuf: syscall.EOPNOTSUPP, noPeerMem: syscall.EFAULT,
			why: []string{"the NIC's driver does not register dmabufs", "bad address (EFAULT): the NIC's driver cannot pin GPU memory: load nvidia-peermem", "never"}},
		{name: "forced dmabuf", asked: api.GPURegistrationDMABuf, noDMABuf: syscall.EOPNOTSUPP,
			why: []string{"the NIC's driver does not register dmabufs", "not tried: --gpu-registration dmabuf", "never"}},
		{name: "forced peermem", asked: api.GPURegistrationPeerMem, want: api.GPURegistrationPeerMem,
			why: []string{"not tried: --gpu-registration peermem", "never"}},
	} {
		t.Run(c.name, func(t *testing.T) {
			f := newFabric()
			dev := mapT(t, 2<<20)
			tr := listenT(t, f, Config{Device: gpuArenaIn(t, f, dev, 1<<20, c.asked)})
			f.noDMABuf, f.noPeerMem = c.noDMABuf, c.noPeerMem // after the arena's registration
			mem := dev[1<<20+100 : 1<<20+100+65436]
			export, closed := dmabufOf(t, f, mem)
			if c.noExport {
				export = func() (int, uint64, error) { return -1, 0, noExport }
			}
			er, g, err := tr.RegisterEngineDevice(EngineDevice{Range: transport.Range{Addr: addrOf(mem), Len: uint64(len(mem))}, DMABuf: export}, engineAddr+100)
			closed()
			if er != nil {
				defer er.Close()
			}
			switch {
			case c.want == "" && (err == nil || !strings.Contains(err.Error(), fmt.Sprintf("registering 65436 bytes of GPU memory at %#x with the NIC for peers' writes at the engine's address %#x failed", addrOf(mem), uint64(engineAddr+100)))):
				t.Fatalf("no path working: %v, want the memory refused", err)
			case c.want != "" && err != nil:
				t.Fatal(err)
			case g == nil || g.Path != c.want || len(g.NotTaken) != len(c.why):
				t.Fatalf("registration %+v, want path %q and %d paths not taken", g, c.want, len(c.why))
			}
			for i, n := range g.NotTaken {
				why := n.Reason
				if n.Err != nil {
					why = n.Err.Error()
					if c.want == "" && !strings.Contains(err.Error(), string(n.Path)+": "+why) {
						t.Errorf("the refusal %q does not say why %s failed", err, n.Path)
					}
				}
				if !strings.Contains(why, c.why[i]) {
					t.Errorf("%s not taken because %q, want %q", n.Path, why, c.why[i])
				}
			}
		})
	}
}

// TestEngineRegionRefusals: an engine region of no bytes, one whose
// addresses wrap, one whose engine address lies at another offset in
// its page than the daemon's mapping of it (the kernel would refuse
// it), or GPU memory the NIC does not reach, is refused naming what is
// wrong.
func TestEngineRegionRefusals(t *testing.T) {
	_, ferry := mcPair(t, newFabric(), 0)
	mem := mapT(t, 1<<16)
	for _, c := range []struct {
		mem  []byte
		iova uint64
		want string
	}{
		{nil, engineAddr, "no bytes"},
		{mem, ^uint64(0) - 100, "end of the address space"},
		{mem, engineAddr + 8, "lies 8 bytes into its page, and at"},
	} {
		if _, err := ferry.tr.RegisterEngineRegion(c.mem, c.iova); err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%d bytes at %#x: %v, want an error saying %q", len(c.mem), c.iova, err, c.want)
		}
	}
	// GPU memory where the NIC reaches none (the GPU arena's bounce
	// path): refused, saying so.
	f := newFabric()
	dev := mapT(t, 2<<20)
	tr := listenT(t, f, Config{Device: gpuArenaIn(t, f, dev, 1<<20, api.GPURegistrationBounce)})
	_, g, err := tr.RegisterEngineDevice(EngineDevice{Range: transport.Range{Addr: addrOf(dev) + 1<<20, Len: 1 << 20}}, engineAddr)
	if want := "only where the NIC reaches the GPU arena itself (dmabuf or peermem), and the GPU arena went by the bounce path"; err == nil || g != nil || !strings.Contains(err.Error(), want) {
		t.Errorf("GPU memory on the bounce path: %v, want an error saying %q", err, want)
	}
}

// TestEngineRegionMooncakeReads: a Mooncake peer reads an engine region
// at the engine's addresses over its QP (Mooncake's READ); the arena,
// whose rkey the same descriptor lists, it cannot read (REM_ACCESS_ERR,
// or REM_INV_REQ_ERR), nor past the region.
func TestEngineRegionMooncakeReads(t *testing.T) {
	peer, ferry := mcPair(t, newFabric(), 0)
	mem := mapT(t, 1<<16)
	fill(mem, 3)
	fill(ferry.mem, 5)
	er, err := ferry.tr.RegisterEngineRegion(mem, engineAddr)
	if err != nil {
		t.Fatal(err)
	}
	defer er.Close()
	_, lkey, _ := peer.tr.SharedKeys()
	arenaRKey, _, _ := ferry.tr.SharedKeys()
	read := func(remote uint64, rkey uint32, n uint32) completion {
		t.Helper()
		w := postRaw(t, peer.qp, op{Local: addrOf(peer.mem), Remote: remote, Len: n, LKey: lkey, RKey: rkey, Signaled: true, Read: true})
		c, err := peer.qp.l.completion(w, time.Now().Add(30*time.Second), nil)
		if err != nil {
			t.Fatalf("waiting for the read's completion: %v", err)
		}
		return c
	}
	if c := read(engineAddr+512, er.RKey, 8192); c.Status != wcSuccess || !bytes.Equal(peer.mem[:8192], mem[512:512+8192]) {
		t.Fatalf("a read of the engine region at its owner's address: %s (equal %t)", c.Status.String(), bytes.Equal(peer.mem[:8192], mem[512:512+8192]))
	}
	clear(peer.mem)
	if c := read(addrOf(ferry.mem), arenaRKey, 4096); c.Status != wcRemAccessErr && c.Status != wcRemInvReqErr {
		t.Fatalf("a read of the arena over a Mooncake QP: %s, want REM_ACCESS_ERR", c.Status.String())
	}
	if !isZero(peer.mem[:4096]) {
		t.Error("a refused read brought the arena's bytes back")
	}
}
