package bench

import (
	"bytes"
	"context"
	"encoding/csv"
	"encoding/json"
	"errors"
	"strings"
	"sync/atomic"
	"testing"
	"time"
	"unicode/utf8"

	"github.com/ferry-project/ferry/api"
)

func us(v ...int) []time.Duration {
	out := make([]time.Duration, len(v))
	for i, x := range v {
		out[i] = time.Duration(x) * time.Microsecond
	}
	return out
}

func TestSummarizeNearestRank(t *testing.T) {
	// 1..1000 µs, shuffled: nearest-rank percentiles are exact samples.
	var s []time.Duration
	for i := 1000; i >= 1; i-- {
		s = append(s, time.Duration(i)*time.Microsecond)
	}
	got := Summarize(s)
	want := Summary{N: 1000, Min: 1, P50: 500, P90: 900, P99: 990, P999: 999, Max: 1000, Mean: 500.5}
	if got.N != want.N || got.Min != want.Min || got.P50 != want.P50 || got.P90 != want.P90 ||
		got.P99 != want.P99 || got.P999 != want.P999 || got.Max != want.Max || got.Mean != want.Mean {
		t.Fatalf("got %+v, want %+v", got, want)
	}
	if got.Stddev < 288 || got.Stddev > 289 {
		t.Fatalf("stddev %v, want about 288.7", got.Stddev)
	}
	// Few samples: p99.9 is the maximum, never a value between samples.
	if s := Summarize(us(10, 20, 30)); s.P999 != 30 || s.P50 != 20 {
		t.Fatalf("3 samples: %+v", s)
	}
	if s := Summarize(nil); s.N != 0 || s.Max != 0 {
		t.Fatalf("no samples: %+v", s)
	}
}

func TestRowRates(t *testing.T) {
	r := Row{Size: 1 << 20}
	r.finish(us(100, 200, 300, 400), 2*time.Second)
	if r.Iterations != 4 || r.OpsPerSec != 2 {
		t.Fatalf("%+v", r)
	}
	if want := 4.0 * (1 << 20) / 2 / 1e9; r.GBps != want || r.Gbitps != want*8 {
		t.Fatalf("GB/s %v Gbit/s %v, want %v", r.GBps, r.Gbitps, want)
	}
}

func testReport() Report {
	r := Row{Op: "send", Size: 4096, Concurrency: 4, Errors: 1, DaemonWrite: &Summary{P50: 12.5}, Stage: &Stage{Method: ZeroCopy, GBps: 1.5}}
	r.finish(us(100, 200, 300), time.Second)
	return Report{Command: "transfer", Date: time.Unix(0, 0).UTC(), Setup: map[string]string{"transport": "tcp"}, Rows: []Row{r}}
}

func TestWriteFormats(t *testing.T) {
	rep := testReport()
	var tbl, cs, js bytes.Buffer
	for f, b := range map[Format]*bytes.Buffer{Table: &tbl, CSV: &cs, JSON: &js} {
		if err := rep.Write(b, f); err != nil {
			t.Fatal(err)
		}
	}
	lines := strings.Split(strings.TrimRight(tbl.String(), "\n"), "\n")
	if len(lines) != 2 || !strings.Contains(lines[0], "p99.9µs") || !strings.Contains(lines[1], "4KiB") {
		t.Fatalf("table:\n%s", tbl.String())
	}
	if utf8.RuneCountInString(lines[0]) != utf8.RuneCountInString(lines[1]) {
		t.Fatalf("table columns are not aligned:\n%s", tbl.String())
	}
	recs, err := csv.NewReader(&cs).ReadAll()
	if err != nil || len(recs) != 2 {
		t.Fatalf("csv: %v %q", err, cs.String())
	}
	row := map[string]string{}
	for i, h := range recs[0] {
		row[h] = recs[1][i]
	}
	if row["size_bytes"] != "4096" || row["iterations"] != "3" || row["p50_us"] != "200.0" || row["errors"] != "1" ||
		row["daemon_write_p50_us"] != "12.5" || row["stage_gb_per_s"] != "1.500" {
		t.Fatalf("csv row %v", row)
	}
	var back Report
	if err := json.Unmarshal(js.Bytes(), &back); err != nil || len(back.Rows) != 1 || back.Rows[0].Latency.P50 != 200 || back.Rows[0].Stage.Method != ZeroCopy {
		t.Fatalf("json round trip: %v %+v", err, back)
	}
	if err := rep.Write(&tbl, "yaml"); err == nil {
		t.Fatal("an unknown format must fail")
	}
}

func TestCDFKeepsTheTail(t *testing.T) {
	var s []time.Duration
	for i := 1; i <= 10000; i++ {
		s = append(s, time.Duration(i)*time.Microsecond)
	}
	r := Row{}
	r.finish(s, time.Second)
	xys := cdf(r)
	if len(xys) > cdfPoints+1 {
		t.Fatalf("%d points, want at most %d", len(xys), cdfPoints+1)
	}
	last := xys[len(xys)-1]
	if last.X != 10000 || last.Y != 1 {
		t.Fatalf("the CDF must end at the maximum with 1, ends at %+v", last)
	}
	for i := 1; i < len(xys); i++ {
		if xys[i].X < xys[i-1].X || xys[i].Y < xys[i-1].Y {
			t.Fatalf("not monotonic at %d: %+v %+v", i, xys[i-1], xys[i])
		}
	}
}

func TestHammerIterationsAndErrors(t *testing.T) {
	var calls atomic.Int64
	m := hammer(context.Background(), 4, Limit{Iterations: 100}, func(int) error {
		if calls.Add(1)%10 == 0 {
			return errors.New("every tenth fails")
		}
		return nil
	})
	if calls.Load() != 100 || len(m.lat) != 90 || m.errs != 10 || m.firstErr == nil {
		t.Fatalf("calls %d, timed %d, errors %d (%v)", calls.Load(), len(m.lat), m.errs, m.firstErr)
	}
}

func TestForEachCoversEveryIndexOnce(t *testing.T) {
	seen := make([]atomic.Int32, 1000)
	forEach(7, len(seen), func(i int) { seen[i].Add(1) })
	for i := range seen {
		if seen[i].Load() != 1 {
			t.Fatalf("index %d ran %d times", i, seen[i].Load())
		}
	}
}

// TestNICRates: a send row's per-NIC figures are each rail's bytes over
// the point (the sender's status before and after), shown per NIC.
func TestNICRates(t *testing.T) {
	rail := func(dev string, b uint64) api.Rail {
		return api.Rail{NICChoice: api.NICChoice{Device: dev}, Bytes: b}
	}
	got := since([]api.Rail{rail("rxe0", 100), rail("rxe1", 50)}, []api.Rail{rail("rxe0", 100+3e9), rail("rxe1", 50+1e9)})
	if len(got) != 2 || got[0] != (NICRate{NIC: "rxe0", Bytes: 3e9}) || got[1] != (NICRate{NIC: "rxe1", Bytes: 1e9}) {
		t.Fatalf("since: %+v", got)
	}
	if since(nil, []api.Rail{rail("rxe0", 1)}) != nil {
		t.Fatal("rails that changed under a point must give no rates")
	}
	// A point's turns (A B A B beside Mooncake) add up, and its row
	// divides them by the time of its sends.
	var all roundResult
	for range 2 {
		all.add(roundResult{send: timed{wall: time.Second}, nics: got})
	}
	row := (&transferRun{}).row("send", 1<<20, 1, all)
	if len(row.NICs) != 2 || row.NICs[0].GBps != 3 || row.NICs[1].GBps != 1 {
		t.Fatalf("the row of two turns: per NIC %+v, want rxe0 3 GB/s and rxe1 1 GB/s", row.NICs)
	}
	r := Row{NICs: []NICRate{{NIC: "rxe0", GBps: 1.5}, {NIC: "rxe1", GBps: 0.5}}}
	if cell := colNICs.cell(r); cell != "rxe0=1.500,rxe1=0.500" {
		t.Fatalf("per-NIC cell %q", cell)
	}
}
