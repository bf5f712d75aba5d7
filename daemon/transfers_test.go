package daemon

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/ferry-project/ferry/api"
	"github.com/ferry-project/ferry/client"
)

// At most maxRunning batches run at once; one ending makes room, and the
// newest keptTransfers ended ones stay reportable.
func TestTransfersAreBounded(t *testing.T) {
	ts := newTransfers()
	var running []*batch
	for i := range maxRunning {
		b, err := ts.add(api.Transfer{}, 0, 0)
		if err != nil {
			t.Fatalf("batch %d: %v", i, err)
		}
		running = append(running, b)
	}
	if _, err := ts.add(api.Transfer{}, 0, 0); !isCode(err, api.CodeBusy) {
		t.Fatalf("one batch over the limit: %v", err)
	}
	first := running[0]
	ts.retire(first.t.ID)
	b, err := ts.add(api.Transfer{}, 0, 0)
	if err != nil {
		t.Fatalf("after one ended: %v", err)
	}
	for _, b := range append(running[1:], b) {
		ts.retire(b.t.ID)
	}
	if _, err := ts.get(first.t.ID); err != nil {
		t.Fatalf("an ended batch is no longer reportable: %v", err)
	}
	for range keptTransfers {
		b, err := ts.add(api.Transfer{}, 0, 0)
		if err != nil {
			t.Fatal(err)
		}
		ts.retire(b.t.ID)
	}
	if _, err := ts.get(first.t.ID); !isCode(err, api.CodeNotFound) {
		t.Fatalf("the oldest ended batch after %d newer ended: %v", keptTransfers, err)
	}
}

// At most maxRegions regions are registered at once.
func TestRegionsAreBounded(t *testing.T) {
	r := newRegistry(nil)
	for i := range maxRegions {
		if _, err := r.addRegion(fmt.Sprintf("g%d", i), hostRegion(make([]byte, 1)), nil, nil); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := r.addRegion("one-more", hostRegion(make([]byte, 1)), nil, nil); !isCode(err, api.CodeBusy) {
		t.Fatalf("one region over the limit: %v", err)
	}
}

// A transfer past api's limits, or one the running transfers have no
// room left for, is refused through the real handler with an answer that
// names the limit; its source stays staged, and once room is made the
// same transfer runs.
func TestTransferLimitsAreAnswered(t *testing.T) {
	d, c := serveTestDaemon(t, t.TempDir(), "d", nil)
	// Its requests are megabytes of JSON, 14 s of CPU under the race
	// detector: the bound leaves room for a busy machine.
	ctx, cancel := context.WithTimeout(t.Context(), 3*time.Minute)
	defer cancel()
	data := make([]byte, 8192)
	rand.Read(data)
	if _, err := c.Stage(ctx, "src", []int64{8192}, "u8", bytes.NewReader(data), 8192); err != nil {
		t.Fatal(err)
	}
	slot, err := c.Receive(ctx, "dst", 8192)
	if err != nil {
		t.Fatal(err)
	}
	// Two writes: the source's halves swapped in the slot.
	good := api.TransferRequest{Sources: []api.TransferSource{{ReqID: "src"}}, Destinations: []api.ReceiveSlot{slot},
		Items: api.Items{{0, 0, 0, 4096, 4096}, {0, 4096, 0, 0, 4096}}}

	tooMany := make(api.Items, api.MaxTransferItems+1)
	for i := range tooMany {
		tooMany[i] = []int64{0, 0, 0, 0, 1}
	}
	longSession := slot
	longSession.Session = strings.Repeat("a", 400) + ":17100"
	for _, c2 := range []struct {
		what       string
		change     func(r *api.TransferRequest)
		code, says string
	}{
		{"65537 destinations", func(r *api.TransferRequest) {
			r.Destinations = slices.Repeat(r.Destinations, api.MaxTransferDestinations+1)
		}, api.CodeTooLarge, "the transfer lists more than 65536 destinations, the most one transfer may: split it into several transfers"},
		{"65537 sources", func(r *api.TransferRequest) {
			r.Sources = slices.Repeat(r.Sources, api.MaxTransferSources+1)
		}, api.CodeTooLarge, "the transfer lists more than 65536 sources, the most one transfer may: split it into several transfers"},
		{"1048577 items", func(r *api.TransferRequest) { r.Items = tooMany },
			api.CodeTooLarge, "the transfer has more than 1048576 items, the most one transfer may: split them into several transfers"},
		{"an item of six fields", func(r *api.TransferRequest) { r.Items = api.Items{{0, 0, 0, 0, 1}, {0, 0, 0, 0, 1, 0}} },
			api.CodeBadRequest, "items: item 1 has more than 5 fields"},
		{"a session of 406 bytes", func(r *api.TransferRequest) { r.Destinations = []api.ReceiveSlot{longSession} },
			api.CodeBadRequest, "destination 0: session \"aaaa"},
	} {
		req := good
		c2.change(&req)
		_, err := c.StartTransfer(ctx, req)
		var ae *client.Error
		if !errors.As(err, &ae) || ae.Code != c2.code || ae.Status != api.StatusOf(c2.code) || !strings.Contains(ae.Message, c2.says) {
			t.Fatalf("%s: got %v; want %d %s saying %q", c2.what, err, api.StatusOf(c2.code), c2.code, c2.says)
		}
	}

	// Room for 8 KiB between the running transfers, 8100 bytes of it
	// taken by one that runs on: the good transfer (some 200 bytes) waits.
	d.transfers.mu.Lock()
	d.transfers.most = 8 << 10
	d.transfers.mu.Unlock()
	other, err := d.transfers.add(api.Transfer{State: api.TransferRunning}, 0, 8100)
	if err != nil {
		t.Fatal(err)
	}
	_, err = c.Transfer(ctx, good, 10*time.Second)
	var ae *client.Error
	if !errors.As(err, &ae) || ae.Code != api.CodeBusy ||
		!strings.Contains(ae.Message, "(its 2 writes and 1 destination), and the running transfers (1) hold 7.91KiB of the 8KiB ferryd lets them hold at once: wait for some to end (GET /v1/events), or split it into smaller transfers") {
		t.Fatalf("past the room left: got %v; want busy naming the bytes", err)
	}
	d.transfers.retire(other.t.ID)
	tr, err := c.Transfer(ctx, good, 10*time.Second)
	if err != nil || tr.State != api.TransferDone || tr.Writes != 2 {
		t.Fatalf("with room made: %+v, %v", tr, err)
	}
	got, err := c.Wait(ctx, "dst", 10*time.Second)
	if err != nil || !bytes.Equal(got, append(data[4096:], data[:4096]...)) {
		t.Fatalf("the slot holds %d bytes (%v), not the source's halves swapped", len(got), err)
	}
	// Once it ended (its event comes after), it holds nothing.
	for after := uint64(0); ; {
		evs, err := c.Events(ctx, after, 10*time.Second)
		if err != nil {
			t.Fatal(err)
		}
		if slices.ContainsFunc(evs.Events, func(e api.Event) bool { return e.TransferID == tr.ID }) {
			break
		}
		after = evs.Next
	}
	d.transfers.mu.Lock()
	held := d.transfers.held
	d.transfers.mu.Unlock()
	if held != 0 {
		t.Fatalf("with no transfer running, %d bytes are counted held", held)
	}
}

// A caller waiting on a transfer that leaves gets a wait that ran out,
// naming the transfer, never a bare context error (a 500).
func TestTransferWaitWhoseCallerLeft(t *testing.T) {
	d, _ := serveTestDaemon(t, t.TempDir(), "d", nil)
	b, err := d.transfers.add(api.Transfer{State: api.TransferRunning, Writes: 3}, 0, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer d.transfers.retire(b.t.ID)
	left, leave := context.WithCancel(context.Background())
	leave()
	rec := httptest.NewRecorder()
	d.http.Handler.ServeHTTP(rec, httptest.NewRequestWithContext(left, "GET", "/v1/transfers/"+b.t.ID+"?wait=30s", nil))
	var env api.ErrorBody
	if err := json.Unmarshal(rec.Body.Bytes(), &env); err != nil || rec.Code != http.StatusGatewayTimeout || env.Error.Code != api.CodeTimeout ||
		!strings.Contains(env.Error.Message, "transfer "+b.t.ID+" is still running after waiting") {
		t.Fatalf("got %d %s", rec.Code, rec.Body)
	}
}

// Transfer bodies are read a few at once: with every turn taken, a body
// waits, and one whose caller leaves meanwhile is answered so, unread.
func TestTransferBodiesWaitTheirTurn(t *testing.T) {
	d, _ := serveTestDaemon(t, t.TempDir(), "d", nil)
	for range maxReading {
		d.transfers.reading <- struct{}{}
	}
	defer func() {
		for range maxReading {
			d.transfers.doneReading()
		}
	}()
	left, leave := context.WithCancel(context.Background())
	leave()
	rec := httptest.NewRecorder()
	d.http.Handler.ServeHTTP(rec, httptest.NewRequestWithContext(left, "POST", "/v1/transfers", strings.NewReader(`{"sources":[]}`)))
	var env api.ErrorBody
	if err := json.Unmarshal(rec.Body.Bytes(), &env); err != nil || rec.Code != http.StatusGatewayTimeout ||
		!strings.Contains(env.Error.Message, "for its turn to be read, and its request ended first: ferryd reads and checks 4 transfer bodies at once") {
		t.Fatalf("got %d %s", rec.Code, rec.Body)
	}
}

// An item field of 2^64 or more, which a parser summing digits unchecked
// reads as what is left after wrapping (2^64 as 0), is refused through
// the real handler with a 400 naming the item and the field; the daemon
// goes on serving.
func TestTransferItemOutOfRangeIsRefused(t *testing.T) {
	_, c := serveTestDaemon(t, t.TempDir(), "d", nil)
	hc := &http.Client{Transport: &http.Transport{DialContext: client.UnixDialer(c.Socket)}, Timeout: 30 * time.Second}
	for field, n := range []string{"18446744073709551616", "18446744073709551617", "-18446744073709551616", "340282366920938463463374607431768211456", "18446744073709551616"} {
		item := []string{"0", "0", "0", "0", "1"}
		item[field] = n
		body := `{"sources":[{"req_id":"src"}],"destinations":[{"session":"127.0.0.1:1","buffer_address":4096,"key":"00112233445566778899aabbccddeeff00112233","nbytes":8}],` +
			`"items":[[0,0,0,0,1],[` + strings.Join(item, ",") + `]]}`
		resp, err := hc.Post("http://ferryd/v1/transfers", "application/json", strings.NewReader(body))
		if err != nil {
			t.Fatal(err)
		}
		var eb api.ErrorBody
		err = json.NewDecoder(resp.Body).Decode(&eb)
		resp.Body.Close()
		says := fmt.Sprintf("items: item 1: field %d (%s) is out of range", field, []string{"source", "source_offset", "destination", "destination_offset", "nbytes"}[field])
		if err != nil || resp.StatusCode != http.StatusBadRequest || eb.Error.Code != api.CodeBadRequest || !strings.Contains(eb.Error.Message, says) {
			t.Fatalf("field %d = %s: %d %+v (%v); want 400 bad_request saying %q", field, n, resp.StatusCode, eb.Error, err, says)
		}
	}
	if _, err := c.Status(t.Context()); err != nil {
		t.Fatalf("after the refusals: %v", err)
	}
}
