package tcp

import (
	"bytes"
	"testing"
	"time"

	"github.com/ferry-project/ferry/transport"
	"github.com/ferry-project/ferry/transport/peer"
	"github.com/ferry-project/ferry/transport/transporttest"
)

var secretA = []byte("0123456789abcdef-secret-A")

func TestConformanceWithSecret(t *testing.T) {
	transporttest.Run(t, func(t *testing.T, sink transport.Sink) transport.Transport {
		return listen(t, peer.Config{Sink: sink, Secret: secretA})
	})
}

func TestAuthSameSecret(t *testing.T) {
	slots := transporttest.NewSlots(1 << 20)
	rx := listen(t, peer.Config{Sink: slots, Secret: secretA})
	tx := listen(t, peer.Config{Sink: transporttest.NewSlots(0), Secret: bytes.Clone(secretA)})
	s, err := tx.Dial(ctxFor(t, 10*time.Second), rx.Addr().String())
	if err != nil {
		t.Fatalf("dial with the same secret: %v", err)
	}
	defer s.Close()
	src := bytes.Repeat([]byte("ferry"), 1000)
	key := slots.Add(4096, uint64(len(src)))
	if _, err := s.Write(ctxFor(t, 10*time.Second), transport.Write{Src: src, Remote: 4096, Key: key, Tag: 9}); err != nil {
		t.Fatalf("write: %v", err)
	}
	if !bytes.Equal(slots.Mem[4096:4096+len(src)], src) {
		t.Fatal("the slot does not hold the bytes written")
	}
}
