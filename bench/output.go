package bench

import (
	"encoding/csv"
	"encoding/json"
	"fmt"
	"io"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/ferry-project/ferry/internal/size"
)

// Row is one measured point: a block size at a concurrency, one kind of
// control call, or one registration size.
type Row struct {
	// Op is what was timed: send (the daemon's send of staged data into
	// a peer slot, as its client sees it), write (a bare transport write,
	// no daemon), status, stage_send, register, deregister or send_cpu
	// (ferry's own CPU per RDMA send, on the simulated NIC).
	Op          string `json:"op"`
	Size        int64  `json:"size_bytes,omitempty"`
	Concurrency int    `json:"concurrency,omitempty"`
	// Batch is the items each timed operation of a batch sweep moved;
	// the rates count items (OpsPerSec: items/s), the latency batches.
	Batch      int     `json:"batch,omitempty"`
	Iterations int     `json:"iterations"`
	Seconds    float64 `json:"seconds"` // the measured time the rates divide by
	GBps       float64 `json:"gb_per_s,omitempty"`
	Gbitps     float64 `json:"gbit_per_s,omitempty"`
	OpsPerSec  float64 `json:"ops_per_s"`
	Latency    Summary `json:"latency"`
	Errors     int     `json:"errors"`
	// DaemonWrite is the transport write as the sending daemon timed it
	// (its "ms"), without the control-socket round trip.
	DaemonWrite *Summary `json:"daemon_write,omitempty"`
	// Stage is the staging that fed the sends, timed apart from them.
	Stage *Stage `json:"stage,omitempty"`
	// Lanes and CPU are a send_cpu row's: the RC QPs the sends shared,
	// and their CPU per send.
	Lanes int  `json:"lanes,omitempty"`
	CPU   *CPU `json:"cpu,omitempty"`
	// NICs is a send row's throughput through each RDMA device of the
	// sending ferryd (its rails, --rdma-device): their bytes over the
	// send time; GBps is their sum.
	NICs []NICRate `json:"nics,omitempty"`

	samples []time.Duration // sorted, for the latency CDF
}

// Stage is the staging phase of a transfer point.
type Stage struct {
	Method  string  `json:"method"` // zero-copy or upload
	Seconds float64 `json:"seconds"`
	GBps    float64 `json:"gb_per_s"`
	Latency Summary `json:"latency"`
}

// Report is one ferrybench run.
type Report struct {
	Command string            `json:"command"`
	Date    time.Time         `json:"date"`
	Setup   map[string]string `json:"setup"`
	Rows    []Row             `json:"rows"`
}

// finish computes a row's rates and latency summary from its samples and
// the measured wall time.
func (r *Row) finish(samples []time.Duration, wall time.Duration) {
	r.Iterations = len(samples)
	r.Seconds = wall.Seconds()
	r.Latency = Summarize(samples)
	r.samples = samples
	if wall > 0 {
		ops := float64(len(samples) * max(r.Batch, 1))
		r.OpsPerSec = ops / wall.Seconds()
		if r.Size > 0 {
			r.GBps = float64(r.Size) * ops / wall.Seconds() / 1e9
			r.Gbitps = r.GBps * 8
		}
	}
}

// column is one column of the table and the CSV.
type column struct {
	head string // table heading
	csv  string // CSV heading
	cell func(Row) string
}

// NICRate is what one RDMA device of the sender carried in a point.
type NICRate struct {
	NIC   string  `json:"nic"`
	Bytes int64   `json:"bytes"`
	GBps  float64 `json:"gb_per_s"`
}

func num(v float64, prec int) string { return strconv.FormatFloat(v, 'f', prec, 64) }

// gbps is a GB/s figure: three decimals, or three significant digits
// below 0.01, so a slow point (tiny sends on a busy host) reads as what
// it was, not 0.000.
func gbps(v float64) string {
	if v != 0 && v < 0.01 {
		return strconv.FormatFloat(v, 'g', 3, 64)
	}
	return num(v, 3)
}

var (
	colOp   = column{"op", "op", func(r Row) string { return r.Op }}
	colSize = column{"size", "size_bytes", func(r Row) string {
		if r.Size == 0 {
			return "-"
		}
		return size.Format(r.Size)
	}}
	colConc   = column{"conc", "concurrency", func(r Row) string { return strconv.Itoa(r.Concurrency) }}
	colBatch  = column{"batch", "batch", func(r Row) string { return strconv.Itoa(r.Batch) }}
	colItems  = column{"items/s", "items_per_s", func(r Row) string { return num(r.OpsPerSec, 0) }}
	colIters  = column{"iters", "iterations", func(r Row) string { return strconv.Itoa(r.Iterations) }}
	colGBps   = column{"GB/s", "gb_per_s", func(r Row) string { return gbps(r.GBps) }}
	colGbit   = column{"Gbit/s", "gbit_per_s", func(r Row) string { return num(r.Gbitps, 2) }}
	colRate   = column{"req/s", "ops_per_s", func(r Row) string { return num(r.OpsPerSec, 0) }}
	colP50    = column{"p50µs", "p50_us", func(r Row) string { return num(r.Latency.P50, 1) }}
	colP90    = column{"p90µs", "p90_us", func(r Row) string { return num(r.Latency.P90, 1) }}
	colP99    = column{"p99µs", "p99_us", func(r Row) string { return num(r.Latency.P99, 1) }}
	colP999   = column{"p99.9µs", "p99_9_us", func(r Row) string { return num(r.Latency.P999, 1) }}
	colMax    = column{"maxµs", "max_us", func(r Row) string { return num(r.Latency.Max, 1) }}
	colErrors = column{"errors", "errors", func(r Row) string { return strconv.Itoa(r.Errors) }}
	colWrite  = column{"write p50µs", "daemon_write_p50_us", func(r Row) string {
		if r.DaemonWrite == nil {
			return "-"
		}
		return num(r.DaemonWrite.P50, 1)
	}}
	colNICs = column{"per-NIC GB/s", "nic_gb_per_s", func(r Row) string {
		if len(r.NICs) == 0 {
			return "-"
		}
		var parts []string
		for _, n := range r.NICs {
			parts = append(parts, n.NIC+"="+gbps(n.GBps))
		}
		return strings.Join(parts, ",")
	}}
	colStage = column{"stage GB/s", "stage_gb_per_s", func(r Row) string {
		if r.Stage == nil {
			return "-"
		}
		return gbps(r.Stage.GBps)
	}}
)

// The columns of send_cpu rows, whose CPU is set.
var (
	colMode    = column{"mode", "mode", func(r Row) string { return r.CPU.Mode }}
	colLanes   = column{"lanes", "lanes", func(r Row) string { return strconv.Itoa(r.Lanes) }}
	colCPU     = column{"cpu µs/send", "cpu_us_per_send", func(r Row) string { return num(r.CPU.PerSend, 2) }}
	colNIC     = column{"nic µs left out", "nic_us_left_out", func(r Row) string { return num(r.CPU.NICLeftOut, 2) }}
	colWithNIC = column{"with nic µs/send", "with_nic_us_per_send", func(r Row) string { return num(r.CPU.WithNIC, 2) }}
	colControl = column{"control/send", "control_per_send", func(r Row) string { return num(r.CPU.Control, 2) }}
	colPosts   = column{"posts/send", "posts_per_send", func(r Row) string { return num(r.CPU.Posts, 2) }}
)

// Column sets per command. The size column shows bytes in the CSV.
var (
	transferColumns = []column{colOp, colSize, colConc, colIters, colGBps, colGbit, colP50, colP90, colP99, colP999, colMax, colErrors, colWrite, colStage, colNICs}
	apiColumns      = []column{colOp, colSize, colConc, colIters, colRate, colP50, colP90, colP99, colP999, colMax, colErrors}
	batchColumns    = []column{colOp, colSize, colBatch, colIters, colItems, colGBps, colGbit, colP50, colP90, colP99, colMax}
	cpuColumns      = []column{colMode, colSize, colConc, colLanes, colIters, colCPU, colNIC, colWithNIC, colControl, colPosts}
)

// Format names an output format.
type Format string

const (
	Table Format = "table"
	JSON  Format = "json"
	CSV   Format = "csv"
)

// Write prints rep in format f, with the columns of its command.
func (rep Report) Write(w io.Writer, f Format) error {
	cols := columnsFor(rep.Command)
	switch f {
	case JSON:
		enc := json.NewEncoder(w)
		enc.SetIndent("", "  ")
		return enc.Encode(rep)
	case CSV:
		cw := csv.NewWriter(w)
		head := make([]string, len(cols))
		for i, c := range cols {
			head[i] = c.csv
		}
		_ = cw.Write(head)
		for _, r := range rep.Rows {
			rec := make([]string, len(cols))
			for i, c := range cols {
				rec[i] = c.cell(r)
				if c.csv == "size_bytes" {
					rec[i] = strconv.FormatInt(r.Size, 10)
				}
			}
			_ = cw.Write(rec)
		}
		cw.Flush()
		return cw.Error()
	case Table:
		tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
		head := make([]string, len(cols))
		for i, c := range cols {
			head[i] = c.head
		}
		fmt.Fprintln(tw, strings.Join(head, "\t")+"\t")
		for _, r := range rep.Rows {
			cells := make([]string, len(cols))
			for i, c := range cols {
				cells[i] = c.cell(r)
			}
			fmt.Fprintln(tw, strings.Join(cells, "\t")+"\t")
		}
		return tw.Flush()
	}
	return fmt.Errorf("output format %q: use table, json or csv", f)
}

func columnsFor(command string) []column {
	switch command {
	case "api":
		return apiColumns
	case "batch":
		return batchColumns
	case "rdma-cpu":
		return cpuColumns
	}
	return transferColumns
}

// WriteRatios prints, for each size and concurrency measured as both ops,
// the ratio of their throughputs (a over b), with both in MiB/s.
func WriteRatios(w io.Writer, rows []Row, a, b string) {
	type point struct {
		size     int64
		c, batch int
	}
	of := map[string]map[point]Row{a: {}, b: {}}
	var order []point
	for _, r := range rows {
		if m, ok := of[r.Op]; ok {
			p := point{r.Size, r.Concurrency, r.Batch}
			if _, seen := of[a][p]; !seen && r.Op == a {
				order = append(order, p)
			}
			m[p] = r
		}
	}
	for _, p := range order {
		ra, rb := of[a][p], of[b][p]
		if rb.GBps == 0 {
			continue
		}
		at := fmt.Sprintf("x%d", p.c)
		if p.batch > 0 {
			at = fmt.Sprintf("batch %d", p.batch)
		}
		fmt.Fprintf(w, "ratio %s/%s %s %s = %.2f (%s %.0f MiB/s, %s %.0f MiB/s)\n", a, b, size.Format(p.size), at,
			ra.GBps/rb.GBps, a, ra.GBps*1e9/(1<<20), b, rb.GBps*1e9/(1<<20))
	}
}
