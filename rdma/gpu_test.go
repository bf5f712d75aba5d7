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
	f.mu.Lock()
	f.device = append(f.device, dev)
	f.mu.Unlock()
	null, err := os.Open(os.DevNull)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { null.Close() })
	return &DeviceMemory{Base: addrOf(dev), Size: uint64(size), DMABufFD: int(null.Fd()), Bounce: mapT(t, 1<<20), Path: path}, dev
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
		name                string
		path                api.GPURegistration
		noDMABuf, noPeerMem error
		want                api.GPURegistration
		mode                string
		notTaken            map[api.GPURegistration]string
	}{
		{"dmabuf", "", nil, nil, api.GPURegistrationDMABuf, ModeArenaRKey, map[api.GPURegistration]string{
			"peermem": "not tried: dmabuf was taken first", "bounce": "not tried: dmabuf was taken first"}},
		{"no dmabuf", api.GPURegistrationAuto, syscall.EOPNOTSUPP, nil, api.GPURegistrationPeerMem, ModeArenaRKey, map[api.GPURegistration]string{
			"dmabuf": "operation not supported (ENOTSUP)", "bounce": "not tried: peermem was taken first"}},
		{"neither", "", syscall.EOPNOTSUPP, syscall.EFAULT, api.GPURegistrationBounce, ModeGrant, map[api.GPURegistration]string{
			"dmabuf": "the NIC's driver does not register dmabufs", "peermem": "bad address (EFAULT): the NIC's driver cannot pin GPU memory: load nvidia-peermem"}},
		{"forced bounce", api.GPURegistrationBounce, nil, nil, api.GPURegistrationBounce, ModeGrant, map[api.GPURegistration]string{
			"dmabuf": "not tried: --gpu-registration bounce", "peermem": "not tried: --gpu-registration bounce"}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			f := newFabric()
			f.noDMABuf, f.noPeerMem = c.noDMABuf, c.noPeerMem
			dev, _ := gpuArena(t, f, 4<<20, c.path)
			tr := listenFake(t, f, Config{Peer: peer.Config{Secret: testSecret, Sink: mappedSlots(t, 4096)}, Device: dev})
			reg := tr.Registration()
			g := reg.GPU
			if g == nil || g.Path != c.want || reg.Mode != api.RegistrationShared || reg.Err != nil || tr.Mode() != c.mode {
				t.Fatalf("registration %+v (gpu %+v), mode %s; want path %s, shared, mode %s", reg, g, tr.Mode(), c.want, c.mode)
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
// (dmabuf refused), writes go NIC to NIC from and into device memory:
// direct between authenticated peers, granted (AcceptInPlace) without a
// secret, with no copy and no registration per write. On the fake NIC
// and on soft-RoCE.
func TestGPUArenaWrites(t *testing.T) {
	for _, secret := range [][]byte{testSecret, nil} {
		f := newFabric()
		f.noDMABuf = syscall.EOPNOTSUPP
		const size = 1 << 20
		srcDev, src := gpuArena(t, f, 4<<20, "")
		dstDev, dst := gpuArena(t, f, 4<<20, "")
		slots := transporttest.NewSlots(0)
		slots.Mem, slots.Base = dst, addrOf(dst)
		tx := listenT(t, f, Config{Peer: peer.Config{Secret: secret}, Device: srcDev})
		rx := listenT(t, f, Config{Peer: peer.Config{Sink: slots, Secret: secret}, Device: dstDev})
		for _, tr := range []*Transport{tx, rx} {
			g := tr.Registration().GPU
			if g.Path != api.GPURegistrationPeerMem || g.NotTaken[0].Path != api.GPURegistrationDMABuf || g.NotTaken[0].Err == nil {
				t.Fatalf("registration %+v: want peermem, dmabuf refused with its reason", g)
			}
			t.Logf("dmabuf not taken: %v", g.NotTaken[0].Err)
		}
		s, err := tx.Dial(ctxFor(t, 30*time.Second), rx.Addr().String())
		if err != nil {
			t.Fatal(err)
		}
		fill(src, len(secret))
		for i := range 3 {
			off := uint64(i * size)
			key := slots.Add(off, size)
			w := transport.Write{Device: transport.Range{Addr: srcDev.Base + off, Len: size}, Remote: dstDev.Base + off, Key: key, Tag: key.Tag(), Whole: true}
			rep, err := s.Write(ctxFor(t, 60*time.Second), w)
			if err != nil {
				t.Fatal(err)
			}
			if rep.Registration != transport.RegisteredShared || rep.Copied != 0 {
				t.Errorf("report %+v, want the shared registration and no copy", rep)
			}
			if err := slots.Wait(ctxFor(t, 30*time.Second), w.Tag); err != nil {
				t.Fatal(err)
			}
			if !bytes.Equal(dst[off:off+size], src[off:off+size]) {
				t.Fatalf("write %d landed wrong", i)
			}
		}
		s.Close()
		st := tx.Stats()
		if wantDirect := uint64(len(secret) / len(testSecret) * 3); st.Sends != 3 || st.Direct != wantDirect || st.CopiedBytes != 0 || st.PerSend != 0 || st.Bounced != 0 {
			t.Errorf("sender stats %+v, want 3 sends (%d direct), no copy, no per-send registration", st, wantDirect)
		}
		if st := rx.Stats(); st.CopiedBytes != 0 || st.PerReceive != 0 || st.Staged != 0 {
			t.Errorf("receiver stats %+v, want no copy, no per-receive registration, no staging", st)
		}
	}
}
