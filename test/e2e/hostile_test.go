package e2e

import (
	"bufio"
	"bytes"
	"fmt"
	"io"
	"net"
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
)

// Hostile load: each of ferryd's listeners flooded (many connections,
// huge headers, slow bodies, descriptors passed on the control socket)
// while a real peer ferryd sends to it and an admitted client calls its
// API. The calls and sends must succeed and ferryd's descriptors and
// memory stay under stated bounds; each listener prints one line:
//
//	== HOSTILE port=NAME conns=N fds=N rss_mb=N peer_ok=N/M api_ok=N/M
//
// The helpers here serve any listener: a flood is a dial and what each
// connection sends first.

// hostileSends and hostileCalls are the peer's sends and the client's
// API calls made during each flood; each must succeed.
const (
	hostileSends = 10
	hostileCalls = 20
)

// floodKinds are what flood connections send first, in turn: the start
// of a request's headers and nothing more; headers far past any limit;
// a request with a body that never comes.
var floodKinds = []func(c net.Conn){
	func(c net.Conn) { io.WriteString(c, "GET /v1/status HTTP/1.1\r\nHost: ferryd\r\nX-Slow: ") },
	func(c net.Conn) {
		io.WriteString(c, "GET /metrics HTTP/1.1\r\nHost: ferryd\r\nX-Big: ")
		// ferryd stops reading past its header limit: the rest waits out
		// its deadline beside the flood.
		c.SetWriteDeadline(time.Now().Add(5 * time.Second))
		go c.Write(bigHeader)
	},
	func(c net.Conn) {
		io.WriteString(c, "PUT /v1/embeddings/slow?shape=1048576&dtype=uint8 HTTP/1.1\r\nHost: ferryd\r\nContent-Length: 1048576\r\n\r\nslow")
	},
}

// bigHeader is a header's value of 1 MiB.
var bigHeader = bytes.Repeat([]byte("a"), 1<<20)

// flood opens n connections with dial, each sending its floodKinds
// entry (and first, if set, with its first byte: passed descriptors),
// and holds them open. It returns how many ferryd accepted at the time
// (a refused or evicted one is closed by ferryd, which the flood does
// not wait for) and a function that closes them.
func flood(n int, dial func() (net.Conn, error), first func(c net.Conn) error) (opened int, closeAll func()) {
	var conns []net.Conn
	for i := range n {
		c, err := dial()
		if err != nil {
			continue
		}
		conns = append(conns, c)
		if first != nil && first(c) != nil {
			continue
		}
		floodKinds[i%len(floodKinds)](c)
	}
	return len(conns), func() {
		for _, c := range conns {
			c.Close()
		}
	}
}

// passFDs sends one byte with four descriptors (a pipe's ends, twice)
// beside it, as a client passing a region's memfd does.
func passFDs(c net.Conn) error {
	var p [2]int
	if err := unix.Pipe2(p[:], unix.O_CLOEXEC); err != nil {
		return err
	}
	defer unix.Close(p[0])
	defer unix.Close(p[1])
	_, _, err := c.(*net.UnixConn).WriteMsgUnix([]byte("G"), unix.UnixRights(p[0], p[1], p[0], p[1]), nil)
	return err
}

// procUsage is a process's open descriptors and resident memory (MiB).
func procUsage(t *testing.T, pid int) (fds, rssMB int) {
	t.Helper()
	return openFDs(t, pid), int(procStatusBytes(t, pid, "VmRSS") >> 20)
}

// underLoad runs the peer's sends from snd into target and the
// client's calls (call) against target, counting the successes, while
// sampling target's descriptors and memory; it returns the peaks.
type hostileResult struct {
	fds, rssMB      int
	peerOK, apiOK   int
	peerErr, apiErr error
}

func underLoad(t *testing.T, snd, target *daemon, call func(i int) error) hostileResult {
	t.Helper()
	var r hostileResult
	sample := func() {
		f, m := procUsage(t, target.cmd.Process.Pid)
		r.fds, r.rssMB = max(r.fds, f), max(r.rssMB, m)
	}
	sample()
	data := randomBytes(64<<10, 7)
	for i := range hostileSends {
		id := fmt.Sprintf("hostile-%d", i)
		_, err := snd.c.Stage(ctxT(t), id, []int64{int64(len(data))}, "uint8", bytes.NewReader(data), int64(len(data)))
		if err == nil {
			_, err = snd.c.Send(ctxT(t), id, slotFor(t, target, id, int64(len(data))))
		}
		if err == nil {
			var got []byte
			if got, err = target.c.Wait(ctxT(t), id, 10*time.Second); err == nil && !bytes.Equal(got, data) {
				err = fmt.Errorf("%s arrived with other bytes", id)
			}
			target.c.FreeReceive(ctxT(t), id)
		}
		if err == nil {
			r.peerOK++
		} else {
			r.peerErr = err
		}
		sample()
	}
	for i := range hostileCalls {
		if err := call(i); err == nil {
			r.apiOK++
		} else {
			r.apiErr = err
		}
		sample()
	}
	return r
}

// report prints a listener's HOSTILE line and checks it against its
// bounds.
func (r hostileResult) report(t *testing.T, port string, conns, maxFDs, maxRSS int) {
	t.Helper()
	fmt.Printf("== HOSTILE port=%s conns=%d fds=%d rss_mb=%d peer_ok=%d/%d api_ok=%d/%d\n",
		port, conns, r.fds, r.rssMB, r.peerOK, hostileSends, r.apiOK, hostileCalls)
	if r.peerOK != hostileSends {
		t.Errorf("%s flood: %d of %d peer sends succeeded; the last failure: %v", port, r.peerOK, hostileSends, r.peerErr)
	}
	if r.apiOK != hostileCalls {
		t.Errorf("%s flood: %d of %d API calls succeeded; the last failure: %v", port, r.apiOK, hostileCalls, r.apiErr)
	}
	if r.fds > maxFDs || r.rssMB > maxRSS {
		t.Errorf("%s flood: ferryd held %d descriptors and %d MiB resident; the bounds are %d and %d MiB", port, r.fds, r.rssMB, maxFDs, maxRSS)
	}
}

// The floods' sizes and the bounds ferryd stays under (a race-built
// ferryd, as make e2e runs, takes several times the memory of a plain
// one). The control socket holds at most 512 connections of one uid
// (daemon.controlLimits), the metrics listener 16 of one address
// (daemon.metricsLimits); the rest is ferryd's own.
const (
	controlFloodConns = 1500
	metricsFloodConns = 500
	controlMaxFDs     = 512 + 100
	metricsMaxFDs     = 16 + 100
	controlMaxRSSMiB  = 400
	metricsMaxRSSMiB  = 200
)

// floodEnv tells TestMain to be the control-socket flood of
// floodControlAs, as another user: "socket:n".
const floodEnv = "FERRY_E2E_FLOOD"

// floodControlMain is that flood: it prints how many connections it
// opened, then holds them until its stdin closes.
func floodControlMain(spec string) int {
	i := strings.LastIndex(spec, ":")
	n, err := strconv.Atoi(spec[i+1:])
	if err != nil {
		fmt.Fprintln(os.Stderr, "bad", floodEnv, spec)
		return 2
	}
	var lim unix.Rlimit
	unix.Getrlimit(unix.RLIMIT_NOFILE, &lim)
	lim.Cur = lim.Max
	unix.Setrlimit(unix.RLIMIT_NOFILE, &lim)
	opened, closeAll := flood(n, func() (net.Conn, error) { return net.Dial("unix", spec[:i]) }, passFDs)
	fmt.Println(opened)
	io.Copy(io.Discard, os.Stdin)
	closeAll()
	return 0
}

// floodControlAs runs the control-socket flood as uid/gid, from a copy
// of this test binary that user may run, and returns once its
// connections are open; the flood ends with the test.
func floodControlAs(t *testing.T, uid, gid uint32, socket string, n int) int {
	t.Helper()
	self, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	exe := filepath.Join(bin, "e2e-flood.test")
	if b, err := os.ReadFile(self); err != nil || os.WriteFile(exe, b, 0o755) != nil {
		t.Fatalf("copying the test binary for the flood: %v", err)
	}
	cmd := exec.Command(exe)
	cmd.Env = append(os.Environ(), fmt.Sprintf("%s=%s:%d", floodEnv, socket, n))
	cmd.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: uid, Gid: gid}}
	stdin, err := cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	cmd.Stderr = os.Stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	var once sync.Once
	end := func() {
		once.Do(func() {
			stdin.Close()
			done := make(chan struct{})
			go func() { cmd.Wait(); close(done) }()
			select {
			case <-done:
			case <-time.After(10 * time.Second):
				cmd.Process.Kill()
				<-done
			}
		})
	}
	t.Cleanup(end)
	line := make(chan string, 1)
	go func() {
		l, _ := bufio.NewReader(out).ReadString('\n')
		line <- l
	}()
	select {
	case l := <-line:
		opened, err := strconv.Atoi(strings.TrimSpace(l))
		if err != nil {
			end()
			t.Fatalf("the flood as uid %d said %q", uid, l)
		}
		return opened
	case <-time.After(40 * time.Second):
		end()
		t.Fatalf("the flood as uid %d did not open its connections within 40s", uid)
	}
	return 0
}

// TestHostileLoadControlSocket: a user in the socket's group but off the
// allow-list floods the control socket (1,500 connections: stalled
// headers, 1 MiB headers, bodies that never come, four descriptors passed
// with each first byte) while an admitted client calls the API and a
// peer ferryd sends to it. Run as root, which may act as another user;
// elsewhere the flood is this process's own (an admitted caller's).
func TestHostileLoadControlSocket(t *testing.T) {
	raiseFileLimit(t, 4*controlFloodConns)
	const (
		group    = 64990 // owns the socket
		stranger = 64992 // in the group, off the allow-list
	)
	dir := openDir(t)
	target := startDaemon(t, dir, "target", "--arena-size", "8MiB", "--socket-group", strconv.Itoa(group), "--allow-uids", "64991")
	snd := startDaemon(t, dir, "peer", "--arena-size", "8MiB")
	var conns int
	if os.Geteuid() == 0 {
		conns = floodControlAs(t, stranger, group, target.socket, controlFloodConns)
	} else {
		var closeAll func()
		conns, closeAll = flood(controlFloodConns, func() (net.Conn, error) { return net.Dial("unix", target.socket) }, passFDs)
		defer closeAll()
	}
	r := underLoad(t, snd, target, func(i int) error {
		if i%2 == 0 {
			_, err := target.c.Status(ctxT(t))
			return err
		}
		_, err := target.c.Embeddings(ctxT(t))
		return err
	})
	r.report(t, "control", conns, controlMaxFDs, controlMaxRSSMiB)
	target.alive(t)
}

// TestHostileLoadMetrics: another local user floods --metrics-listen
// (500 connections from 127.0.0.2: stalled headers, 1 MiB headers,
// bodies that never come) while Prometheus scrapes it from 127.0.0.1
// and a peer ferryd sends to it.
func TestHostileLoadMetrics(t *testing.T) {
	raiseFileLimit(t, 4*metricsFloodConns)
	dir := t.TempDir()
	target := startDaemon(t, dir, "target", "--arena-size", "8MiB", "--metrics-listen", "127.0.0.1:0")
	snd := startDaemon(t, dir, "peer", "--arena-size", "8MiB")
	ready := target.log.wait(t, time.Second, `"ready"`, msg("ready"))
	addr, _ := ready["metrics"].(string)
	from := &net.Dialer{LocalAddr: &net.TCPAddr{IP: net.IPv4(127, 0, 0, 2)}, Timeout: time.Second}
	conns, closeAll := flood(metricsFloodConns, func() (net.Conn, error) { return from.Dial("tcp", addr) }, nil)
	defer closeAll()
	scraper := &http.Client{Timeout: 10 * time.Second}
	r := underLoad(t, snd, target, func(int) error {
		resp, err := scraper.Get("http://" + addr + "/metrics")
		if err != nil {
			return err
		}
		defer resp.Body.Close()
		body, err := io.ReadAll(resp.Body)
		if err == nil && (resp.StatusCode != 200 || !bytes.Contains(body, []byte("ferry_arena_bytes"))) {
			err = fmt.Errorf("a scrape: %s, %d bytes", resp.Status, len(body))
		}
		return err
	})
	r.report(t, "metrics", conns, metricsMaxFDs, metricsMaxRSSMiB)
}
