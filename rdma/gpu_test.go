package rdma

import (
	"bytes"
	"os"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/ferry-project/ferry/api"
	"github.com/ferry-project/ferry/transport"
	"github.com/ferry-project/ferry/transport/peer"
	"github.com/ferry-project/ferry/transport/transporttest"
)

// gpuArena is a stand-in GPU arena: mapped host memory declared to the
// fake fabric as device memory (on soft-RoCE it is plain memory, which
// ibv_reg_mr takes as the peer-memory path would take a GPU's), with a
// dmabuf fd of /dev/null (what the fake CUDA driver exports) and a
// bounce area.
func gpuArena(t *testing.T, f *fabric, size int, path api.GPURegistration) (*DeviceMemory, []byte) {
	t.Helper()
	dev := mapT(t, size)
	return gpuArenaIn(t, f, dev, size, path), dev
}

// gpuArenaIn is gpuArena over the first size bytes of dev, all of which
// is declared device memory: what lies past the arena stands for other
// allocations on its GPU (CUDA regions).
func gpuArenaIn(t *testing.T, f *fabric, dev []byte, size int, path api.GPURegistration) *DeviceMemory {
	t.Helper()
	f.mu.Lock()
	f.device = append(f.device, dev)
	f.mu.Unlock()
	null, err := os.Open(os.DevNull)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { null.Close() })
	f.mu.Lock()
	f.dmabufs[int(null.Fd())] = addrOf(dev)
	f.mu.Unlock()
	return &DeviceMemory{Base: addrOf(dev), Size: uint64(size), DMABufFD: int(null.Fd()), Bounce: mapT(t, 1<<20), Path: path}
}

// TestGPURegistrationChoice: auto takes dmabuf, else peer memory, else
// the bounce area, and says why each path before it failed, with what to
// do; --gpu-registration forces one, and a forced path that fails stops
// the transport. On the fake NIC, whose refusals a test sets.
func TestGPURegistrationChoice(t *testing.T) {
	if onDevice(t) {
		t.Skip("the fake NIC's refusals; on soft-RoCE, TestGPUArenaWrites and the e2e TestGPUArenaOverRDMA show its own")
	}
	cases := []struct {
		name                 string
		path                 api.GPURegistration
		noDMABuf, noPeerMem  error
		noDeviceMWBind       error
		windows, refuseBinds bool // the NIC's memory windows
		want                 api.GPURegistration
		mode, why            string
		notTaken             map[api.GPURegistration]string
	}{
		{name: "dmabuf with windows", windows: true, want: api.GPURegistrationDMABuf, mode: ModeWindows, notTaken: map[api.GPURegistration]string{
			"peermem": "not tried: dmabuf was taken first", "bounce": "not tried: dmabuf was taken first"}},
		{name: "peermem with windows", noDMABuf: syscall.EOPNOTSUPP, windows: true, want: api.GPURegistrationPeerMem, mode: ModeWindows, notTaken: map[api.GPURegistration]string{
			"dmabuf": "operation not supported (ENOTSUP)", "bounce": "not tried: peermem was taken first"}},
		// A NIC that will not bind windows over the memory: the arena's
		// rkey between authenticated peers, and why.
		{name: "binds refused", windows: true, refuseBinds: true, want: api.GPURegistrationDMABuf, mode: ModeArenaRKey, why: "no memory windows: binding a memory window over", notTaken: map[api.GPURegistration]string{
			"peermem": "not tried: dmabuf was taken first", "bounce": "not tried: dmabuf was taken first"}},
		{name: "bounce with windows", noDMABuf: syscall.EOPNOTSUPP, noPeerMem: syscall.EFAULT, windows: true, want: api.GPURegistrationBounce, mode: ModeGrant, why: "no memory windows: the GPU arena's slots are out of the NIC's reach on the bounce path", notTaken: map[api.GPURegistration]string{
			"dmabuf": "ENOTSUP", "peermem": "EFAULT"}},
		// A NIC that will not register the memory to bind windows over:
		// dmabuf's two tries failed apart, and both are told.
		{name: "no windows over device memory", noDMABuf: syscall.EOPNOTSUPP, noDeviceMWBind: syscall.EINVAL, windows: true, want: api.GPURegistrationPeerMem, mode: ModeArenaRKey,
			why: "no memory windows: registering the memory for windows (IBV_ACCESS_MW_BIND): ibv_reg_mr of 4194304 bytes of device memory", notTaken: map[api.GPURegistration]string{
				"dmabuf": "operation not supported (ENOTSUP): the NIC's driver does not register dmabufs (mlx5 does from Linux 5.12; soft-RoCE never does): use such a NIC and kernel, load nvidia-peermem for the peermem path, or run with --gpu-registration bounce; asked first with windows over the slots: registering the memory for windows (IBV_ACCESS_MW_BIND): ibv_reg_dmabuf_mr of 4194304 bytes of dmabuf fd",
				"bounce": "not tried: peermem was taken first"}},
		{name: "dmabuf", want: api.GPURegistrationDMABuf, mode: ModeArenaRKey, notTaken: map[api.GPURegistration]string{
			"peermem": "not tried: dmabuf was taken first", "bounce": "not tried: dmabuf was taken first"}},
		{name: "no dmabuf", path: api.GPURegistrationAuto, noDMABuf: syscall.EOPNOTSUPP, want: api.GPURegistrationPeerMem, mode: ModeArenaRKey, notTaken: map[api.GPURegistration]string{
			"dmabuf": "operation not supported (ENOTSUP)", "bounce": "not tried: peermem was taken first"}},
		{name: "neither", noDMABuf: syscall.EOPNOTSUPP, noPeerMem: syscall.EFAULT, want: api.GPURegistrationBounce, mode: ModeGrant, notTaken: map[api.GPURegistration]string{
			"dmabuf": "the NIC's driver does not register dmabufs", "peermem": "bad address (EFAULT): the NIC's driver cannot pin GPU memory: load nvidia-peermem"}},
		{name: "forced bounce", path: api.GPURegistrationBounce, want: api.GPURegistrationBounce, mode: ModeGrant, notTaken: map[api.GPURegistration]string{
			"dmabuf": "not tried: --gpu-registration bounce", "peermem": "not tried: --gpu-registration bounce"}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			f := newFabric()
			f.noDMABuf, f.noPeerMem, f.noDeviceMWBind = c.noDMABuf, c.noPeerMem, c.noDeviceMWBind
			f.windows, f.refuseBinds = c.windows, c.refuseBinds
			dev, _ := gpuArena(t, f, 4<<20, c.path)
			tr := listenFake(t, f, Config{Peer: peer.Config{Secret: testSecret, Sink: transporttest.WindowSlots{Slots: mappedSlots(t, 4096)}}, Device: dev})
			reg := tr.Registration()
			g := reg.GPU
			if g == nil || g.Path != c.want || reg.Mode != api.RegistrationShared || reg.Err != nil || tr.Mode() != c.mode {
				t.Fatalf("registration %+v (gpu %+v), mode %s (%s); want path %s, shared, mode %s", reg, g, tr.Mode(), tr.ModeWhy(), c.want, c.mode)
			}
			if why := tr.ModeWhy(); c.why != "" && !strings.HasPrefix(why, c.why) {
				t.Errorf("mode %s because %q, want %q", tr.Mode(), why, c.why)
			}
			if len(g.NotTaken) != 2 {
				t.Fatalf("paths not taken %+v, want the other two", g.NotTaken)
			}
			for _, n := range g.NotTaken {
				why := n.Reason
				if n.Err != nil {
					why = n.Err.Error()
				}
				if want, ok := c.notTaken[n.Path]; !ok || !strings.Contains(strings.ToLower(why), strings.ToLower(want)) {
					t.Errorf("%s not taken because %q, want %q", n.Path, why, want)
				}
			}
		})
	}

	// A forced path that fails stops the transport, saying why and what
	// else to run with.
	f := newFabric()
	f.noDMABuf = syscall.EOPNOTSUPP
	dev, _ := gpuArena(t, f, 4<<20, api.GPURegistrationDMABuf)
	_, err := listen(testConfig(t, Config{Device: dev}), f.nic(1))
	if err == nil || !strings.Contains(err.Error(), "--gpu-registration dmabuf") || !strings.Contains(err.Error(), "ENOTSUP") ||
		!strings.Contains(err.Error(), "--gpu-registration auto") {
		t.Fatalf("forced dmabuf on a NIC without it: %v", err)
	}
}

// TestGPUArenaWrites: between two GPU arenas registered by peer memory
// (dmabuf refused), writes go NIC to NIC from and into device memory
// with no copy and no registration per write: whole slots direct
// through each slot's window (windows mode, no secret needed), or under
// the arena's rkey between authenticated peers, and granted
// (AcceptInPlace) without either; a piece of a slot always granted,
// under the slot's window in windows mode. On the fake NIC and on
// soft-RoCE, whose NIC has windows: there every case but the Sink
// without them is windows mode.
func TestGPUArenaWrites(t *testing.T) {
	for _, c := range []struct {
		name    string
		secret  []byte
		windows bool
		mode    string
	}{
		{"windows", nil, true, ModeWindows},
		{"arena rkey", testSecret, false, ModeArenaRKey},
		{"grant", nil, false, ModeGrant},
	} {
		t.Run(c.name, func(t *testing.T) {
			f := newFabric()
			f.noDMABuf, f.windows = syscall.EOPNOTSUPP, c.windows
			const size = 1 << 20
			srcDev, src := gpuArena(t, f, 4<<20, "")
			dstDev, dst := gpuArena(t, f, 4<<20, "")
			slots := transporttest.NewSlots(0)
			slots.Mem, slots.Base = dst, addrOf(dst)
			var sink transport.Sink = slots
			if c.windows {
				sink = transporttest.WindowSlots{Slots: slots}
			}
			tx := listenT(t, f, Config{Peer: peer.Config{Secret: c.secret}, Device: srcDev})
			rx := listenT(t, f, Config{Peer: peer.Config{Sink: sink, Secret: c.secret}, Device: dstDev})
			for _, tr := range []*Transport{tx, rx} {
				g := tr.Registration().GPU
				if g.Path != api.GPURegistrationPeerMem || g.NotTaken[0].Path != api.GPURegistrationDMABuf || g.NotTaken[0].Err == nil {
					t.Fatalf("registration %+v: want peermem, dmabuf refused with its reason", g)
				}
				t.Logf("dmabuf not taken: %v", g.NotTaken[0].Err)
			}
			if onDevice(t) && !c.windows {
				t.Skip("soft-RoCE has windows: the fake NIC shows this mode")
			}
			if m := rx.Mode(); m != c.mode {
				t.Fatalf("receiver in mode %s (%s), want %s", m, rx.ModeWhy(), c.mode)
			}
			// Mooncake peers write under one rkey, not per slot: the
			// pool's, part of the device memory registered on its own.
			if addr, rkey, _, err := rx.MooncakePool(4096, 8192); err != nil || addr != dstDev.Base+4096 || rkey == 0 {
				t.Fatalf("the Mooncake pool: addr %#x (want %#x), rkey %#x, %v", addr, dstDev.Base+4096, rkey, err)
			}
			s, err := tx.Dial(ctxFor(t, 30*time.Second), rx.Addr().String())
			if err != nil {
				t.Fatal(err)
			}
			defer s.Close()
			fill(src, len(c.name))
			write := func(w transport.Write) {
				t.Helper()
				rep, err := s.Write(ctxFor(t, 60*time.Second), w)
				if err != nil {
					t.Fatal(err)
				}
				if rep.Registration != transport.RegisteredShared || rep.Copied != 0 {
					t.Errorf("report %+v, want the shared registration and no copy", rep)
				}
				if err := slots.WaitIdle(ctxFor(t, 30*time.Second)); err != nil {
					t.Fatal(err)
				}
			}
			for i := range 3 {
				off := uint64(i * size)
				key := slots.Add(off, size)
				w := transport.Write{Device: transport.Range{Addr: srcDev.Base + off, Len: size}, Remote: dstDev.Base + off, Key: key, Tag: key.Tag(), Whole: true}
				if i == 2 {
					// Two pieces: each asks first, whatever the mode.
					for _, half := range []uint64{0, size / 2} {
						piece := w
						piece.Whole, piece.Device, piece.Remote = false, transport.Range{Addr: w.Device.Addr + half, Len: size / 2}, w.Remote+half
						write(piece)
					}
				} else {
					write(w)
				}
				if err := slots.Wait(ctxFor(t, 30*time.Second), w.Tag); err != nil {
					t.Fatal(err)
				}
				if !bytes.Equal(dst[off:off+size], src[off:off+size]) {
					t.Fatalf("write %d landed wrong", i)
				}
			}
			st := tx.Stats()
			wantDirect := uint64(2)
			if c.mode == ModeGrant {
				wantDirect = 0
			}
			if st.Sends != 4 || st.Direct != wantDirect || st.CopiedBytes != 0 || st.PerSend != 0 || st.Bounced != 0 {
				t.Errorf("sender stats %+v, want 4 sends (%d direct), no copy, no per-send registration", st, wantDirect)
			}
			if st := rx.Stats(); st.CopiedBytes != 0 || st.PerReceive != 0 || st.Staged != 0 {
				t.Errorf("receiver stats %+v, want no copy, no per-receive registration, no staging", st)
			}
		})
	}
}
