package e2e

import (
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/ferry-project/ferry/api"
	"github.com/ferry-project/ferry/transport"
	"github.com/ferry-project/ferry/transport/transporttest"
)

// secretFile writes a peer secret file, mode 0600, into dir.
func secretFile(t *testing.T, dir, name, secret string) string {
	t.Helper()
	path := filepath.Join(dir, name)
	if err := os.WriteFile(path, []byte(secret+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	return path
}

func TestPeersWithTheSameSecretTransferByteExact(t *testing.T) {
	dir := t.TempDir()
	secret := secretFile(t, dir, "peer.secret", "cluster-secret-0123456789abcdef")
	snd := startDaemon(t, dir, "snd", "--peer-secret-file", secret)
	rcv := startDaemon(t, dir, "rcv", "--peer-secret-file", secret)
	for _, d := range []*daemon{snd, rcv} {
		d.log.wait(t, 5*time.Second, "peer authentication on", func(m map[string]any) bool {
			return strings.HasPrefix(m["message"].(string), "peer authentication on") && m["peer_secret_file"] == secret
		})
	}
	data := stageOn(t, snd, "auth-ok", 3<<20, 71)
	res, err := snd.c.Send(ctxT(t), "auth-ok", slotFor(t, rcv, "auth-ok", int64(len(data))))
	if err != nil {
		t.Fatal(err)
	}
	if res.Attempts != 1 {
		t.Errorf("send took %d attempts", res.Attempts)
	}
	received(t, rcv, "auth-ok", data)
}

// refusedFor matches the receiver's WARN line refusing a peer's handshake
// for reason.
func refusedFor(reason string) func(map[string]any) bool {
	return func(m map[string]any) bool {
		s, _ := m["message"].(string)
		return m["level"] == "warn" && strings.Contains(s, "handshake from 127.0.0.1:") &&
			strings.Contains(s, "peer authentication failed") && strings.Contains(s, reason)
	}
}

func TestPeerWithoutTheSecretIsRefused(t *testing.T) {
	dir := t.TempDir()
	rcv := startDaemon(t, dir, "rcv", "--peer-secret-file", secretFile(t, dir, "rcv.secret", "the-receivers-secret-0123456789"))
	for _, c := range []struct {
		name   string
		flags  []string
		reason string // in the receiver's log line
	}{
		{"OtherSecret", []string{"--peer-secret-file", secretFile(t, dir, "snd.secret", "another-secret-altogether-98765")}, "proof mismatch"},
		{"NoSecret", nil, "peer has no secret"},
	} {
		t.Run(c.name, func(t *testing.T) {
			// Retries allowed, yet none spent: no re-dial changes a secret.
			snd := startDaemon(t, t.TempDir(), "snd", append(c.flags, "--send-retries", "3")...)
			stageOn(t, snd, "auth-no", 4096, 72)
			_, err := snd.c.Send(ctxT(t), "auth-no", slotFor(t, rcv, "auth-no", 4096))
			wantErr(t, err, http.StatusBadGateway, api.CodeTransferFailed, "peer authentication failed", "--peer-secret-file", "ret=auth", "after 1 attempt(s)", rcv.advertise)
			rcv.log.wait(t, 5*time.Second, "the receiver's refusal", refusedFor(c.reason))
			// Both stay up; the sender keeps its staged data; the slot was
			// never written.
			snd.alive(t)
			rcv.alive(t)
			if _, err := snd.c.Embedding(ctxT(t), "auth-no"); err != nil {
				t.Errorf("the refused send's staged entry is gone: %v", err)
			}
			if err := rcv.c.FreeReceive(ctxT(t), "auth-no"); err != nil {
				t.Fatal(err)
			}
		})
	}
}

// TestRelayedHandshakeIsRefused: a slot whose session names a relay (a
// host without the secret that connects on to the receiver) fails at
// once: the receiver refuses the handshake its peer proved for the
// relay's address, and both name the fix. A receiver behind that same
// forwarding, advertising its address, takes the send.
func TestRelayedHandshakeIsRefused(t *testing.T) {
	dir := t.TempDir()
	secret := secretFile(t, dir, "peer.secret", "cluster-secret-0123456789abcdef")
	snd := startDaemon(t, dir, "snd", "--peer-secret-file", secret, "--send-retries", "3")
	rcv := startDaemon(t, dir, "rcv", "--peer-secret-file", secret)
	relay := transporttest.Listener(t)
	transporttest.Relay(t, relay, rcv.advertise)
	stageOn(t, snd, "relayed", 4096, 76)
	req := slotFor(t, rcv, "relayed", 4096)
	req.Session = relay.Addr().String()
	_, err := snd.c.Send(ctxT(t), "relayed", req)
	wantErr(t, err, http.StatusBadGateway, api.CodeTransferFailed, "peer authentication failed",
		"does not take the address dialed as its own", req.Session, "--advertise", "ret=auth", "after 1 attempt(s)")
	rcv.log.wait(t, 5*time.Second, "the receiver's refusal", refusedFor("the peer dialed \""+req.Session+"\", which is not this daemon's address"))
	rcv.alive(t)

	front := transporttest.Listener(t) // port forwarding, known to the receiver
	fwd := startDaemon(t, dir, "fwd", "--peer-secret-file", secret, "--advertise", front.Addr().String())
	transporttest.Relay(t, front, fwd.listen)
	data := stageOn(t, snd, "forwarded", 4096, 77)
	req = slotFor(t, fwd, "forwarded", 4096)
	if req.Session != front.Addr().String() {
		t.Fatalf("the slot names session %s, want the advertised %s", req.Session, front.Addr())
	}
	if _, err := snd.c.Send(ctxT(t), "forwarded", req); err != nil {
		t.Fatalf("send through the advertised forwarding: %v", err)
	}
	received(t, fwd, "forwarded", data)
}

func TestBadPeerSecretFileStopsFerryd(t *testing.T) {
	dir := t.TempDir()
	ctx := ctxT(t) // a ferryd that wrongly starts is killed, not waited for
	open := secretFile(t, dir, "open.secret", "long-enough-secret-0123456789")
	if err := os.Chmod(open, 0o644); err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		name, path string
		names      []string
	}{
		{"readable by others", open, []string{"has mode 0644", "chmod 600"}},
		{"empty", secretFile(t, dir, "empty.secret", ""), []string{"0 bytes", "at least 16"}},
		{"short", secretFile(t, dir, "short.secret", "tooshort"), []string{"8 bytes", "at least 16"}},
		{"missing", filepath.Join(dir, "missing.secret"), []string{"no such file"}},
	} {
		for _, check := range []bool{false, true} {
			args := []string{"--socket", filepath.Join(dir, "never.sock"), "--listen", "127.0.0.1:0", "--peer-secret-file", c.path}
			if check {
				args = append(args, "--check-config")
			}
			cmd := exec.CommandContext(ctx, filepath.Join(bin, "ferryd"), args...)
			cmd.Env = append(os.Environ(), "FERRY_CONFIG="+os.DevNull)
			out, err := cmd.CombinedOutput()
			if err == nil {
				t.Errorf("%s (check %v): ferryd accepted it:\n%s", c.name, check, out)
				continue
			}
			for _, n := range append(c.names, "--peer-secret-file", c.path) {
				if !strings.Contains(string(out), n) {
					t.Errorf("%s (check %v): the error does not name %q:\n%s", c.name, check, n, out)
				}
			}
		}
	}
}

// TestRDMAPeersProveTheSecret: an RDMA lane's control connection opens
// with the same handshake, so the secret guards it as it guards TCP.
func TestRDMAPeersProveTheSecret(t *testing.T) {
	requireRDMA(t)
	dir := t.TempDir()
	secret := secretFile(t, dir, "peer.secret", "cluster-secret-0123456789abcdef")
	snd := startDaemon(t, dir, "snd", "--transport", "rdma", "--peer-secret-file", secret)
	rcv := startDaemon(t, dir, "rcv", "--transport", "rdma", "--peer-secret-file", secret)
	data := stageOn(t, snd, "rd-auth", 3<<20, 73)
	res, err := snd.c.Send(ctxT(t), "rd-auth", slotFor(t, rcv, "rd-auth", int64(len(data))))
	if err != nil || res.Transport != "rdma" {
		t.Fatalf("send between RDMA peers with the same secret: %+v, %v; want it over rdma", res, err)
	}
	received(t, rcv, "rd-auth", data)

	other := startDaemon(t, dir, "other", "--transport", "rdma", "--send-retries", "3",
		"--peer-secret-file", secretFile(t, dir, "other.secret", "another-secret-altogether-98765"))
	stageOn(t, other, "rd-auth-no", 4096, 74)
	_, err = other.c.Send(ctxT(t), "rd-auth-no", slotFor(t, rcv, "rd-auth-no", 4096))
	wantErr(t, err, http.StatusBadGateway, api.CodeTransferFailed, "peer authentication failed", "ret=auth", "after 1 attempt(s)")
	rcv.log.wait(t, 5*time.Second, "the receiver's refusal", refusedFor("proof mismatch"))
	rcv.alive(t)
}

// TestSendToAPortThatIsNotFerry: a session naming some other service's
// port fails once, saying what answered, instead of re-dialing a peer
// that can never speak ferry's protocol.
func TestSendToAPortThatIsNotFerry(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			c.SetDeadline(time.Now().Add(10 * time.Second))
			io.WriteString(c, "HTTP/1.1 400 Bad Request\r\n\r\n")
			c.Close()
		}
	}()
	snd := startDaemon(t, t.TempDir(), "snd", "--send-retries", "3")
	stageOn(t, snd, "not-ferry", 4096, 75)
	_, err = snd.c.Send(ctxT(t), "not-ferry", api.SendRequest{Session: ln.Addr().String(), BufferAddress: 1 << 20, Key: transport.Key{1}})
	wantErr(t, err, http.StatusBadGateway, api.CodeTransferFailed, "bad magic", "HTTP", "ret=incompatible", "after 1 attempt(s)", "same ferry release")
	snd.alive(t)
}
