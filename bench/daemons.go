package bench

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/ferry-project/ferry/client"
	"github.com/ferry-project/ferry/internal/size"
)

// DaemonConfig is how ferrybench starts its own ferryd processes.
type DaemonConfig struct {
	Ferryd    string   // the binary
	Dir       string   // for the control sockets
	ArenaSize int64    // per daemon
	Args      []string // passed through (--transport, --device, --rdma-device, --max-conns)
}

// ArenaFor is the memory a receiver (a daemon, or a Mooncake segment)
// gets for a run with need bytes in flight: twice that, so a round's
// slots fit beside the last round's, and at least 64 MiB.
func ArenaFor(need int64) int64 { return max(2*need, 64<<20) }

// Pair is a sending and a receiving ferryd that ferrybench started.
type Pair struct {
	Sender, Receiver *Daemon
	dir              string // made for the sockets by StartPair
}

// StartPair starts a sender and a receiver as cfg says, their control
// sockets in a fresh temporary directory (cfg.Dir is ignored).
func StartPair(ctx context.Context, cfg DaemonConfig) (*Pair, error) {
	dir, err := os.MkdirTemp("", "ferrybench-")
	if err != nil {
		return nil, err
	}
	cfg.Dir = dir
	p := &Pair{dir: dir}
	if p.Sender, err = StartDaemon(ctx, cfg, "sender"); err == nil {
		p.Receiver, err = StartDaemon(ctx, cfg, "receiver")
	}
	if err != nil {
		p.Stop()
		return nil, err
	}
	return p, nil
}

// Peers are the pair as a run's daemons.
func (p *Pair) Peers() Peers { return Peers{From: p.Sender.Client, To: p.Receiver.Client} }

// Stop ends both daemons by their PIDs and removes their directory.
func (p *Pair) Stop() error {
	var errs []error
	for _, d := range []*Daemon{p.Sender, p.Receiver} {
		if d != nil {
			errs = append(errs, d.Stop())
		}
	}
	errs = append(errs, os.RemoveAll(p.dir))
	return errors.Join(errs...)
}

// Daemon is a ferryd that ferrybench started; Stop ends it by its PID.
type Daemon struct {
	*proc
	Name      string
	Socket    string
	Advertise string
	Client    *client.Client
}

// DefaultArenaDir is where ferrybench puts arena memory files: /dev/shm
// (tmpfs, so no disk writeback ever enters a figure), else the temp dir.
func DefaultArenaDir() string {
	if fi, err := os.Stat("/dev/shm"); err == nil && fi.IsDir() {
		return "/dev/shm"
	}
	return os.TempDir()
}

// FindFerryd returns given, else the ferryd beside this executable, else
// the one on PATH.
func FindFerryd(given string) (string, error) {
	if given != "" {
		if _, err := os.Stat(given); err != nil {
			return "", fmt.Errorf("--ferryd %s: %w", given, err)
		}
		return given, nil
	}
	if self, err := os.Executable(); err == nil {
		p := filepath.Join(filepath.Dir(self), "ferryd")
		if _, err := os.Stat(p); err == nil {
			return p, nil
		}
	}
	if p, err := exec.LookPath("ferryd"); err == nil {
		return p, nil
	}
	return "", errors.New("ferryd not found beside ferrybench or on PATH: run 'make build' and use bin/ferrybench, or pass --ferryd PATH (or --from/--to sockets of running daemons)")
}

// StartDaemon runs ferryd on loopback with its socket in cfg.Dir and waits
// for its "ready" log line, which names the address peers dial.
func StartDaemon(ctx context.Context, cfg DaemonConfig, name string) (*Daemon, error) {
	sock := filepath.Join(cfg.Dir, name+".sock")
	args := append([]string{
		"--socket", sock, "--listen", "127.0.0.1:0",
		"--arena-size", size.Format(cfg.ArenaSize), "--log-level", "info", "--drain-timeout", "5s",
	}, cfg.Args...)
	cmd := exec.Command(cfg.Ferryd, args...)
	stderr, err := cmd.StderrPipe()
	if err != nil {
		return nil, err
	}
	p, advertise, err := startProc(ctx, "ferryd "+name, cmd, stderr, func(line string) (string, bool) {
		var m struct{ Message, Advertise string }
		return m.Advertise, json.Unmarshal([]byte(line), &m) == nil && m.Message == "ready"
	})
	if err != nil {
		return nil, err
	}
	return &Daemon{proc: p, Name: name, Socket: sock, Advertise: advertise, Client: &client.Client{Socket: sock}}, nil
}

// proc is a child process ferrybench started and stops by its PID.
type proc struct {
	name   string
	cmd    *exec.Cmd
	exited chan struct{}
	log    *logTail
}

// readyTimeout bounds a child's start-up (a ferryd allocates its arena).
const readyTimeout = 30 * time.Second

// startProc starts cmd and waits until ready accepts a line of out,
// returning what ready extracted from it.
func startProc(ctx context.Context, name string, cmd *exec.Cmd, out io.Reader, ready func(line string) (string, bool)) (*proc, string, error) {
	// The child goes when ferrybench goes, even when it is killed.
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGTERM}
	if err := cmd.Start(); err != nil {
		return nil, "", fmt.Errorf("starting %s: %w", name, err)
	}
	p := &proc{name: name, cmd: cmd, exited: make(chan struct{}), log: &logTail{}}
	got := make(chan string, 1)
	go p.log.follow(out, ready, got)
	go func() { _ = cmd.Wait(); close(p.exited) }()

	timer := time.NewTimer(readyTimeout)
	defer timer.Stop()
	select {
	case v := <-got:
		return p, v, nil
	case <-p.exited:
		return nil, "", fmt.Errorf("%s (pid %d) exited during start-up (%s); its output:\n%s", name, cmd.Process.Pid, cmd.ProcessState, p.log)
	case <-timer.C:
		p.Stop()
		return nil, "", fmt.Errorf("%s (pid %d) was not ready within %s; its output:\n%s", name, cmd.Process.Pid, readyTimeout, p.log)
	case <-ctx.Done():
		p.Stop()
		return nil, "", ctx.Err()
	}
}

// PID is the process id.
func (p *proc) PID() int { return p.cmd.Process.Pid }

// Stop ends the process by its PID: SIGTERM, then SIGKILL after 15 s.
func (p *proc) Stop() error {
	select {
	case <-p.exited:
		return nil
	default:
	}
	_ = p.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-p.exited:
		return nil
	case <-time.After(15 * time.Second):
		_ = p.cmd.Process.Kill()
		<-p.exited
		return fmt.Errorf("%s (pid %d) ignored SIGTERM for 15s and was killed; its output:\n%s", p.name, p.cmd.Process.Pid, p.log)
	}
}

// logTail keeps a child's last output lines for error messages, and hands
// the first line ready accepts to got.
type logTail struct {
	mu    sync.Mutex
	lines []string
}

const tailLines = 20

func (l *logTail) follow(r io.Reader, ready func(string) (string, bool), got chan<- string) {
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		line := sc.Text()
		l.mu.Lock()
		l.lines = append(l.lines, line)
		if len(l.lines) > tailLines {
			l.lines = l.lines[1:]
		}
		l.mu.Unlock()
		if v, ok := ready(line); ok {
			select {
			case got <- v:
			default:
			}
		}
	}
}

func (l *logTail) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return strings.Join(l.lines, "\n")
}

// RawSinkProc is a RawSink running in a child process (ferrybench
// raw-sink), so raw writes cross processes as a daemon's do.
type RawSinkProc struct {
	*proc
	Addr string
}

// StartRawSink runs self (this ferrybench) as a raw sink of n bytes.
func StartRawSink(ctx context.Context, self, arenaDir string, n int64) (*RawSinkProc, error) {
	cmd := exec.Command(self, "raw-sink", "--arena-dir", arenaDir, "--bytes", strconv.FormatInt(n, 10))
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		return nil, err
	}
	cmd.Stderr = cmd.Stdout
	p, addr, err := startProc(ctx, "ferrybench raw-sink", cmd, stdout, func(line string) (string, bool) {
		addr, ok := strings.CutPrefix(line, RawSinkReady)
		return addr, ok
	})
	if err != nil {
		return nil, err
	}
	return &RawSinkProc{proc: p, Addr: addr}, nil
}

// RawSinkReady starts the line a raw sink prints once it listens.
const RawSinkReady = "ready "

// MooncakePeerProc is a Mooncake test segment running in a child process
// (ferrybench mooncake-peer), so writes into it cross processes as they
// do into a receiving ferryd.
type MooncakePeerProc struct {
	*proc
	Target MooncakeTarget
}

// MooncakePeerReady starts the line a mooncake-peer prints once it
// serves: "ready SEGMENT BASE LENGTH".
const MooncakePeerReady = "mooncake-peer ready "

// StartMooncakePeer runs self (this ferrybench) as a Mooncake segment
// with a buffer of n bytes.
func StartMooncakePeer(ctx context.Context, self string, n int64) (*MooncakePeerProc, error) {
	cmd := exec.Command(self, "mooncake-peer", "--bytes", strconv.FormatInt(n, 10))
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		return nil, err
	}
	cmd.Stderr = cmd.Stdout
	p, line, err := startProc(ctx, "ferrybench mooncake-peer", cmd, stdout, func(line string) (string, bool) {
		rest, ok := strings.CutPrefix(line, MooncakePeerReady)
		return rest, ok
	})
	if err != nil {
		return nil, err
	}
	m := &MooncakePeerProc{proc: p}
	if _, err := fmt.Sscanf(line, "%s %d %d", &m.Target.Segment, &m.Target.Base, &m.Target.Length); err != nil {
		p.Stop()
		return nil, fmt.Errorf("ferrybench mooncake-peer said %q: %w", line, err)
	}
	return m, nil
}
