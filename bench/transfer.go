package bench

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"os"
	"slices"
	"sync/atomic"
	"time"

	"github.com/ferry-project/ferry/api"
	"github.com/ferry-project/ferry/client"
	"github.com/ferry-project/ferry/internal/size"
)

// Peers are the two daemons of a run: From stages and sends into receive
// slots on To. With Mooncake set, every point is also sent into that
// Mooncake segment, alternating with To (A B A B), for a side-by-side
// comparison in one run.
type Peers struct {
	From, To *client.Client
	Mooncake *MooncakeTarget
}

// Staging methods.
const (
	ZeroCopy = "zero-copy" // slice, write through the arena mapping, commit
	Upload   = "upload"    // PUT the bytes over the control socket
)

// TransferConfig is a transfer sweep.
type TransferConfig struct {
	Sizes       []int64
	Concurrency []int
	Limit
	Stage    string    // ZeroCopy or Upload
	Progress io.Writer // a line per point on long sweeps; nil for none
}

// A round stages about roundBytes (at least one block per send in flight,
// at most batchCap blocks) before sending them. Rounds reuse the same
// arena memory, so a send reads data written as recently as a tensor a
// client has just staged (and iperf3 reuses one buffer), and a sweep needs
// only a small arena.
const (
	roundBytes = 4 << 20
	batchCap   = 512
)

// Transfer sweeps sizes × concurrency through the daemons. Each point runs
// in rounds: stage a batch (timed as staging), allocate its receive slots
// (untimed), send the batch with Concurrency sends in flight (timed: the
// throughput and latency columns), free the slots (untimed). The first
// round's first transfer is checked byte for byte at the receiver.
func Transfer(ctx context.Context, p Peers, cfg TransferConfig) ([]Row, error) {
	if cfg.Stage != ZeroCopy && cfg.Stage != Upload {
		return nil, fmt.Errorf("staging method %q: use %s or %s", cfg.Stage, ZeroCopy, Upload)
	}
	maxSize := int64(0)
	for _, s := range cfg.Sizes {
		maxSize = max(maxSize, s)
	}
	t := &transferRun{p: p, cfg: cfg, data: pattern(maxSize), prefix: fmt.Sprintf("fb%d-", os.Getpid())}
	if cfg.Stage == ZeroCopy {
		var err error
		if t.mapping, err = p.From.MapArena(ctx); err != nil {
			return nil, fmt.Errorf("%w (or stage by upload)", err)
		}
		defer t.mapping.Close()
	}
	tos := []receiver{ferryReceiver{p.To}}
	if p.Mooncake != nil {
		tos = append(tos, p.Mooncake)
	}
	// Compared receivers take turns, twice each (A B A B), each turn with
	// half the limit: drift on a noisy machine falls on both.
	turns := 1
	if len(tos) > 1 {
		turns = 2
	}
	lim := cfg.Limit
	lim.Duration /= time.Duration(turns)
	lim.Iterations = (lim.Iterations + turns - 1) / turns
	prog := newProgress(cfg.Progress, len(cfg.Sizes)*len(cfg.Concurrency)*len(tos))
	var rows []Row
	for _, sz := range cfg.Sizes {
		for _, c := range cfg.Concurrency {
			all := make([]roundResult, len(tos))
			for turn := 0; turn < turns; turn++ {
				for i, to := range tos {
					r, err := t.point(ctx, to, sz, c, lim, turn == 0)
					if err != nil {
						return rows, fmt.Errorf("%s, size %s, concurrency %d: %w", to.op(), size.Format(sz), c, err)
					}
					all[i].add(r)
				}
			}
			for i, to := range tos {
				row := t.row(to.op(), sz, c, all[i])
				rows = append(rows, row)
				prog.point(fmt.Sprintf("%s %s x%d: %.3f GB/s, p50 %.0fµs", to.op(), size.Format(sz), c, row.GBps, row.Latency.P50))
			}
		}
	}
	return rows, nil
}

// pattern is n bytes of fixed-seed noise: the staged data.
func pattern(n int64) []byte {
	b := make([]byte, n)
	rand.NewChaCha8([32]byte{'f', 'e', 'r', 'r', 'y', 'b', 'e', 'n', 'c', 'h'}).Read(b)
	return b
}

type transferRun struct {
	p       Peers
	cfg     TransferConfig
	data    []byte
	mapping *client.Mapping // sender's arena, for zero-copy staging
	prefix  string
	seq     atomic.Int64
}

// batch is how many entries of sz one round stages: about roundBytes,
// at least c, and what fits in the free memory of the sender and the
// receiver (with a tenth spare).
func (t *transferRun) batch(ctx context.Context, to receiver, sz int64, c int) (int, error) {
	fit := batchCap
	for _, r := range []receiver{ferryReceiver{t.p.From}, to} {
		free, align, err := r.room(ctx)
		if err != nil {
			return 0, err
		}
		align = max(align, 1)
		per := (sz + align - 1) / align * align
		fit = min(fit, int(free*9/10/per))
	}
	if fit < c {
		return 0, fmt.Errorf("%d blocks of %s in flight need %s free in each arena, and only %d fit: raise the arena size (ferrybench --arena-size, or ferryd --arena-size) or lower --concurrency",
			c, size.Format(sz), size.Format(int64(c)*sz*10/9), fit)
	}
	return min(fit, max(int(roundBytes/sz), c)), nil
}

// point runs one turn of a point into to: a warm-up, then rounds until
// lim is used up; verify checks the first round's first transfer.
func (t *transferRun) point(ctx context.Context, to receiver, sz int64, c int, lim Limit, verify bool) (roundResult, error) {
	batch, err := t.batch(ctx, to, sz, c)
	if err != nil {
		return roundResult{}, err
	}
	if _, err := t.round(ctx, to, sz, c, min(max(lim.Warmup, c), batch), false); err != nil {
		return roundResult{}, fmt.Errorf("warm-up: %w", err)
	}
	var all roundResult
	before := t.nicBytes(ctx)
	for first := true; ; first = false {
		n := batch
		if lim.Iterations > 0 {
			n = min(n, lim.Iterations-all.sends())
		}
		r, err := t.round(ctx, to, sz, c, n, first && verify)
		if err != nil {
			return all, err
		}
		all.add(r)
		if lim.Iterations > 0 && all.sends() >= lim.Iterations ||
			lim.Iterations == 0 && all.send.wall >= lim.Duration {
			break
		}
	}
	all.nics = since(before, t.nicBytes(ctx))
	return all, nil
}

// nicBytes is what left the sending daemon through each of its RDMA
// devices so far (its status's rails); nil over TCP. Only sends move it,
// so its change over a point's rounds is their bytes.
func (t *transferRun) nicBytes(ctx context.Context) []api.Rail {
	st, err := t.p.From.Status(ctx)
	if err != nil || st.Transport.RDMA == nil {
		return nil
	}
	return st.Transport.RDMA.Rails
}

// since is each rail's bytes from before to after.
func since(before, after []api.Rail) []NICRate {
	if len(after) != len(before) {
		return nil
	}
	out := make([]NICRate, len(after))
	for i, r := range after {
		out[i] = NICRate{NIC: r.Device, Bytes: int64(r.Bytes - before[i].Bytes)}
	}
	return out
}

// row is a point's figures from all its turns.
func (t *transferRun) row(op string, sz int64, c int, all roundResult) Row {
	row := Row{Op: op, Size: sz, Concurrency: c, Errors: all.send.errs}
	row.finish(all.send.lat, all.send.wall)
	w := Summarize(all.writes)
	row.DaemonWrite = &w
	stage := Summarize(all.stage.lat)
	row.Stage = &Stage{Method: t.cfg.Stage, Seconds: all.stage.wall.Seconds(), Latency: stage}
	if all.send.wall > 0 && op == "send" {
		for _, n := range all.nics {
			n.GBps = float64(n.Bytes) / all.send.wall.Seconds() / 1e9
			row.NICs = append(row.NICs, n)
		}
	}
	if all.stage.wall > 0 {
		row.Stage.GBps = float64(sz) * float64(stage.N) / all.stage.wall.Seconds() / 1e9
	}
	if all.send.firstErr != nil {
		fmt.Fprintf(os.Stderr, "ferrybench: %s %s x%d: %d send(s) failed; the first: %v\n", op, size.Format(sz), c, all.send.errs, all.send.firstErr)
	}
	return row
}

// roundResult accumulates the timed phases of rounds.
type roundResult struct {
	stage, send timed
	writes      []time.Duration // the daemon's own timing of each send
	nics        []NICRate       // bytes per RDMA device of the sender
}

func (r *roundResult) sends() int { return len(r.send.lat) + r.send.errs }

func (r *roundResult) add(o roundResult) {
	for _, p := range []struct{ to, from *timed }{{&r.stage, &o.stage}, {&r.send, &o.send}} {
		p.to.lat = append(p.to.lat, p.from.lat...)
		p.to.wall += p.from.wall
		p.to.errs += p.from.errs
		if p.to.firstErr == nil {
			p.to.firstErr = p.from.firstErr
		}
	}
	r.writes = append(r.writes, o.writes...)
	// A point's turns add up per NIC (the rails are the same in each).
	switch {
	case r.nics == nil:
		r.nics = slices.Clone(o.nics)
	case len(o.nics) == len(r.nics):
		for i := range r.nics {
			r.nics[i].Bytes += o.nics[i].Bytes
		}
	}
}

// round stages n entries of sz, sends them with c in flight and cleans up.
// Staging and slot failures end the run (every later figure would be
// wrong); failed sends are counted.
func (t *transferRun) round(ctx context.Context, to receiver, sz int64, c, n int, verify bool) (roundResult, error) {
	ids := make([]string, n)
	for i := range ids {
		ids[i] = fmt.Sprintf("%s%d", t.prefix, t.seq.Add(1))
	}
	staged := make([]bool, n)
	freed := make([]bool, n)
	slots := make([]api.SendRequest, n)
	haveSlot := make([]bool, n)
	defer func() {
		// Whatever a failure left behind goes, so a run against
		// long-lived daemons leaves their arenas as it found them.
		cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 30*time.Second)
		defer cancel()
		forEach(c, n, func(i int) {
			if haveSlot[i] {
				_ = to.free(cctx, ids[i])
			}
			if staged[i] && !freed[i] {
				_ = t.p.From.Delete(cctx, ids[i])
			}
		})
	}()

	var res roundResult
	res.stage = timedEach(c, n, func(i int) error {
		err := t.stage(ctx, ids[i], sz)
		staged[i] = err == nil
		return err
	})
	if res.stage.errs > 0 {
		return res, fmt.Errorf("staging %s: %w", size.Format(sz), res.stage.firstErr)
	}
	slotErrs := timedEach(c, n, func(i int) error {
		var err error
		slots[i], err = to.slot(ctx, ids[i], i, sz)
		haveSlot[i] = err == nil
		return err
	})
	if slotErrs.errs > 0 {
		return res, fmt.Errorf("allocating receive slots: %w", slotErrs.firstErr)
	}
	writes := make([]time.Duration, n)
	res.send = timedEach(c, n, func(i int) error {
		r, err := t.p.From.Send(ctx, ids[i], slots[i])
		if err == nil {
			freed[i] = true
			writes[i] = time.Duration(r.Millis * float64(time.Millisecond))
		}
		return err
	})
	for i, ok := range freed {
		if ok {
			res.writes = append(res.writes, writes[i])
		}
	}
	if len(res.send.lat) == 0 && res.send.errs > 0 {
		return res, fmt.Errorf("every send failed; the first: %w", res.send.firstErr)
	}
	if verify {
		if err := t.verify(ctx, to, ids, slots, freed, sz); err != nil {
			return res, err
		}
	}
	return res, nil
}

// timedEach runs fn for each of n items on c goroutines and times each.
func timedEach(c, n int, fn func(i int) error) timed {
	lat := make([]time.Duration, n)
	errs := make([]error, n)
	start := time.Now()
	forEach(c, n, func(i int) {
		t0 := time.Now()
		errs[i] = fn(i)
		lat[i] = time.Since(t0)
	})
	out := timed{wall: time.Since(start)}
	for i, err := range errs {
		if err != nil {
			out.errs++
			if out.firstErr == nil {
				out.firstErr = err
			}
			continue
		}
		out.lat = append(out.lat, lat[i])
	}
	return out
}

func (t *transferRun) stage(ctx context.Context, id string, sz int64) error {
	shape := []int64{sz}
	if t.cfg.Stage == Upload {
		_, err := t.p.From.Stage(ctx, id, shape, "u8", bytes.NewReader(t.data[:sz]), sz)
		return err
	}
	_, err := t.p.From.StageInPlace(ctx, t.mapping, id, shape, "u8", func(dst []byte) error {
		copy(dst, t.data[:sz])
		return nil
	})
	return err
}

// verify checks the first delivered entry byte for byte at the receiver.
func (t *transferRun) verify(ctx context.Context, to receiver, ids []string, slots []api.SendRequest, sent []bool, sz int64) error {
	for i, ok := range sent {
		if !ok {
			continue
		}
		got, err := to.read(ctx, ids[i], slots[i], sz)
		if err != nil {
			return fmt.Errorf("reading back %s at the receiver: %w", ids[i], err)
		}
		if !bytes.Equal(got, t.data[:sz]) {
			return errors.New("the bytes that arrived differ from the staged ones: ferry delivered wrong data")
		}
		return nil
	}
	return nil
}
