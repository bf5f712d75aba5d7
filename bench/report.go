// Package bench measures ferry: transfer sweeps over block sizes and
// concurrency through the daemons (or over the bare transport), and the
// control plane's round trip. It reports rows the way etcd's report, nixlbench and
// perftest do (throughput, latency percentiles in µs, errors) as a table,
// JSON or CSV, and draws them with gonum/plot.
package bench

import (
	"math"
	"slices"
	"time"
)

// Summary is a latency distribution in microseconds.
type Summary struct {
	N      int     `json:"n"`
	Mean   float64 `json:"mean_us"`
	Stddev float64 `json:"stddev_us"`
	Min    float64 `json:"min_us"`
	P50    float64 `json:"p50_us"`
	P90    float64 `json:"p90_us"`
	P99    float64 `json:"p99_us"`
	P999   float64 `json:"p99_9_us"`
	Max    float64 `json:"max_us"`
}

// Summarize sorts samples in place and describes them.
func Summarize(samples []time.Duration) Summary {
	n := len(samples)
	if n == 0 {
		return Summary{}
	}
	slices.Sort(samples)
	var sum, sq float64
	for _, d := range samples {
		us := micros(d)
		sum += us
		sq += us * us
	}
	mean := sum / float64(n)
	return Summary{
		N: n, Mean: mean, Stddev: math.Sqrt(max(sq/float64(n)-mean*mean, 0)),
		Min: micros(samples[0]), Max: micros(samples[n-1]),
		P50: Percentile(samples, 50), P90: Percentile(samples, 90),
		P99: Percentile(samples, 99), P999: Percentile(samples, 99.9),
	}
}

// Percentile is the nearest-rank percentile p (0 < p ≤ 100) of sorted
// samples, in µs: the smallest sample that at least p % of them do not
// exceed, so p99.9 of 100 samples is their maximum, never an invented value.
func Percentile(sorted []time.Duration, p float64) float64 {
	if len(sorted) == 0 {
		return 0
	}
	// The epsilon keeps 99.9 % of 1000 at rank 999 despite float rounding.
	rank := int(math.Ceil(p/100*float64(len(sorted)) - 1e-9))
	return micros(sorted[min(max(rank, 1), len(sorted))-1])
}

func micros(d time.Duration) float64 { return float64(d) / float64(time.Microsecond) }
