package e2e

import (
	"bytes"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/ferry-project/ferry/api"
)

type sendResult struct {
	res api.SendResult
	err error
}

// sendToStalledPeer stages n bytes as reqID on snd, warms the session to
// rcv, stops rcv's process and starts the send, which then hangs on the
// stopped peer. It returns once snd logs the write attempt.
func sendToStalledPeer(t *testing.T, snd, rcv *daemon, reqID string, n int) (data []byte, req api.SendRequest, sent <-chan sendResult) {
	t.Helper()
	ctx := ctxT(t)
	warm := randomBytes(256, 10)
	if _, err := snd.c.Stage(ctx, "warm", []int64{256}, "u8", bytes.NewReader(warm), 256); err != nil {
		t.Fatal(err)
	}
	if _, err := snd.c.Send(ctx, "warm", slotFor(t, rcv, "warm", 256)); err != nil {
		t.Fatal(err)
	}
	data = randomBytes(n, 11)
	if _, err := snd.c.Stage(ctx, reqID, []int64{int64(n)}, "u8", bytes.NewReader(data), int64(n)); err != nil {
		t.Fatal(err)
	}
	req = slotFor(t, rcv, reqID, int64(n))
	rcv.pause(t)
	ch := make(chan sendResult, 1)
	go func() {
		r, err := snd.c.Send(ctx, reqID, req)
		ch <- sendResult{r, err}
	}()
	snd.log.wait(t, 10*time.Second, "the send attempt", func(m map[string]any) bool {
		return m["message"] == "write attempt" && m["req_id"] == reqID
	})
	return data, req, ch
}

func TestDrainLetsAnInFlightSendFinish(t *testing.T) {
	dir := t.TempDir()
	snd := startDaemon(t, dir, "snd", "--drain-timeout", "30s")
	rcv := startDaemon(t, dir, "rcv")
	data, _, sent := sendToStalledPeer(t, snd, rcv, "long-1", 8<<20)

	snd.signal(syscall.SIGTERM)
	line := snd.log.wait(t, 10*time.Second, "the draining line", msg("draining: new requests get 503, requests in flight may finish"))
	if line["in_flight"] != 1.0 {
		t.Errorf("draining with in_flight=%v, want 1 (the send); log:\n%s", line["in_flight"], snd.log.dump())
	}
	// A new request during the drain: 503 in the envelope, at once.
	_, err := snd.c.Status(ctxT(t))
	wantErr(t, err, 503, api.CodeUnavailable, "shutting down")

	// The peer comes back: the send in flight completes.
	rcv.signal(syscall.SIGCONT)
	r := <-sent
	if r.err != nil {
		t.Fatalf("in-flight send failed during the drain: %v", r.err)
	}
	if code := snd.waitExit(t, 20*time.Second); code != 0 {
		t.Fatalf("ferryd exited %d after draining; log:\n%s", code, snd.log.dump())
	}
	got, err := rcv.c.Wait(ctxT(t), "long-1", 10*time.Second)
	if err != nil || !bytes.Equal(got, data) {
		t.Fatalf("drained send did not deliver byte-exact: %v", err)
	}
}

func TestDrainTimeoutFailsTheInFlightSendClearly(t *testing.T) {
	dir := t.TempDir()
	// io-timeout far above the drain timeout: the drain is what ends it.
	snd := startDaemon(t, dir, "snd", "--drain-timeout", "1s", "--io-timeout", "60s")
	rcv := startDaemon(t, dir, "rcv")
	_, _, sent := sendToStalledPeer(t, snd, rcv, "stuck-1", 8<<20)

	snd.signal(syscall.SIGTERM)
	var r sendResult
	select {
	case r = <-sent:
	case <-time.After(30 * time.Second):
		t.Fatalf("the send's client got no answer 30s after SIGTERM with a 1s drain; log:\n%s", snd.log.dump())
	}
	wantErr(t, r.err, 503, api.CodeUnavailable, "drain timeout", "/v1/embeddings/stuck-1/send")
	if code := snd.waitExit(t, 20*time.Second); code != 0 {
		t.Fatalf("ferryd exited %d; log:\n%s", code, snd.log.dump())
	}
	snd.log.wait(t, time.Second, "the drain timeout warning", msg("drain timed out: cancelling the requests still in flight; their clients get 503 unavailable"))
	// The entry it could not send is dropped at exit, by name.
	snd.log.wait(t, time.Second, "the drop of stuck-1", func(m map[string]any) bool {
		return m["level"] == "warn" && m["req_id"] == "stuck-1" && strings.HasPrefix(m["message"].(string), "dropped at shutdown")
	})
	rcv.signal(syscall.SIGCONT)
	rcv.alive(t)
}

func TestSighupReloadsLogLevelAndSlowThreshold(t *testing.T) {
	dir := t.TempDir()
	conf := filepath.Join(dir, "ferryd.toml")
	write := func(body string) {
		t.Helper()
		if err := os.WriteFile(conf, []byte(body), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	const base = "listen = \"127.0.0.1:0\"\narena_size = \"8MiB\"\n"
	write(base + "log_level = \"info\"\nslow_threshold = \"1h\"\n")
	d := startDaemonWith(t, launch{bare: true}, dir, "hup", "--config", conf)
	ctx := ctxT(t)
	if _, err := d.c.Status(ctx); err != nil {
		t.Fatal(err)
	}

	write(base + "log_level = \"debug\"\nslow_threshold = \"1ns\"\nmax_conns = 2\n")
	d.signal(syscall.SIGHUP)
	line := d.log.wait(t, 10*time.Second, "the reload line", msg("configuration reloaded"))
	if line["log_level"] != "debug" || line["slow_threshold"] != "1ns" {
		t.Fatalf("reload line: %v", line)
	}
	if nr, _ := line["need_restart"].([]any); line["level"] != "warn" || len(nr) != 1 || nr[0] != "max_conns" {
		t.Fatalf("a changed max_conns should be named as needing a restart: %v", line)
	}
	st, err := d.c.Status(ctx)
	if err != nil || st.Settings.SlowThreshold != "1ns" {
		t.Fatalf("slow threshold after reload: %+v %v", st.Settings, err)
	}
	// Debug lines now appear, with the caller's uid and pid, and none did
	// before the reload.
	req := d.log.wait(t, 5*time.Second, "a debug request line", msg("request"))
	if req["uid"] != float64(os.Getuid()) || req["pid"] != float64(os.Getpid()) {
		t.Errorf("request line names uid %v pid %v, want %d %d", req["uid"], req["pid"], os.Getuid(), os.Getpid())
	}
	for _, m := range d.log.snapshot() {
		if m["message"] == "configuration reloaded" {
			break
		}
		if m["level"] == "debug" {
			t.Fatalf("a debug line before the reload, at log_level info: %v", m)
		}
	}

	// A broken file on reload: an error line, and the daemon keeps going.
	write(base + "log_levle = \"warn\"\n")
	d.signal(syscall.SIGHUP)
	bad := d.log.wait(t, 10*time.Second, "the failed reload", msg("reload failed: the configuration has an error; the running one stays"))
	if e, _ := bad["error"].(string); !strings.Contains(e, "log_levle") || !strings.Contains(e, "line 3") {
		t.Errorf("failed reload does not name the key and line: %v", bad)
	}
	d.alive(t)
}

func TestSigusr1DumpsGoroutines(t *testing.T) {
	d := startDaemon(t, t.TempDir(), "usr1")
	d.signal(syscall.SIGUSR1)
	dump := d.log.wait(t, 10*time.Second, "the goroutine dump", msg("goroutine dump"))
	if n, _ := dump["goroutines"].(float64); n < 2 {
		t.Fatalf("goroutine dump counted %v goroutines", dump["goroutines"])
	}
	d.log.wait(t, time.Second, "the stack of the serving goroutine", func(m map[string]any) bool {
		s, _ := m["stack"].(string)
		return m["message"] == "goroutine" && strings.Contains(s, "daemon.(*Daemon).Serve")
	})
	d.alive(t)
}

// TestDrainLetsAnInFlightWaitGetItsData: a wait for a receive slot's data
// that is in flight when ferryd starts draining keeps waiting, and a
// sender's write into that slot during the drain still lands and answers
// it; a write into a slot nobody waits on is refused as shutting down.
func TestDrainLetsAnInFlightWaitGetItsData(t *testing.T) {
	dir := t.TempDir()
	rcv := startDaemon(t, dir, "rcv", "--drain-timeout", "30s")
	snd := startDaemon(t, dir, "snd")
	ctx := ctxT(t)
	const n = 1 << 20
	data := randomBytes(n, 12)
	waited := slotFor(t, rcv, "late-1", n)
	idle := slotFor(t, rcv, "idle-1", n)
	type waitResult struct {
		data []byte
		err  error
	}
	got := make(chan waitResult, 1)
	go func() {
		b, err := rcv.c.Wait(ctx, "late-1", time.Minute)
		got <- waitResult{b, err}
	}()
	// The slot's description counts the wait once it is in flight.
	for deadline := time.Now().Add(10 * time.Second); ; {
		info, err := rcv.c.WaitInfo(ctx, "late-1", 0)
		if err != nil {
			t.Fatal(err)
		}
		if info.Waiters == 1 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the wait is not in flight after 10s: %+v", info)
		}
		select {
		case r := <-got:
			t.Fatalf("the wait ended before the drain: %v", r.err)
		case <-time.After(10 * time.Millisecond):
		}
	}

	rcv.signal(syscall.SIGTERM)
	line := rcv.log.wait(t, 10*time.Second, "the draining line", msg("draining: new requests get 503, requests in flight may finish"))
	if line["in_flight"] != 1.0 {
		t.Errorf("draining with in_flight=%v, want 1 (the wait); log:\n%s", line["in_flight"], rcv.log.dump())
	}
	for _, id := range []string{"late-1", "idle-1"} {
		if _, err := snd.c.Stage(ctx, id, []int64{n}, "u8", bytes.NewReader(data), n); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := snd.c.Send(ctx, "idle-1", idle); err == nil || !strings.Contains(err.Error(), "shutting down") {
		t.Errorf("a send into a slot nobody waits on during the drain: %v, want a refusal saying the receiver is shutting down", err)
	}
	if _, err := snd.c.Send(ctx, "late-1", waited); err != nil {
		t.Fatalf("a send into the slot a wait in flight waits on, during the drain: %v", err)
	}
	r := <-got
	if r.err != nil || !bytes.Equal(r.data, data) {
		t.Fatalf("the wait in flight at SIGTERM: %v (%d bytes), want the %d bytes sent; log:\n%s", r.err, len(r.data), n, rcv.log.dump())
	}
	if code := rcv.waitExit(t, 20*time.Second); code != 0 {
		t.Fatalf("ferryd exited %d after draining; log:\n%s", code, rcv.log.dump())
	}
}
