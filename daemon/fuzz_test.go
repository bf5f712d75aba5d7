package daemon

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/ferry-project/ferry/api"
)

// FuzzControlAPI sends one arbitrary request (method, target with path and
// query, JSON or raw body) through the daemon's real route table, as the
// HTTP server would hand it over. Before each request the daemon holds a
// staged entry (staged-1, 64 bytes), a reserved slice (reserved-1) and a
// receive slot (slot-1, 64 bytes); $SESSION, $ADDR and $KEY in the input
// stand for that slot's address, so a send to it can succeed.
//
// Every answer must be a success or the one error envelope with a code
// that fits its status, never a 500; afterwards every entry and slot must
// be deletable (none left busy) and the arena must be empty again.
// Seeds: testdata/fuzz/FuzzControlAPI.
func FuzzControlAPI(f *testing.F) {
	dir := f.TempDir()
	cfg := testConfig(dir, "d")
	cfg.ArenaSize, cfg.SendTimeout, cfg.IOTimeout, cfg.RequestTimeout = "1MiB", "2s", "2s", "5s"
	d, err := New(cfg)
	if err != nil {
		f.Fatal(err)
	}
	f.Cleanup(d.closeAll)
	routes := d.http.Handler

	f.Fuzz(func(t *testing.T, method, target string, body []byte) {
		slot := d.fuzzFixtures(t)
		defer d.fuzzReset(t)
		subst := strings.NewReplacer("$SESSION", d.advertise, "$ADDR", fmt.Sprint(slot.addr), "$KEY", fmt.Sprint(slot.key))
		target = subst.Replace(target)
		body = []byte(subst.Replace(string(body)))
		raw := fmt.Sprintf("%s %s HTTP/1.1\r\nHost: ferryd\r\nContent-Length: %d\r\n\r\n%s", method, target, len(body), body)
		req, err := http.ReadRequest(bufio.NewReader(strings.NewReader(raw)))
		if err != nil {
			return // the HTTP server answers these itself, before any handler
		}
		if req.Method == http.MethodPost && strings.HasSuffix(req.URL.Path, "/send") && dialsElsewhere(d, body) {
			return // tests dial no address but their own
		}
		// Waits end early: what is fuzzed is the decoding, not the clock.
		ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
		defer cancel()
		rec := httptest.NewRecorder()
		routes.ServeHTTP(rec, req.WithContext(ctx))
		checkAnswer(t, req, rec)
	})
}

// dialsElsewhere says whether a send body names a valid session other
// than the daemon's own, which the send would dial.
func dialsElsewhere(d *Daemon, body []byte) bool {
	var sr api.SendRequest
	if json.NewDecoder(bytes.NewReader(body)).Decode(&sr) != nil {
		return false // the daemon's stricter decoding refuses it too
	}
	return api.CheckSession(sr.Session) == nil && sr.Session != d.advertise
}

func checkAnswer(t *testing.T, req *http.Request, rec *httptest.ResponseRecorder) {
	t.Helper()
	what := fmt.Sprintf("%s %q", req.Method, req.URL)
	switch {
	case rec.Code >= 200 && rec.Code < 300:
		return
	case rec.Code < 400 || rec.Code >= 600:
		t.Fatalf("%s: answered %d %q, neither a success nor an error envelope", what, rec.Code, rec.Body)
	}
	var env api.ErrorBody
	if ct := rec.Header().Get("Content-Type"); ct != "application/json" {
		t.Fatalf("%s: error %d has Content-Type %q: %q", what, rec.Code, ct, rec.Body)
	}
	if err := json.Unmarshal(rec.Body.Bytes(), &env); err != nil || env.Error.Message == "" {
		t.Fatalf("%s: error %d is not the envelope with a message: %q (%v)", what, rec.Code, rec.Body, err)
	}
	if rec.Code == http.StatusInternalServerError {
		t.Fatalf("%s: an internal error answers input a client may send: %s", what, env.Error.Message)
	}
	if want, ok := api.Codes()[env.Error.Code]; !ok || want != rec.Code {
		t.Fatalf("%s: code %q with status %d; want status %d", what, env.Error.Code, rec.Code, want)
	}
}

// fuzzFixtures puts the entries FuzzControlAPI starts from in place and
// returns the receive slot.
func (d *Daemon) fuzzFixtures(t *testing.T) *slot {
	t.Helper()
	if _, err := d.reg.reserve("staged-1", 64, []int64{64}, "u8", staged); err != nil {
		t.Fatal(err)
	}
	if _, err := d.reg.reserve("reserved-1", 64, nil, "", reserved); err != nil {
		t.Fatal(err)
	}
	s, err := d.reg.newSlot("slot-1", 64, false)
	if err != nil {
		t.Fatal(err)
	}
	return s
}

// fuzzReset deletes every entry and slot, failing if one is still busy or
// the arena keeps bytes nobody holds.
func (d *Daemon) fuzzReset(t *testing.T) {
	t.Helper()
	for _, e := range d.reg.embeddings() {
		if err := d.reg.deleteEntry(e.ReqID); err != nil {
			t.Fatalf("after the request, entry %s cannot be deleted: %v", e.ReqID, err)
		}
	}
	for _, s := range d.reg.receives() {
		if err := d.reg.deleteSlot(s.ReqID); err != nil {
			t.Fatalf("after the request, slot %s cannot be deleted: %v", s.ReqID, err)
		}
	}
	if st := d.arena.Stats(); st.Used != 0 || st.Allocations != 0 {
		t.Fatalf("arena holds %d bytes in %d allocations with every entry and slot deleted", st.Used, st.Allocations)
	}
}
