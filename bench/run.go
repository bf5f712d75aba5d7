package bench

import (
	"context"
	"fmt"
	"io"
	"sync"
	"sync/atomic"
	"time"
)

// forEach runs fn(i) for every i in [0, n) on c goroutines.
func forEach(c, n int, fn func(i int)) {
	var next atomic.Int64
	var wg sync.WaitGroup
	for range min(c, n) {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := int(next.Add(1) - 1); i < n; i = int(next.Add(1) - 1) {
				fn(i)
			}
		}()
	}
	wg.Wait()
}

// Limit is how long each point runs: Iterations operations, or for
// Duration when Iterations is 0.
type Limit struct {
	Iterations int
	Duration   time.Duration
	Warmup     int // operations before measuring
}

// timed is the outcome of a measured loop.
type timed struct {
	lat      []time.Duration // one per successful operation
	wall     time.Duration
	errs     int
	firstErr error
}

// hammer calls op on c goroutines until lim is reached and times each
// call. Failed calls are counted, not timed.
func hammer(ctx context.Context, c int, lim Limit, op func(worker int) error) timed {
	var (
		left  atomic.Int64
		errs  atomic.Int64
		once  sync.Once
		first error
		wg    sync.WaitGroup
	)
	left.Store(int64(lim.Iterations))
	per := make([][]time.Duration, c)
	start := time.Now()
	for w := range c {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for ctx.Err() == nil {
				if lim.Iterations > 0 {
					if left.Add(-1) < 0 {
						return
					}
				} else if time.Since(start) >= lim.Duration {
					return
				}
				t0 := time.Now()
				err := op(w)
				d := time.Since(t0)
				if err != nil {
					errs.Add(1)
					once.Do(func() { first = err })
					continue
				}
				per[w] = append(per[w], d)
			}
		}()
	}
	wg.Wait()
	out := timed{wall: time.Since(start), errs: int(errs.Load()), firstErr: first}
	for _, p := range per {
		out.lat = append(out.lat, p...)
	}
	if out.firstErr == nil && ctx.Err() != nil {
		out.firstErr = ctx.Err()
	}
	return out
}

// progress prints a line on stderr per finished point once a sweep has
// run for a few seconds.
type progress struct {
	w     io.Writer
	total int
	done  int
	start time.Time
}

func newProgress(w io.Writer, total int) *progress {
	return &progress{w: w, total: total, start: time.Now()}
}

func (p *progress) point(what string) {
	p.done++
	el := time.Since(p.start)
	if p.w == nil || el < 3*time.Second || p.total < 2 {
		return
	}
	left := time.Duration(float64(el) / float64(p.done) * float64(p.total-p.done))
	fmt.Fprintf(p.w, "ferrybench: [%d/%d] %s (%s elapsed, about %s left)\n",
		p.done, p.total, what, el.Round(time.Second), left.Round(time.Second))
}
