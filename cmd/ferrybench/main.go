// Command ferrybench measures ferry: transfer sweeps through two daemons
// or the bare transport, and the control plane. The logic is in package
// bench.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"path/filepath"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/ferry-project/ferry/bench"
	"github.com/ferry-project/ferry/client"
	"github.com/ferry-project/ferry/internal/size"
	"github.com/ferry-project/ferry/mooncake"
)

const usage = `ferrybench measures ferry.

Usage: ferrybench COMMAND [flags]

Commands:
  transfer   sweep block sizes x concurrency through two daemons' send path
             (--raw: the bare transport write, no daemon; --mooncake: also
             into a Mooncake-protocol segment, side by side, with ratios)
  batch      batch transfers (POST /v1/transfers) of N scattered items per call
             through two daemons, beside the bare transport writing the same
             items, side by side, with ratios (--python: also the Python client)
  api        control-plane round trips: status, and stage+send of a tiny embedding
  rdma-cpu   ferry's own CPU per RDMA send, both ends in this process on a
             simulated NIC (no device, no daemon), the NIC's own work left out

Daemons: --from SOCKET --to SOCKET measures two running ferryd; without them
ferrybench starts two ferryd on loopback (--ferryd PATH, default the one
beside ferrybench or on PATH) and stops them by PID when done.

Output: an aligned table, or --json / --csv; --plot FILE.png|svg draws it.
Run 'ferrybench COMMAND -h' for a command's flags.
`

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	err := run(ctx, os.Args[1:], os.Stdout, os.Stderr)
	stop()
	if errors.Is(err, flag.ErrHelp) {
		return // the usage was printed, as asked
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "ferrybench:", err)
		os.Exit(1)
	}
}

func run(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	if len(args) == 0 || args[0] == "-h" || args[0] == "--help" || args[0] == "help" {
		fmt.Fprint(stderr, usage)
		if len(args) == 0 {
			return errors.New("no command given")
		}
		return nil
	}
	cmd, ok := map[string]func(context.Context, []string, *out) error{
		"transfer": cmdTransfer,
		"batch":    cmdBatch,
		"api":      cmdAPI,
		"rdma-cpu": cmdRDMACPU,
		"raw-sink": cmdRawSink,

		"mooncake-peer": cmdMooncakePeer,
	}[args[0]]
	if !ok {
		return fmt.Errorf("unknown command %q: use transfer, batch, api or rdma-cpu (ferrybench -h)", args[0])
	}
	return cmd(ctx, args[1:], &out{stdout: stdout, stderr: stderr})
}

// out is where a command writes: results on stdout, progress on stderr.
type out struct {
	stdout, stderr io.Writer
	json, csv      bool
	plot           string
}

func (o *out) register(fs *flag.FlagSet) {
	fs.BoolVar(&o.json, "json", false, "print JSON (every figure, for machines)")
	fs.BoolVar(&o.csv, "csv", false, "print CSV")
	fs.StringVar(&o.plot, "plot", "", "also draw the results into `FILE`.png or FILE.svg")
}

// check runs before any measuring, so a bad flag costs no run.
func (o *out) check() error {
	if o.json && o.csv {
		return errors.New("--json and --csv: choose one")
	}
	if o.plot == "" {
		return nil
	}
	if ext := strings.ToLower(filepath.Ext(o.plot)); ext != ".png" && ext != ".svg" {
		return fmt.Errorf("--plot %s: name a .png or .svg file", o.plot)
	}
	if fi, err := os.Stat(filepath.Dir(o.plot)); err != nil || !fi.IsDir() {
		return fmt.Errorf("--plot %s: the directory %s does not exist", o.plot, filepath.Dir(o.plot))
	}
	return nil
}

func (o *out) report(rep bench.Report) error {
	f := bench.Table
	switch {
	case o.json:
		f = bench.JSON
	case o.csv:
		f = bench.CSV
	default:
		keys := make([]string, 0, len(rep.Setup))
		for k, v := range rep.Setup {
			keys = append(keys, k+"="+v)
		}
		slices.Sort(keys)
		fmt.Fprintf(o.stdout, "# ferrybench %s  %s  %s\n", rep.Command, rep.Date.Format(time.RFC3339), strings.Join(keys, " "))
	}
	if err := rep.Write(o.stdout, f); err != nil {
		return err
	}
	if o.plot != "" {
		if err := rep.Plot(o.plot); err != nil {
			return err
		}
		fmt.Fprintf(o.stderr, "ferrybench: plot written to %s\n", o.plot)
	}
	return nil
}

// reportRun reports rep, or on err what was measured before it, and
// returns err.
func (o *out) reportRun(rep bench.Report, err error) error {
	if err != nil {
		if len(rep.Rows) > 0 {
			_ = o.report(rep) // what was measured before the failure
		}
		return err
	}
	return o.report(rep)
}

// lines is where a command's summary lines go: after the table, or to
// stderr beside --json and --csv, which keep stdout parseable.
func (o *out) lines() io.Writer {
	if o.json || o.csv {
		return o.stderr
	}
	return o.stdout
}

// daemonFlags choose the daemons: running ones, or two of our own.
type daemonFlags struct {
	from, to          string
	ferryd            string
	transport, device string
	rdmaDevice        string
	arenaSize         string
	arenaDir          string
}

func (d *daemonFlags) register(fs *flag.FlagSet) {
	fs.StringVar(&d.from, "from", "", "control `socket` of a running sending ferryd (with --to)")
	fs.StringVar(&d.to, "to", "", "control `socket` of a running receiving ferryd (with --from)")
	fs.StringVar(&d.ferryd, "ferryd", "", "ferryd `binary` for self-contained runs (default: beside ferrybench, else on PATH)")
	fs.StringVar(&d.transport, "transport", "tcp", "data plane of the daemons ferrybench starts (ferryd --transport)")
	fs.StringVar(&d.device, "device", "cpu", "arena memory of the daemons ferrybench starts (ferryd --device)")
	fs.StringVar(&d.rdmaDevice, "rdma-device", "", "RDMA `devices` of the daemons ferrybench starts (ferryd --rdma-device; all: every one, sends from rdma_stripe_min up striped over them; default: ferryd's own choice)")
	fs.StringVar(&d.arenaSize, "arena-size", "auto", "arena `size` of each daemon ferrybench starts (auto: twice the largest size x concurrency, at least 64MiB)")
	fs.StringVar(&d.arenaDir, "arena-dir", "", "`dir` for the memory files of --raw runs and the batch sink (default /dev/shm: tmpfs keeps disk writeback out of the figures); the ferryd it starts keeps its arena in a memfd, in no file system")
}

// peers returns the two daemons to measure and the function that stops
// any ferrybench started. need is the arena the run needs per daemon.
func (d *daemonFlags) peers(ctx context.Context, fs *flag.FlagSet, need int64, maxConc int, setup map[string]string) (bench.Peers, func(), error) {
	if (d.from == "") != (d.to == "") {
		return bench.Peers{}, nil, errors.New("give both --from and --to (the sending and the receiving daemon's sockets), or neither for a self-contained run")
	}
	if d.from != "" {
		for _, name := range []string{"ferryd", "transport", "device", "rdma-device", "arena-size", "arena-dir"} {
			if flagGiven(fs, name) {
				return bench.Peers{}, nil, fmt.Errorf("--%s applies to the daemons ferrybench starts; with --from/--to the running daemons' own settings apply", name)
			}
		}
		setup["daemons"] = "running:" + d.from + "->" + d.to
		return bench.Peers{From: &client.Client{Socket: d.from}, To: &client.Client{Socket: d.to}}, func() {}, nil
	}
	ferryd, err := bench.FindFerryd(d.ferryd)
	if err != nil {
		return bench.Peers{}, nil, err
	}
	arenaSize := bench.ArenaFor(need)
	if d.arenaSize != "auto" {
		if arenaSize, err = size.Parse(d.arenaSize); err != nil {
			return bench.Peers{}, nil, fmt.Errorf("--arena-size: %w", err)
		}
	}
	conns := strconv.Itoa(max(maxConc, 8))
	args := []string{"--transport", d.transport, "--device", d.device, "--max-conns", conns}
	if d.rdmaDevice != "" {
		args = append(args, "--rdma-device", d.rdmaDevice)
	}
	pair, err := bench.StartPair(ctx, bench.DaemonConfig{Ferryd: ferryd, ArenaSize: arenaSize, Args: args})
	if err != nil {
		return bench.Peers{}, nil, err
	}
	stop := func() {
		if err := pair.Stop(); err != nil {
			fmt.Fprintln(os.Stderr, "ferrybench:", err)
		}
	}
	setup["daemons"] = fmt.Sprintf("self-contained(pids %d,%d)", pair.Sender.PID(), pair.Receiver.PID())
	setup["transport"] = d.transport
	setup["device"] = d.device
	if d.rdmaDevice != "" {
		setup["rdma_device"] = d.rdmaDevice
	}
	setup["arena"] = size.Format(arenaSize)
	setup["max_conns"] = conns
	return pair.Peers(), stop, nil
}

func (d *daemonFlags) arenaDirOrDefault() string {
	if d.arenaDir != "" {
		return d.arenaDir
	}
	return bench.DefaultArenaDir()
}

func flagGiven(fs *flag.FlagSet, name string) bool {
	given := false
	fs.Visit(func(f *flag.Flag) { given = given || f.Name == name })
	return given
}

// limitFlags are how long each point runs.
type limitFlags struct {
	duration   time.Duration
	iterations int
	warmup     int
}

func (l *limitFlags) register(fs *flag.FlagSet, duration time.Duration) {
	fs.DurationVar(&l.duration, "duration", duration, "measured time per point (ignored with --iterations)")
	fs.IntVar(&l.iterations, "iterations", 0, "operations per point instead of --duration")
	fs.IntVar(&l.warmup, "warmup", 16, "operations per point before measuring (at least the concurrency)")
}

func (l *limitFlags) limit(setup map[string]string) (bench.Limit, error) {
	if l.iterations < 0 || l.warmup < 0 {
		return bench.Limit{}, errors.New("--iterations and --warmup must not be negative")
	}
	if l.iterations == 0 && l.duration <= 0 {
		return bench.Limit{}, errors.New("give a positive --duration or --iterations")
	}
	if l.iterations > 0 {
		setup["per_point"] = fmt.Sprintf("%d iterations", l.iterations)
	} else {
		setup["per_point"] = l.duration.String()
	}
	return bench.Limit{Iterations: l.iterations, Duration: l.duration, Warmup: l.warmup}, nil
}

func parseSizes(s string) ([]int64, error) {
	var out []int64
	for _, f := range strings.Split(s, ",") {
		n, err := size.Parse(f)
		if err != nil || n <= 0 {
			return nil, fmt.Errorf("--sizes %q: %q is not a positive size (e.g. 4KiB,1MiB,64MiB)", s, f)
		}
		out = append(out, n)
	}
	return out, nil
}

func parseInts(flagName, s string) ([]int, error) {
	var out []int
	for _, f := range strings.Split(s, ",") {
		n, err := strconv.Atoi(strings.TrimSpace(f))
		if err != nil || n <= 0 {
			return nil, fmt.Errorf("--%s %q: %q is not a positive integer (e.g. 1,4,16)", flagName, s, f)
		}
		out = append(out, n)
	}
	return out, nil
}

const defaultSizes = "4KiB,16KiB,64KiB,256KiB,1MiB,4MiB,16MiB,64MiB"

func newFlagSet(name string, stderr io.Writer) *flag.FlagSet {
	fs := flag.NewFlagSet("ferrybench "+name, flag.ContinueOnError)
	fs.SetOutput(stderr)
	return fs
}

func parse(fs *flag.FlagSet, args []string, o *out) error {
	if err := fs.Parse(args); err != nil {
		return err
	}
	if fs.NArg() > 0 {
		return fmt.Errorf("unexpected arguments %q: %s takes flags only", fs.Args(), fs.Name())
	}
	if o != nil {
		return o.check()
	}
	return nil
}

func baseSetup() map[string]string {
	return map[string]string{"cpus": strconv.Itoa(runtime.NumCPU())}
}

func cmdTransfer(ctx context.Context, args []string, o *out) error {
	fs := newFlagSet("transfer", o.stderr)
	var d daemonFlags
	var l limitFlags
	d.register(fs)
	l.register(fs, time.Second)
	o.register(fs)
	sizes := fs.String("sizes", defaultSizes, "block `sizes` to sweep")
	concs := fs.String("concurrency", "1,4,16", "sends in flight, a `list`")
	stage := fs.String("stage", bench.ZeroCopy, "how the data is staged before the timed sends: zero-copy or upload")
	raw := fs.Bool("raw", false, "time bare tcp transport writes instead, from ferrybench into a second ferrybench process (no daemon, no control socket, no staging)")
	mc := fs.Bool("mooncake", false, "also send every point into a Mooncake-protocol segment (Mooncake's TCP transport, a ferrybench mooncake-peer process), alternating with the ferry receiver, and print the ratio ferry/mooncake")
	if err := parse(fs, args, o); err != nil {
		return err
	}
	sz, err := parseSizes(*sizes)
	if err != nil {
		return err
	}
	cs, err := parseInts("concurrency", *concs)
	if err != nil {
		return err
	}
	setup := baseSetup()
	lim, err := l.limit(setup)
	if err != nil {
		return err
	}
	need, maxConc := int64(0), 0
	for _, s := range sz {
		for _, c := range cs {
			need = max(need, s*int64(c))
			maxConc = max(maxConc, c)
		}
	}
	rep := bench.Report{Command: "transfer", Date: time.Now(), Setup: setup}
	if *raw {
		if d.from != "" || d.to != "" || d.transport != "tcp" {
			return errors.New("--raw times tcp writes from ferrybench into a receiving ferrybench process: it takes no --from/--to and only --transport tcp")
		}
		self, err := os.Executable()
		if err != nil {
			return err
		}
		sink, err := bench.StartRawSink(ctx, self, d.arenaDirOrDefault(), need)
		if err != nil {
			return err
		}
		setup["daemons"] = fmt.Sprintf("none(raw-sink pid %d)", sink.PID())
		setup["transport"] = "tcp"
		rep.Rows, err = bench.RawWrite(ctx, bench.RawConfig{Sizes: sz, Concurrency: cs, Limit: lim, Sink: sink.Addr, ArenaDir: d.arenaDirOrDefault(), Progress: o.stderr})
		if serr := sink.Stop(); err == nil {
			err = serr
		}
	} else {
		p, stop, perr := d.peers(ctx, fs, need, maxConc, setup)
		if perr != nil {
			return perr
		}
		setup["stage"] = *stage
		if *mc {
			var peer *bench.MooncakePeerProc
			if peer, err = startMooncakePeer(ctx, need); err != nil {
				stop()
				return err
			}
			defer peer.Stop()
			p.Mooncake = &peer.Target
			setup["mooncake_peer"] = fmt.Sprintf("pid %d segment %s tcp v2", peer.PID(), peer.Target.Segment)
		}
		rep.Rows, err = bench.Transfer(ctx, p, bench.TransferConfig{Sizes: sz, Concurrency: cs, Limit: lim, Stage: *stage, Progress: o.stderr})
		stop()
	}
	if err := o.reportRun(rep, err); err != nil {
		return err
	}
	if *mc {
		bench.WriteRatios(o.lines(), rep.Rows, "send", "send_mooncake")
	}
	return nil
}

func cmdBatch(ctx context.Context, args []string, o *out) error {
	fs := newFlagSet("batch", o.stderr)
	var d daemonFlags
	var l limitFlags
	d.register(fs)
	l.register(fs, 2*time.Second)
	o.register(fs)
	item := fs.String("item-size", "64KiB", "`bytes` of each item")
	batches := fs.String("batches", "1,16,256", "items per batch transfer, a `list`")
	python := fs.String("python", "", "also time the batches through the Python client: the `command` that runs bench/batch.py (e.g. \"python3 bench/batch.py\", with the ferry package importable)")
	if err := parse(fs, args, o); err != nil {
		return err
	}
	sz, err := size.Parse(*item)
	if err != nil || sz <= 0 {
		return fmt.Errorf("--item-size %q: give a positive size, e.g. 64KiB", *item)
	}
	bs, err := parseInts("batches", *batches)
	if err != nil {
		return err
	}
	if d.transport != "tcp" {
		return errors.New("batch compares the daemons with the bare tcp transport: only --transport tcp")
	}
	setup := baseSetup()
	lim, err := l.limit(setup)
	if err != nil {
		return err
	}
	maxItems := slices.Max(bs)
	need := sz * int64(maxItems)
	p, stop, err := d.peers(ctx, fs, 2*need, 16, setup)
	if err != nil {
		return err
	}
	defer stop()
	self, err := os.Executable()
	if err != nil {
		return err
	}
	sink, err := bench.StartRawSink(ctx, self, d.arenaDirOrDefault(), need)
	if err != nil {
		return err
	}
	defer sink.Stop()
	setup["raw_sink"] = fmt.Sprintf("pid %d", sink.PID())
	cfg := bench.BatchConfig{ItemSize: sz, Batches: bs, Limit: lim, Sink: sink.Addr, ArenaDir: d.arenaDirOrDefault(), Progress: o.stderr}
	if *python != "" {
		cfg.Python = strings.Fields(*python)
		setup["python"] = *python
	}
	rep := bench.Report{Command: "batch", Date: time.Now(), Setup: setup}
	rep.Rows, err = bench.Batch(ctx, p, cfg)
	if err := o.reportRun(rep, err); err != nil {
		return err
	}
	w := o.lines()
	bench.WriteRatios(w, rep.Rows, bench.OpBatch, bench.OpWriteBatch)
	if *python != "" {
		// Go's rate over Python's: Python's time per batch over Go's.
		bench.WriteRatios(w, rep.Rows, bench.OpBatch, bench.OpBatchPython)
	}
	return nil
}

// startMooncakePeer runs this ferrybench as a Mooncake segment big enough
// for a run that needs need bytes in flight.
func startMooncakePeer(ctx context.Context, need int64) (*bench.MooncakePeerProc, error) {
	self, err := os.Executable()
	if err != nil {
		return nil, err
	}
	return bench.StartMooncakePeer(ctx, self, bench.ArenaFor(need))
}

// cmdMooncakePeer serves as a Mooncake segment (Mooncake's TCP transport,
// protocol v2) with one buffer, until stopped.
func cmdMooncakePeer(ctx context.Context, args []string, o *out) error {
	fs := newFlagSet("mooncake-peer", o.stderr)
	n := fs.Int("bytes", 64<<20, "size of the registered buffer")
	if err := parse(fs, args, nil); err != nil {
		return err
	}
	p, err := mooncake.StartMemorySegment(mooncake.MemoryConfig{Buf: make([]byte, *n)})
	if err != nil {
		return err
	}
	defer p.Close()
	fmt.Fprintf(o.stdout, "%s%s %d %d\n", bench.MooncakePeerReady, p.Name(), p.Base(), *n)
	<-ctx.Done()
	return nil
}

func cmdAPI(ctx context.Context, args []string, o *out) error {
	fs := newFlagSet("api", o.stderr)
	var d daemonFlags
	var l limitFlags
	d.register(fs)
	l.register(fs, 2*time.Second)
	o.register(fs)
	ops := fs.String("ops", bench.OpStatus+","+bench.OpStageSend, "operations to time, a `list`: status, stage_send")
	concs := fs.String("concurrency", "1,4,16", "client calls in flight, a `list`")
	emb := fs.String("size", "128B", "`bytes` of the stage_send embedding")
	if err := parse(fs, args, o); err != nil {
		return err
	}
	for _, op := range strings.Split(*ops, ",") {
		if op != bench.OpStatus && op != bench.OpStageSend {
			return fmt.Errorf("--ops %q: %q is not an operation: use %s, %s or both", *ops, op, bench.OpStatus, bench.OpStageSend)
		}
	}
	cs, err := parseInts("concurrency", *concs)
	if err != nil {
		return err
	}
	n, err := size.Parse(*emb)
	if err != nil || n <= 0 {
		return fmt.Errorf("--size %q: give a positive size, e.g. 128B", *emb)
	}
	setup := baseSetup()
	lim, err := l.limit(setup)
	if err != nil {
		return err
	}
	maxConc := 0
	for _, c := range cs {
		maxConc = max(maxConc, c)
	}
	p, stop, err := d.peers(ctx, fs, 32<<20, maxConc, setup)
	if err != nil {
		return err
	}
	rep := bench.Report{Command: "api", Date: time.Now(), Setup: setup}
	rep.Rows, err = bench.API(ctx, p, bench.APIConfig{Ops: strings.Split(*ops, ","), Concurrency: cs, Limit: lim, Size: n, Progress: o.stderr})
	stop()
	if err != nil {
		return err
	}
	return o.report(rep)
}

// cmdRDMACPU measures ferry's own CPU per RDMA send (bench.SendCPU).
func cmdRDMACPU(ctx context.Context, args []string, o *out) error {
	fs := newFlagSet("rdma-cpu", o.stderr)
	o.register(fs)
	sz := fs.String("size", "64KiB", "`bytes` per send")
	concs := fs.String("concurrency", "16", "sends in flight, a `list`")
	lanes := fs.Int("lanes", 8, "lanes (RC QPs) the sends share, as ferryd's --max-conns")
	sends := fs.Int("sends", 3000, "sends measured per point, after a warm-up round")
	modes := fs.String("modes", bench.CPUDirect+","+bench.CPUGranted, "`list`: direct (authenticated peers, no control message per send), granted (a header and a grant per send)")
	nic := fs.String("nic", bench.NICEngine, "how the simulated NIC carries out work requests: engine (a goroutine per QP, woken per post: an upper bound of ferry's CPU) or inline (inside the post, completed at once, as soft-RoCE on loopback: a lower bound)")
	if err := parse(fs, args, o); err != nil {
		return err
	}
	if o.plot != "" {
		return errors.New("--plot: rdma-cpu has nothing to draw; use --json or --csv")
	}
	n, err := size.Parse(*sz)
	if err != nil || n <= 0 {
		return fmt.Errorf("--size %q: give a positive size, e.g. 64KiB", *sz)
	}
	cs, err := parseInts("concurrency", *concs)
	if err != nil {
		return err
	}
	if *lanes <= 0 || *sends <= 0 {
		return errors.New("--lanes and --sends must be positive")
	}
	setup := baseSetup()
	setup["nic"] = "simulated"
	rep := bench.Report{Command: "rdma-cpu", Date: time.Now(), Setup: setup}
	rep.Rows, err = bench.SendCPU(ctx, bench.SendCPUConfig{Size: n, Sends: *sends, Concurrency: cs, Lanes: *lanes, Modes: strings.Split(*modes, ","), NIC: *nic, Progress: o.stderr})
	if err := o.reportRun(rep, err); err != nil {
		return err
	}
	bench.WriteCPU(o.lines(), rep.Rows)
	return nil
}

// cmdRawSink is the receiving process of transfer --raw; it prints
// "ready ADDR" once it listens and serves until SIGTERM.
func cmdRawSink(ctx context.Context, args []string, o *out) error {
	fs := newFlagSet("raw-sink", o.stderr)
	dir := fs.String("arena-dir", bench.DefaultArenaDir(), "`dir` for the memory file")
	n := fs.Int64("bytes", 64<<20, "memory to receive into")
	if err := parse(fs, args, nil); err != nil {
		return err
	}
	return bench.RawSink(ctx, *dir, *n, func(addr string) { fmt.Fprintln(o.stdout, bench.RawSinkReady+addr) })
}
