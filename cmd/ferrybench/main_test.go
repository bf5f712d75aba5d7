package main

import (
	"bytes"
	"context"
	"encoding/csv"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/ferry-project/ferry/bench"
)

// ferryd is the binary TestMain built for the self-contained runs.
var ferryd string

func TestMain(m *testing.M) {
	// transfer --raw runs its own executable as the receiving process;
	// under test that executable is this test binary.
	if len(os.Args) > 1 && (os.Args[1] == "raw-sink" || os.Args[1] == "mooncake-peer") {
		main()
		return
	}
	dir, err := os.MkdirTemp("", "ferrybench-test-")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	ferryd = filepath.Join(dir, "ferryd")
	build := exec.Command("go", "build", "-o", ferryd, "../ferryd")
	build.Stdout, build.Stderr = os.Stderr, os.Stderr
	if err := build.Run(); err != nil {
		fmt.Fprintln(os.Stderr, "building ferryd:", err)
		os.Exit(1)
	}
	code := m.Run()
	os.RemoveAll(dir)
	os.Exit(code)
}

func runBench(t *testing.T, args ...string) (stdout, stderr string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	var o, e bytes.Buffer
	if err := run(ctx, args, &o, &e); err != nil {
		t.Fatalf("ferrybench %s: %v\nstderr:\n%s", strings.Join(args, " "), err, e.String())
	}
	return o.String(), e.String()
}

// transfer --mooncake sends each point into a Mooncake-protocol segment
// too, alternating with the ferry receiver, and prints the ratio.
func TestTransferMooncakeSideBySide(t *testing.T) {
	out, _ := runBench(t, "transfer", "--mooncake", "--ferryd", ferryd, "--arena-dir", t.TempDir(),
		"--sizes", "64KiB", "--concurrency", "2", "--iterations", "20", "--warmup", "2")
	for _, want := range []string{"\n           send  64KiB     2     20", "\n  send_mooncake  64KiB     2     20", "ratio send/send_mooncake 64KiB x2 = "} {
		if !strings.Contains(out, want) {
			t.Errorf("output lacks %q:\n%s", want, out)
		}
	}
}

// The smoke test that keeps the tool alive: one tiny self-contained
// transfer point through two real ferryd, as CSV, with a plot.
func TestTransferSmoke(t *testing.T) {
	plot := filepath.Join(t.TempDir(), "sweep.png")
	out, _ := runBench(t, "transfer", "--ferryd", ferryd, "--arena-dir", t.TempDir(),
		"--sizes", "4KiB", "--concurrency", "2", "--iterations", "20", "--warmup", "2", "--csv", "--plot", plot)
	recs, err := csv.NewReader(strings.NewReader(out)).ReadAll()
	if err != nil || len(recs) != 2 {
		t.Fatalf("want a header and one row of CSV, got %q (%v)", out, err)
	}
	row := map[string]string{}
	for i, h := range recs[0] {
		row[h] = recs[1][i]
	}
	if row["op"] != "send" || row["size_bytes"] != "4096" || row["concurrency"] != "2" || row["iterations"] != "20" || row["errors"] != "0" {
		t.Fatalf("unexpected row %v", row)
	}
	for _, col := range []string{"gb_per_s", "p50_us", "p99_9_us", "daemon_write_p50_us", "stage_gb_per_s"} {
		if v, err := strconv.ParseFloat(row[col], 64); err != nil || v <= 0 {
			t.Errorf("%s = %q, want a positive number", col, row[col])
		}
	}
	png, err := os.ReadFile(plot)
	if err != nil || !bytes.HasPrefix(png, []byte("\x89PNG")) {
		t.Fatalf("--plot did not write a PNG: %v", err)
	}
}

func TestRawSmoke(t *testing.T) {
	out, _ := runBench(t, "transfer", "--raw", "--arena-dir", t.TempDir(),
		"--sizes", "4KiB,64KiB", "--concurrency", "1,2", "--iterations", "10", "--json")
	var rep bench.Report
	if err := json.Unmarshal([]byte(out), &rep); err != nil {
		t.Fatalf("--json output does not parse: %v\n%s", err, out)
	}
	if len(rep.Rows) != 4 {
		t.Fatalf("want 4 rows (2 sizes x 2 concurrencies), got %d", len(rep.Rows))
	}
	for _, r := range rep.Rows {
		if r.Op != "write" || r.Iterations != 10 || r.Errors != 0 || r.GBps <= 0 {
			t.Errorf("unexpected raw row %+v", r)
		}
	}
}

// batch times the daemons' batches beside the bare transport writing the
// same items, and checks each size's first batch byte for byte.
func TestBatchSmoke(t *testing.T) {
	out, _ := runBench(t, "batch", "--ferryd", ferryd, "--arena-dir", t.TempDir(),
		"--item-size", "4KiB", "--batches", "1,8", "--iterations", "4", "--json")
	var rep bench.Report
	if err := json.Unmarshal([]byte(out), &rep); err != nil {
		t.Fatalf("--json output does not parse: %v\n%s", err, out)
	}
	want := map[string]int{}
	for _, r := range rep.Rows {
		if r.Iterations != 4 || r.Errors != 0 || r.GBps <= 0 || r.Size != 4096 {
			t.Errorf("unexpected row %+v", r)
		}
		want[fmt.Sprintf("%s/%d", r.Op, r.Batch)]++
	}
	for _, k := range []string{"batch/1", "batch/8", "write_batch/1", "write_batch/8"} {
		if want[k] != 1 {
			t.Errorf("rows: %v, want one %s", want, k)
		}
	}
}

func TestAPISmoke(t *testing.T) {
	out, _ := runBench(t, "api", "--ferryd", ferryd, "--arena-dir", t.TempDir(),
		"--concurrency", "2", "--iterations", "20", "--warmup", "2")
	for _, want := range []string{"# ferrybench api", "req/s", "status", "stage_send"} {
		if !strings.Contains(out, want) {
			t.Errorf("table lacks %q:\n%s", want, out)
		}
	}
}

// rdma-cpu runs both modes on the simulated NIC, with no daemon; the
// figures are timings and go unchecked, the counters are exact.
func TestRDMACPUSmoke(t *testing.T) {
	out, errOut := runBench(t, "rdma-cpu", "--sends", "50", "--concurrency", "4", "--lanes", "2", "--json")
	var rep bench.Report
	if err := json.Unmarshal([]byte(out), &rep); err != nil {
		t.Fatalf("--json output does not parse: %v\n%s", err, out)
	}
	if len(rep.Rows) != 2 {
		t.Fatalf("want a row per mode, got %d", len(rep.Rows))
	}
	for i, want := range []struct {
		mode    string
		control float64
	}{{"arena-rkey", 0}, {"grant", 2}} {
		r := rep.Rows[i]
		if r.Op != bench.OpSendCPU || r.CPU == nil || r.CPU.Mode != want.mode || r.CPU.Control != want.control || r.CPU.Posts <= 0 ||
			r.Iterations != 50 || r.Size != 64<<10 || r.Concurrency != 4 || r.Lanes != 2 {
			t.Errorf("row %d: %+v (cpu %+v), want mode %s with %v control messages per send", i, r, r.CPU, want.mode, want.control)
		}
	}
	for _, want := range []string{"rdma-cpu mode=arena-rkey nic=engine size=64KiB in_flight=4 lanes=2 sends=50 cpu_us_per_send=", "rdma-cpu mode=grant "} {
		if !strings.Contains(errOut, want) {
			t.Errorf("stderr lacks %q:\n%s", want, errOut)
		}
	}
	// The simulated NIC inline: both modes still deliver every send.
	out, _ = runBench(t, "rdma-cpu", "--sends", "50", "--concurrency", "4", "--lanes", "2", "--nic", "inline")
	for _, want := range []string{"rdma-cpu mode=arena-rkey nic=inline ", "rdma-cpu mode=grant nic=inline "} {
		if !strings.Contains(out, want) {
			t.Errorf("output lacks %q:\n%s", want, out)
		}
	}
}

func TestBadInput(t *testing.T) {
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"transfer", "--from", "/x.sock"}, "give both --from and --to"},
		{[]string{"transfer", "--sizes", "4KiB,lots"}, `"lots" is not a positive size`},
		{[]string{"transfer", "--concurrency", "0"}, "not a positive integer"},
		{[]string{"transfer", "--from", "/a", "--to", "/b", "--ferryd", "x"}, "--ferryd applies to the daemons ferrybench starts"},
		{[]string{"transfer", "--duration", "0s"}, "positive --duration or --iterations"},
		{[]string{"api", "--ops", "status,nap"}, `"nap" is not an operation`},
		{[]string{"api", "--ops", "status", "--from", "/nonexistent/a.sock", "--to", "/nonexistent/b.sock", "--iterations", "1"}, "cannot reach ferryd"},
		{[]string{"transfer", "--plot", "x.jpg"}, "name a .png or .svg"},
		{[]string{"frobnicate"}, "unknown command"},
		{[]string{"transfer", "--json", "--csv"}, "choose one"},
		{[]string{"rdma-cpu", "--modes", "direct,windy"}, `mode "windy"`},
		{[]string{"rdma-cpu", "--plot", "x.png"}, "nothing to draw"},
		{[]string{"rdma-cpu", "--nic", "fast"}, `simulated NIC "fast"`},
	} {
		var o, e bytes.Buffer
		err := run(context.Background(), tc.args, &o, &e)
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("ferrybench %s: want an error containing %q, got %v", strings.Join(tc.args, " "), tc.want, err)
		}
	}
}
