package e2e

import (
	"bytes"
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/ferry-project/ferry/api"
	"github.com/ferry-project/ferry/internal/fakecuda"
)

// One ferryd with an arena on each of three devices (two GPUs of the
// stand-in driver and host memory: --device cuda:0,1,cpu, a size each)
// and a second, host-memory ferryd. A slot on each device fills from a
// send and reads back byte-exact, in that device's arena; an entry
// staged on each device is sent from that device's arena and arrives
// byte-exact; status, ferryctl status and /metrics count each arena; a
// device ferryd has no arena on is refused naming the ones it has.
func TestAnArenaPerDevice(t *testing.T) {
	lib := fakecuda.Build(t, fakecuda.Working)
	env := []string{"env", "LD_LIBRARY_PATH=" + lib, "FAKECUDA_BUS_IDS=0000:3b:00.0,0000:86:00.0"}
	dir := t.TempDir()
	gpu := startDaemonIn(t, env, dir, "gpu", "--device", "cuda:0,1,cpu", "--arena-size", "16MiB,32MiB,8MiB", "--bounce-size", "4MiB")
	host := startDaemon(t, dir, "host")
	ctx := ctxT(t)
	devices := []struct {
		name, kind string
		size       int64
	}{{"cuda:0", "cuda", 16 << 20}, {"cuda:1", "cuda", 32 << 20}, {"cpu", "host", 8 << 20}}
	const n = 3<<20 + 5 // more than one 1 MiB piece, not a whole number of them
	shape := []int64{n}

	arenas := func() []api.ArenaStatus {
		t.Helper()
		st, err := gpu.c.Status(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if len(st.Arenas) != len(devices) || st.Memory.Device != "cuda:0" {
			t.Fatalf("status: %d arenas %+v, memory on %s; want one per device, the first memory's", len(st.Arenas), st.Arenas, st.Memory.Device)
		}
		for i, a := range st.Arenas {
			if a.Device != devices[i].name || a.Kind != devices[i].kind || a.Size != devices[i].size {
				t.Fatalf("arena %d: %+v, want %s %s of %d bytes", i, a, devices[i].name, devices[i].kind, devices[i].size)
			}
		}
		return st.Arenas
	}

	// Into each device's arena.
	want := map[string][]byte{}
	for i, dev := range devices {
		id := "in-" + dev.name
		slot, err := gpu.c.ReceiveOn(ctx, dev.name, id, n)
		if err != nil || slot.Device != dev.name {
			t.Fatalf("slot on %s: %+v, %v", dev.name, slot, err)
		}
		want[id] = randomBytes(n, uint64(40+i))
		if _, err := host.c.Stage(ctx, id, shape, "u8", bytes.NewReader(want[id]), n); err != nil {
			t.Fatal(err)
		}
		if _, err := host.c.Send(ctx, id, api.SendRequest{Session: slot.Session, BufferAddress: slot.BufferAddress, Key: slot.Key, NBytes: n}); err != nil {
			t.Fatalf("send into %s's arena: %v", dev.name, err)
		}
	}
	for i, a := range arenas() {
		if a.Slots != 1 || a.Used < n || a.Staged != 0 {
			t.Errorf("arena %s holds %d slots, %d bytes used, %d staged; want its one slot", a.Device, a.Slots, a.Used, a.Staged)
		}
		id := "in-" + devices[i].name
		info, err := gpu.c.WaitInfo(ctx, id, 10*time.Second)
		if err != nil || !info.Arrived || info.Device != a.Device || info.Region != "" ||
			(a.Kind == "cuda") != (info.CUDAIPC != nil && len(info.IPCHandle) == 64) {
			t.Fatalf("%s: %+v, %v; want it arrived in %s's arena, with that arena's IPC handle for a GPU", id, info, err, a.Device)
		}
		if got, err := gpu.c.Wait(ctx, id, 0); err != nil || !bytes.Equal(got, want[id]) {
			t.Fatalf("%s: %d bytes back, %v: the bytes differ", id, len(got), err)
		}
	}
	if v := gpu.metric(t, `ferry_device_arena_slots{device="cuda:1"}`); v != 1 {
		t.Errorf(`ferry_device_arena_slots{device="cuda:1"} = %v, want 1`, v)
	}
	for _, dev := range devices {
		if err := gpu.c.FreeReceive(ctx, "in-"+dev.name); err != nil {
			t.Fatal(err)
		}
	}

	// Out of each device's arena.
	for i, dev := range devices {
		id := "out-" + dev.name
		data := randomBytes(n, uint64(50+i))
		if e, err := gpu.c.StageOn(ctx, dev.name, id, shape, "u8", bytes.NewReader(data), n); err != nil || e.Device != dev.name {
			t.Fatalf("stage on %s: %+v, %v", dev.name, e, err)
		}
		if e, err := gpu.c.Embedding(ctx, id); err != nil || e.Device != dev.name || (dev.kind == "cuda") != (e.CUDAIPC != nil) {
			t.Fatalf("entry staged on %s: %+v, %v; want it there, with that arena's IPC handle for a GPU", dev.name, e, err)
		}
		if a := arenas()[i]; a.Staged != 1 || a.Used < n {
			t.Fatalf("arena %s after staging: %+v; want the entry in it", dev.name, a)
		}
		if _, err := gpu.c.Send(ctx, id, slotFor(t, host, id, n)); err != nil {
			t.Fatalf("send from %s's arena: %v", dev.name, err)
		}
		if got, err := host.c.Wait(ctx, id, 10*time.Second); err != nil || !bytes.Equal(got, data) {
			t.Fatalf("%s: %d bytes back, %v: the bytes differ", id, len(got), err)
		}
	}
	for _, a := range arenas() {
		if a.Slots != 0 || a.Staged != 0 || a.Used != 0 {
			t.Errorf("arena %s once all is sent and freed: %+v; want it empty", a.Device, a)
		}
	}
	for series, v := range map[string]float64{
		`ferry_device_arena_bytes{device="cuda:1",state="total"}`: 32 << 20,
		`ferry_device_arena_bytes{device="cpu",state="free"}`:     8 << 20,
		`ferry_device_arena_staged{device="cuda:0"}`:              0,
	} {
		if got := gpu.metric(t, series); got != v {
			t.Errorf("%s = %v, want %v", series, got, v)
		}
	}
	out, err := exec.CommandContext(ctx, filepath.Join(bin, "ferryctl"), "--socket", gpu.socket, "status").CombinedOutput()
	if err != nil {
		t.Fatalf("ferryctl status: %v\n%s", err, out)
	}
	for _, line := range []string{"arena      cuda:0 (cuda) 16MiB, used 0B", "arena      cuda:1 (cuda) 32MiB", "arena      cpu (host) 8MiB"} {
		if !strings.Contains(string(out), line) {
			t.Errorf("ferryctl status lacks %q:\n%s", line, out)
		}
	}
	// ferryctl names the device too.
	out, err = exec.CommandContext(ctx, filepath.Join(bin, "ferryctl"), "--socket", gpu.socket, "--json", "recv", "ctl-in", "--nbytes", "4096", "--device", "cuda:1").CombinedOutput()
	var ctlSlot api.ReceiveSlot
	if err != nil || json.Unmarshal(out, &ctlSlot) != nil || ctlSlot.Device != "cuda:1" {
		t.Fatalf("ferryctl recv --device cuda:1: %v\n%s", err, out)
	}
	stage := exec.CommandContext(ctx, filepath.Join(bin, "ferryctl"), "--socket", gpu.socket, "stage", "ctl-out", "--shape", "4096", "--dtype", "u8", "--device", "cpu", "-")
	stage.Stdin = bytes.NewReader(randomBytes(4096, 70))
	if out, err := stage.CombinedOutput(); err != nil {
		t.Fatalf("ferryctl stage --device cpu: %v\n%s", err, out)
	}
	if e, err := gpu.c.Embedding(ctx, "ctl-out"); err != nil || e.Device != "cpu" {
		t.Fatalf("ferryctl stage --device cpu: %+v, %v; want the entry in cpu's arena", e, err)
	}
	for _, free := range []func() error{
		func() error { return gpu.c.FreeReceive(ctx, "ctl-in") },
		func() error { return gpu.c.Delete(ctx, "ctl-out") },
	} {
		if err := free(); err != nil {
			t.Fatal(err)
		}
	}

	// A CUDA region of the second GPU opens on that GPU's arena (the
	// stand-in's handles are not bound to a device, so this shows the
	// daemon takes it there; a real driver opens it in that GPU's context).
	own := startCUDAOwner(t, lib, n, 61)
	if g, err := gpu.c.RegisterCUDARegion(ctx, "kv1", "cuda:1", own.handle, n, n); err != nil || g.Kind != "cuda" {
		t.Fatalf("a CUDA region on cuda:1: %+v, %v", g, err)
	}
	_, err = gpu.c.RegisterCUDARegion(ctx, "kv7", "cuda:7", own.handle, n, n)
	wantErr(t, err, 400, api.CodeBadRequest, `the memory is on "cuda:7"`, "it has arenas on cuda:0, cuda:1, cpu")
	slot, err := gpu.c.ReceiveWith(ctx, api.ReceiveRequest{ReqID: "in-kv1", NBytes: n, Region: "kv1"})
	if err != nil || slot.Device != "" {
		t.Fatalf("a slot in the region: %+v, %v", slot, err)
	}
	data := randomBytes(n, 62)
	if _, err := host.c.Stage(ctx, "in-kv1", shape, "u8", bytes.NewReader(data), n); err != nil {
		t.Fatal(err)
	}
	if _, err := host.c.Send(ctx, "in-kv1", api.SendRequest{Session: slot.Session, BufferAddress: slot.BufferAddress, Key: slot.Key, NBytes: n}); err != nil {
		t.Fatal(err)
	}
	if _, err := gpu.c.WaitInfo(ctx, "in-kv1", 10*time.Second); err != nil {
		t.Fatal(err)
	}
	if got := own.read(t, n, n); !bytes.Equal(got, data) {
		t.Fatal("the write did not land in the owner's memory on cuda:1")
	}
	_, err = gpu.c.ReceiveWith(ctx, api.ReceiveRequest{ReqID: "both", NBytes: n, Region: "kv1", Device: "cuda:1"})
	wantErr(t, err, 400, api.CodeBadRequest, "name one of region and device")

	_, err = gpu.c.ReceiveOn(ctx, "cuda:7", "nowhere", n)
	wantErr(t, err, 400, api.CodeBadRequest, `device "cuda:7"`, "cuda:0, cuda:1, cpu")
	_, err = gpu.c.StageOn(ctx, "cuda:7", "nowhere", shape, "u8", bytes.NewReader(make([]byte, n)), n)
	wantErr(t, err, 400, api.CodeBadRequest, `device "cuda:7"`, "cuda:0, cuda:1, cpu")
	// The daemon stays up, and the default is the first device.
	if slot, err := gpu.c.Receive(ctx, "default", n); err != nil || slot.Device != "cuda:0" {
		t.Fatalf("a slot naming no device: %+v, %v; want it on cuda:0", slot, err)
	}

	// cuda:all is every GPU the driver lists, one size each.
	all := startDaemonIn(t, env, dir, "all", "--device", "cuda:all", "--arena-size", "8MiB", "--bounce-size", "4MiB")
	st, err := all.c.Status(ctx)
	if err != nil || len(st.Arenas) != 2 || st.Arenas[0].Device != "cuda:0" || st.Arenas[1].Device != "cuda:1" || st.Arenas[1].Size != 8<<20 {
		t.Fatalf("cuda:all: %+v, %v; want an 8 MiB arena on each of the two GPUs", st.Arenas, err)
	}
	// A size for each of three devices where the driver lists two stops
	// ferryd at start, naming both settings.
	bad := exec.CommandContext(ctx, env[0], append(env[1:], filepath.Join(bin, "ferryd"), "--socket", filepath.Join(dir, "bad.sock"),
		"--listen", "127.0.0.1:0", "--transport", "tcp", "--device", "cuda:all", "--arena-size", "8MiB,8MiB,8MiB")...)
	bad.Env = append(os.Environ(), "FERRY_CONFIG="+os.DevNull)
	out, err = bad.CombinedOutput()
	if exitCode(err) == 0 || !strings.Contains(string(out), "--arena-size 8MiB,8MiB,8MiB lists 3 sizes for the 2 devices of --device cuda:all") {
		t.Errorf("three sizes for two GPUs: exit %d\n%s", exitCode(err), out)
	}
}
