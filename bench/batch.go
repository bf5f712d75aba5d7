package bench

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"os/exec"
	"strconv"
	"sync/atomic"
	"time"

	"github.com/ferry-project/ferry/api"
	"github.com/ferry-project/ferry/internal/size"
	"github.com/ferry-project/ferry/transport"
	"github.com/ferry-project/ferry/transport/peer"
	"github.com/ferry-project/ferry/transport/tcp"
)

// BatchConfig is a sweep of batch transfers: each timed operation moves
// Batch items of ItemSize, scattered so that none merge, and ends when
// the last has arrived.
type BatchConfig struct {
	ItemSize int64
	Batches  []int
	Limit
	Sink     string // host:port of a RawSink, for the bare transport's turn
	ArenaDir string
	// Python, when set, is a command (argv) that times the same batches
	// through the Python client (bench/batch.py); its turns alternate
	// with the Go client's.
	Python   []string
	Progress io.Writer
}

// rawInFlight is how many writes of a batch the bare transport keeps in
// flight: as many as ferryd's batches do (daemon.batchWindow).
const rawInFlight = 16

// Ops of a batch sweep.
const (
	OpBatch       = "batch"        // POST /v1/transfers + wait, through two daemons (Go client)
	OpBatchPython = "batch_python" // the same through the Python client
	OpWriteBatch  = "write_batch"  // the bare tcp transport's writes, rawInFlight at a time
)

// Batch sweeps batch sizes: per size, the daemons' batch transfer, the
// bare transport writing the same pieces and, with cfg.Python, the
// Python client, taking turns twice each (A B A B) so drift on a noisy
// machine falls on all of them. The first daemon batch of each size is
// checked byte for byte at the receiver.
func Batch(ctx context.Context, p Peers, cfg BatchConfig) ([]Row, error) {
	maxItems := 0
	for _, n := range cfg.Batches {
		maxItems = max(maxItems, n)
	}
	data := pattern(cfg.ItemSize * int64(maxItems))
	src := fmt.Sprintf("fbb%d-src", os.Getpid())
	if _, err := p.From.Stage(ctx, src, []int64{int64(len(data))}, "u8", bytes.NewReader(data), int64(len(data))); err != nil {
		return nil, fmt.Errorf("staging the batches' source: %w", err)
	}
	defer p.From.Delete(context.WithoutCancel(ctx), src)

	raw, err := newRawWriter(ctx, cfg, data)
	if err != nil {
		return nil, err
	}
	defer raw.close()

	lim := cfg.Limit
	lim.Duration /= 2
	lim.Iterations = (lim.Iterations + 1) / 2
	prog := newProgress(cfg.Progress, len(cfg.Batches))
	var rows []Row
	for _, n := range cfg.Batches {
		items := scattered(n, cfg.ItemSize)
		turns := []struct {
			op  string
			run func(verify bool) (timed, error)
		}{
			{OpBatch, func(verify bool) (timed, error) {
				return daemonBatches(ctx, p, src, items, n, cfg.ItemSize, lim, data, verify)
			}},
			{OpWriteBatch, func(bool) (timed, error) { return raw.batches(ctx, n, lim) }},
		}
		if len(cfg.Python) > 0 {
			turns = append(turns, struct {
				op  string
				run func(verify bool) (timed, error)
			}{OpBatchPython, func(bool) (timed, error) { return pythonBatches(ctx, cfg, p, src, n, lim) }})
		}
		all := make([]timed, len(turns))
		for round := 0; round < 2; round++ {
			for i, t := range turns {
				m, err := t.run(round == 0)
				if err != nil {
					return rows, fmt.Errorf("%s, %d items of %s: %w", t.op, n, size.Format(cfg.ItemSize), err)
				}
				all[i].lat = append(all[i].lat, m.lat...)
				all[i].wall += m.wall
			}
		}
		var line string
		for i, t := range turns {
			row := Row{Op: t.op, Size: cfg.ItemSize, Concurrency: 1, Batch: n}
			row.finish(all[i].lat, all[i].wall)
			rows = append(rows, row)
			line += fmt.Sprintf(" %s %.0f items/s p50 %.0fµs;", t.op, row.OpsPerSec, row.Latency.P50)
		}
		prog.point(fmt.Sprintf("batch %d x %s:%s", n, size.Format(cfg.ItemSize), line))
	}
	return rows, nil
}

// scattered is n items of sz from one source into one slot, laid out in
// reverse so that no two are adjacent at both ends (none merge).
func scattered(n int, sz int64) [][]int64 {
	items := make([][]int64, n)
	for i := range items {
		items[i] = []int64{0, int64(i) * sz, 0, int64(n-1-i) * sz, sz}
	}
	return items
}

// daemonBatches times batch transfers through the daemons until lim: per
// batch a receive slot is made and freed untimed; the transfer and its
// wait are timed.
func daemonBatches(ctx context.Context, p Peers, src string, items [][]int64, n int, sz int64, lim Limit, data []byte, verify bool) (timed, error) {
	var out timed
	req := api.TransferRequest{Sources: []api.TransferSource{{ReqID: src}}, Items: items, KeepSources: true}
	for i := 0; ctx.Err() == nil && (lim.Iterations > 0 && i < lim.Iterations || lim.Iterations == 0 && out.wall < lim.Duration); i++ {
		id := fmt.Sprintf("fbb%d-%d-%d", os.Getpid(), n, i)
		slot, err := p.To.Receive(ctx, id, int64(n)*sz)
		if err != nil {
			return out, err
		}
		req.Destinations = []api.ReceiveSlot{slot}
		t0 := time.Now()
		t, err := p.From.Transfer(ctx, req, time.Minute)
		took := time.Since(t0)
		if err == nil && (t.State != api.TransferDone || t.Writes != n) {
			err = fmt.Errorf("transfer %s ended %s with %d writes for %d scattered items: %+v", t.ID, t.State, t.Writes, n, t.Error)
		}
		if err == nil && verify && i == 0 {
			err = verifyScattered(ctx, p, id, items, data)
		}
		if ferr := p.To.FreeReceive(ctx, id); err == nil {
			err = ferr
		}
		if err != nil {
			return out, err
		}
		out.lat = append(out.lat, took)
		out.wall += took
	}
	return out, ctx.Err()
}

// verifyScattered checks that the slot holds the source's pieces where
// the items put them.
func verifyScattered(ctx context.Context, p Peers, id string, items [][]int64, data []byte) error {
	got, err := p.To.Wait(ctx, id, 10*time.Second)
	if err != nil {
		return err
	}
	for i, it := range items {
		so, do, n := it[api.ItemSourceOffset], it[api.ItemDestinationOffset], it[api.ItemNBytes]
		if !bytes.Equal(got[do:do+n], data[so:so+n]) {
			return fmt.Errorf("verify: item %d did not arrive where it was sent", i)
		}
	}
	return nil
}

// rawWriter is the bare transport's side of a batch sweep: a tcp session
// from this process to the RawSink.
type rawWriter struct {
	tr   transport.Transport
	sess transport.Session
	src  []byte
	sz   int64 // one item
}

func newRawWriter(ctx context.Context, cfg BatchConfig, data []byte) (*rawWriter, error) {
	tr, err := tcp.Listen(peer.Config{Addr: "127.0.0.1:0", Sink: rawSink{}, MaxConnsPerPeer: rawInFlight, SendBuffer: peer.DefaultSendBuffer})
	if err != nil {
		return nil, err
	}
	sess, err := tr.Dial(ctx, cfg.Sink)
	if err != nil {
		tr.Close()
		return nil, err
	}
	return &rawWriter{tr: tr, sess: sess, src: data, sz: cfg.ItemSize}, nil
}

func (r *rawWriter) close() {
	r.sess.Close()
	r.tr.Close()
}

// batches times batches of n writes, rawInFlight at a time, into the
// sink's memory laid out as the daemons' batches lay theirs.
func (r *rawWriter) batches(ctx context.Context, n int, lim Limit) (timed, error) {
	var out timed
	for i := 0; ctx.Err() == nil && (lim.Iterations > 0 && i < lim.Iterations || lim.Iterations == 0 && out.wall < lim.Duration); i++ {
		var first atomic.Pointer[error]
		t0 := time.Now()
		forEach(rawInFlight, n, func(k int) {
			off := int64(k) * r.sz
			if _, err := r.sess.Write(ctx, transport.Write{Src: r.src[off : off+r.sz], Remote: uint64(int64(n-1-k) * r.sz), Key: rawKey}); err != nil {
				first.CompareAndSwap(nil, &err)
			}
		})
		took := time.Since(t0)
		if err := first.Load(); err != nil {
			return out, *err
		}
		out.lat = append(out.lat, took)
		out.wall += took
	}
	return out, ctx.Err()
}

// pythonBatches runs the Python client's timing of the same batches
// (bench/batch.py) against the same daemons, and reads its samples.
func pythonBatches(ctx context.Context, cfg BatchConfig, p Peers, src string, n int, lim Limit) (timed, error) {
	args := append(append([]string{}, cfg.Python[1:]...),
		"--from", p.From.Socket, "--to", p.To.Socket, "--source", src,
		"--item-size", strconv.FormatInt(cfg.ItemSize, 10), "--batch", strconv.Itoa(n))
	if lim.Iterations > 0 {
		args = append(args, "--iterations", strconv.Itoa(lim.Iterations))
	} else {
		args = append(args, "--seconds", strconv.FormatFloat(lim.Duration.Seconds(), 'f', 3, 64))
	}
	cmd := exec.CommandContext(ctx, cfg.Python[0], args...)
	cmd.Stderr = os.Stderr
	outb, err := cmd.Output()
	if err != nil {
		return timed{}, fmt.Errorf("%s: %w", cfg.Python, err)
	}
	var res struct {
		SamplesUS []float64 `json:"samples_us"`
	}
	if err := json.Unmarshal(outb, &res); err != nil {
		return timed{}, fmt.Errorf("%s printed %q, not its samples: %w", cfg.Python, outb, err)
	}
	var out timed
	for _, us := range res.SamplesUS {
		d := time.Duration(us * float64(time.Microsecond))
		out.lat = append(out.lat, d)
		out.wall += d
	}
	return out, nil
}
