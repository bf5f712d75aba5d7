package bench

import (
	"context"
	"fmt"
	"io"
	"os"
	"path/filepath"

	"github.com/ferry-project/ferry/arena"
	"github.com/ferry-project/ferry/internal/size"
	"github.com/ferry-project/ferry/transport"
	"github.com/ferry-project/ferry/transport/peer"
	"github.com/ferry-project/ferry/transport/tcp"
)

// RawConfig is a sweep of bare transport writes: no daemon, no control
// socket, no staging; the floor the daemon's send is measured against.
// Its connections have ferryd's default send buffer, as the daemons'.
type RawConfig struct {
	Sizes       []int64
	Concurrency []int
	Limit
	Sink     string // host:port of a RawSink, in another process like a peer daemon
	ArenaDir string // for the source memory file
	Progress io.Writer
}

// rawKey is the one key of a RawSink's one slot.
var rawKey = transport.Key{0x5e, 0xed}

// rawSink takes any write that lands inside its memory with rawKey.
type rawSink struct{ mem []byte }

func (s rawSink) Accept(addr, n uint64, key transport.Key, _ uint32) ([]byte, func(error), error) {
	if key != rawKey || addr > uint64(len(s.mem)) || n > uint64(len(s.mem))-addr {
		return nil, nil, &transport.Refusal{Code: transport.NoSlot, Message: "outside the raw benchmark's slot"}
	}
	return s.mem[addr : addr+n], func(error) {}, nil
}

// memFile is memory mapped the way a daemon maps its arena.
func memFile(dir, name string, n int64) (*arena.HostFile, error) {
	return arena.CreateHostFile(filepath.Join(dir, fmt.Sprintf("ferrybench-%d-%s", os.Getpid(), name)), n)
}

// RawSink is the receiving side of a raw sweep: a tcp transport on
// loopback that takes writes into n bytes of arena-like memory. ready gets
// its address; it serves until ctx ends.
func RawSink(ctx context.Context, dir string, n int64, ready func(addr string)) error {
	mem, err := memFile(dir, "raw-sink", n)
	if err != nil {
		return err
	}
	defer mem.Close()
	tr, err := tcp.Listen(peer.Config{Addr: "127.0.0.1:0", Sink: rawSink{mem.Host()}, MaxWrite: uint64(n), SendBuffer: peer.DefaultSendBuffer})
	if err != nil {
		return err
	}
	defer tr.Close()
	ready(tr.Addr().String())
	<-ctx.Done()
	return nil
}

// RawWrite sweeps sizes × concurrency of tcp writes into the RawSink at
// cfg.Sink: each of c writers writes its own region, from memory mapped
// like the daemon's arena.
func RawWrite(ctx context.Context, cfg RawConfig) ([]Row, error) {
	maxSize, maxConc := int64(0), 0
	for _, s := range cfg.Sizes {
		maxSize = max(maxSize, s)
	}
	for _, c := range cfg.Concurrency {
		maxConc = max(maxConc, c)
	}
	src, err := memFile(cfg.ArenaDir, "raw-src", maxSize)
	if err != nil {
		return nil, err
	}
	defer src.Close()
	copy(src.Host(), pattern(maxSize))
	snd, err := tcp.Listen(peer.Config{Addr: "127.0.0.1:0", Sink: rawSink{}, MaxConnsPerPeer: maxConc, SendBuffer: peer.DefaultSendBuffer})
	if err != nil {
		return nil, err
	}
	defer snd.Close()
	sess, err := snd.Dial(ctx, cfg.Sink)
	if err != nil {
		return nil, err
	}
	defer sess.Close()

	prog := newProgress(cfg.Progress, len(cfg.Sizes)*len(cfg.Concurrency))
	var rows []Row
	for _, sz := range cfg.Sizes {
		for _, c := range cfg.Concurrency {
			write := func(w int) error {
				_, err := sess.Write(ctx, transport.Write{Src: src.Host()[:sz], Remote: uint64(w) * uint64(sz), Key: rawKey, Tag: uint32(w)})
				return err
			}
			if warm := hammer(ctx, c, Limit{Iterations: max(cfg.Warmup, c)}, write); warm.firstErr != nil {
				return rows, fmt.Errorf("raw write warm-up, size %s x%d: %w", size.Format(sz), c, warm.firstErr)
			}
			m := hammer(ctx, c, cfg.Limit, write)
			if ctx.Err() != nil {
				return rows, ctx.Err()
			}
			row := Row{Op: "write", Size: sz, Concurrency: c, Errors: m.errs}
			row.finish(m.lat, m.wall)
			if m.firstErr != nil {
				fmt.Fprintf(os.Stderr, "ferrybench: raw %s x%d: %d write(s) failed; the first: %v\n", size.Format(sz), c, m.errs, m.firstErr)
			}
			rows = append(rows, row)
			prog.point(fmt.Sprintf("raw %s x%d: %.3f GB/s, p50 %.0fµs", size.Format(sz), c, row.GBps, row.Latency.P50))
		}
	}
	return rows, nil
}
