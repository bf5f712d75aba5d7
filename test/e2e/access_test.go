package e2e

import (
	"bytes"
	"encoding/json"
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

	// The socket and the arena file: mode 0660, the configured group.
	st, err := d.c.Status(ctxT(t))
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range []string{d.socket, st.Memory.ArenaFile} {
		var s syscall.Stat_t
		if err := syscall.Stat(p, &s); err != nil {
			t.Fatal(err)
		}
		if s.Mode&0o777 != 0o660 || s.Gid != group {
			t.Errorf("%s: mode %#o gid %d, want 0660 gid %d", p, s.Mode&0o777, s.Gid, group)
		}
	}

	if out, err := ferryctlAs(t, allowed, group, nil, "--socket", d.socket, "status"); err != nil {
		t.Errorf("uid %d on allow_uids was refused: %v\n%s", allowed, err, out)
	}
	out, err := ferryctlAs(t, other, group, nil, "--socket", d.socket, "status")
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
	d.log.wait(t, 5*time.Second, "the 403 logged", func(m map[string]any) bool {
		return m["code"] == api.CodeForbidden && m["uid"] == float64(other)
	})
	d.alive(t)
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
