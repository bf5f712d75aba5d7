// Package size reads and writes byte counts the way operators type them:
// "64MiB", "8GiB", "1.5GB", "4096".
package size

import (
	"fmt"
	"math"
	"strconv"
	"strings"
)

var units = []struct {
	suffix string
	mult   float64
}{
	{"KiB", 1 << 10}, {"MiB", 1 << 20}, {"GiB", 1 << 30}, {"TiB", 1 << 40},
	{"KB", 1e3}, {"MB", 1e6}, {"GB", 1e9}, {"TB", 1e12},
	{"K", 1 << 10}, {"M", 1 << 20}, {"G", 1 << 30}, {"T", 1 << 40},
	{"B", 1},
}

// Parse reads a byte count with an optional unit (binary KiB/MiB/GiB/TiB,
// decimal KB/MB/GB/TB, or the bare K/M/G/T meaning binary).
func Parse(s string) (int64, error) {
	t := strings.TrimSpace(s)
	mult := 1.0
	for _, u := range units {
		if strings.HasSuffix(t, u.suffix) {
			mult = u.mult
			t = strings.TrimSpace(strings.TrimSuffix(t, u.suffix))
			break
		}
	}
	v, err := strconv.ParseFloat(t, 64)
	if err != nil || v < 0 || math.IsInf(v, 0) || math.IsNaN(v) {
		return 0, fmt.Errorf("size %q is not a byte count: write e.g. 4096, 64MiB or 8GiB", s)
	}
	b := v * mult
	if b >= math.MaxInt64 {
		return 0, fmt.Errorf("size %q is too large", s)
	}
	return int64(b), nil
}

// Format writes n with the largest binary unit that keeps it readable,
// with at most two decimals: 131072 -> "128KiB", 1610612736 -> "1.5GiB".
func Format(n int64) string {
	f := float64(n)
	for _, u := range []struct {
		s string
		m float64
	}{{"TiB", 1 << 40}, {"GiB", 1 << 30}, {"MiB", 1 << 20}, {"KiB", 1 << 10}} {
		if f >= u.m {
			v := strconv.FormatFloat(f/u.m, 'f', 2, 64)
			return strings.TrimSuffix(strings.TrimRight(v, "0"), ".") + u.s
		}
	}
	return strconv.FormatInt(n, 10) + "B"
}
