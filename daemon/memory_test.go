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

func TestParseDevice(t *testing.T) {
	for in, want := range map[string]int{"auto": -1, "cpu": -1, "cuda:0": 0, "cuda:7": 7} {
		if got, err := parseDevice(in); err != nil || got != want {
			t.Errorf("parseDevice(%q) = %d, %v; want %d", in, got, err, want)
		}
	}
	for _, in := range []string{"", "gpu", "cuda", "cuda:", "cuda:-1", "cuda:x", "CUDA:0", "cuda:0 "} {
		if _, err := parseDevice(in); err == nil || !strings.Contains(err.Error(), "use auto") {
			t.Errorf("parseDevice(%q) = %v, want an error listing the choices", in, err)
		}
	}
	c := Config{Device: "tpu:0", BounceSize: -1}
	err := c.Check()
	for _, want := range []string{`--device "tpu:0"`, "--bounce-size -1"} {
		if err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("Check() = %v, want it to name %s", err, want)
		}
	}
}

// The choice of memory on a host without a GPU; make test-gpu covers the
// GPU side with real daemons.
func TestOpenMemoryWithoutAGPU(t *testing.T) {
	cudatest.NeedsNoGPU(t)
	dir := t.TempDir()
	cfg := Config{ArenaFile: filepath.Join(dir, "a.arena"), ArenaSize: 1 << 20, BounceSize: 1 << 20}

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
