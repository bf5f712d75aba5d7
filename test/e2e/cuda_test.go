package e2e

import (
	"bytes"
	"context"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/ferry-project/ferry/api"
	"github.com/ferry-project/ferry/cuda"
	"github.com/ferry-project/ferry/cuda/cudatest"
	"github.com/ferry-project/ferry/internal/fakecuda"
)

// ferrydExit runs a ferryd that is expected to fail at start and returns
// its output and exit code; a ferryd still running after 30 s is killed by
// its PID and fails the test.
// prefix runs before it (e.g. "env LD_LIBRARY_PATH=...").
func ferrydExit(t *testing.T, prefix []string, extra ...string) (string, int) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	dir := t.TempDir()
	argv := append(append([]string{}, prefix...), filepath.Join(bin, "ferryd"), "--socket", filepath.Join(dir, "d.sock"),
		"--listen", "127.0.0.1:0", "--arena-size", "64MiB")
	argv = append(argv, extra...)
	cmd := exec.CommandContext(ctx, argv[0], argv[1:]...)
	out, err := cmd.CombinedOutput()
	if ctx.Err() != nil {
		t.Fatalf("ferryd %v was still running after 30 s; output:\n%s", extra, out)
	}
	var ee *exec.ExitError
	if !errors.As(err, &ee) {
		t.Fatalf("ferryd %v: want a failed start, got %v; output:\n%s", extra, err, out)
	}
	return string(out), ee.ExitCode()
}

func TestDeviceCUDAWithoutAGPUFailsAtStartNamingWhatIsMissing(t *testing.T) {
	cudatest.NeedsNoGPU(t)
	why := cudatest.Probe()
	out, code := ferrydExit(t, nil, "--device", "cuda:0")
	if code != 1 {
		t.Fatalf("exit code %d, want 1; output:\n%s", code, out)
	}
	// The log lines before it (JSON) aside, the failure is one plain line
	// that says what is missing and what to do.
	lines := strings.Split(strings.TrimSpace(out), "\n")
	last := lines[len(lines)-1]
	if !strings.HasPrefix(last, "ferryd: ") {
		t.Fatalf("the last line is not ferryd's error sentence:\n%s", out)
	}
	want := []string{"--device cuda:0", "or run with --device cpu"}
	if errors.Is(why, cuda.ErrNoDriver) {
		want = append(want, "no CUDA driver", cuda.Library, "install the NVIDIA driver")
	}
	for _, w := range want {
		if !strings.Contains(last, w) {
			t.Errorf("the error line does not say %q:\n%s", w, out)
		}
	}
}

func TestDeviceAutoWithoutAGPUUsesHostMemoryAndSaysWhy(t *testing.T) {
	cudatest.NeedsNoGPU(t)
	d := startDaemon(t, t.TempDir(), "auto", "--device", "auto")
	line := d.log.wait(t, 5*time.Second, "saying the arena is in host memory", msg("the arena is in host memory"))
	reason, _ := line["reason"].(string)
	if line["level"] != "info" || !strings.Contains(reason, "--device auto found no usable GPU") || !strings.Contains(reason, "--device cpu") {
		t.Fatalf("fallback line %v", line)
	}
	if n := strings.Count(d.log.dump(), "the arena is in host memory"); n != 1 {
		t.Errorf("%d fallback lines, want one", n)
	}
	st, err := d.c.Status(ctxT(t))
	if err != nil {
		t.Fatal(err)
	}
	if m := st.Memory; m.Kind != "host" || m.Device != "cpu" || m.Reason != reason || m.CUDA != nil || m.ArenaFile == "" {
		t.Fatalf("status memory %+v", m)
	}
	sl, err := d.c.Slice(ctxT(t), "auto-1", api.SliceRequest{NBytes: 4096})
	if err != nil || sl.CUDAIPC != nil || sl.ArenaFile == "" {
		t.Fatalf("a host arena's slice %+v, %v: want the arena file and no IPC handle", sl, err)
	}
}

// The daemon's GPU-arena plumbing, run by ferryd processes that load the
// stand-in driver (internal/fakecuda) through LD_LIBRARY_PATH: the choice
// of device, status, upload staging copied in, sends copied out through
// the bounce area (and past it when it is full), received writes copied in
// and reads copied out. TestGPUArenasTransferOverTCP runs the same on the
// real driver (make test-gpu).
func TestDeviceArenaOverAStandInDriver(t *testing.T) {
	env := []string{"env", "LD_LIBRARY_PATH=" + fakecuda.Build(t, fakecuda.Working)}
	dir := t.TempDir()
	snd := startDaemonIn(t, env, dir, "snd", "--device", "auto", "--bounce-size", "1MiB")
	rcv := startDaemonIn(t, env, dir, "rcv", "--device", "cuda:1", "--bounce-size", "1MiB")
	ctx := ctxT(t)
	for name, d := range map[string]*daemon{"cuda:0": snd, "cuda:1": rcv} {
		line := d.log.wait(t, 5*time.Second, "saying the arena is in GPU memory", msg("the arena is in GPU memory"))
		if line["device"] != name || line["pci_bus_id"] == "" || line["dmabuf_exported"] != true {
			t.Errorf("GPU arena line %v", line)
		}
		st, err := d.c.Status(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if m := st.Memory; m.Kind != "cuda" || m.Device != name || m.CUDA == nil || m.CUDA.Name != "Fake GPU "+name[5:] ||
			!m.CUDA.DMABufExported || m.CUDA.BounceSize != 1<<20 || m.ArenaFile != "" || !strings.Contains(st.Registration.Reason, "bounce") {
			t.Errorf("status of %s: %+v (cuda %+v)", name, m, m.CUDA)
		}
	}

	for i, n := range []int{embBytes, 3 << 20} { // the second is larger than the bounce area
		id := []string{"fake-small", "fake-large"}[i]
		data := randomBytes(n, uint64(20+i))
		if _, err := snd.c.Stage(ctx, id, []int64{int64(n)}, "u8", bytes.NewReader(data), int64(n)); err != nil {
			t.Fatal(err)
		}
		if _, err := snd.c.Send(ctx, id, slotFor(t, rcv, id, int64(n))); err != nil {
			t.Fatal(err)
		}
		got, err := rcv.c.Wait(ctx, id, 10*time.Second)
		if err != nil || !bytes.Equal(got, data) {
			t.Fatalf("%s: %d bytes back, %v: the bytes differ", id, len(got), err)
		}
	}
	if st, _ := snd.c.Status(ctx); st.Memory.CUDA == nil || st.Memory.CUDA.BounceFallbacks == 0 {
		t.Error("a copy larger than the bounce area was not counted as a fallback")
	}
	// A batch piece of 40 MiB goes as writes of at most ferryd's 16 MiB
	// staging chunk, and its upload and the receiver's read back are
	// staged a chunk at a time.
	const chunked, chunk = 40 << 20, 16 << 20
	data := randomBytes(chunked, 22)
	if _, err := snd.c.Stage(ctx, "fake-chunked", []int64{chunked}, "u8", bytes.NewReader(data), chunked); err != nil {
		t.Fatal(err)
	}
	slot, err := rcv.c.Receive(ctx, "fake-chunked", chunked)
	if err != nil {
		t.Fatal(err)
	}
	done, err := snd.c.Transfer(ctx, api.TransferRequest{Sources: []api.TransferSource{{ReqID: "fake-chunked"}},
		Destinations: []api.ReceiveSlot{slot}, Items: api.Items{{0, 0, 0, 0, chunked}}}, 30*time.Second)
	if err != nil || done.State != api.TransferDone || done.Writes != 1 {
		t.Fatalf("transfer: %+v, %v", done, err)
	}
	if _, err := rcv.c.WaitInfo(ctx, "fake-chunked", 10*time.Second); err != nil {
		t.Fatal(err)
	}
	if got, err := rcv.c.Wait(ctx, "fake-chunked", 10*time.Second); err != nil || !bytes.Equal(got, data) {
		t.Fatalf("fake-chunked: %d bytes back, %v: the bytes differ", len(got), err)
	}
	if err := rcv.c.FreeReceive(ctx, "fake-chunked"); err != nil {
		t.Fatal(err)
	}
	// A host arena's send of 40 MiB in one write lands a chunk at a
	// time too: staged whole, it would take 40 MiB of the receiver's
	// host memory at once.
	host := startDaemon(t, dir, "host", "--tcp-stripes", "1")
	if _, err := host.c.Stage(ctx, "host-chunked", []int64{chunked}, "u8", bytes.NewReader(data), chunked); err != nil {
		t.Fatal(err)
	}
	if res, err := host.c.Send(ctx, "host-chunked", slotFor(t, rcv, "host-chunked", chunked)); err != nil || res.Writes != 1 {
		t.Fatalf("the host arena's send: %+v, %v; want one write", res, err)
	}
	if got, err := rcv.c.Wait(ctx, "host-chunked", 10*time.Second); err != nil || !bytes.Equal(got, data) {
		t.Fatalf("host-chunked: %d bytes back, %v: the bytes differ", len(got), err)
	}
	// Uploads, sends, writes landing and reads back alike.
	for name, d := range map[string]*daemon{"sender": snd, "receiver": rcv} {
		if st, err := d.c.Status(ctx); err != nil || st.Memory.CUDA == nil {
			t.Errorf("the %s's status: %+v, %v", name, st.Memory, err)
		} else if peak := st.Memory.CUDA.StagingPeak; peak > chunk {
			t.Errorf("the %s staged %d bytes at once, more than one %d-byte chunk", name, peak, chunk)
		}
	}
	sl, err := snd.c.Slice(ctx, "fake-zc", api.SliceRequest{NBytes: 4096})
	if err != nil || sl.CUDAIPC == nil || sl.Device != "cuda:0" || len(sl.IPCHandle) != 64 || sl.ArenaFile != "" {
		t.Fatalf("slice of a GPU arena %+v, %v", sl, err)
	}

	out, code := ferrydExit(t, env, "--device", "cuda:5")
	if code != 1 || !strings.Contains(out, "--device cuda:5: no CUDA device: cuda:5 does not exist: the driver sees 2 CUDA device(s) (cuda:0 to cuda:1)") {
		t.Errorf("cuda:5 of two GPUs: exit %d\n%s", code, out)
	}
}

// ferryd must start where libcuda.so.1 is absent: it loads the library at
// run time, never links it.
func TestFerrydDoesNotLinkLibcuda(t *testing.T) {
	ldd, err := exec.LookPath("ldd")
	if err != nil {
		t.Skip("ldd is not installed (it comes with libc-bin)")
	}
	for _, name := range []string{"ferryd", "ferryctl"} {
		out, err := exec.Command(ldd, filepath.Join(bin, name)).CombinedOutput()
		if err != nil && !strings.Contains(string(out), "not a dynamic executable") {
			t.Fatalf("ldd %s: %v\n%s", name, err, out)
		}
		if strings.Contains(string(out), "libcuda") || strings.Contains(string(out), "not found") {
			t.Fatalf("%s needs libraries beyond libc:\n%s", name, out)
		}
		t.Logf("ldd %s:\n%s", name, out)
	}
}

// Two ferryd with GPU arenas on loopback over TCP: upload staging copies
// in, the send copies out through the pinned area, the receiver copies in,
// and a client reads back through a copy out. Then zero-copy: this test
// process is the CUDA client, writing and reading the arenas in place
// through their IPC handles.
func TestGPUArenasTransferOverTCP(t *testing.T) {
	gpu := cudatest.Device(t)
	snd, rcv := pair(t, "--device", "cuda:0", "--arena-size", "512MiB", "--bounce-size", "128MiB")
	ctx := ctxT(t)
	for _, d := range []*daemon{snd, rcv} {
		d.log.wait(t, 5*time.Second, "saying the arena is in GPU memory", msg("the arena is in GPU memory"))
		st, err := d.c.Status(ctx)
		if err != nil {
			t.Fatal(err)
		}
		m := st.Memory
		if m.Kind != "cuda" || m.Device != "cuda:0" || m.CUDA == nil || m.CUDA.Name != gpu.Info().Name ||
			len(m.CUDA.IPCHandle) != len(cuda.IPCHandle{}) || m.ArenaFile != "" {
			t.Fatalf("status memory %+v (cuda %+v)", m, m.CUDA)
		}
		t.Logf("%s: %+v", d.socket, *m.CUDA)
	}

	// Upload staging of 96 MiB.
	data := randomBytes(96<<20, 11)
	if _, err := snd.c.Stage(ctx, "gpu-up", []int64{96 << 10, 1024}, "u8", bytes.NewReader(data), int64(len(data))); err != nil {
		t.Fatal(err)
	}
	res, err := snd.c.Send(ctx, "gpu-up", slotFor(t, rcv, "gpu-up", int64(len(data))))
	if err != nil {
		t.Fatal(err)
	}
	got, err := rcv.c.Wait(ctx, "gpu-up", 30*time.Second)
	if err != nil || !bytes.Equal(got, data) {
		t.Fatalf("upload-staged bytes differ after the transfer (%d bytes back, %v)", len(got), err)
	}
	t.Logf("96 MiB GPU to GPU over loopback TCP: %.1f ms, %.2f GB/s", res.Millis, res.GBps)

	// Zero-copy: write the slice through the sender's IPC handle.
	emb := randomBytes(embBytes, 12)
	sl, err := snd.c.Slice(ctx, "gpu-zc", api.SliceRequest{Shape: embShape, DType: "bf16"})
	if err != nil {
		t.Fatal(err)
	}
	if sl.CUDAIPC == nil || sl.Device != "cuda:0" {
		t.Fatalf("slice of a GPU arena without an IPC handle: %+v", sl)
	}
	withIPC(t, gpu, sl.IPCHandle, func(base uint64) {
		if err := gpu.CopyHtoD(base+uint64(sl.Offset), emb); err != nil {
			t.Fatal(err)
		}
	})
	if _, err := snd.c.Commit(ctx, "gpu-zc", embShape, "bf16"); err != nil {
		t.Fatal(err)
	}
	if _, err := snd.c.Send(ctx, "gpu-zc", slotFor(t, rcv, "gpu-zc", embBytes)); err != nil {
		t.Fatal(err)
	}
	info, err := rcv.c.WaitInfo(ctx, "gpu-zc", 30*time.Second)
	if err != nil || !info.Arrived || info.CUDAIPC == nil {
		t.Fatalf("receive %+v, %v", info, err)
	}
	inPlace := make([]byte, embBytes)
	withIPC(t, gpu, info.IPCHandle, func(base uint64) {
		if err := gpu.CopyDtoH(inPlace, base+uint64(info.Offset)); err != nil {
			t.Fatal(err)
		}
	})
	if !bytes.Equal(inPlace, emb) {
		t.Fatal("the embedding read in place from the receiver's GPU arena differs from what was written")
	}

	// ferryctl cannot write GPU memory: it says so instead of failing obscurely.
	in := filepath.Join(t.TempDir(), "emb.bin")
	if err := os.WriteFile(in, emb, 0o644); err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(filepath.Join(bin, "ferryctl"), "--socket", snd.socket, "stage", "gpu-cli", "--shape", "16,4096", "--dtype", "bf16", "--zero-copy", in)
	out, err := cmd.CombinedOutput()
	if err == nil || !strings.Contains(string(out), "drop --zero-copy") {
		t.Fatalf("ferryctl --zero-copy on a GPU arena: %v\n%s", err, out)
	}
	snd.alive(t)
}

// withIPC maps a daemon's arena into this process for f.
func withIPC(t *testing.T, gpu *cuda.Device, handle []byte, f func(base uint64)) {
	t.Helper()
	var h cuda.IPCHandle
	if copy(h[:], handle) != len(h) {
		t.Fatalf("an IPC handle of %d bytes", len(handle))
	}
	base, err := gpu.OpenIPC(h)
	if err != nil {
		t.Fatal(err)
	}
	defer func() {
		if err := gpu.CloseIPC(base); err != nil {
			t.Error(err)
		}
	}()
	f(base)
}

// scriptsDir holds the GPU scripts: FERRY_GPU_SCRIPTS in the GPU bundle,
// else the source tree.
func scriptsDir() string {
	if d := os.Getenv("FERRY_GPU_SCRIPTS"); d != "" {
		return d
	}
	return "../../scripts/gpu"
}

// A torch process is the client: it stages an embedding in place through
// the sender's IPC handle and reads it in place on the receiver's arena
// (scripts/gpu/torch_ipc.py).
func TestGPUTorchClientStagesAndReadsInPlace(t *testing.T) {
	runTorchClient(t, "torch_ipc.py", "256MiB", "64MiB")
}

// runTorchClient runs a torch client script of scripts/gpu against two
// ferryd on cuda:0 (arena and bounce sizes as given, then extra flags);
// it must print PASS.
// The ferry package is beside the script in the GPU bundle, else in the
// tree.
func runTorchClient(t *testing.T, script, arena, bounce string, extra ...string) {
	t.Helper()
	cudatest.Require(t)
	if out, err := exec.Command("python3", "-c", "import torch; assert torch.cuda.is_available()").CombinedOutput(); err != nil {
		if cudatest.Required() {
			t.Fatalf("python3 with CUDA-enabled torch is needed here: %v\n%s", err, out)
		}
		t.Skipf("python3 with CUDA-enabled torch is not installed: %s", bytes.TrimSpace(out))
	}
	snd, rcv := pair(t, append([]string{"--device", "cuda:0", "--arena-size", arena, "--bounce-size", bounce}, extra...)...)
	ctx, cancel := context.WithTimeout(context.Background(), 120*time.Second)
	defer cancel()
	cmd := exec.CommandContext(ctx, "python3", filepath.Join(scriptsDir(), script), snd.socket, rcv.socket)
	cmd.Env = append(os.Environ(), "PYTHONPATH="+filepath.Join(scriptsDir(), "..", "..", "python"))
	out, err := cmd.CombinedOutput()
	t.Logf("%s (pid %d):\n%s", script, cmd.Process.Pid, out)
	if err != nil || !bytes.Contains(out, []byte("\nPASS")) {
		t.Fatalf("the torch client failed: %v", err)
	}
	snd.alive(t)
	rcv.alive(t)
}

// GPU memory this process owns, lent to two ferryd as regions by its IPC
// handle: one sends from it, the other receives into it, with no copy
// through either arena.
func TestGPURegionsSendAndReceiveTheOwnersMemory(t *testing.T) {
	gpu := cudatest.Device(t)
	snd, rcv := pair(t, "--device", "cuda:0", "--arena-size", "64MiB", "--bounce-size", "16MiB")
	ctx := ctxT(t)
	const n = 4 << 20
	own, err := gpu.Alloc(2 * n)
	if err != nil {
		t.Fatal(err)
	}
	defer gpu.Free(own)
	h, err := gpu.IPCHandle(own)
	if err != nil {
		t.Fatal(err)
	}
	data := randomBytes(n, 51)
	if err := gpu.CopyHtoD(own, data); err != nil {
		t.Fatal(err)
	}
	// The first half is the sender's region, the second the receiver's.
	if g, err := snd.c.RegisterCUDARegion(ctx, "src", "cuda:0", h[:], 0, n); err != nil || g.Kind != "cuda" {
		t.Fatalf("register: %+v, %v", g, err)
	}
	if _, err := rcv.c.RegisterCUDARegion(ctx, "dst", "cuda:0", h[:], n, n); err != nil {
		t.Fatal(err)
	}
	// One byte more would run past the allocation, into whatever memory
	// follows it on the GPU: refused, by the driver's word for its size.
	_, err = rcv.c.RegisterCUDARegion(ctx, "past", "cuda:0", h[:], n, n+1)
	wantErr(t, err, 400, api.CodeBadRequest, "region past", "runs past the allocation", "lend at most 4194304 bytes")
	slot, err := rcv.c.ReceiveWith(ctx, api.ReceiveRequest{ReqID: "gpu-region", NBytes: n, Region: "dst"})
	if err != nil {
		t.Fatal(err)
	}
	done, err := snd.c.Transfer(ctx, api.TransferRequest{Sources: []api.TransferSource{{Region: "src"}},
		Destinations: []api.ReceiveSlot{slot}, Items: api.Items{{0, 0, 0, 0, n}}}, 30*time.Second)
	if err != nil || done.State != api.TransferDone {
		t.Fatalf("transfer: %+v, %v", done, err)
	}
	got := make([]byte, n)
	if err := gpu.CopyDtoH(got, own+n); err != nil || !bytes.Equal(got, data) {
		t.Fatalf("the receiver's region (the owner's second half) after the transfer: %v", err)
	}
	for _, d := range []*daemon{snd, rcv} {
		if st, err := d.c.Status(ctx); err != nil || st.Memory.Used != 0 {
			t.Fatalf("arena used %d bytes (%v): a region transfer went through the arena", st.Memory.Used, err)
		}
	}
	if err := rcv.c.FreeReceive(ctx, "gpu-region"); err != nil {
		t.Fatal(err)
	}
	for name, d := range map[string]*daemon{"src": snd, "dst": rcv} {
		if err := d.c.UnregisterRegion(ctx, name, 10*time.Second); err != nil {
			t.Fatal(err)
		}
	}
}

// The Python client lends torch tensors as GPU regions and moves a batch
// between them (scripts/gpu/torch_region.py).
func TestGPUTorchRegions(t *testing.T) {
	runTorchClient(t, "torch_region.py", "64MiB", "32MiB", "--mooncake-listen", "127.0.0.1:0")
}

// torch.cuda tensors Mooncake engines register take a peer engine's
// writes and serve its reads: sglang's and vLLM's sequences with their
// receiving half in GPU memory (scripts/gpu/mooncake_replays.py; make
// test runs it on the stand-in driver).
func TestGPUTorchMooncakeReceiver(t *testing.T) {
	runTorchClient(t, "mooncake_replays.py", "64MiB", "32MiB", "--mooncake-listen", "127.0.0.1:0")
}

// A host-memory ferryd cannot take GPU memory: it says what to do.
func TestCUDARegionOnAHostArenaSaysWhy(t *testing.T) {
	d := startDaemon(t, t.TempDir(), "d")
	_, err := d.c.RegisterCUDARegion(ctxT(t), "g", "cuda:0", make([]byte, 64), 0, 4096)
	wantErr(t, err, 400, api.CodeBadRequest, "region g", "--device cuda:0")
	_, err = d.c.RegisterCUDARegion(ctxT(t), "g", "cuda:0", nil, 0, 4096)
	wantErr(t, err, 400, api.CodeBadRequest, "region g")
}
