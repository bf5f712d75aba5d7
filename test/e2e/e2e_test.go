package e2e

import (
	"bytes"
	"encoding/json"
	"math/rand/v2"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ferry-project/ferry/api"
	"github.com/ferry-project/ferry/client"
)

func randomBytes(n int, seed uint64) []byte {
	r := rand.New(rand.NewPCG(seed, seed^0x9e3779b97f4a7c15))
	b := make([]byte, n)
	for i := range b {
		b[i] = byte(r.Uint32())
	}
	return b
}

// pair starts a sender and a receiver daemon.
func pair(t *testing.T, extra ...string) (snd, rcv *daemon) {
	dir := t.TempDir()
	return startDaemon(t, dir, "snd", extra...), startDaemon(t, dir, "rcv", extra...)
}

// wantErr checks that err is an API error with this status and code whose
// message names every one of names.
func wantErr(t *testing.T, err error, status int, code string, names ...string) {
	t.Helper()
	e, ok := err.(*client.Error)
	if !ok {
		t.Fatalf("want API error %d %s, got %v", status, code, err)
	}
	if e.Status != status || e.Code != code {
		t.Fatalf("want %d %s, got %d %s: %s", status, code, e.Status, e.Code, e.Message)
	}
	for _, n := range names {
		if !strings.Contains(e.Message, n) {
			t.Fatalf("error message does not name %q: %s", n, e.Message)
		}
	}
}

// warnFor matches the WARN line a failed request logs.
func warnFor(reqID, code string) func(map[string]any) bool {
	return func(m map[string]any) bool {
		return m["level"] == "warn" && m["req_id"] == reqID && m["code"] == code
	}
}

var embShape = []int64{16, 4096}

const embBytes = 16 * 4096 * 2 // bf16

func slotFor(t *testing.T, rcv *daemon, id string, n int64) api.SendRequest {
	t.Helper()
	slot, err := rcv.c.Receive(ctxT(t), id, n)
	if err != nil {
		t.Fatal(err)
	}
	return api.SendRequest{Session: slot.Session, BufferAddress: slot.BufferAddress, Key: slot.Key}
}

func TestUploadStagingArrivesByteExact(t *testing.T) {
	snd, rcv := pair(t, "--slow-threshold", "1ns")
	ctx := ctxT(t)
	data := randomBytes(embBytes, 1)
	if _, err := snd.c.Stage(ctx, "up-1", embShape, "bf16", bytes.NewReader(data), int64(len(data))); err != nil {
		t.Fatal(err)
	}
	res, err := snd.c.Send(ctx, "up-1", slotFor(t, rcv, "up-1", embBytes))
	if err != nil {
		t.Fatal(err)
	}
	if res.NBytes != embBytes || res.Attempts != 1 || res.Transport != "tcp" {
		t.Fatalf("unexpected send result %+v", res)
	}
	got, err := rcv.c.Wait(ctx, "up-1", 10*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, data) {
		t.Fatal("received bytes differ from the staged ones")
	}
	// The sent entry is freed on success.
	if _, err := snd.c.Embedding(ctx, "up-1"); client.Code(err) != api.CodeNoEmbedding {
		t.Fatalf("sent entry still staged: %v", err)
	}
	// --slow-threshold 1ns makes every transfer a slow one: one INFO line
	// with the fields the seeds' log carried.
	line := snd.log.wait(t, 5*time.Second, "slow transfer", msg("slow transfer"))
	for _, f := range []string{"req_id", "session", "nbytes", "ms", "transport", "shared_mr"} {
		if _, ok := line[f]; !ok {
			t.Errorf("slow-transfer line lacks %q: %v", f, line)
		}
	}
	if line["level"] != "info" || line["req_id"] != "up-1" {
		t.Errorf("slow-transfer line: %v", line)
	}
	if err := rcv.c.FreeReceive(ctx, "up-1"); err != nil {
		t.Fatal(err)
	}
	st, err := rcv.c.Status(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if st.Memory.Used != 0 {
		t.Fatalf("receiver arena still has %d bytes used after the slot was freed", st.Memory.Used)
	}
}

func TestZeroCopyStagingArrivesByteExact(t *testing.T) {
	snd, rcv := pair(t)
	ctx := ctxT(t)
	data := randomBytes(embBytes, 2)
	sl, err := snd.c.Slice(ctx, "zc-1", api.SliceRequest{Shape: embShape, DType: "bf16"})
	if err != nil {
		t.Fatal(err)
	}
	writeInPlace(t, snd, sl, data)
	// Not committed yet: a send does not take it.
	if _, err := snd.c.Send(ctx, "zc-1", slotFor(t, rcv, "zc-0", embBytes)); err == nil {
		t.Fatal("send of an uncommitted slice succeeded")
	} else {
		wantErr(t, err, 404, api.CodeNoEmbedding, "zc-1", "not committed")
	}
	// A commit whose shape disagrees with the slice is refused.
	_, err = snd.c.Commit(ctx, "zc-1", []int64{16, 4095}, "bf16")
	wantErr(t, err, 400, api.CodeBadRequest, "zc-1")
	if _, err := snd.c.Commit(ctx, "zc-1", embShape, "bfloat16"); err != nil {
		t.Fatal(err)
	}
	if _, err := snd.c.Send(ctx, "zc-1", slotFor(t, rcv, "zc-1", embBytes)); err != nil {
		t.Fatal(err)
	}
	// The receiver's client reads the data in place, through its mapping.
	info, err := rcv.c.WaitInfo(ctx, "zc-1", 10*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	got := readInPlace(t, rcv, info)
	if !info.Arrived || !bytes.Equal(got, data) {
		t.Fatalf("in-place bytes differ (arrived=%v, received=%d)", info.Arrived, info.Received)
	}
}

func TestSendBeforeStageNamesReqID(t *testing.T) {
	snd, rcv := pair(t)
	_, err := snd.c.Send(ctxT(t), "never-staged", slotFor(t, rcv, "x", 64))
	wantErr(t, err, 404, api.CodeNoEmbedding, "never-staged")
	snd.log.wait(t, 5*time.Second, "a WARN naming the req_id", warnFor("never-staged", api.CodeNoEmbedding))
	snd.alive(t)
}

func TestStageRacingSendWithWait(t *testing.T) {
	snd, rcv := pair(t)
	ctx := ctxT(t)
	data := randomBytes(embBytes, 3)
	req := slotFor(t, rcv, "race-1", embBytes)
	req.WaitMS = 20000
	type result struct {
		res api.SendResult
		err error
	}
	sent := make(chan result, 1)
	go func() {
		r, err := snd.c.Send(ctx, "race-1", req)
		sent <- result{r, err}
	}()
	// Stage only once the daemon says the send is waiting for it.
	snd.log.wait(t, 10*time.Second, "the send waiting", func(m map[string]any) bool {
		return m["message"] == "send waiting for its req_id to be staged" && m["req_id"] == "race-1"
	})
	if _, err := snd.c.Stage(ctx, "race-1", embShape, "bf16", bytes.NewReader(data), int64(len(data))); err != nil {
		t.Fatal(err)
	}
	r := <-sent
	if r.err != nil {
		t.Fatal(r.err)
	}
	got, err := rcv.c.Wait(ctx, "race-1", 10*time.Second)
	if err != nil || !bytes.Equal(got, data) {
		t.Fatalf("raced send did not deliver the data: %v", err)
	}
}

func TestPeerDownKeepsStagedDataAndResendSucceeds(t *testing.T) {
	peerDownScenario(t, "down-1", "tcp")
}

// peerDownScenario warms a session, kills the receiver and sends: a 502
// transfer_failed naming what broke after a retry, the staged data kept;
// then the receiver comes back on the same port and the resend to its new
// slot delivers byte-exact over transport.
func peerDownScenario(t *testing.T, reqID, transport string) {
	dir := t.TempDir()
	snd := startDaemon(t, dir, "snd", "--transport", transport, "--io-timeout", "3s", "--send-timeout", "20s")
	rcv := startDaemon(t, dir, "rcv", "--transport", transport)
	ctx := ctxT(t)
	data := randomBytes(embBytes, 4)
	if _, err := snd.c.Stage(ctx, reqID, embShape, "bf16", bytes.NewReader(data), int64(len(data))); err != nil {
		t.Fatal(err)
	}
	// A first send establishes the session; then the receiver dies.
	warm := randomBytes(256, 5)
	if _, err := snd.c.Stage(ctx, "warm", []int64{256}, "u8", bytes.NewReader(warm), 256); err != nil {
		t.Fatal(err)
	}
	if _, err := snd.c.Send(ctx, "warm", slotFor(t, rcv, "warm", 256)); err != nil {
		t.Fatal(err)
	}
	req := slotFor(t, rcv, reqID, embBytes)
	port := rcv.listen[strings.LastIndex(rcv.listen, ":")+1:]
	rcv.kill()

	_, err := snd.c.Send(ctx, reqID, req)
	wantErr(t, err, 502, api.CodeTransferFailed, reqID, req.Session, "nbytes=131072", "ret=", "kept")
	emb, err := snd.c.Embedding(ctx, reqID)
	if err != nil || emb.State != "staged" {
		t.Fatalf("staged data not kept after a failed send: %+v %v", emb, err)
	}
	snd.log.wait(t, 5*time.Second, "a retry warning", func(m map[string]any) bool {
		return m["level"] == "warn" && m["req_id"] == reqID && strings.Contains(m["message"].(string), "retrying")
	})

	// The receiver comes back on the same port: the resend to its new slot works.
	rcv2 := startDaemon(t, dir, "rcv", "--transport", transport, "--listen", "127.0.0.1:"+port)
	res, err := snd.c.Send(ctx, reqID, slotFor(t, rcv2, reqID, embBytes))
	if err != nil || res.Transport != transport {
		t.Fatalf("resend to the restarted peer: %+v, %v", res, err)
	}
	got, err := rcv2.c.Wait(ctx, reqID, 10*time.Second)
	if err != nil || !bytes.Equal(got, data) {
		t.Fatalf("resend did not deliver byte-exact: %v", err)
	}
	sessions, err := snd.c.Sessions(ctx)
	if err != nil || len(sessions) != 1 || sessions[0].Failures == 0 {
		t.Fatalf("sessions should record the failures: %+v %v", sessions, err)
	}
}

func TestBadInputGetsClearErrorsAndDaemonStaysUp(t *testing.T) {
	snd, rcv := pair(t)
	ctx := ctxT(t)
	raw := &http.Client{Transport: &http.Transport{DialContext: client.UnixDialer(snd.socket)}}
	do := func(method, path, body string) (int, string) {
		req, _ := http.NewRequestWithContext(ctx, method, "http://ferryd"+path, strings.NewReader(body))
		resp, err := raw.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		var env api.ErrorBody
		buf := new(bytes.Buffer)
		_, _ = buf.ReadFrom(resp.Body)
		_ = json.Unmarshal(buf.Bytes(), &env)
		return resp.StatusCode, env.Error.Code + ": " + env.Error.Message
	}
	small := randomBytes(1024, 6)
	cases := []struct {
		name, method, path, body string
		status                   int
		mention                  string
	}{
		{"malformed JSON", "POST", "/v1/embeddings/a/send", `{"session":`, 400, "JSON"},
		{"unknown field", "POST", "/v1/receives", `{"req_id":"a","nbytes":1,"bogus":1}`, 400, "bogus"},
		{"unknown dtype", "PUT", "/v1/embeddings/a?shape=1,4&dtype=f128", "xxxx", 400, "f128"},
		{"negative shape", "PUT", "/v1/embeddings/a?shape=-1,4&dtype=u8", "", 400, "positive"},
		{"overflowing shape", "PUT", "/v1/embeddings/a?shape=4294967296,4294967296&dtype=f32", "", 400, "overflow"},
		{"non-integer shape", "PUT", "/v1/embeddings/a?shape=1,x&dtype=u8", "", 400, "integer"},
		{"body shorter than shape", "PUT", "/v1/embeddings/a?shape=2,4&dtype=f32", "abc", 400, "32 bytes"},
		{"odd req_id", "PUT", "/v1/embeddings/%2e%2e?shape=1&dtype=u8", "x", 400, "req_id"},
		{"req_id with space", "POST", "/v1/receives", `{"req_id":"a b","nbytes":1}`, 400, "req_id"},
		{"over-long req_id", "PUT", "/v1/embeddings/" + strings.Repeat("r", 200) + "?shape=1&dtype=u8", "x", 400, "128"},
		{"zero nbytes slot", "POST", "/v1/receives", `{"req_id":"a","nbytes":0}`, 400, "positive"},
		{"a key twice, in two cases", "POST", "/v1/receives", `{"req_id":"dupkey","nbytes":1024,"NBYTES":2048}`, 400, `"NBYTES" comes twice`},
		{"bad session", "POST", "/v1/embeddings/a/send", `{"session":"nohost","buffer_address":1,"key":"000102030405060708090a0b0c0d0e0f10111213"}`, 400, "host:port"},
		{"numeric key", "POST", "/v1/embeddings/a/send", `{"session":"127.0.0.1:1","buffer_address":1,"key":1}`, 400, "key"},
		{"short key", "POST", "/v1/embeddings/a/send", `{"session":"127.0.0.1:1","buffer_address":1,"key":"0a0b"}`, 400, "40 hex digits"},
		{"missing key", "POST", "/v1/embeddings/a/send", `{"session":"127.0.0.1:1","buffer_address":1}`, 400, "key is missing"},
		{"bad wait", "GET", "/v1/receives/a?wait=forever", "", 400, "wait"},
		{"oversize upload", "PUT", "/v1/embeddings/big?shape=128,1048576&dtype=u8", "", 413, "arena"},
		{"unknown route", "GET", "/v1/nope", "", 404, "/v1/nope"},
		{"wrong method", "POST", "/v1/status", "", 405, "GET"},
	}
	for _, c := range cases {
		status, text := do(c.method, c.path, c.body)
		if status != c.status || !strings.Contains(text, c.mention) {
			t.Errorf("%s: got %d %q; want %d mentioning %q", c.name, status, text, c.status, c.mention)
		}
		snd.alive(t)
	}

	// Duplicate req_id → 409.
	if _, err := snd.c.Stage(ctx, "dup", []int64{1024}, "u8", bytes.NewReader(small), 1024); err != nil {
		t.Fatal(err)
	}
	_, err := snd.c.Stage(ctx, "dup", []int64{1024}, "u8", bytes.NewReader(small), 1024)
	wantErr(t, err, 409, api.CodeExists, "dup")
	_, err = rcv.c.Receive(ctx, "dupslot", 10)
	if err == nil {
		_, err = rcv.c.Receive(ctx, "dupslot", 10)
	}
	wantErr(t, err, 409, api.CodeExists, "dupslot")
	// A req_id carried in the body is named in the WARN line too.
	rcv.log.wait(t, 5*time.Second, "a WARN naming dupslot", warnFor("dupslot", api.CodeExists))

	// Slot too small → 400 naming both sizes, staged data kept.
	_, err = snd.c.Send(ctx, "dup", slotFor(t, rcv, "tiny", 512))
	wantErr(t, err, 400, api.CodeRefused, "dup", "1024", "512", "too small")
	if _, err := snd.c.Embedding(ctx, "dup"); err != nil {
		t.Fatalf("refused send dropped the staged entry: %v", err)
	}
	// Wrong key → 400.
	req := slotFor(t, rcv, "keyed", 1024)
	req.Key[15] ^= 1
	_, err = snd.c.Send(ctx, "dup", req)
	wantErr(t, err, 400, api.CodeRefused, "key")

	// Arena full → 507: 64 MiB arena, 40 MiB staged, 40 more do not fit.
	big := int64(40 << 20)
	if _, err := snd.c.Slice(ctx, "fill", api.SliceRequest{NBytes: big}); err != nil {
		t.Fatal(err)
	}
	_, err = snd.c.Slice(ctx, "fill2", api.SliceRequest{NBytes: big})
	wantErr(t, err, 507, api.CodeArenaFull, "fill2")
	snd.alive(t)
	rcv.alive(t)
}

func TestTTLSweepNamesWhatItDrops(t *testing.T) {
	dir := t.TempDir()
	d := startDaemon(t, dir, "ttl", "--stage-ttl", "300ms", "--receive-ttl", "300ms")
	ctx := ctxT(t)
	if _, err := d.c.Stage(ctx, "forgotten", []int64{64}, "u8", bytes.NewReader(make([]byte, 64)), 64); err != nil {
		t.Fatal(err)
	}
	if _, err := d.c.Receive(ctx, "unread", 64); err != nil {
		t.Fatal(err)
	}
	for _, id := range []string{"forgotten", "unread"} {
		d.log.wait(t, 10*time.Second, "the TTL drop of "+id, func(m map[string]any) bool {
			return m["level"] == "warn" && m["req_id"] == id && strings.Contains(m["message"].(string), "TTL")
		})
	}
	st, err := d.c.Status(ctx)
	if err != nil || st.Memory.Used != 0 || st.Staged != 0 || st.Receives != 0 {
		t.Fatalf("sweep left memory or entries behind: %+v %v", st.Memory, err)
	}
}

func TestConcurrentSendsToOnePeer(t *testing.T) {
	snd, rcv := pair(t)
	ctx := ctxT(t)
	const n = 32
	var wg sync.WaitGroup
	errs := make(chan error, n)
	datas := make([][]byte, n)
	for i := range n {
		datas[i] = randomBytes(64<<10+i, uint64(100+i))
		id := "c-" + string(rune('a'+i%26)) + strings.Repeat("x", i/26)
		wg.Add(1)
		go func(i int, id string) {
			defer wg.Done()
			d := datas[i]
			if _, err := snd.c.Stage(ctx, id, []int64{int64(len(d))}, "u8", bytes.NewReader(d), int64(len(d))); err != nil {
				errs <- err
				return
			}
			slot, err := rcv.c.Receive(ctx, id, int64(len(d)))
			if err != nil {
				errs <- err
				return
			}
			if _, err := snd.c.Send(ctx, id, api.SendRequest{Session: slot.Session, BufferAddress: slot.BufferAddress, Key: slot.Key}); err != nil {
				errs <- err
				return
			}
			got, err := rcv.c.Wait(ctx, id, 10*time.Second)
			if err != nil {
				errs <- err
				return
			}
			if !bytes.Equal(got, d) {
				errs <- &client.Error{Code: "mismatch", Message: id}
			}
		}(i, id)
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
}

func TestFerryctlRoundTrip(t *testing.T) {
	snd, rcv := pair(t)
	dir := t.TempDir()
	data := randomBytes(embBytes, 7)
	in, out, slot := filepath.Join(dir, "in"), filepath.Join(dir, "out"), filepath.Join(dir, "slot.json")
	if err := os.WriteFile(in, data, 0o644); err != nil {
		t.Fatal(err)
	}
	ctl := func(sock string, args ...string) string {
		t.Helper()
		cmd := exec.Command(filepath.Join(bin, "ferryctl"), append([]string{"--socket", sock}, args...)...)
		b, err := cmd.CombinedOutput()
		if err != nil {
			t.Fatalf("ferryctl %v: %v\n%s", args, err, b)
		}
		return string(b)
	}
	ctl(snd.socket, "stage", "cli-1", "--shape", "16,4096", "--dtype", "bf16", "--zero-copy", in)
	slotJSON := ctl(rcv.socket, "--json", "recv", "cli-1", "--shape", "16,4096", "--dtype", "bf16")
	if err := os.WriteFile(slot, []byte(slotJSON), 0o644); err != nil {
		t.Fatal(err)
	}
	if s := ctl(snd.socket, "send", "cli-1", "--slot", slot); !strings.Contains(s, "sent cli-1: 131072 bytes") {
		t.Fatalf("send output: %s", s)
	}
	ctl(rcv.socket, "wait", "cli-1", "-o", out)
	got, err := os.ReadFile(out)
	if err != nil || !bytes.Equal(got, data) {
		t.Fatalf("ferryctl round trip differs: %v", err)
	}
	if s := ctl(snd.socket, "status"); !strings.Contains(s, "transport  tcp") {
		t.Fatalf("status output: %s", s)
	}

	// A daemon that is not there: one sentence naming the socket.
	missing := filepath.Join(dir, "nobody.sock")
	cmd := exec.Command(filepath.Join(bin, "ferryctl"), "--socket", missing, "status")
	b, err := cmd.CombinedOutput()
	if err == nil || !strings.Contains(string(b), missing) || !strings.Contains(string(b), "is ferryd running") || !strings.Contains(string(b), "--socket or FERRY_SOCKET") {
		t.Fatalf("unreachable daemon: err=%v output=%s", err, b)
	}
}

func TestSecondDaemonOnSameSocketIsRefused(t *testing.T) {
	dir := t.TempDir()
	d := startDaemon(t, dir, "one")
	cmd := exec.Command(filepath.Join(bin, "ferryd"), "--socket", d.socket, "--listen", "127.0.0.1:0", "--arena-size", "1MiB")
	b, err := cmd.CombinedOutput()
	if err == nil || !strings.Contains(string(b), "in use by a running ferryd") {
		t.Fatalf("second ferryd on the same socket: err=%v output=%s", err, b)
	}
	d.alive(t)
}

// A send that names the slot's size is refused before anything moves when
// the embedding is larger, and keeps it staged.
func TestSendLargerThanTheNamedSlotIsRefused(t *testing.T) {
	snd, rcv := pair(t)
	ctx := ctxT(t)
	data := randomBytes(8192, 61)
	if _, err := snd.c.Stage(ctx, "big", []int64{8192}, "u8", bytes.NewReader(data), 8192); err != nil {
		t.Fatal(err)
	}
	slot, err := rcv.c.Receive(ctx, "small", 4096)
	if err != nil {
		t.Fatal(err)
	}
	_, err = snd.c.Send(ctx, "big", api.SendRequest{Session: slot.Session, BufferAddress: slot.BufferAddress, Key: slot.Key, NBytes: slot.NBytes})
	wantErr(t, err, 400, api.CodeBadRequest, "big", "8192 bytes", "4096", "kept")
	if e, err := snd.c.Embedding(ctx, "big"); err != nil || e.State != "staged" {
		t.Fatalf("after the refusal: %+v, %v", e, err)
	}
	if info, err := rcv.c.WaitInfo(ctx, "small", 0); err != nil || info.WritesInFlight != 0 || info.Arrived {
		t.Fatalf("the slot after a refused send: %+v, %v", info, err)
	}
}

// TestLargeSendIsStriped: over TCP a send of several MiB goes as
// tcp_stripes pieces at once, each on a connection of its own, and the
// slot arrives once, whole and byte-exact; tcp_stripes 1 sends it whole.
// A slot too small for the embedding refuses the pieces that do not fit,
// the send fails with the refusal and the entry stays staged, and a
// resend to a slot of the right size delivers it.
func TestLargeSendIsStriped(t *testing.T) {
	const n = 8<<20 + 4096 + 3 // not a multiple of the stripes
	for _, tc := range []struct {
		stripes string
		writes  int
	}{{"4", 4}, {"1", 1}} {
		t.Run("tcp_stripes="+tc.stripes, func(t *testing.T) {
			snd, rcv := pair(t, "--tcp-stripes", tc.stripes)
			ctx := ctxT(t)
			data := randomBytes(n, 7)
			if _, err := snd.c.Stage(ctx, "big", []int64{n}, "u8", bytes.NewReader(data), n); err != nil {
				t.Fatal(err)
			}
			if tc.writes > 1 {
				// The first two pieces fit, the last two do not.
				_, err := snd.c.Send(ctx, "big", slotFor(t, rcv, "small", n/2))
				wantErr(t, err, 400, api.CodeRefused, "big", "out_of_bounds", "kept")
				if _, err := snd.c.Embedding(ctx, "big"); err != nil {
					t.Fatalf("the refused send's entry is gone: %v", err)
				}
			}
			res, err := snd.c.Send(ctx, "big", slotFor(t, rcv, "big", n))
			if err != nil {
				t.Fatal(err)
			}
			if res.Writes != tc.writes || res.NBytes != n {
				t.Fatalf("send result %+v, want %d writes of %d bytes", res, tc.writes, n)
			}
			got, err := rcv.c.Wait(ctx, "big", 10*time.Second)
			if err != nil {
				t.Fatal(err)
			}
			if !bytes.Equal(got, data) {
				t.Fatal("received bytes differ from the staged ones")
			}
		})
	}
}
