package bench

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"os"
	"time"

	"github.com/ferry-project/ferry/api"
)

// Control-plane operations ferrybench api times.
const (
	OpStatus    = "status"     // GET /v1/status
	OpStageSend = "stage_send" // PUT a tiny embedding, then send it to the local peer
)

// APIConfig is a control-plane run.
type APIConfig struct {
	Ops         []string
	Concurrency []int
	Limit
	Size     int64 // bytes of the stage_send embedding
	Progress io.Writer
}

// API times control calls at each client concurrency: status round trips
// on the sending daemon, and stage_send (upload a Size-byte embedding and
// send it into a slot on the peer) as one operation. stage_send's receive
// slots are allocated before and freed after each timed round.
func API(ctx context.Context, p Peers, cfg APIConfig) ([]Row, error) {
	prog := newProgress(cfg.Progress, len(cfg.Ops)*len(cfg.Concurrency))
	t := &transferRun{p: p, data: pattern(cfg.Size), prefix: fmt.Sprintf("fb%d-api-", os.Getpid())}
	var rows []Row
	for _, op := range cfg.Ops {
		for _, c := range cfg.Concurrency {
			var m timed
			var err error
			row := Row{Op: op, Concurrency: c}
			switch op {
			case OpStatus:
				status := func(int) error { _, err := p.From.Status(ctx); return err }
				if w := hammer(ctx, c, Limit{Iterations: max(cfg.Warmup, c)}, status); w.firstErr != nil {
					return rows, fmt.Errorf("status warm-up: %w", w.firstErr)
				}
				m = hammer(ctx, c, cfg.Limit, status)
			case OpStageSend:
				row.Size = cfg.Size
				m, err = t.stageSend(ctx, c, cfg.Limit)
			default:
				return rows, fmt.Errorf("api op %q: use %s or %s", op, OpStatus, OpStageSend)
			}
			if err != nil {
				return rows, fmt.Errorf("%s x%d: %w", op, c, err)
			}
			if ctx.Err() != nil {
				return rows, ctx.Err()
			}
			if m.firstErr != nil {
				fmt.Fprintf(os.Stderr, "ferrybench: %s x%d: %d call(s) failed; the first: %v\n", op, c, m.errs, m.firstErr)
			}
			row.Errors = m.errs
			row.finish(m.lat, m.wall)
			rows = append(rows, row)
			prog.point(fmt.Sprintf("%s x%d: %.0f req/s, p50 %.0fµs", op, c, row.OpsPerSec, row.Latency.P50))
		}
	}
	return rows, nil
}

// stageSend runs rounds of (upload + send) operations, c at a time, until
// lim is reached, after a warm-up round.
func (t *transferRun) stageSend(ctx context.Context, c int, lim Limit) (timed, error) {
	if _, err := t.stageSendRound(ctx, c, min(max(lim.Warmup, c), batchCap)); err != nil {
		return timed{}, fmt.Errorf("warm-up: %w", err)
	}
	var all timed
	for {
		n := batchCap
		if lim.Iterations > 0 {
			n = min(n, lim.Iterations-len(all.lat)-all.errs)
		}
		r, err := t.stageSendRound(ctx, c, n)
		if err != nil {
			return all, err
		}
		all.lat = append(all.lat, r.lat...)
		all.wall += r.wall
		all.errs += r.errs
		if all.firstErr == nil {
			all.firstErr = r.firstErr
		}
		if lim.Iterations > 0 && len(all.lat)+all.errs >= lim.Iterations ||
			lim.Iterations == 0 && all.wall >= lim.Duration {
			return all, nil
		}
	}
}

func (t *transferRun) stageSendRound(ctx context.Context, c, n int) (timed, error) {
	sz := int64(len(t.data))
	ids := make([]string, n)
	slots := make([]api.SendRequest, n)
	left := make([]bool, n) // staged, not sent
	for i := range ids {
		ids[i] = fmt.Sprintf("%s%d", t.prefix, t.seq.Add(1))
	}
	cleanup := func() {
		cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 30*time.Second)
		defer cancel()
		forEach(c, n, func(i int) {
			_ = t.p.To.FreeReceive(cctx, ids[i])
			if left[i] {
				_ = t.p.From.Delete(cctx, ids[i])
			}
		})
	}
	defer cleanup()
	if s := timedEach(c, n, func(i int) error {
		r, err := t.p.To.Receive(ctx, ids[i], sz)
		slots[i] = api.SendRequest{Session: r.Session, BufferAddress: r.BufferAddress, Key: r.Key, NBytes: r.NBytes}
		return err
	}); s.errs > 0 {
		return timed{}, fmt.Errorf("allocating receive slots: %w", s.firstErr)
	}
	return timedEach(c, n, func(i int) error {
		if _, err := t.p.From.Stage(ctx, ids[i], []int64{sz}, "u8", bytes.NewReader(t.data), sz); err != nil {
			return err
		}
		_, err := t.p.From.Send(ctx, ids[i], slots[i])
		left[i] = err != nil
		return err
	}), nil
}
