// Package e2e runs real ferryd processes on loopback (and in network
// namespaces it creates) and drives them through the Go client and ferryctl.
package e2e

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/ferry-project/ferry/api"
	"github.com/ferry-project/ferry/client"
)

// bin holds the binaries TestMain built for this run.
var bin string

func TestMain(m *testing.M) {
	if spec := os.Getenv(floodEnv); spec != "" {
		os.Exit(floodControlMain(spec)) // a flood run as another user
	}
	// FERRY_BIN names binaries built beforehand, for hosts without Go (the
	// GPU bundle of make gpu-bundle, the soft-RoCE VM).
	if bin = os.Getenv("FERRY_BIN"); bin != "" {
		os.Exit(m.Run())
	}
	dir, err := os.MkdirTemp("", "ferry-e2e-bin-")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	bin = dir
	// Other users run ferryctl from here in the access tests.
	if err := os.Chmod(dir, 0o755); err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	args := []string{"build", "-o", dir + "/"}
	if os.Getenv("FERRY_E2E_RACE") == "1" {
		args = append(args, "-race")
	}
	build := exec.Command("go", append(args, "../../cmd/ferryd", "../../cmd/ferryctl", "../../cmd/ferrybench")...)
	build.Stdout, build.Stderr = os.Stderr, os.Stderr
	if err := build.Run(); err != nil {
		fmt.Fprintln(os.Stderr, "building ferryd, ferryctl and ferrybench:", err)
		os.Exit(1)
	}
	code := m.Run()
	os.RemoveAll(dir)
	os.Exit(code)
}

// logLines collects a daemon's JSON log lines and lets tests wait for one.
type logLines struct {
	mu      sync.Mutex
	lines   []map[string]any
	raw     []string
	changed chan struct{}
	done    chan struct{}
}

func newLogLines(r io.Reader) *logLines {
	l := &logLines{changed: make(chan struct{}), done: make(chan struct{})}
	go func() {
		defer close(l.done)
		sc := bufio.NewScanner(r)
		sc.Buffer(make([]byte, 64<<10), 1<<20)
		for sc.Scan() {
			var m map[string]any
			_ = json.Unmarshal(sc.Bytes(), &m)
			l.mu.Lock()
			l.lines = append(l.lines, m)
			l.raw = append(l.raw, sc.Text())
			close(l.changed)
			l.changed = make(chan struct{})
			l.mu.Unlock()
		}
	}()
	return l
}

// wait returns the first line that match accepts, failing the test if
// none comes within timeout.
func (l *logLines) wait(t *testing.T, timeout time.Duration, what string, match func(map[string]any) bool) map[string]any {
	t.Helper()
	deadline := time.After(timeout)
	seen := 0
	for {
		l.mu.Lock()
		for ; seen < len(l.lines); seen++ {
			if m := l.lines[seen]; m != nil && match(m) {
				l.mu.Unlock()
				return m
			}
		}
		ch := l.changed
		l.mu.Unlock()
		select {
		case <-ch:
		case <-l.done:
			l.mu.Lock()
			n := len(l.lines)
			l.mu.Unlock()
			if seen == n {
				t.Fatalf("ferryd exited before logging %s; its log:\n%s", what, l.dump())
			}
		case <-deadline:
			t.Fatalf("no log line %s within %s; log so far:\n%s", what, timeout, l.dump())
		}
	}
}

func (l *logLines) dump() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return strings.Join(l.raw, "\n")
}

// msg matches a log line by its message.
func msg(m string) func(map[string]any) bool {
	return func(line map[string]any) bool { return line["message"] == m }
}

// snapshot returns the lines logged so far, in order.
func (l *logLines) snapshot() []map[string]any {
	l.mu.Lock()
	defer l.mu.Unlock()
	return append([]map[string]any(nil), l.lines...)
}

// daemon is one ferryd process.
type daemon struct {
	t         *testing.T
	cmd       *exec.Cmd
	socket    string
	advertise string
	listen    string
	log       *logLines
	c         *client.Client
	exited    chan struct{}
	exitErr   error // cmd.Wait's result, once exited is closed
}

// launch is how a test starts ferryd, beyond its flags.
type launch struct {
	prefix []string   // command prefix, e.g. "ip netns exec ns"
	env    []string   // added to the environment, KEY=VALUE
	files  []*os.File // passed as fds 3, 4, … (socket activation)
	bare   bool       // pass only --socket: the test gives the rest
	ferryd string     // the binary to run; default: the one TestMain built
}

// startDaemon runs ferryd with a socket in dir and the given extra flags
// (the defaults put its peer port on 127.0.0.1:0), waits for its "ready"
// line, and stops it by PID at the end of the test.
func startDaemon(t *testing.T, dir, name string, extra ...string) *daemon {
	t.Helper()
	return startDaemonWith(t, launch{}, dir, name, extra...)
}

// startDaemonIn is startDaemon with a command prefix (e.g. "ip netns exec ns").
func startDaemonIn(t *testing.T, prefix []string, dir, name string, extra ...string) *daemon {
	t.Helper()
	return startDaemonWith(t, launch{prefix: prefix}, dir, name, extra...)
}

// startDaemonWith is startDaemon started as l says. The daemon reads no
// configuration file unless the test passes --config.
func startDaemonWith(t *testing.T, l launch, dir, name string, extra ...string) *daemon {
	t.Helper()
	sock := filepath.Join(dir, name+".sock")
	args := []string{"--socket", sock}
	if !l.bare {
		// Host memory and TCP unless a test asks otherwise (a later flag
		// wins), so the tests mean the same on a host with a GPU or an
		// RDMA NIC.
		args = append(args, "--listen", "127.0.0.1:0", "--arena-size", "64MiB", "--log-level", "debug",
			"--device", "cpu", "--transport", "tcp")
	}
	args = append(args, extra...)
	if l.ferryd == "" {
		l.ferryd = filepath.Join(bin, "ferryd")
	}
	argv := append(append(append([]string{}, l.prefix...), l.ferryd), args...)
	cmd := exec.Command(argv[0], argv[1:]...)
	cmd.Env = append(append(os.Environ(), "FERRY_CONFIG="+os.DevNull), l.env...)
	cmd.ExtraFiles = l.files
	// A pipe of our own rather than StderrPipe: Wait closes that one when
	// the process exits, dropping its last lines unread.
	stderr, w, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	cmd.Stderr = w
	err = cmd.Start()
	w.Close()
	if err != nil {
		stderr.Close()
		t.Fatal(err)
	}
	d := &daemon{t: t, cmd: cmd, socket: sock, log: newLogLines(stderr), exited: make(chan struct{})}
	go func() { <-d.log.done; stderr.Close() }()
	go func() { d.exitErr = cmd.Wait(); close(d.exited) }()
	t.Cleanup(d.stop)
	// A deadline against a hang, not a speed bound: under TCG on a busy
	// host ferryd's start (devices, the arena's registration) took >20 s.
	ready := d.log.wait(t, time.Minute, `"ready"`, msg("ready"))
	d.advertise, _ = ready["advertise"].(string)
	d.listen, _ = ready["listen"].(string)
	d.c = &client.Client{Socket: sock}
	return d
}

// stop ends the daemon by PID: SIGTERM, then SIGKILL if it outstays 10 s.
func (d *daemon) stop() {
	select {
	case <-d.exited:
		return
	default:
	}
	_ = d.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-d.exited:
	case <-time.After(10 * time.Second):
		d.t.Errorf("ferryd pid %d ignored SIGTERM for 10s; killing it", d.cmd.Process.Pid)
		_ = d.cmd.Process.Kill()
		<-d.exited
	}
}

// signal sends sig to the daemon's PID.
func (d *daemon) signal(sig syscall.Signal) {
	d.t.Helper()
	if err := d.cmd.Process.Signal(sig); err != nil {
		d.t.Fatalf("signalling ferryd pid %d: %v", d.cmd.Process.Pid, err)
	}
}

// waitExit waits for the daemon to exit on its own and returns its exit
// code, failing the test if it outstays timeout.
func (d *daemon) waitExit(t *testing.T, timeout time.Duration) int {
	t.Helper()
	select {
	case <-d.exited:
	case <-time.After(timeout):
		t.Fatalf("ferryd pid %d still running after %s; log:\n%s", d.cmd.Process.Pid, timeout, d.log.dump())
	}
	<-d.log.done // its last lines are in
	code := exitCode(d.exitErr)
	if code < 0 {
		t.Fatalf("waiting for ferryd: %v", d.exitErr)
	}
	return code
}

// exitCode is the exit status a command's error carries: 0 for none, -1
// when it did not exit (it never started, or a signal ended it).
func exitCode(err error) int {
	if err == nil {
		return 0
	}
	var ee *exec.ExitError
	if errors.As(err, &ee) {
		return ee.ExitCode()
	}
	return -1
}

// pause stops the daemon's process (SIGSTOP): a peer that takes no data.
// It resumes at the end of the test at the latest.
func (d *daemon) pause(t *testing.T) {
	t.Helper()
	d.signal(syscall.SIGSTOP)
	t.Cleanup(func() { _ = d.cmd.Process.Signal(syscall.SIGCONT) })
	// kill(2) returns before the process has stopped; a test that relies on
	// the stop waits for the kernel to report it (WNOWAIT leaves the state
	// for nobody else to reap: the exit is still Wait's).
	var info unix.Siginfo
	if err := unix.Waitid(unix.P_PID, d.cmd.Process.Pid, &info, unix.WSTOPPED|unix.WNOWAIT, nil); err != nil {
		t.Fatalf("waiting for ferryd pid %d to stop: %v", d.cmd.Process.Pid, err)
	}
}

// kill ends the daemon with SIGKILL, as a crash would.
func (d *daemon) kill() {
	_ = d.cmd.Process.Kill()
	<-d.exited
}

func ctxT(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	t.Cleanup(cancel)
	return ctx
}

// alive checks that the daemon still answers status.
func (d *daemon) alive(t *testing.T) {
	t.Helper()
	if _, err := d.c.Status(ctxT(t)); err != nil {
		t.Fatalf("ferryd stopped answering status: %v\nlog:\n%s", err, d.log.dump())
	}
}

// metrics reads the daemon's /metrics, over a connection of its own that
// is closed after the answer: each sample's value by its name and labels
// as written, e.g. `ferry_transfers_total{outcome="ok",transport="tcp"}`.
func (d *daemon) metrics(t *testing.T) map[string]float64 {
	t.Helper()
	hc := &http.Client{Transport: &http.Transport{DialContext: client.UnixDialer(d.socket), DisableKeepAlives: true}}
	resp, err := hc.Get("http://ferryd/metrics")
	if err != nil {
		t.Fatalf("reading ferryd's metrics: %v", err)
	}
	defer resp.Body.Close()
	got := map[string]float64{}
	sc := bufio.NewScanner(resp.Body)
	for sc.Scan() {
		name, value, ok := strings.Cut(sc.Text(), " ")
		if ok && !strings.HasPrefix(name, "#") {
			got[name], _ = strconv.ParseFloat(value, 64)
		}
	}
	if err := sc.Err(); err != nil {
		t.Fatalf("reading ferryd's metrics: %v", err)
	}
	return got
}

// metricSum adds up the samples of the metric called name whose labels
// include every one of labels (each as written, e.g. `outcome="ok"`).
func metricSum(m map[string]float64, name string, labels ...string) float64 {
	sum := 0.0
	for k, v := range m {
		n, rest, _ := strings.Cut(k, "{")
		if n != name {
			continue
		}
		all := true
		for _, l := range labels {
			all = all && strings.Contains(rest, l)
		}
		if all {
			sum += v
		}
	}
	return sum
}

// resources reads the daemon's goroutine and open-file counts from its
// /metrics (the Go and process collectors).
func (d *daemon) resources(t *testing.T) (goroutines, fds int) {
	t.Helper()
	m := d.metrics(t)
	g, okG := m["go_goroutines"]
	f, okF := m["process_open_fds"]
	if !okG || !okF {
		t.Fatalf("ferryd's metrics lack go_goroutines or process_open_fds")
	}
	return int(g), int(f)
}

// holdsNothing checks that the daemon holds no staged entries, receive
// slots or arena bytes, as after every transfer was sent, verified and
// freed, and returns its status.
func (d *daemon) holdsNothing(t *testing.T) api.Status {
	t.Helper()
	st, err := d.c.Status(ctxT(t))
	if err != nil {
		t.Fatal(err)
	}
	if st.Memory.Used != 0 || st.Staged != 0 || st.Receives != 0 {
		t.Errorf("ferryd pid %d keeps %d arena bytes, %d staged entries and %d receive slots after every transfer was accounted for",
			d.cmd.Process.Pid, st.Memory.Used, st.Staged, st.Receives)
	}
	return st
}

// idleResources is the daemon's goroutine and open-file counts once the
// test's client connections are closed and their goroutines have ended:
// the readings have stopped falling.
func (d *daemon) idleResources(t *testing.T) (goroutines, fds int) {
	t.Helper()
	d.c.CloseIdleConnections()
	deadline := time.Now().Add(10 * time.Second)
	tick := time.NewTicker(10 * time.Millisecond) // a poll: there is no event to wait on
	defer tick.Stop()
	g, f := d.resources(t)
	for same := 0; same < 3 && time.Now().Before(deadline); {
		<-tick.C
		g2, f2 := d.resources(t)
		if g2 < g || f2 < f {
			same = 0
		} else {
			same++
		}
		g, f = min(g, g2), min(f, f2)
	}
	return g, f
}

// noLeaks waits up to 10 s for the daemon's goroutines and open files to
// come back to at most a baseline from idleResources, and returns them.
func (d *daemon) noLeaks(t *testing.T, goroutines, fds int) (int, int) {
	t.Helper()
	d.c.CloseIdleConnections()
	deadline := time.Now().Add(10 * time.Second)
	tick := time.NewTicker(10 * time.Millisecond)
	defer tick.Stop()
	for ; ; <-tick.C {
		g, f := d.resources(t)
		if g <= goroutines && f <= fds {
			return g, f
		}
		if time.Now().After(deadline) {
			t.Fatalf("ferryd pid %d holds %d goroutines and %d open files, against %d and %d before: a leak; its files: %s",
				d.cmd.Process.Pid, g, f, goroutines, fds, openFiles(d.cmd.Process.Pid))
		}
	}
}

// openFiles lists what a process's file descriptors point at.
func openFiles(pid int) string {
	dir := fmt.Sprintf("/proc/%d/fd", pid)
	ents, err := os.ReadDir(dir)
	if err != nil {
		return err.Error()
	}
	var out []string
	for _, e := range ents {
		target, _ := os.Readlink(filepath.Join(dir, e.Name()))
		out = append(out, e.Name()+"->"+target)
	}
	return strings.Join(out, " ")
}

// writeInPlace is a client's zero-copy staging: it writes data into a
// reserved slice through its own mapping of d's arena.
func writeInPlace(t *testing.T, d *daemon, sl api.Slice, data []byte) {
	t.Helper()
	m, err := d.c.MapArena(ctxT(t))
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	dst, err := m.Slice(sl)
	if err != nil {
		t.Fatal(err)
	}
	copy(dst, data)
}

// readInPlace is a receiving client reading an arrived slot through its
// own mapping of d's arena.
func readInPlace(t *testing.T, d *daemon, info api.Receive) []byte {
	t.Helper()
	m, err := d.c.MapArena(ctxT(t))
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	got, err := m.Bytes(info.Offset, info.Received)
	if err != nil {
		t.Fatal(err)
	}
	return bytes.Clone(got)
}
