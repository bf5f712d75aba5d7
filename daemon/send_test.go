package daemon

import (
	"bytes"
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/ferry-project/ferry/api"
	"github.com/ferry-project/ferry/arena"
	"github.com/ferry-project/ferry/client"
	"github.com/ferry-project/ferry/config"
	"github.com/ferry-project/ferry/transport"
)

// TestSharedMRFromReport: shared_mr is what the transport reported of the
// write: false for a per-send registration or a bounce copy.
func TestSharedMRFromReport(t *testing.T) {
	for _, c := range []struct {
		r    transport.Report
		want bool
	}{
		{transport.Report{Messages: 2}, true}, // TCP
		{transport.Report{Registration: transport.RegisteredShared, Messages: 2}, true},
		{transport.Report{Registration: transport.RegisteredPerSend, Messages: 2}, false},
		{transport.Report{Copied: 4096, Messages: 2}, false}, // through a bounce buffer
	} {
		if got := sharedMR(c.r); got != c.want {
			t.Errorf("sharedMR(%+v) = %v, want %v", c.r, got, c.want)
		}
	}
}

// nicErr is a transport's error that names the NIC's status.
type nicErr struct{}

func (nicErr) Error() string      { return "the write completed in error" }
func (nicErr) StatusName() string { return "RETRY_EXC_ERR" }

func TestRetCodeNamesTheNICStatus(t *testing.T) {
	if got := retCode(fmt.Errorf("rdma write to x: %w", nicErr{})); got != "RETRY_EXC_ERR" {
		t.Fatalf("retCode = %q, want the status the error names", got)
	}
}

// A send of a staged entry and a batch piece from a CUDA region, each
// several stageChunks of GPU memory (beneath the arena.Copier seam),
// reach a receiver over TCP byte-exact, while each write holds at most
// one chunk of host staging: the batch piece one chunk, the send's two
// stripes two between them. Copied out whole, each would take all its
// bytes at once.
func TestGPUSourcesAreStagedInChunks(t *testing.T) {
	const n = 3*stageChunk + 12345 // three whole chunks and a tail
	ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
	defer cancel()
	dir := t.TempDir()
	_, rcv := serveTestDaemon(t, dir, "rcv", func(c *Config) { c.ArenaSize = "128MiB" })
	d := newTestDaemon(t, dir, "snd", func(c *Config) { c.TCPStripes = 2 })
	gpu := &deviceMemory{mem: make([]byte, n+(1<<20))}
	var err error
	if d.arena, err = arena.New(gpu, config.ArenaAlign); err != nil {
		t.Fatal(err)
	}
	d.reg.arena = d.arena
	snd := serveDaemon(t, d)
	region := &deviceMemory{mem: make([]byte, n+4096)}
	if _, err := d.reg.addRegion("kv", region, nil, nil); err != nil {
		t.Fatal(err)
	}

	data := make([]byte, n)
	if _, err := rand.Read(data); err != nil {
		t.Fatal(err)
	}
	arrived := func(reqID string) {
		t.Helper()
		got, err := rcv.Wait(ctx, reqID, 30*time.Second)
		if err != nil || !bytes.Equal(got, data) {
			t.Fatalf("%s: %d bytes arrived (%v), not the %d sent", reqID, len(got), err, n)
		}
	}

	if _, err := snd.Stage(ctx, "e1", []int64{n}, "u8", bytes.NewReader(data), n); err != nil {
		t.Fatal(err)
	}
	gpu.takePeak() // the upload's staging
	slot, err := rcv.Receive(ctx, "e1", n)
	if err != nil {
		t.Fatal(err)
	}
	res, err := snd.Send(ctx, "e1", api.SendRequest{Session: slot.Session, BufferAddress: slot.BufferAddress, Key: slot.Key, NBytes: n})
	if err != nil || res.Writes != 2 || res.Attempts != 1 || !res.SharedMR {
		t.Fatalf("send: %+v, %v; want 2 writes, 1 attempt, nothing registered or bounced", res, err)
	}
	arrived("e1")
	if peak := gpu.takePeak(); peak < stageChunk || peak > 2*stageChunk {
		t.Errorf("the send's two stripes held %d bytes of host staging at once, want one to two chunks (%d each)", peak, stageChunk)
	}

	copy(region.mem[4096:], data)
	slot, err = rcv.Receive(ctx, "r1", n)
	if err != nil {
		t.Fatal(err)
	}
	// Items of 4 MiB end to end: one piece of n bytes.
	req := api.TransferRequest{Sources: []api.TransferSource{{Region: "kv"}}, Destinations: []api.ReceiveSlot{slot}}
	for off := int64(0); off < n; off += 4 << 20 {
		req.Items = append(req.Items, []int64{0, 4096 + off, 0, off, min(4<<20, n-off)})
	}
	tr, err := snd.Transfer(ctx, req, 30*time.Second)
	if err != nil || tr.State != api.TransferDone || tr.Writes != 1 {
		t.Fatalf("transfer: %+v, %v; want done in one write", tr, err)
	}
	arrived("r1")
	if peak := region.takePeak(); peak != stageChunk {
		t.Errorf("the batch piece of %d bytes held %d bytes of host staging at once, want one chunk (%d)", n, peak, stageChunk)
	}

	// Staging runs out after some chunks went: the send fails as busy,
	// the entry stays staged, and a resend rewrites the slot whole.
	for _, id := range []string{"e1", "r1"} {
		if err := rcv.FreeReceive(ctx, id); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := snd.Stage(ctx, "e2", []int64{n}, "u8", bytes.NewReader(data), n); err != nil {
		t.Fatal(err)
	}
	if slot, err = rcv.Receive(ctx, "e2", n); err != nil {
		t.Fatal(err)
	}
	sendE2 := func() error {
		_, err := snd.Send(ctx, "e2", api.SendRequest{Session: slot.Session, BufferAddress: slot.BufferAddress, Key: slot.Key, NBytes: n})
		return err
	}
	gpu.mu.Lock()
	gpu.lendLimit = gpu.lends + 3 // of the four chunks the two stripes take
	gpu.mu.Unlock()
	var ae *client.Error
	if err := sendE2(); !errors.As(err, &ae) || ae.Code != api.CodeBusy || !strings.Contains(ae.Message, "stays staged") {
		t.Fatalf("a send whose staging ran out midway: %v; want 409 busy, the entry kept", err)
	}
	gpu.mu.Lock()
	gpu.lendLimit = 0
	gpu.mu.Unlock()
	// The resend's stripes run at once: the one carrying the bytes the
	// failed send left out may complete the slot before the other lands,
	// which is then refused as writing into a slot that holds its data.
	// Either way the slot holds the entry's bytes.
	if err := sendE2(); err != nil && !(errors.As(err, &ae) && ae.Code == api.CodeRefused && strings.Contains(ae.Message, "already holds its data")) {
		t.Fatalf("the resend: %v", err)
	}
	arrived("e2")
}
