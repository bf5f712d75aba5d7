package daemon

import (
	"fmt"
	"testing"

	"github.com/ferry-project/ferry/api"
)

// At most maxRunning batches run at once; one ending makes room, and the
// newest keptTransfers ended ones stay reportable.
func TestTransfersAreBounded(t *testing.T) {
	ts := newTransfers()
	var running []*batch
	for i := range maxRunning {
		b, err := ts.add(api.Transfer{})
		if err != nil {
			t.Fatalf("batch %d: %v", i, err)
		}
		running = append(running, b)
	}
	if _, err := ts.add(api.Transfer{}); !isCode(err, api.CodeBusy) {
		t.Fatalf("one batch over the limit: %v", err)
	}
	first := running[0]
	ts.retire(first.t.ID)
	b, err := ts.add(api.Transfer{})
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
		b, err := ts.add(api.Transfer{})
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
