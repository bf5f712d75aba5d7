package bench

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"time"

	"github.com/ferry-project/ferry/arena"
	"github.com/ferry-project/ferry/transport"
	"github.com/ferry-project/ferry/transport/tcp"
)

// OpenTransport opens the named transport on loopback, for the
// measurements that need one without a daemon. A transport that arrives
// (rdma) adds its case here.
func OpenTransport(name string) (transport.Transport, error) {
	switch name {
	case "tcp":
		return tcp.Listen(tcp.Config{Addr: "127.0.0.1:0", Sink: rawSink{}})
	}
	return nil, fmt.Errorf("--transport %q is not in this build: only tcp is", name)
}

// RegisterConfig is a registration sweep.
type RegisterConfig struct {
	Sizes      []int64 // per-send registrations
	Iterations int     // per size
	ArenaSize  int64   // the shared registration: the whole arena, once
	ArenaDir   string
}

// Register times memory registration through r: each size registered and
// deregistered Iterations times (per_send), and the whole arena once
// (shared), on memory mapped like the daemon's arena.
func Register(ctx context.Context, r transport.Registrar, cfg RegisterConfig) ([]Row, error) {
	n := cfg.ArenaSize
	for _, s := range cfg.Sizes {
		n = max(n, s)
	}
	mem, err := arena.CreateHostFile(filepath.Join(cfg.ArenaDir, fmt.Sprintf("ferrybench-%d-register", os.Getpid())), n)
	if err != nil {
		return nil, err
	}
	defer mem.Close()

	var rows []Row
	measure := func(mode string, sz int64, iters int) error {
		reg := Row{Op: "register", Mode: mode, Size: sz}
		dereg := Row{Op: "deregister", Mode: mode, Size: sz}
		var regLat, deregLat []time.Duration
		var regWall, deregWall time.Duration
		for range iters {
			if err := ctx.Err(); err != nil {
				return err
			}
			t0 := time.Now()
			h, err := r.Register(mem.Base(), sz)
			t1 := time.Now()
			if err != nil {
				return fmt.Errorf("registering %d bytes (%s): %w", sz, mode, err)
			}
			err = h.Deregister()
			t2 := time.Now()
			if err != nil {
				return fmt.Errorf("deregistering %d bytes (%s): %w", sz, mode, err)
			}
			regLat = append(regLat, t1.Sub(t0))
			deregLat = append(deregLat, t2.Sub(t1))
			regWall += t1.Sub(t0)
			deregWall += t2.Sub(t1)
		}
		reg.finish(regLat, regWall)
		dereg.finish(deregLat, deregWall)
		rows = append(rows, reg, dereg)
		return nil
	}
	for _, sz := range cfg.Sizes {
		if err := measure("per_send", sz, cfg.Iterations); err != nil {
			return rows, err
		}
	}
	if err := measure("shared", mem.Size(), 1); err != nil {
		return rows, err
	}
	return rows, nil
}
