package daemon

import (
	"bytes"
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"io"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/ferry-project/ferry/api"
	"github.com/ferry-project/ferry/arena"
	"github.com/ferry-project/ferry/client"
	"github.com/ferry-project/ferry/config"
	"github.com/ferry-project/ferry/transport"
)

// gpuDaemon serves a ferryd whose arena is GPU memory of size bytes
// (beneath the arena.Copier seam), taking writes of up to 128 MiB.
func gpuDaemon(t *testing.T, dir, name string, size int) (*deviceMemory, *client.Client) {
	t.Helper()
	d := newTestDaemon(t, dir, name, func(c *Config) { c.ArenaSize = "128MiB" })
	gpu := &deviceMemory{mem: make([]byte, size)}
	var err error
	if d.arena, err = arena.New(gpu, config.ArenaAlign); err != nil {
		t.Fatal(err)
	}
	d.reg.arena = d.arena
	return gpu, serveDaemon(t, d)
}

// A write of 48 MiB from a host arena, over TCP in one piece, lands in a
// GPU slot byte-exact through one stageChunk of host staging, each
// chunk copied in before the next is read; reading the slot back takes
// no more, and one whose copy out fails midway is cut short. A chunk
// whose copy in fails midway fails the write: the sender is told why,
// the slot has not arrived, and a resend lands it.
func TestTCPWritesLandInGPUMemoryAChunkAtATime(t *testing.T) {
	const n = 3 * stageChunk
	ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
	defer cancel()
	dir := t.TempDir()
	gpu, rcv := gpuDaemon(t, dir, "rcv", 2*n)
	_, snd := serveTestDaemon(t, dir, "snd", func(c *Config) { c.ArenaSize = "64MiB"; c.TCPStripes = 1 })

	data := make([]byte, n)
	if _, err := rand.Read(data); err != nil {
		t.Fatal(err)
	}
	// A send frees its entry; a failed one keeps it staged.
	stage := func() {
		t.Helper()
		if _, err := snd.Stage(ctx, "h", []int64{n}, "u8", bytes.NewReader(data), n); err != nil {
			t.Fatal(err)
		}
	}
	slots := map[string]api.ReceiveSlot{}
	for _, id := range []string{"g1", "g2"} {
		slot, err := rcv.Receive(ctx, id, n)
		if err != nil {
			t.Fatal(err)
		}
		slots[id] = slot
	}
	send := func(reqID string) error {
		t.Helper()
		slot := slots[reqID]
		_, err := snd.Send(ctx, "h", api.SendRequest{Session: slot.Session, BufferAddress: slot.BufferAddress, Key: slot.Key, NBytes: n})
		return err
	}

	stage()
	if err := send("g1"); err != nil {
		t.Fatal(err)
	}
	if peak := gpu.takePeak(); peak != stageChunk {
		t.Errorf("the write of %d bytes held %d bytes of host staging at once, want one chunk (%d)", n, peak, stageChunk)
	}
	got, err := rcv.Wait(ctx, "g1", 30*time.Second)
	if err != nil || !bytes.Equal(got, data) {
		t.Fatalf("g1: %d bytes read back (%v), not the %d sent", len(got), err, n)
	}
	if peak := gpu.takePeak(); peak != stageChunk {
		t.Errorf("reading the slot back held %d bytes of host staging at once, want one chunk (%d)", peak, stageChunk)
	}
	// A copy out that fails once the answer has begun cuts it short.
	gpu.mu.Lock()
	gpu.failOut = gpu.copiesOut + 2
	gpu.mu.Unlock()
	if got, err := rcv.Wait(ctx, "g1", 30*time.Second); !errors.Is(err, io.ErrUnexpectedEOF) {
		t.Fatalf("a read back whose second chunk could not be copied out: %d bytes, %v; want the body cut short", len(got), err)
	}
	gpu.mu.Lock()
	gpu.failOut = 0
	gpu.mu.Unlock()

	// The second chunk's copy fails: the send (kept staged) is refused
	// with the receiver's reason, the receiver's wait answers it at once,
	// and the slot waits for a resend.
	stage()
	gpu.mu.Lock()
	gpu.failFrom = gpu.copiesIn + 2
	gpu.mu.Unlock()
	var ae *client.Error
	if err := send("g2"); !errors.As(err, &ae) || ae.Code != api.CodeRefused ||
		!strings.Contains(ae.Message, "could not copy the write's bytes into the GPU memory of the receive slot of req_id g2") ||
		!strings.Contains(ae.Message, "CUDA_ERROR_ILLEGAL_ADDRESS") {
		t.Fatalf("a send whose second chunk could not be copied in: %v", err)
	}
	if _, err := rcv.WaitInfo(ctx, "g2", 30*time.Second); !errors.As(err, &ae) || ae.Code != api.CodeInternal ||
		!strings.Contains(ae.Message, "could not be copied into GPU memory") || !strings.Contains(ae.Message, "CUDA_ERROR_ILLEGAL_ADDRESS") {
		t.Fatalf("waiting for a slot whose write could not be copied in: %v; want 500 internal naming the copy", err)
	}
	gpu.mu.Lock()
	gpu.failFrom = 0
	gpu.mu.Unlock()
	if err := send("g2"); err != nil {
		t.Fatalf("the resend: %v", err)
	}
	if got, err := rcv.Wait(ctx, "g2", 30*time.Second); err != nil || !bytes.Equal(got, data) {
		t.Fatalf("g2: %d bytes read back (%v), not the %d sent", len(got), err, n)
	}
}

// An upload into GPU memory goes through one stageChunk of host staging,
// each chunk copied in before the next is read; a chunk whose copy fails
// stages nothing, and the upload can be made again.
func TestUploadsIntoGPUMemoryGoAChunkAtATime(t *testing.T) {
	const n = 2*stageChunk + 4096
	ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
	defer cancel()
	gpu, c := gpuDaemon(t, t.TempDir(), "gpu", n+(1<<20))
	data := make([]byte, n)
	if _, err := rand.Read(data); err != nil {
		t.Fatal(err)
	}
	gpu.mu.Lock()
	gpu.failFrom = gpu.copiesIn + 2
	gpu.mu.Unlock()
	var ae *client.Error
	if _, err := c.Stage(ctx, "u", []int64{n}, "u8", bytes.NewReader(data), n); !errors.As(err, &ae) || ae.Code != api.CodeInternal ||
		!strings.Contains(ae.Message, "copying it into GPU memory failed") || !strings.Contains(ae.Message, "nothing was staged") {
		t.Fatalf("an upload whose second chunk could not be copied in: %v", err)
	}
	if _, err := c.Embedding(ctx, "u"); err == nil {
		t.Fatal("the failed upload left an entry")
	}
	gpu.mu.Lock()
	gpu.failFrom = 0
	gpu.mu.Unlock()
	gpu.takePeak()
	e, err := c.Stage(ctx, "u", []int64{n}, "u8", bytes.NewReader(data), n)
	if err != nil {
		t.Fatal(err)
	}
	if peak := gpu.takePeak(); peak != stageChunk {
		t.Errorf("the upload of %d bytes held %d bytes of host staging at once, want one chunk (%d)", n, peak, stageChunk)
	}
	if got := gpu.mem[e.Offset : e.Offset+n]; !bytes.Equal(got, data) {
		t.Fatal("the GPU memory does not hold the bytes uploaded")
	}
}

// A Mooncake WRITE into a slot in GPU memory is lent stageChunk bytes of
// host staging at a time, each piece copied in before the next.
func TestUnkeyedWritesLandInGPUMemoryAChunkAtATime(t *testing.T) {
	const n = 2*stageChunk + 5
	gpu := &deviceMemory{mem: make([]byte, 2*n+(1<<20))}
	a, err := arena.New(gpu, config.ArenaAlign)
	if err != nil {
		t.Fatal(err)
	}
	r := newRegistry(a)
	s, err := r.newSlot("m", n, true)
	if err != nil {
		t.Fatal(err)
	}
	body, done, err := r.AcceptUnkeyed(s.addr, n)
	if err != nil {
		t.Fatal(err)
	}
	var lens []int
	eachPiece(t, body, func(piece []byte) {
		for i := range piece {
			piece[i] = byte(len(lens) + 1)
		}
		lens = append(lens, len(piece))
	})
	done(nil)
	if !slices.Equal(lens, []int{stageChunk, stageChunk, 5}) || gpu.takePeak() != stageChunk {
		t.Fatalf("pieces of %v bytes; want two chunks and the 5-byte tail, through one chunk of staging", lens)
	}
	if got := gpu.mem[s.slice.Offset+n-5 : s.slice.Offset+n]; !bytes.Equal(got, bytes.Repeat([]byte{3}, 5)) || !r.receives()[0].Arrived {
		t.Fatalf("the tail in GPU memory is %v, arrived %t", got, r.receives()[0].Arrived)
	}

	// A write whose copy in fails leaves its slot open, and no word from
	// outside (the client's complete, a Mooncake notify) completes it
	// until a write lands.
	s2, err := r.newSlot("m2", n, true)
	if err != nil {
		t.Fatal(err)
	}
	gpu.mu.Lock()
	gpu.failFrom = gpu.copiesIn + 1
	gpu.mu.Unlock()
	body, done, err = r.AcceptUnkeyed(s2.addr, n)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := body(); err != nil {
		t.Fatal(err)
	}
	_, err = body()
	if err == nil {
		t.Fatal("the first chunk's copy in failed, and the body went on")
	}
	var refusals []transport.Code
	r.onRefusal = func(c transport.Code) { refusals = append(refusals, c) }
	done(&transport.PlaceError{Err: err})
	if !slices.Equal(refusals, []transport.Code{transport.Internal}) {
		t.Fatalf("refusals counted %v, want one internal", refusals)
	}
	gpu.mu.Lock()
	gpu.failFrom = 0
	gpu.mu.Unlock()
	for _, complete := range []func() error{
		func() error { return r.completeReceive("m2") },
		func() error { _, _, err := r.deliverNotified(fmt.Sprint(s2.addr)); return err },
	} {
		if err := complete(); !isCode(err, api.CodeInternal) || !strings.Contains(err.Error(), "could not be copied into GPU memory") {
			t.Fatalf("completing a slot whose write could not be copied in: %v; want it refused as internal", err)
		}
	}
}

// eachPiece hands fill each piece body lends, until the empty one.
func eachPiece(t *testing.T, body transport.Body, fill func(piece []byte)) {
	t.Helper()
	for {
		piece, err := body()
		if err != nil {
			t.Fatal(err)
		}
		if len(piece) == 0 {
			return
		}
		fill(piece)
	}
}
