package e2e

import (
	"bytes"
	"encoding/json"
	"fmt"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/ferry-project/ferry/api"
	"github.com/ferry-project/ferry/client"
	"github.com/ferry-project/ferry/internal/loglimit"
)

// openDir is a temporary directory other users may enter (t.TempDir's
// are private to root).
func openDir(t *testing.T) string {
	t.Helper()
	dir, err := os.MkdirTemp("", "ferry-e2e-open-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	if err := os.Chmod(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	return dir
}

// ferryctlAs runs ferryctl as uid/gid (with supplementary groups).
func ferryctlAs(t *testing.T, uid, gid uint32, groups []uint32, args ...string) (string, error) {
	t.Helper()
	cmd := exec.CommandContext(ctxT(t), filepath.Join(bin, "ferryctl"), args...)
	cmd.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: uid, Gid: gid, Groups: groups}}
	out, err := cmd.CombinedOutput()
	return string(out), err
}

func TestAllowListAndSocketGroup(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("skipping: running a client as other users needs root (run make test as root)")
	}
	// Ids no account on a test machine uses; the kernel needs none.
	const (
		group   = 64990 // owns the socket: its members can open it
		allowed = 64991 // on allow_uids
		other   = 64992 // may open the socket, is not on the list
		viaGID  = 64993 // not on allow_uids, but in an allowed group
		okGroup = 64994
	)
	dir := openDir(t)
	d := startDaemon(t, dir, "acl", "--socket-group", "64990", "--allow-uids", "64991", "--allow-gids", "64994")

	// The socket: mode 0660, the configured group. The arena is in no
	// file: a memfd ferryd holds, reached through ferryd's /proc/PID/fd.
	var s syscall.Stat_t
	if err := syscall.Stat(d.socket, &s); err != nil {
		t.Fatal(err)
	}
	if s.Mode&0o777 != 0o660 || s.Gid != group {
		t.Errorf("%s: mode %#o gid %d, want 0660 gid %d", d.socket, s.Mode&0o777, s.Gid, group)
	}
	arenaFD := arenaDescriptor(t, d.cmd.Process.Pid)

	// Only an admitted caller reaches the memory: the allowed uid stages in
	// place through the descriptor ferryd passes it; a uid in the socket's
	// group but off the list gets 403 for it and cannot open the memfd.
	data := filepath.Join(dir, "emb.bin")
	if err := os.WriteFile(data, bytes.Repeat([]byte("z"), 4096), 0o644); err != nil {
		t.Fatal(err)
	}
	if out, err := ferryctlAs(t, allowed, group, nil, "--socket", d.socket, "stage", "acl-zc", "--shape", "4096", "--dtype", "u8", "--zero-copy", data); err != nil {
		t.Errorf("uid %d on allow_uids could not stage in place: %v\n%s", allowed, err, out)
	} else if e, err := d.c.Embedding(ctxT(t), "acl-zc"); err != nil || e.State != "staged" {
		t.Errorf("the allowed uid's zero-copy stage: %+v, %v", e, err)
	}
	out, err := ferryctlAs(t, other, group, nil, "--socket", d.socket, "stage", "acl-zc2", "--shape", "4096", "--dtype", "u8", "--zero-copy", data)
	if err == nil || !strings.Contains(out, "(forbidden)") {
		t.Errorf("uid %d off the list staged in place: err=%v\n%s", other, err, out)
	}
	for _, tool := range [][]string{{"head", "-c", "1", arenaFD}, {"dd", "if=" + arenaFD, "of=/dev/null", "count=1"}} {
		cmd := exec.CommandContext(ctxT(t), tool[0], tool[1:]...)
		cmd.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: other, Gid: group}}
		if out, err := cmd.CombinedOutput(); err == nil || !strings.Contains(string(out), "Permission denied") {
			t.Errorf("uid %d in the socket's group read the arena's memfd with %s: err=%v\n%s", other, tool[0], err, out)
		}
	}

	if out, err := ferryctlAs(t, allowed, group, nil, "--socket", d.socket, "status"); err != nil {
		t.Errorf("uid %d on allow_uids was refused: %v\n%s", allowed, err, out)
	}
	out, err = ferryctlAs(t, other, group, nil, "--socket", d.socket, "status")
	if err == nil || !strings.Contains(out, "(forbidden)") || !strings.Contains(out, "uid 64992") {
		t.Errorf("uid %d not on the list: err=%v\n%s", other, err, out)
	}
	// A supplementary group on allow_gids admits (SO_PEERGROUPS).
	if out, err := ferryctlAs(t, viaGID, group, []uint32{okGroup}, "--socket", d.socket, "status"); err != nil {
		t.Errorf("uid %d with supplementary group %d on allow_gids was refused: %v\n%s", viaGID, okGroup, err, out)
	}
	// Outside the socket's group, the file mode already stops it.
	out, err = ferryctlAs(t, other, other, nil, "--socket", d.socket, "status")
	if err == nil || !strings.Contains(out, "permission denied") {
		t.Errorf("uid %d outside the socket's group: err=%v\n%s", other, err, out)
	}
	refused := func(m map[string]any) bool {
		msg, _ := m["message"].(string)
		return m["component"] == "api" && strings.HasPrefix(msg, "refused GET /v1/status from uid 64992")
	}
	d.log.wait(t, 5*time.Second, "the 403 logged", refused)
	// A refused caller asking as fast as it can is logged rate-limited,
	// and each refusal closes its connection (ferryd keeps nothing of it).
	const asks = 300
	script := `import socket, sys
for i in range(int(sys.argv[2])):
    s = socket.socket(socket.AF_UNIX)
    s.settimeout(10)
    s.connect(sys.argv[1])
    s.sendall(b"GET /v1/status HTTP/1.1\r\nHost: ferryd\r\n\r\n")
    answer = b""
    while chunk := s.recv(65536):
        answer += chunk
    assert answer.startswith(b"HTTP/1.1 403"), answer[:80]
    s.close()
`
	cmd := exec.CommandContext(ctxT(t), "/usr/bin/python3", "-c", script, d.socket, fmt.Sprint(asks))
	cmd.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: other, Gid: group}}
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("%d refused calls, each to its connection's close: %v\n%s", asks, err, out)
	}
	d.alive(t)
	// Burst lines a second: 300 asks would need 30 s to all be logged.
	if n := d.log.count(refused); n < 1 || n >= asks/3 {
		t.Errorf("%d refused calls logged %d lines; want them rate-limited to %d a second", asks+1, n, loglimit.Burst)
	}
	if n := metricSum(d.metrics(t), "ferry_refused_requests_total"); n < asks+1 {
		t.Errorf("ferry_refused_requests_total = %v after at least %d refused requests", n, asks+1)
	}
}

func TestControlRequestLimits(t *testing.T) {
	d := startDaemon(t, t.TempDir(), "lim", "--max-body-bytes", "1KiB", "--max-header-bytes", "4KiB",
		"--request-timeout", "2s", "--send-timeout", "1s")
	ctx := ctxT(t)
	raw := &http.Client{Transport: &http.Transport{DialContext: client.UnixDialer(d.socket)}}
	do := func(method, path string, body []byte, header string) (int, api.ErrorBody) {
		t.Helper()
		req, _ := http.NewRequestWithContext(ctx, method, "http://ferryd"+path, bytes.NewReader(body))
		if header != "" {
			req.Header.Set("X-Padding", header)
		}
		resp, err := raw.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		var env api.ErrorBody
		_ = json.NewDecoder(resp.Body).Decode(&env)
		return resp.StatusCode, env
	}

	big := []byte(`{"req_id":"lim-1","nbytes":1,"pad":"` + strings.Repeat("p", 2048) + `"}`)
	if status, env := do("POST", "/v1/receives", big, ""); status != 413 || env.Error.Code != api.CodeTooLarge || !strings.Contains(env.Error.Message, "max_body_bytes") {
		t.Errorf("2KiB body over a 1KiB limit: %d %+v", status, env)
	}
	// net/http answers an oversize header itself (431), before any handler.
	if status, _ := do("GET", "/v1/status", nil, strings.Repeat("h", 16<<10)); status != http.StatusRequestHeaderFieldsTooLarge {
		t.Errorf("16KiB header over a 4KiB limit: %d", status)
	}
	// A wait longer than request_timeout ends with 504 naming the limit.
	if _, err := d.c.Receive(ctx, "lim-wait", 64); err != nil {
		t.Fatal(err)
	}
	// (ctx would end a wait the limit failed to cut.)
	status, env := do("GET", "/v1/receives/lim-wait?wait=90s", nil, "")
	if status != 504 || env.Error.Code != api.CodeTimeout || !strings.Contains(env.Error.Message, "request_timeout (2s)") {
		t.Errorf("wait past request_timeout: %d %+v", status, env)
	}
	d.alive(t)
}
