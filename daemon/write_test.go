package daemon

import (
	"bytes"
	"context"
	"errors"
	"math/rand/v2"
	"strings"
	"testing"
	"time"

	"github.com/ferry-project/ferry/api"
	"github.com/ferry-project/ferry/client"
	"github.com/ferry-project/ferry/transport"
)

// POST /v1/writes lands its inline bytes in a keyed slot and in a
// Mooncake one (in pieces, each at its own buffer_address), answers once
// they are there, and keeps nothing on the sending side whether it
// succeeded or failed: no staged entry, the arena as free as before.
func TestInlineWritesLandAndKeepNothing(t *testing.T) {
	ctx, cancel := context.WithTimeout(t.Context(), 60*time.Second)
	defer cancel()
	dir := t.TempDir()
	snd, sc := serveTestDaemon(t, dir, "snd", nil)
	_, rc := serveTestDaemon(t, dir, "rcv", func(c *Config) { c.MooncakeListen = "127.0.0.1:0" })
	data := make([]byte, 96<<10)
	rand.NewChaCha8([32]byte{7}).Read(data)
	free := snd.arena.Stats().Free

	keyed, err := rc.Receive(ctx, "keyed", int64(len(data)))
	if err != nil {
		t.Fatal(err)
	}
	res, err := sc.Write(ctx, keyed, data)
	if err != nil {
		t.Fatalf("write into a keyed slot: %v", err)
	}
	if res.NBytes != int64(len(data)) || res.Attempts != 1 {
		t.Fatalf("the write's answer: %+v", res)
	}
	if got, err := rc.Wait(ctx, "keyed", 0); err != nil || !bytes.Equal(got, data) {
		t.Fatalf("the keyed slot holds %d bytes (%v), want the %d written", len(got), err, len(data))
	}

	mc, err := rc.ReceiveWith(ctx, api.ReceiveRequest{ReqID: "mc", NBytes: int64(len(data)), Mooncake: true})
	if err != nil {
		t.Fatal(err)
	}
	half := len(data) / 2
	for _, at := range []int{half, 0} {
		piece := api.ReceiveSlot{Session: "mooncake://" + mc.MooncakeSession, BufferAddress: mc.BufferAddress + uint64(at)}
		if _, err := sc.Write(ctx, piece, data[at:at+half]); err != nil {
			t.Fatalf("write at %d of a Mooncake slot: %v", at, err)
		}
	}
	if got, err := rc.Wait(ctx, "mc", 0); err != nil || !bytes.Equal(got, data) {
		t.Fatalf("the Mooncake slot holds %d bytes (%v), want the %d written in two pieces", len(got), err, len(data))
	}

	// Refused and bad writes say what was wrong and keep nothing either.
	if err := rc.FreeReceive(ctx, "keyed"); err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		slot api.ReceiveSlot
		data []byte
		code string
		says string
	}{
		{keyed, data, api.CodeRefused, "nothing is kept"},
		{api.ReceiveSlot{Session: keyed.Session, BufferAddress: keyed.BufferAddress}, data, api.CodeBadRequest, "key is missing"},
		{api.ReceiveSlot{Session: keyed.Session, Key: keyed.Key}, data, api.CodeBadRequest, "buffer_address is missing"},
		{keyed, nil, api.CodeBadRequest, "no Content-Length, or is empty"},
		{api.ReceiveSlot{Session: keyed.Session, BufferAddress: 1, Key: keyed.Key, NBytes: 16}, data, api.CodeBadRequest, "more than the 16 of the receive slot"},
		{api.ReceiveSlot{Session: keyed.Session, BufferAddress: 1, Key: transport.Key{1}}, make([]byte, 16<<20), api.CodeTooLarge, "larger than the whole arena"},
	} {
		_, err := sc.Write(ctx, c.slot, c.data)
		var ce *client.Error
		if !errors.As(err, &ce) || ce.Code != c.code || !strings.Contains(ce.Message, c.says) {
			t.Errorf("write %+v of %d bytes: %v, want %s saying %q", c.slot, len(c.data), err, c.code, c.says)
		}
	}
	if es, err := sc.Embeddings(ctx); err != nil || len(es) != 0 {
		t.Fatalf("the sender keeps %d entries (%v) after its writes, want none", len(es), err)
	}
	if got := snd.arena.Stats().Free; got != free {
		t.Fatalf("the sender's arena has %d bytes free after its writes, %d before", got, free)
	}
}
