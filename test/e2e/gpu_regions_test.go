package e2e

import (
	"bufio"
	"bytes"
	"encoding/hex"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/ferry-project/ferry/api"
	"github.com/ferry-project/ferry/cuda"
	"github.com/ferry-project/ferry/internal/fakecuda"
)

// cudaOwnerEnv makes the test binary a CUDA owner process (see
// TestCUDAOwnerProcess): its value is the bytes to allocate and the seed
// of those written, "N:SEED".
const cudaOwnerEnv = "FERRY_E2E_CUDA_OWNER"

// TestCUDAOwnerProcess is no test of its own: run by startCUDAOwner with
// cudaOwnerEnv set and a CUDA driver on LD_LIBRARY_PATH, it is a client
// that owns GPU memory. It allocates 2N bytes on cuda:0, writes N bytes
// of randomBytes(N, SEED) to the first half and zeroes to the second,
// prints "addr P" (its own address of them) and "handle HEX" (the
// allocation's IPC handle), then answers each
// "read OFF LEN PATH" line on stdin by writing those bytes of its memory
// to PATH and printing "read", until stdin closes; then it frees them.
func TestCUDAOwnerProcess(t *testing.T) {
	spec := os.Getenv(cudaOwnerEnv)
	if spec == "" {
		t.Skip("a helper process that startCUDAOwner runs")
	}
	var n int
	var seed uint64
	if _, err := fmt.Sscanf(spec, "%d:%d", &n, &seed); err != nil {
		t.Fatalf("%s=%q: %v", cudaOwnerEnv, spec, err)
	}
	drv, err := cuda.Load()
	if err != nil {
		t.Fatal(err)
	}
	dev, err := drv.Open(0)
	if err != nil {
		t.Fatal(err)
	}
	defer dev.Close()
	p, err := dev.Alloc(int64(2 * n))
	if err != nil {
		t.Fatal(err)
	}
	defer dev.Free(p)
	if err := dev.SetSyncMemops(p); err != nil {
		t.Fatal(err)
	}
	if err := dev.CopyHtoD(p, append(randomBytes(n, seed), make([]byte, n)...)); err != nil {
		t.Fatal(err)
	}
	h, err := dev.IPCHandle(p)
	if err != nil {
		t.Fatal(err)
	}
	fmt.Printf("addr %d\n", p)
	fmt.Printf("handle %x\n", h[:])
	in := bufio.NewScanner(os.Stdin)
	for in.Scan() {
		var off, size int64
		var path string
		if _, err := fmt.Sscanf(in.Text(), "read %d %d %s", &off, &size, &path); err != nil {
			t.Fatalf("%q: %v", in.Text(), err)
		}
		buf := make([]byte, size)
		if err := dev.CopyDtoH(buf, p+uint64(off)); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(path, buf, 0o600); err != nil {
			t.Fatal(err)
		}
		fmt.Println("read")
	}
}

// cudaOwner is a running TestCUDAOwnerProcess.
type cudaOwner struct {
	handle []byte
	addr   uint64 // its own address of its memory
	stdin  io.WriteCloser
	lines  chan string // its stdout, closed at its end
	out    bytes.Buffer
	dir    string
}

// startCUDAOwner starts a CUDA owner process on the stand-in driver in
// lib, owning 2n bytes, the first n of randomBytes(n, seed), and waits
// for its IPC handle. It is ended when the test ends: its stdin closed,
// then killed by its PID if it has not exited 10 s later.
func startCUDAOwner(t *testing.T, lib string, n int, seed uint64) *cudaOwner {
	t.Helper()
	cmd := exec.Command(os.Args[0], "-test.run=^TestCUDAOwnerProcess$")
	cmd.Env = append(os.Environ(), "LD_LIBRARY_PATH="+lib, fmt.Sprintf("%s=%d:%d", cudaOwnerEnv, n, seed), "FERRY_BIN="+bin)
	o := &cudaOwner{lines: make(chan string, 16), dir: t.TempDir()}
	cmd.Stderr = &o.out
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if o.stdin, err = cmd.StdinPipe(); err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	exited := make(chan error, 1)
	go func() {
		defer close(o.lines)
		sc := bufio.NewScanner(stdout)
		for sc.Scan() {
			o.lines <- sc.Text()
		}
		exited <- cmd.Wait() // after stdout's last read, as Wait requires
	}()
	t.Cleanup(func() {
		o.stdin.Close()
		go func() {
			for range o.lines { // drain, so Wait is reached
			}
		}()
		select {
		case err := <-exited:
			if err != nil {
				t.Errorf("the CUDA owner process (pid %d) ended with %v:\n%s", cmd.Process.Pid, err, o.out.String())
			}
		case <-time.After(10 * time.Second):
			cmd.Process.Kill()
			<-exited
			t.Errorf("the CUDA owner process (pid %d) had not exited 10 s after its stdin closed: killed", cmd.Process.Pid)
		}
	})
	if _, err := fmt.Sscanf(o.next(t, "addr "), "addr %d", &o.addr); err != nil {
		t.Fatalf("the owner's addr line: %v", err)
	}
	line := o.next(t, "handle ")
	if o.handle, err = hex.DecodeString(strings.TrimPrefix(line, "handle ")); err != nil || len(o.handle) != len(cuda.IPCHandle{}) {
		t.Fatalf("the owner's handle line %q: %v", line, err)
	}
	return o
}

// next waits 30 s at most for the owner's next line that starts with
// prefix, failing the test if the owner ends first.
func (o *cudaOwner) next(t *testing.T, prefix string) string {
	t.Helper()
	deadline := time.After(30 * time.Second)
	for {
		select {
		case line, ok := <-o.lines:
			if !ok {
				t.Fatalf("the CUDA owner process ended before printing %q:\n%s", prefix, o.out.String())
			}
			if strings.HasPrefix(line, prefix) {
				return line
			}
			o.out.WriteString(line + "\n")
		case <-deadline:
			t.Fatalf("the CUDA owner process printed no %q in 30 s:\n%s", prefix, o.out.String())
		}
	}
}

// read is n bytes of the owner's memory at off, as the owner reads it.
func (o *cudaOwner) read(t *testing.T, off, n int) []byte {
	t.Helper()
	path := filepath.Join(o.dir, "read")
	if _, err := fmt.Fprintf(o.stdin, "read %d %d %s\n", off, n, path); err != nil {
		t.Fatal(err)
	}
	o.next(t, "read")
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// TestGPURegionsOverRDMA: GPU memory another process owns (a CUDA owner
// process on the stand-in driver, whose IPC handles map its memory into
// each ferryd at an address of their own, as the real driver's do), lent
// to two ferryd with GPU arenas over soft-RoCE (make test-rdma) as CUDA
// regions. Each ferryd registers its region with the NIC by its device
// pointer (peermem; rdma_rxe takes any memory), so a batch moves region
// to region NIC to NIC: the owner's memory holds the bytes after, and
// neither ferryd copied, bounced or staged any, on the GPU or the CPU.
// A whole-slot send from the sender's GPU arena into a slot in the
// receiver's region goes direct through the slot's window.
func TestGPURegionsOverRDMA(t *testing.T) {
	requireRDMA(t)
	gpuRegionTransfer(t, "rdma")
}

// TestGPURegionsOnAStandInDriver: the same over TCP, on any host: the
// CUDA regions are copied through each ferryd's bounce area, and the
// owner's memory holds the bytes after.
func TestGPURegionsOnAStandInDriver(t *testing.T) {
	gpuRegionTransfer(t, "tcp")
}

func gpuRegionTransfer(t *testing.T, transport string) {
	lib := fakecuda.Build(t, fakecuda.Working)
	const n = 4 << 20
	own := startCUDAOwner(t, lib, n, 61)
	env := []string{"env", "LD_LIBRARY_PATH=" + lib}
	dir := t.TempDir()
	args := []string{"--device", "cuda:0", "--transport", transport, "--bounce-size", "8MiB"}
	snd := startDaemonIn(t, env, dir, "snd", args...)
	rcv := startDaemonIn(t, env, dir, "rcv", args...)
	ctx := ctxT(t)
	rdma := transport == "rdma"
	// The owner's first half is the sender's region, its second the
	// receiver's.
	for i, d := range []*daemon{snd, rcv} {
		g, err := d.c.RegisterCUDARegion(ctx, "kv", "cuda:0", own.handle, int64(i*n), n)
		if err != nil || g.Kind != "cuda" {
			t.Fatalf("register: %+v, %v", g, err)
		}
		if rdma && (g.NIC == nil || !g.NIC.Registered || g.NIC.Error != "") {
			t.Fatalf("register over rdma: %+v (nic %+v); want it registered with the NIC", g, g.NIC)
		}
		listed, err := d.c.Regions(ctx)
		if err != nil || len(listed) != 1 || rdma && (listed[0].NIC == nil || !listed[0].NIC.Registered) {
			t.Fatalf("GET /v1/regions: %+v, %v", listed, err)
		}
		if v := d.metric(t, `ferry_region_registrations_total{outcome="registered"}`); rdma && v != 1 {
			t.Errorf("ferry_region_registrations_total registered = %v, want 1", v)
		}
	}
	// A byte more than the owner's second half runs past its
	// allocation, into whatever follows it on the GPU: the driver's word
	// for the allocation's size refuses it, in a separate process.
	_, err := rcv.c.RegisterCUDARegion(ctx, "past", "cuda:0", own.handle, n, n+1)
	wantErr(t, err, 400, api.CodeBadRequest, "region past", "runs past the allocation", "lend at most 4194304 bytes")
	slot, err := rcv.c.ReceiveWith(ctx, api.ReceiveRequest{ReqID: "layer-0", NBytes: n, Region: "kv"})
	if err != nil {
		t.Fatal(err)
	}
	counters := []string{"ferry_gpu_copied_bytes_total", "ferry_rdma_copied_bytes_total", "ferry_rdma_bounced_sends_total",
		"ferry_rdma_staged_receives_total", "ferry_gpu_bounce_fallbacks_total", "ferry_rdma_sends_total"}
	before := map[*daemon]map[string]float64{snd: snd.metrics(t), rcv: rcv.metrics(t)}
	// The region in 1 MiB pieces, reversed.
	const piece = 1 << 20
	var items [][]int64
	for i := int64(0); i < n/piece; i++ {
		items = append(items, []int64{0, i * piece, 0, (n/piece - 1 - i) * piece, piece})
	}
	done, err := snd.c.Transfer(ctx, api.TransferRequest{Sources: []api.TransferSource{{Region: "kv"}},
		Destinations: []api.ReceiveSlot{slot}, Items: items}, 30*time.Second)
	if err != nil || done.State != api.TransferDone {
		t.Fatalf("transfer: %+v, %v", done, err)
	}
	if _, err := rcv.c.WaitInfo(ctx, "layer-0", 30*time.Second); err != nil {
		t.Fatal(err)
	}
	data, got := randomBytes(n, 61), own.read(t, n, n)
	for i := 0; i < n/piece; i++ {
		if !bytes.Equal(got[(n/piece-1-i)*piece:(n/piece-i)*piece], data[i*piece:(i+1)*piece]) {
			t.Fatalf("piece %d did not land in the owner's memory", i)
		}
	}
	delta := map[string]float64{}
	for _, d := range []*daemon{snd, rcv} {
		after := d.metrics(t)
		for _, c := range counters {
			delta[c] += metricSum(after, c) - metricSum(before[d], c)
		}
	}
	st, err := rcv.c.Status(ctx)
	if err != nil {
		t.Fatal(err)
	}
	mode := "tcp"
	if st.Transport.RDMA != nil {
		mode = st.Transport.RDMA.WriteMode
	}
	fmt.Printf("== GPU REGIONS %s mode=%s writes=%.0f gpu_copied_bytes=%.0f rdma_copied_bytes=%.0f bounced_sends=%.0f staged_receives=%.0f\n", transport, mode,
		delta["ferry_rdma_sends_total"], delta["ferry_gpu_copied_bytes_total"], delta["ferry_rdma_copied_bytes_total"], delta["ferry_rdma_bounced_sends_total"], delta["ferry_rdma_staged_receives_total"])
	switch {
	case rdma && (delta["ferry_rdma_sends_total"] != n/piece || delta["ferry_gpu_copied_bytes_total"] != 0 || delta["ferry_rdma_copied_bytes_total"] != 0 ||
		delta["ferry_rdma_bounced_sends_total"] != 0 || delta["ferry_rdma_staged_receives_total"] != 0 || delta["ferry_gpu_bounce_fallbacks_total"] != 0):
		t.Errorf("counters moved by %v; want %d RDMA writes and nothing copied, bounced or staged", delta, n/piece)
	case !rdma && delta["ferry_gpu_copied_bytes_total"] != 2*n:
		t.Errorf("the GPU copied %v bytes, want %d: out of the sender's region and into the receiver's", delta["ferry_gpu_copied_bytes_total"], 2*n)
	}
	if err := rcv.c.FreeReceive(ctx, "layer-0"); err != nil {
		t.Fatal(err)
	}

	if rdma {
		// A whole-slot send from the sender's GPU arena into a slot in
		// the receiver's region: in windows mode direct, through the
		// slot's window.
		emb := randomBytes(embBytes, 62)
		if _, err := snd.c.Stage(ctx, "emb-0", embShape, "bf16", bytes.NewReader(emb), int64(len(emb))); err != nil {
			t.Fatal(err)
		}
		eslot, err := rcv.c.ReceiveWith(ctx, api.ReceiveRequest{ReqID: "emb-0", NBytes: embBytes, Region: "kv", RegionOffset: 1 << 20})
		if err != nil {
			t.Fatal(err)
		}
		sb, rb := snd.metrics(t), rcv.metrics(t)
		if res, err := snd.c.Send(ctx, "emb-0", api.SendRequest{Session: eslot.Session, BufferAddress: eslot.BufferAddress, Key: eslot.Key, NBytes: eslot.NBytes}); err != nil || !res.SharedMR {
			t.Fatalf("send: %+v, %v", res, err)
		}
		if _, err := rcv.c.WaitInfo(ctx, "emb-0", 30*time.Second); err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(own.read(t, n+1<<20, embBytes), emb) {
			t.Fatal("the embedding did not land in the owner's memory")
		}
		sa, ra := snd.metrics(t), rcv.metrics(t)
		direct := metricSum(sa, "ferry_rdma_direct_sends_total") - metricSum(sb, "ferry_rdma_direct_sends_total")
		copied := metricSum(sa, "ferry_gpu_copied_bytes_total") - metricSum(sb, "ferry_gpu_copied_bytes_total") +
			metricSum(ra, "ferry_gpu_copied_bytes_total") - metricSum(rb, "ferry_gpu_copied_bytes_total")
		fmt.Printf("== GPU REGIONS rdma mode=%s whole-slot send from the GPU arena into a region: direct=%.0f gpu_copied_bytes=%.0f\n", mode, direct, copied)
		if mode == "windows" && direct != 1 || copied != 0 {
			t.Errorf("the send went direct %v times and the GPU copied %v bytes; want direct once in windows mode, nothing copied", direct, copied)
		}
		if err := rcv.c.FreeReceive(ctx, "emb-0"); err != nil {
			t.Fatal(err)
		}
	}
	// Deregistered from the NIC and closed once unused, before the owner
	// frees the memory.
	for _, d := range []*daemon{snd, rcv} {
		if err := d.c.UnregisterRegion(ctx, "kv", 10*time.Second); err != nil {
			t.Fatal(err)
		}
	}
}
