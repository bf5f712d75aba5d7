package e2e

import (
	"bytes"
	"context"
	"errors"
	"testing"
	"time"

	"github.com/ferry-project/ferry/transport"
	"github.com/ferry-project/ferry/transport/peer"
	"github.com/ferry-project/ferry/transport/tcp"
)

// strangerSession dials d's peer port as a peer that is no ferryd of the
// cluster's would: the tcp transport as a library, in this process.
func strangerSession(t *testing.T, d *daemon) transport.Session {
	t.Helper()
	me, err := tcp.Listen(peer.Config{Addr: "127.0.0.1:0", Sink: nobody{}, MaxConnsPerPeer: 1})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { me.Close() })
	s, err := me.Dial(ctxT(t), d.advertise)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close() })
	return s
}

// nobody is a Sink that takes no writes: the stranger only sends.
type nobody struct{}

func (nobody) Accept(uint64, uint64, transport.Key, uint32) ([]byte, func(error), error) {
	return nil, nil, &transport.Refusal{Code: transport.NoSlot, Message: "this peer takes no writes"}
}

// A peer guessing keys: every guess, at a live slot's own address, gets
// the same no_slot refusal, naming nothing of the slot; each is counted;
// its connections are closed every 16 guesses; the slot is untouched and
// its rightful sender still delivers.
func TestWrongKeyFloodIsRefusedUniformlyAndCounted(t *testing.T) {
	snd, rcv := pair(t)
	slot := slotFor(t, rcv, "guarded", 4096)
	s := strangerSession(t, rcv)
	const guesses = 100
	var first string
	for i := range guesses {
		guess := transport.NewKey()
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		_, err := s.Write(ctx, transport.Write{Src: bytes.Repeat([]byte{'!'}, 4096), Remote: slot.BufferAddress, Key: guess, Tag: guess.Tag()})
		cancel()
		var rf *transport.Refusal
		if !errors.As(err, &rf) || rf.Code != transport.NoSlot {
			t.Fatalf("guess %d: %v, want a no_slot refusal", i, err)
		}
		if first == "" {
			first = rf.Message
		} else if rf.Message != first {
			t.Fatalf("guess %d: refusal %q differs from the first, %q", i, rf.Message, first)
		}
	}
	for _, leak := range []string{"guarded", "4096", "req_id"} {
		if bytes.Contains([]byte(first), []byte(leak)) {
			t.Errorf("the refusal %q names %q", first, leak)
		}
	}
	if got := metricSum(rcv.metrics(t), "ferry_peer_refusals_total", `reason="no_slot"`); got != guesses {
		t.Errorf("ferry_peer_refusals_total{reason=\"no_slot\"} = %v, want %d", got, guesses)
	}
	rcv.log.wait(t, 5*time.Second, "the closed guessing connection logged", func(m map[string]any) bool {
		msg, _ := m["message"].(string)
		return bytes.Contains([]byte(msg), []byte("matched no receive slot"))
	})
	if info, err := rcv.c.WaitInfo(ctxT(t), "guarded", 0); err != nil || info.Arrived || info.WritesInFlight != 0 {
		t.Fatalf("the guarded slot after the flood: %+v, %v", info, err)
	}
	data := stageOn(t, snd, "guarded", 4096, 7)
	if _, err := snd.c.Send(ctxT(t), "guarded", slot); err != nil {
		t.Fatal(err)
	}
	if got, err := rcv.c.Wait(ctxT(t), "guarded", 10*time.Second); err != nil || !bytes.Equal(got, data) {
		t.Fatalf("the key's holder after the flood: %v", err)
	}
	rcv.alive(t)
}

// A write that covers part of a slot never makes it arrive: the reader
// would get bytes nobody sent (an earlier tenant's). An empty write is
// refused.
func TestPartialWriteNeverArrives(t *testing.T) {
	_, rcv := pair(t)
	slot := slotFor(t, rcv, "part", 2048)
	s := strangerSession(t, rcv) // a peer holding the key: the sender
	ctx := ctxT(t)
	if _, err := s.Write(ctx, transport.Write{Src: make([]byte, 16), Remote: slot.BufferAddress + 1024, Key: slot.Key, Tag: slot.Key.Tag()}); err != nil {
		t.Fatal(err)
	}
	_, err := s.Write(ctx, transport.Write{Src: nil, Remote: slot.BufferAddress, Key: slot.Key, Tag: slot.Key.Tag()})
	if rf := (*transport.Refusal)(nil); !errors.As(err, &rf) || rf.Code != transport.OutOfBounds {
		t.Errorf("an empty write: %v, want an out_of_bounds refusal", err)
	}
	if info, err := rcv.c.WaitInfo(ctx, "part", 0); err != nil || info.Arrived {
		t.Fatalf("after 16 of 2048 bytes: %+v, %v", info, err)
	}
	rest := bytes.Repeat([]byte{'r'}, 2048)
	if _, err := s.Write(ctx, transport.Write{Src: rest, Remote: slot.BufferAddress, Key: slot.Key, Tag: slot.Key.Tag()}); err != nil {
		t.Fatal(err)
	}
	if got, err := rcv.c.Wait(ctx, "part", 10*time.Second); err != nil || !bytes.Equal(got, rest) {
		t.Fatalf("the slot written whole: %v", err)
	}
}
