package e2e

import (
	"bytes"
	"fmt"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/ferry-project/ferry/api"
	"github.com/ferry-project/ferry/client"
	"github.com/ferry-project/ferry/cuda/cudatest"
	"github.com/ferry-project/ferry/internal/fakecuda"
	"github.com/ferry-project/ferry/mooncake"
	"github.com/ferry-project/ferry/mooncake/mooncaketest"
	"github.com/ferry-project/ferry/transport"
)

// engineMemory is memory an engine registered, lent to an engine
// segment of ferryd at addr, the engine's own address of it (its
// mooncake_addr); read is n bytes of it at off, as the engine reads it.
type engineMemory struct {
	addr uint64
	read func(off, n int) []byte
}

// lendEngineMemory lends size bytes as ferry.mooncake's register_memory
// lends host memory: a memfd mapped here.
func lendEngineMemory(t *testing.T, d *daemon, segment, name string, size int) engineMemory {
	t.Helper()
	f, err := client.NewRegionFile(name, int64(size))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	mem, err := unix.Mmap(int(f.Fd()), 0, size, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { unix.Munmap(mem) })
	e := engineMemory{addr: uint64(uintptr(unsafe.Pointer(unsafe.SliceData(mem)))), read: func(off, n int) []byte { return bytes.Clone(mem[off : off+n]) }}
	lendAt(t, d, e, api.RegionRequest{Name: name, NBytes: int64(size), MooncakeAddr: e.addr, MooncakeSegment: segment}, f)
	return e
}

// lendGPUEngineMemory lends size bytes at off of a CUDA owner's memory
// as register_memory lends a torch.cuda tensor: by its allocation's IPC
// handle, at the owner's address of it.
func lendGPUEngineMemory(t *testing.T, d *daemon, o *cudaOwner, segment, name string, off, size int) engineMemory {
	t.Helper()
	e := engineMemory{addr: o.addr + uint64(off), read: func(at, n int) []byte { return o.read(t, off+at, n) }}
	lendAt(t, d, e, api.RegionRequest{Name: name, NBytes: int64(size), MooncakeAddr: e.addr, MooncakeSegment: segment,
		CUDA: &api.RegionCUDA{Device: "cuda:0", IPCHandle: o.handle, Offset: int64(off)}}, nil)
	return e
}

func lendAt(t *testing.T, d *daemon, e engineMemory, req api.RegionRequest, f *os.File) {
	t.Helper()
	g, err := d.c.RegisterRegionWith(ctxT(t), req, f)
	if err != nil {
		t.Fatal(err)
	}
	if g.MooncakeAddr != e.addr || g.MooncakeSegment != req.MooncakeSegment {
		t.Fatalf("region %+v: want it lent at %#x in engine segment %s", g, e.addr, req.MooncakeSegment)
	}
}

// TestEngineMemoryOverRDMA: memory an engine registered, host memory
// (a memfd) or GPU memory (a CUDA owner process's on the stand-in
// driver, lent by IPC handle: ferryd registers it by its device pointer,
// which rdma_rxe takes as the peer-memory path takes a GPU's), in its
// own engine segment of a ferryd on the rdma transport (make test-rdma).
// Its descriptor says protocol rdma and lists exactly the registered
// range, at the engine's address, with an rkey of its own (never the
// arena's). Another ferryd writes into it over ferry's peer protocol,
// each write granted at the engine's address under that registration:
// in place, with no registration and no CPU or GPU copy per write on
// either side (its DATAPLANE line). A Mooncake RDMA initiator writes
// into it one-sidedly at the engine's addresses; a write past its end
// fails at the NIC (REM_ACCESS_ERR) and changes nothing; its writes into
// two engines' segments in turn all land (each segment has its own
// QPs). Every write is checked byte-exact as the engine reads its
// memory. Closing the segments unregisters the memory.
func TestEngineMemoryOverRDMA(t *testing.T) {
	requireRDMA(t)
	for _, gpu := range []bool{false, true} {
		t.Run(map[bool]string{false: "host", true: "gpu"}[gpu], func(t *testing.T) {
			var lib string
			if gpu {
				lib = fakecuda.Build(t, fakecuda.Working)
			}
			engineMemoryOverRDMA(t, gpu, lib)
		})
	}
}

// TestGPUEngineMemoryOverRDMA is TestEngineMemoryOverRDMA's GPU case on
// a real GPU (make test-gpu), where the host has an RDMA NIC: the GPU
// memory is registered by the first path that works (dmabuf where the
// driver exports the IPC-opened range and the NIC registers dmabufs,
// else peermem), printed as "== ENGINE GPU registration".
func TestGPUEngineMemoryOverRDMA(t *testing.T) {
	cudatest.Require(t)
	requireRDMA(t)
	engineMemoryOverRDMA(t, true, "")
}

// engineMemoryOverRDMA runs TestEngineMemoryOverRDMA's checks on host
// memory, or GPU memory on the CUDA driver in lib ("": the host's).
func engineMemoryOverRDMA(t *testing.T, gpu bool, lib string) {
	const size = 4 << 20
	kind, lend := "engine", func(d *daemon, segment, name string, off, n int) engineMemory {
		return lendEngineMemory(t, d, segment, name, n)
	}
	var prefix, extra []string
	if gpu {
		owner := startCUDAOwner(t, lib, size, 71)
		extra = []string{"--device", "cuda:0", "--bounce-size", "8MiB"}
		if lib != "" {
			prefix = []string{"env", "LD_LIBRARY_PATH=" + lib}
		}
		kind, lend = "engine-gpu", func(d *daemon, segment, name string, off, n int) engineMemory {
			return lendGPUEngineMemory(t, d, owner, segment, name, off, n)
		}
	}
	rcv, own := startMooncakeSegmentIn(t, prefix, append([]string{"--transport", "rdma"}, extra...)...)
	snd := raceFree(t, startDaemon(t, t.TempDir(), "snd", "--transport", "rdma"))
	ctx := ctxT(t)
	es, err := rcv.c.OpenEngineSegment(ctx, 0)
	if err != nil {
		t.Fatal(err)
	}
	e := lend(rcv, es.ID, "engine-kv", 0, size)
	engineRegistration(t, rcv, "engine-kv", gpu, lib != "")
	self := &mooncake.Segment{Name: "test", Buffers: []mooncake.Buffer{}}
	desc, err := mooncake.FetchSegment(ctx, es.Session, self)
	if err != nil {
		t.Fatal(err)
	}
	ownDesc, err := mooncake.FetchSegment(ctx, own, self)
	if err != nil {
		t.Fatal(err)
	}
	if desc.Protocol != "rdma" || len(desc.Buffers) != 1 || desc.Buffers[0].Addr != e.addr || desc.Buffers[0].Length != size || len(desc.Buffers[0].RKey) != 1 {
		t.Fatalf("engine segment descriptor %+v: want protocol rdma, one buffer at %#x of %d bytes with its rkey", desc, e.addr, size)
	}
	if rk := desc.Buffers[0].RKey[0]; rk == ownDesc.Buffers[0].RKey[0] {
		t.Fatalf("the engine's buffer is listed under the arena's rkey %#x", rk)
	}

	// ferry → engine, over ferry's peer protocol on RDMA.
	session := mooncake.Scheme + es.Session
	const sends = 16
	send := func(i int) {
		t.Helper()
		id := fmt.Sprint("e", i)
		data := stageOn(t, snd, id, embBytes, uint64(300+i))
		at := uint64(i * embBytes)
		res, err := snd.c.Send(ctx, id, api.SendRequest{Session: session, BufferAddress: e.addr + at})
		if err != nil {
			t.Fatalf("send %d into engine memory: %v", i, err)
		}
		if res.Transport != "rdma" {
			t.Fatalf("send %d: %+v, want it over ferry's rdma transport", i, res)
		}
		if !bytes.Equal(e.read(int(at), embBytes), data) {
			t.Fatalf("send %d: the engine's memory holds other bytes than were sent", i)
		}
	}
	send(0) // warm-up: the session's lane
	sb, rb := snd.metrics(t), rcv.metrics(t)
	for i := 1; i <= sends; i++ {
		send(i)
	}
	sa, ra := snd.metrics(t), rcv.metrics(t)
	delta := func(a, b map[string]float64, series string) float64 { return a[series] - b[series] }
	if n := delta(sa, sb, "ferry_rdma_sends_total"); n != sends {
		t.Fatalf("%v RDMA sends counted, want %d", n, sends)
	}
	per := func(series string) float64 { return delta(sa, sb, series) / sends }
	both := func(series string) float64 { return (delta(sa, sb, series) + delta(ra, rb, series)) / sends }
	line := fmt.Sprintf("control_msgs_per_send=%.2f posts_per_send=%.2f signaled_per_send=%.2f reg_mr_per_send=%.2f cpu_copy_bytes_per_send=%.0f",
		per("ferry_rdma_control_messages_total"), per("ferry_rdma_posts_total"), per("ferry_rdma_signaled_total"),
		both(`ferry_registrations_total{mode="per-send"}`), both("ferry_rdma_copied_bytes_total"))
	line += fmt.Sprintf(" gpu_copy_bytes_per_send=%.0f staged_per_send=%.2f", both("ferry_gpu_copied_bytes_total"), both("ferry_rdma_staged_receives_total"))
	fmt.Printf("== DATAPLANE %s ferry->ferry rdma nbytes=%d %s\n", kind, embBytes, line)
	if both(`ferry_registrations_total{mode="per-send"}`) != 0 || both("ferry_rdma_copied_bytes_total") != 0 || both("ferry_gpu_copied_bytes_total") != 0 || both("ferry_rdma_staged_receives_total") != 0 {
		t.Errorf("DATAPLANE %s: want reg_mr_per_send=0.00, cpu_copy_bytes_per_send=0, gpu_copy_bytes_per_send=0 and staged_per_send=0.00, sender and receiver together", line)
	}

	// ferry ← engine: another ferryd reads the engine's memory over ferry's
	// peer protocol (a control connection of reads under the segment's
	// key), each piece by RDMA READ from the region's registration for
	// peers, granted at the engine's addresses, into the reader's arena:
	// byte for byte, with no CPU copy (its DATAPLANE line). A range past
	// the registered memory is refused, naming why; ferryd's own segment
	// (its arena and slots) is no ferry engine's and reads nothing.
	const reads = 16
	sb, rb = snd.metrics(t), rcv.metrics(t)
	for i := 0; i < reads; i++ {
		at, n := uint64(i*embBytes+i), uint64(embBytes-i)
		got, err := snd.c.Read(ctx, api.ReadRequest{Session: es.Session, Pieces: [][2]uint64{{e.addr + at, n}, {e.addr + size - 10, 10}}})
		if err != nil {
			t.Fatalf("read %d of the engine's memory: %v", i, err)
		}
		if !bytes.Equal(got, append(e.read(int(at), int(n)), e.read(size-10, 10)...)) {
			t.Fatalf("read %d: other bytes than the engine's memory holds", i)
		}
	}
	sa, ra = snd.metrics(t), rcv.metrics(t)
	perRead := func(series string) float64 { return (delta(sa, sb, series) + delta(ra, rb, series)) / reads }
	// Into a region the reader registered (the reading engine's lent
	// memory): the NIC places the bytes there itself.
	f, into := regionMemory(t, "read-into", 1<<20)
	if _, err := snd.c.RegisterRegionWith(ctx, api.RegionRequest{Name: "read-into", NBytes: 1 << 20}, f); err != nil {
		t.Fatal(err)
	}
	rb0 := snd.metrics(t)
	if res, err := snd.c.ReadInto(ctx, api.ReadRequest{Session: es.Session, Pieces: [][2]uint64{{e.addr + 4096, 1 << 19}, {e.addr + 5, 100}},
		Region: "read-into", RegionOffsets: []uint64{0, 1<<20 - 100}}); err != nil || res.NBytes != 1<<19+100 {
		t.Fatalf("a read into a region: %+v, %v", res, err)
	}
	if !bytes.Equal(into[:1<<19], e.read(4096, 1<<19)) || !bytes.Equal(into[1<<20-100:], e.read(5, 100)) {
		t.Fatal("a read into a region: the region holds other bytes than the engine's memory")
	}
	rb1 := snd.metrics(t)
	regionCopies := delta(rb1, rb0, "ferry_rdma_copied_bytes_total")
	regionPosts := delta(rb1, rb0, "ferry_rdma_work_requests_total")
	_, err = snd.c.Read(ctx, api.ReadRequest{Session: es.Session, Pieces: [][2]uint64{{e.addr + size - 8, 16}}})
	wantErr(t, err, http.StatusBadRequest, api.CodeRefused, "does not fit the memory registered in engine segment")
	// ferryd's own segment is read as any Mooncake segment is: on rdma by
	// RDMA READ under the rkey it lists, its Mooncake pool's, a
	// registration for peers' writes only, so the NIC refuses the READ;
	// on tcp its data port rejects READs.
	_, err = snd.c.Read(ctx, api.ReadRequest{Session: own, Pieces: [][2]uint64{{ownDesc.Buffers[0].Addr, 16}}})
	wantErr(t, err, http.StatusBadGateway, api.CodeTransferFailed, map[string]string{"rdma": "REM_ACCESS_ERR", "tcp": "rejected"}[ownDesc.Protocol])
	line = fmt.Sprintf("control_msgs_per_read=%.2f posts_per_read=%.2f work_requests_per_read=%.2f cpu_copy_bytes_per_read=%.0f",
		perRead("ferry_rdma_control_messages_total"), perRead("ferry_rdma_posts_total"), perRead("ferry_rdma_work_requests_total"), perRead("ferry_rdma_copied_bytes_total"))
	fmt.Printf("== DATAPLANE %s read ferry<-ferry rdma nbytes=%d pieces_per_read=2 reads=%d byte_exact=true out_of_bounds_refused=true %s into_region_work_requests=%.0f into_region_cpu_copy_bytes=%.0f\n",
		kind, embBytes, reads, line, regionPosts, regionCopies)
	if perRead("ferry_rdma_posts_total") < 2 || perRead("ferry_rdma_copied_bytes_total") != 0 || regionPosts < 2 || regionCopies != 0 {
		t.Errorf("DATAPLANE read %s into_region_work_requests=%.0f into_region_cpu_copy_bytes=%.0f: want RDMA READs posted (2 pieces a read) and no CPU copy, reader and peer together",
			line, regionPosts, regionCopies)
	}

	// Mooncake → engine, one-sided RDMA WRITEs at the engine's addresses,
	// into this engine's segment and another's on the same ferryd (two
	// ranks on one host) in turn: the initiator's QPs to one survive its
	// handshake with the other.
	es2, err := rcv.c.OpenEngineSegment(ctx, 0)
	if err != nil {
		t.Fatal(err)
	}
	e2 := lend(rcv, es2.ID, "engine-kv2", size, 1<<20)
	peer := startMooncakePeer(t, mooncaketest.Config{RDMA: true, BufferSize: 4 << 20})
	writes, written := 0, 0
	for i, c := range []struct {
		session string
		e       engineMemory
		off, n  int
	}{
		{es.Session, e, 0, 4096}, {es2.Session, e2, 4096, 65536}, {es.Session, e, 1 << 20, 1<<20 + 17}, {es2.Session, e2, 0, 4096}, {es.Session, e, size - 65536, 65536},
	} {
		data := randomBytes(c.n, uint64(400+i))
		if _, err := peer.WriteRDMA(ctx, c.session, c.e.addr+uint64(c.off), data, ""); err != nil {
			t.Fatalf("a Mooncake write of %d bytes at the engine's %#x (segment %s): %v", c.n, c.e.addr+uint64(c.off), c.session, err)
		}
		if !bytes.Equal(c.e.read(c.off, c.n), data) {
			t.Fatalf("a Mooncake write of %d bytes at offset %d (segment %s): the engine's memory holds other bytes", c.n, c.off, c.session)
		}
		writes, written = writes+1, written+c.n
	}
	tg, ok, err := desc.RDMATarget(e.addr, 1)
	if !ok || err != nil {
		t.Fatalf("the descriptor's target for the engine's first byte: %v, %v", ok, err)
	}
	tail := e.read(size-100, 100)
	err = peer.WriteRawRDMA(ctx, es.Session, tg, e.addr+size-100, randomBytes(4096, 499))
	status := transport.StatusName(err)
	if status != "REM_ACCESS_ERR" {
		t.Errorf("a Mooncake write running past the registered memory: %v (status %q), want REM_ACCESS_ERR", err, status)
	}
	if !bytes.Equal(e.read(size-100, 100), tail) {
		t.Error("the refused write changed the engine's memory")
	}
	fmt.Printf("== MOONCAKE %s rdma writes=%d bytes=%d segments=2 byte_exact=true buffers=%d own_rkey=%t out_of_bounds=%s\n",
		kind, writes, written, len(desc.Buffers), desc.Buffers[0].RKey[0] != ownDesc.Buffers[0].RKey[0], status)

	// Closed, the segments' memory is unregistered.
	for _, id := range []string{es.ID, es2.ID} {
		if err := rcv.c.CloseEngineSegment(ctx, id); err != nil {
			t.Fatal(err)
		}
	}
	if regions, err := rcv.c.Regions(ctx); err != nil || len(regions) != 0 {
		t.Fatalf("regions after the engine segment closed: %+v, %v; want none", regions, err)
	}
}

// engineRegistration checks how region name, memory an engine
// registered, met the NIC for peers' writes, as GET /v1/regions and
// /metrics say: registered; GPU memory by a path the NIC reaches it
// by, never bounce, and on the stand-in driver by peermem, since
// rdma_rxe refuses the dmabuf each region tries first
// (ibv_reg_dmabuf_mr), said with what to do. It prints the path for
// the VM's and make test-gpu's log.
func engineRegistration(t *testing.T, d *daemon, name string, gpu, standIn bool) {
	t.Helper()
	regions, err := d.c.Regions(ctxT(t))
	if err != nil {
		t.Fatal(err)
	}
	i := slices.IndexFunc(regions, func(g api.Region) bool { return g.Name == name })
	if i < 0 || regions[i].NIC == nil || regions[i].NIC.Engine == nil {
		t.Fatalf("regions %+v: want %s with its engine registration", regions, name)
	}
	en := regions[i].NIC.Engine
	if !en.Registered || en.Error != "" || (en.GPU != nil) != gpu {
		t.Fatalf("region %s's engine registration %+v: want it registered, with its GPU path for GPU memory", name, en)
	}
	// ferryctl regions: the region's line, and why a path failed.
	out, err := exec.CommandContext(ctxT(t), filepath.Join(bin, "ferryctl"), "--socket", d.socket, "regions").CombinedOutput()
	if err != nil {
		t.Fatalf("ferryctl regions: %v\n%s", err, out)
	}
	want := regexp.MustCompile(`(?m)^` + name + ` +cuda +[0-9]+ +[0-9]+ +0x[0-9a-f]+ +registered +by (dmabuf|peermem)$`)
	if !gpu {
		want = regexp.MustCompile(`(?m)^` + name + ` +host +[0-9]+ +[0-9]+ +0x[0-9a-f]+ +registered +registered$`)
	} else if standIn {
		want = regexp.MustCompile(`(?ms)^` + name + ` +cuda .* by peermem$.*^` + name + `: engine nic: dmabuf failed: ibv_reg_dmabuf_mr`)
	}
	if !want.Match(out) {
		t.Errorf("ferryctl regions says\n%s\nwant a match for %s", out, want)
	}
	if !gpu {
		return
	}
	why := notTaken(en.GPU)
	fmt.Printf("== ENGINE GPU registration region=%s asked=%s path=%s (%s)\n", name, en.GPU.Asked, en.GPU.Path, strings.Join(why, "; "))
	if len(why) != 2 || !strings.HasPrefix(why[1], "bounce not tried: never for GPU memory an engine registered") {
		t.Errorf("paths not taken %q: want the one not taken of dmabuf and peermem, and bounce never", why)
	}
	failed := map[api.GPURegistration]float64{}
	for _, n := range en.GPU.NotTaken {
		if n.Failed {
			failed[n.Path] = 1
		}
	}
	if standIn && (en.GPU.Path != api.GPURegistrationPeerMem || !strings.HasPrefix(why[0], "dmabuf failed: ibv_reg_dmabuf_mr") || !strings.Contains(why[0], "load nvidia-peermem")) {
		t.Errorf("the engine's GPU memory went by %s, not taken %q; want peermem, dmabuf refused by ibv_reg_dmabuf_mr with what to do", en.GPU.Path, why)
	}
	for _, p := range []api.GPURegistration{api.GPURegistrationDMABuf, api.GPURegistrationPeerMem} {
		taken := map[bool]float64{true: 1}[p == en.GPU.Path]
		for outcome, want := range map[string]float64{"taken": taken, "failed": failed[p]} {
			series := fmt.Sprintf(`ferry_engine_gpu_registrations_total{outcome=%q,path=%q}`, outcome, p)
			if v := d.metric(t, series); v != want {
				t.Errorf("%s = %v, want %v", series, v, want)
			}
		}
	}
}

// TestEngineGPUMemoryOnTheBouncePath: where the NIC reaches no GPU
// memory (the GPU arena went by --gpu-registration bounce), GPU memory
// lent with a mooncake_addr is not registered for peers' RDMA writes:
// GET /v1/regions' nic.engine and ferryctl regions say why (the bounce
// path), and no path is counted. ferryd's segments speak tcp there (the
// Mooncake pool is no part of the arena the NIC reaches), so no
// Mooncake peer writes it one-sidedly: writes into it go through
// staging, as over TCP.
func TestEngineGPUMemoryOnTheBouncePath(t *testing.T) {
	requireRDMA(t)
	lib := fakecuda.Build(t, fakecuda.Working)
	owner := startCUDAOwner(t, lib, 1<<20, 72)
	rcv, _ := startMooncakeSegmentIn(t, []string{"env", "LD_LIBRARY_PATH=" + lib},
		"--transport", "rdma", "--device", "cuda:0", "--gpu-registration", "bounce", "--bounce-size", "8MiB")
	ctx := ctxT(t)
	es, err := rcv.c.OpenEngineSegment(ctx, 0)
	if err != nil {
		t.Fatal(err)
	}
	desc, err := mooncake.FetchSegment(ctx, es.Session, &mooncake.Segment{Name: "test", Buffers: []mooncake.Buffer{}})
	if err != nil || desc.Protocol != "tcp" {
		t.Fatalf("the engine segment's descriptor %+v, %v: want protocol tcp on the bounce path", desc, err)
	}
	g, err := rcv.c.RegisterRegionWith(ctx, api.RegionRequest{Name: "kv", NBytes: 1 << 20, MooncakeAddr: owner.addr, MooncakeSegment: es.ID,
		CUDA: &api.RegionCUDA{Device: "cuda:0", IPCHandle: owner.handle}}, nil)
	if err != nil {
		t.Fatal(err)
	}
	if g.NIC == nil || g.NIC.Engine == nil || g.NIC.Engine.Registered || g.NIC.Engine.GPU != nil ||
		!strings.Contains(g.NIC.Engine.Error, "only where the NIC reaches the GPU arena itself (dmabuf or peermem), and the GPU arena went by the bounce path") {
		t.Fatalf("region %+v (nic %+v): want its engine registration refused, naming the bounce path", g, g.NIC)
	}
	out, err := exec.CommandContext(ctx, filepath.Join(bin, "ferryctl"), "--socket", rcv.socket, "regions").CombinedOutput()
	if err != nil || !regexp.MustCompile(`(?m)^kv +cuda .* not registered$`).Match(out) || !bytes.Contains(out, []byte("kv: engine nic: rdma: GPU memory an engine registered")) {
		t.Errorf("ferryctl regions: %v\n%s\nwant kv's engine registration not registered, and why", err, out)
	}
	for _, p := range []string{"dmabuf", "peermem"} {
		for _, o := range []string{"taken", "failed"} {
			if v := rcv.metric(t, fmt.Sprintf(`ferry_engine_gpu_registrations_total{outcome=%q,path=%q}`, o, p)); v != 0 {
				t.Errorf("ferry_engine_gpu_registrations_total %s %s = %v, want 0: no path is tried on the bounce path", p, o, v)
			}
		}
	}
}
