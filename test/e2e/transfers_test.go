package e2e

import (
	"bytes"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/ferry-project/ferry/api"
	"github.com/ferry-project/ferry/client"
)

// scatter cuts src into pieces of lo..hi bytes and lays them into the
// destination in a shuffled order. It returns the items, the
// destination's bytes, and how many writes the items make once pieces
// adjacent at both ends (by chance of the shuffle) are merged.
func scatter(src []byte, lo, hi int, seed uint64) ([][]int64, []byte, int) {
	r := rand.New(rand.NewPCG(seed, seed+1))
	type cut struct{ off, n int }
	var cuts []cut
	for off := 0; off < len(src); {
		n := min(lo+r.IntN(hi-lo+1), len(src)-off)
		cuts = append(cuts, cut{off, n})
		off += n
	}
	order := r.Perm(len(cuts))
	want := make([]byte, 0, len(src))
	items := make([][]int64, len(cuts))
	dst, writes := 0, 0
	for k, i := range order {
		if k == 0 || order[k-1] != i-1 {
			writes++
		}
		c := cuts[i]
		items[i] = []int64{0, int64(c.off), 0, int64(dst), int64(c.n)}
		want = append(want, src[c.off:c.off+c.n]...)
		dst += c.n
	}
	return items, want, writes
}

func TestBatchScattersPiecesIntoOneSlotAndCompletesOnce(t *testing.T) {
	snd, rcv := pair(t)
	ctx := ctxT(t)
	src := randomBytes(8<<20, 31)
	items, want, writes := scatter(src, 4<<10, 64<<10, 7)
	if len(items) < 200 {
		t.Fatalf("only %d pieces", len(items))
	}
	if _, err := snd.c.Stage(ctx, "kv-src", []int64{int64(len(src))}, "u8", bytes.NewReader(src), int64(len(src))); err != nil {
		t.Fatal(err)
	}
	slot, err := rcv.c.Receive(ctx, "kv-dst", int64(len(src)))
	if err != nil {
		t.Fatal(err)
	}
	started, err := snd.c.StartTransfer(ctx, api.TransferRequest{
		Sources: []api.TransferSource{{ReqID: "kv-src"}}, Destinations: []api.ReceiveSlot{slot}, Items: items,
	})
	if err != nil {
		t.Fatal(err)
	}
	if started.ID == "" || started.Items != len(items) || started.Writes != writes || started.NBytes != int64(len(src)) {
		t.Fatalf("start answered %+v for %d scattered items making %d writes", started, len(items), writes)
	}
	done, err := snd.c.WaitTransfer(ctx, started.ID, 20*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	if done.State != api.TransferDone || done.WritesDone != writes || done.Error != nil {
		t.Fatalf("transfer ended as %+v", done)
	}
	got, err := rcv.c.Wait(ctx, "kv-dst", 10*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, want) {
		t.Fatal("the slot's bytes differ from the pieces laid out as the items said")
	}
	if _, err := snd.c.Embedding(ctx, "kv-src"); client.Code(err) != api.CodeNoEmbedding {
		t.Fatalf("the source is still staged after the transfer succeeded: %v", err)
	}
	// One event on each side: the receiver's slot arrived once, the
	// sender's batch ended once.
	rev, err := rcv.c.Events(ctx, 0, 0)
	if err != nil {
		t.Fatal(err)
	}
	if len(rev.Events) != 1 || rev.Events[0].Kind != api.EventArrived || rev.Events[0].ReqID != "kv-dst" || rev.Events[0].NBytes != int64(len(src)) {
		t.Fatalf("receiver events: %+v", rev)
	}
	sev, err := snd.c.Events(ctx, 0, 0)
	if err != nil {
		t.Fatal(err)
	}
	if len(sev.Events) != 1 || sev.Events[0].Kind != api.EventTransferDone || sev.Events[0].TransferID != started.ID {
		t.Fatalf("sender events: %+v", sev)
	}
	m := snd.metrics(t)
	if v := metricSum(m, "ferry_batches_total", `outcome="ok"`); v != 1 {
		t.Errorf("ferry_batches_total{outcome=ok} = %v, want 1", v)
	}
	if v := metricSum(m, "ferry_batch_writes_total"); v != float64(writes) {
		t.Errorf("ferry_batch_writes_total = %v, want %d", v, writes)
	}
}

func TestBatchMergesAdjacentItemsIntoOneWrite(t *testing.T) {
	snd, rcv := pair(t)
	ctx := ctxT(t)
	src := randomBytes(64*4096, 32)
	if _, err := snd.c.Stage(ctx, "pages", []int64{int64(len(src))}, "u8", bytes.NewReader(src), int64(len(src))); err != nil {
		t.Fatal(err)
	}
	slot, err := rcv.c.Receive(ctx, "pages", int64(len(src)))
	if err != nil {
		t.Fatal(err)
	}
	var items [][]int64
	for i := int64(63); i >= 0; i-- { // listed backwards: merging does not depend on order
		items = append(items, []int64{0, i * 4096, 0, i * 4096, 4096})
	}
	started, err := snd.c.StartTransfer(ctx, api.TransferRequest{
		Sources: []api.TransferSource{{ReqID: "pages"}}, Destinations: []api.ReceiveSlot{slot}, Items: items, KeepSources: true,
	})
	if err != nil {
		t.Fatal(err)
	}
	if started.Writes != 1 || started.Items != 64 {
		t.Fatalf("64 contiguous pages became %d writes", started.Writes)
	}
	if done, err := snd.c.WaitTransfer(ctx, started.ID, 10*time.Second); err != nil || done.State != api.TransferDone {
		t.Fatalf("transfer: %+v, %v", done, err)
	}
	got, err := rcv.c.Wait(ctx, "pages", 10*time.Second)
	if err != nil || !bytes.Equal(got, src) {
		t.Fatalf("slot bytes differ (err %v)", err)
	}
	if e, err := snd.c.Embedding(ctx, "pages"); err != nil || e.State != "staged" {
		t.Fatalf("keep_sources: the source is %+v, %v; want it still staged", e, err)
	}
}

func TestBatchFailureKeepsSourcesAndNamesTheItem(t *testing.T) {
	snd, rcv := pair(t)
	ctx := ctxT(t)
	src := randomBytes(64<<10, 33)
	if _, err := snd.c.Stage(ctx, "big", []int64{int64(len(src))}, "u8", bytes.NewReader(src), int64(len(src))); err != nil {
		t.Fatal(err)
	}
	slot, err := rcv.c.Receive(ctx, "small", 32<<10)
	if err != nil {
		t.Fatal(err)
	}
	slot.NBytes = 0 // a descriptor without its size: only the receiver can refuse
	items := [][]int64{{0, 0, 0, 0, 16 << 10}, {0, 32 << 10, 0, 16 << 10, 32 << 10}}
	started, err := snd.c.StartTransfer(ctx, api.TransferRequest{
		Sources: []api.TransferSource{{ReqID: "big"}}, Destinations: []api.ReceiveSlot{slot}, Items: items,
	})
	if err != nil {
		t.Fatal(err)
	}
	done, err := snd.c.WaitTransfer(ctx, started.ID, 10*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	if done.State != api.TransferFailed || done.Error == nil || done.Error.Code != api.CodeRefused || done.Item == nil || *done.Item != 1 {
		t.Fatalf("transfer ended as %+v (error %+v), want failed, refused, item 1", done, done.Error)
	}
	if e, err := snd.c.Embedding(ctx, "big"); err != nil || e.State != "staged" {
		t.Fatalf("after a failed transfer the source is %+v, %v; want it still staged", e, err)
	}
	sev, err := snd.c.Events(ctx, 0, 0)
	if err != nil || len(sev.Events) != 1 || sev.Events[0].Kind != api.EventTransferFailed || sev.Events[0].Error.Code != api.CodeRefused {
		t.Fatalf("sender events: %+v, %v", sev, err)
	}
	if v := metricSum(snd.metrics(t), "ferry_batches_total", `outcome="failed"`); v != 1 {
		t.Errorf("ferry_batches_total{outcome=failed} = %v, want 1", v)
	}
}

func TestBatchBadRequestsAreRefusedUpFront(t *testing.T) {
	snd, rcv := pair(t)
	ctx := ctxT(t)
	if _, err := snd.c.Stage(ctx, "s", []int64{4096}, "u8", bytes.NewReader(make([]byte, 4096)), 4096); err != nil {
		t.Fatal(err)
	}
	slot, err := rcv.c.Receive(ctx, "d", 4096)
	if err != nil {
		t.Fatal(err)
	}
	src := []api.TransferSource{{ReqID: "s"}}
	dst := []api.ReceiveSlot{slot}
	for _, c := range []struct {
		name   string
		req    api.TransferRequest
		status int
		code   string
		names  []string
	}{
		{"four fields", api.TransferRequest{Sources: src, Destinations: dst, Items: [][]int64{{0, 0, 0, 4096}}}, 400, api.CodeBadRequest, []string{"item 0", "4 fields"}},
		{"source index", api.TransferRequest{Sources: src, Destinations: dst, Items: [][]int64{{1, 0, 0, 0, 1}}}, 400, api.CodeBadRequest, []string{"item 0", "source 1"}},
		{"past the source", api.TransferRequest{Sources: src, Destinations: dst, Items: [][]int64{{0, 4000, 0, 0, 100}}}, 400, api.CodeBadRequest, []string{"item 0", "4096 bytes"}},
		{"past the slot", api.TransferRequest{Sources: src, Destinations: dst, Items: [][]int64{{0, 0, 0, 1, 4096}}}, 400, api.CodeBadRequest, []string{"item 0", "destination 0"}},
		{"empty", api.TransferRequest{Sources: src, Destinations: dst, Items: [][]int64{{0, 0, 0, 0, 0}}}, 400, api.CodeBadRequest, []string{"item 0", "0 bytes"}},
		{"no items", api.TransferRequest{Sources: src, Destinations: dst}, 400, api.CodeBadRequest, []string{"no items"}},
		{"not staged", api.TransferRequest{Sources: []api.TransferSource{{ReqID: "nope"}}, Destinations: dst, Items: [][]int64{{0, 0, 0, 0, 1}}}, 404, api.CodeNoEmbedding, []string{"nope"}},
		{"twice", api.TransferRequest{Sources: []api.TransferSource{{ReqID: "s"}, {ReqID: "s"}}, Destinations: dst, Items: [][]int64{{0, 0, 0, 0, 1}}}, 400, api.CodeBadRequest, []string{"sources 0 and 1"}},
		{"no key", api.TransferRequest{Sources: src, Destinations: []api.ReceiveSlot{{Session: slot.Session, BufferAddress: slot.BufferAddress}}, Items: [][]int64{{0, 0, 0, 0, 1}}}, 400, api.CodeBadRequest, []string{"destination 0", "key"}},
	} {
		t.Run(c.name, func(t *testing.T) {
			_, err := snd.c.StartTransfer(ctx, c.req)
			wantErr(t, err, c.status, c.code, c.names...)
		})
	}
	// Nothing was taken: the source is staged, and sends as before.
	if e, err := snd.c.Embedding(ctx, "s"); err != nil || e.State != "staged" {
		t.Fatalf("after refused transfers the source is %+v, %v", e, err)
	}
	_, err = snd.c.WaitTransfer(ctx, "t999", 0)
	wantErr(t, err, 404, api.CodeNotFound, "t999")
}

func TestEventsLongPollWakesOnArrival(t *testing.T) {
	snd, rcv := pair(t)
	ctx := ctxT(t)
	first, err := rcv.c.Events(ctx, 0, 0)
	if err != nil || len(first.Events) != 0 {
		t.Fatalf("a fresh daemon's events: %+v, %v", first, err)
	}
	type answer struct {
		ev  api.Events
		err error
	}
	got := make(chan answer, 1)
	go func() {
		ev, err := rcv.c.Events(ctx, first.Next, 20*time.Second)
		got <- answer{ev, err}
	}()
	data := randomBytes(4096, 34)
	if _, err := snd.c.Stage(ctx, "ev-1", []int64{4096}, "u8", bytes.NewReader(data), 4096); err != nil {
		t.Fatal(err)
	}
	if _, err := snd.c.Send(ctx, "ev-1", slotFor(t, rcv, "ev-1", 4096)); err != nil {
		t.Fatal(err)
	}
	select {
	case a := <-got:
		if a.err != nil || len(a.ev.Events) != 1 || a.ev.Events[0].ReqID != "ev-1" || a.ev.Next != a.ev.Events[0].Seq {
			t.Fatalf("long poll answered %+v, %v", a.ev, a.err)
		}
		// Asking again past it waits, and answers empty when the wait ends.
		again, err := rcv.c.Events(ctx, a.ev.Next, 50*time.Millisecond)
		if err != nil || len(again.Events) != 0 || again.Next != a.ev.Next {
			t.Fatalf("after the last event: %+v, %v", again, err)
		}
	case <-time.After(20 * time.Second):
		t.Fatal("the long poll did not wake on the arrival")
	}
}
