package daemon

import (
	"bytes"
	"errors"
	"path/filepath"
	"strings"
	"testing"

	"github.com/rs/zerolog"

	"github.com/ferry-project/ferry/cuda"
	"github.com/ferry-project/ferry/cuda/cudatest"
)

// The choice of memory on a host without a GPU; make test-gpu covers the
// GPU side with real daemons.
func TestOpenMemoryWithoutAGPU(t *testing.T) {
	cudatest.NeedsNoGPU(t)
	dir := t.TempDir()
	cfg := testConfig(dir, "m")
	cfg.ArenaFile, cfg.ArenaSize, cfg.BounceSize = filepath.Join(dir, "a.arena"), "1MiB", "1MiB"

	var logs bytes.Buffer
	cfg.Device = "auto"
	m, err := openMemory(cfg, zerolog.New(&logs))
	if err != nil {
		t.Fatal(err)
	}
	if m.Kind() != "host" || m.device != "cpu" || m.Path() != cfg.ArenaFile || m.ipc() != nil || m.status() != nil ||
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
	if m, err = openMemory(cfg, zerolog.New(&logs)); err != nil || m.reason != "--device cpu" || logs.Len() != 0 {
		t.Fatalf("cpu: %+v, %v, log %q", m, err, logs.String())
	}
	m.close()

	cfg.Device = "cuda:0"
	_, err = openMemory(cfg, zerolog.New(&logs))
	if err == nil || !strings.HasPrefix(err.Error(), "--device cuda:0: ") || !strings.Contains(err.Error(), "or run with --device cpu") {
		t.Fatalf("cuda:0 without a GPU: %v", err)
	}
	if errors.Is(cudatest.Probe(), cuda.ErrNoDriver) && !strings.Contains(err.Error(), "install the NVIDIA driver") {
		t.Fatalf("cuda:0 without a driver does not say to install it: %v", err)
	}
}
