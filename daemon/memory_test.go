package daemon

import (
	"bytes"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/rs/zerolog"

	"github.com/ferry-project/ferry/arena"
	"github.com/ferry-project/ferry/cuda"
	"github.com/ferry-project/ferry/cuda/cudatest"
	"github.com/ferry-project/ferry/internal/memlimit"
)

// The choice of memory on a host without a GPU; make test-gpu covers the
// GPU side with real daemons.
func TestOpenMemoryWithoutAGPU(t *testing.T) {
	cudatest.NeedsNoGPU(t)
	dir := t.TempDir()
	cfg := testConfig(dir, "m")
	cfg.ArenaSize, cfg.BounceSize = "1MiB", "1MiB"

	var logs bytes.Buffer
	cfg.Device = "auto"
	m, err := openMemory(cfg, cfg.Device, cfg.ArenaSize.For(0), zerolog.New(&logs))
	if err != nil {
		t.Fatal(err)
	}
	if m.Kind() != "host" || m.device != "cpu" || m.Path() != arena.SealedName || m.ipc() != nil || m.status() != nil ||
		!strings.HasPrefix(m.reason, "--device auto found no usable GPU") {
		t.Fatalf("auto without a GPU: %+v", m)
	}
	if n := strings.Count(logs.String(), "\n"); n != 1 || !strings.Contains(logs.String(), `"level":"info"`) ||
		!strings.Contains(logs.String(), "the arena is in host memory") {
		t.Fatalf("want one INFO line saying why, got:\n%s", logs.String())
	}
	if err := m.close(); err != nil {
		t.Fatal(err)
	}

	logs.Reset()
	cfg.Device = "cpu"
	if m, err = openMemory(cfg, cfg.Device, cfg.ArenaSize.For(0), zerolog.New(&logs)); err != nil || m.reason != "--device cpu" || logs.Len() != 0 {
		t.Fatalf("cpu: %+v, %v, log %q", m, err, logs.String())
	}
	m.close()

	cfg.Device = "cuda:0"
	_, err = openMemory(cfg, cfg.Device, cfg.ArenaSize.For(0), zerolog.New(&logs))
	if err == nil || !strings.HasPrefix(err.Error(), "--device cuda:0: ") || !strings.Contains(err.Error(), "or run with --device cpu") {
		t.Fatalf("cuda:0 without a GPU: %v", err)
	}
	if errors.Is(cudatest.Probe(), cuda.ErrNoDriver) && !strings.Contains(err.Error(), "install the NVIDIA driver") {
		t.Fatalf("cuda:0 without a driver does not say to install it: %v", err)
	}
}

// An arena larger than the memory the host can give fails at start with
// a sentence naming the memory looked at and the setting, not in the
// OOM killer.
func TestArenaLargerThanMemoryFailsAtStart(t *testing.T) {
	dir := t.TempDir()
	cfg := testConfig(dir, "big")
	cfg.ArenaSize = "64TiB"
	_, err := openMemory(cfg, cfg.Device, cfg.ArenaSize.For(0), zerolog.Nop())
	if err == nil || !strings.Contains(err.Error(), "--arena-size 64TiB") || !strings.Contains(err.Error(), "MemAvailable in /proc/meminfo") {
		t.Fatalf("a 64 TiB arena: %v; want an error naming --arena-size and MemAvailable", err)
	}

	// Under a cgroup limit below the arena: a tree of its own.
	root := t.TempDir()
	for name, text := range map[string]string{
		"proc/meminfo":     "MemTotal: 4194304 kB\nMemAvailable: 3145728 kB\n",
		"proc/self/cgroup": "0::/system.slice/ferryd.service\n",
		"cg/system.slice/ferryd.service/memory.max": "536870912\n",
	} {
		p := filepath.Join(root, name)
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(p, []byte(text), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	roots := memlimit.Roots{Proc: filepath.Join(root, "proc"), Cgroup: filepath.Join(root, "cg")}
	if err := hostRoom(256<<20, roots); err != nil {
		t.Fatalf("256 MiB under a 512 MiB limit: %v", err)
	}
	err = hostRoom(1<<30, roots)
	if err == nil || !strings.Contains(err.Error(), "memory.max") || !strings.Contains(err.Error(), "MemoryMax=") {
		t.Fatalf("1 GiB under a 512 MiB cgroup limit: %v; want an error naming memory.max and MemoryMax=", err)
	}
	if err := hostRoom(4<<30, roots); err == nil || !strings.Contains(err.Error(), "3GiB available") {
		t.Fatalf("4 GiB with 3 GiB available: %v", err)
	}
}
