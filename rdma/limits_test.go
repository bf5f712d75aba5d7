package rdma

import (
	"net"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ferry-project/ferry/internal/connlimit"
	"github.com/ferry-project/ferry/internal/loglimit"
	"github.com/ferry-project/ferry/transport"
	"github.com/ferry-project/ferry/transport/peer"
	"github.com/ferry-project/ferry/transport/transporttest"
)

// waitFor polls cond (a lane's end signals nobody) until it holds,
// failing after 30 s.
func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	tick := time.NewTicker(time.Millisecond)
	defer tick.Stop()
	for ; !cond(); <-tick.C {
		if time.Now().After(deadline) {
			t.Fatalf("%s: not within 30s", what)
		}
	}
}

// TestIdleLaneReapedSenderRedials: a lane that carried no write for the
// idle timeout is closed by its receiver, its queue pair destroyed; the
// sender's next write finds the lane gone and opens another without
// failing.
func TestIdleLaneReapedSenderRedials(t *testing.T) {
	f := newFabric()
	var debug transporttest.Logs
	slots := mappedSlots(t, 1<<16)
	rx := listenT(t, f, Config{Memory: slots.Mem, Peer: peer.Config{Sink: slots, IdleTimeout: 200 * time.Millisecond, Debugf: debug.Logf}})
	tx := listenT(t, f, Config{Memory: mapT(t, 4096)})
	fake, _ := rx.nic.(*fakeNIC)
	opened := func() int {
		fake.mu.Lock()
		defer fake.mu.Unlock()
		return fake.open
	}
	before := 0
	if fake != nil {
		before = opened()
	}
	s, err := tx.Dial(ctxFor(t, 30*time.Second), rx.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	for i := range 2 {
		addr := uint64(i * 4096)
		w := transport.Write{Src: tx.cfg.Memory[:100], Remote: addr, Key: slots.Add(addr, 100), Tag: uint32(0x100 + i)}
		if _, err := s.Write(ctxFor(t, 30*time.Second), w); err != nil {
			t.Fatalf("write %d: %v", i, err)
		}
		if err := slots.Wait(ctxFor(t, 30*time.Second), w.Tag); err != nil {
			t.Fatal(err)
		}
		if i > 0 {
			break
		}
		debug.Wait(t, "rdma: closed the lane from", "no write for 200ms")
		waitFor(t, "the idle lane's end", func() bool {
			rx.mu.Lock()
			defer rx.mu.Unlock()
			return len(rx.accepted) == 0
		})
		if fake != nil {
			waitFor(t, "the idle lane's queue pair destroyed", func() bool { return opened() == before })
		}
	}
	if st := rx.PortStats(); st.Idle != 1 {
		t.Fatalf("port stats %+v: want one lane closed idle", st)
	}
}

// closingSink closes the control connection of the receiver's lane when
// armed, on the next write it is asked to accept, instead of answering:
// as a receiver's idle close crossing a header the sender just sent.
type closingSink struct {
	*transporttest.Slots
	rx    *Transport
	armed atomic.Bool
}

func (s *closingSink) Accept(addr, n uint64, key transport.Key, tag uint32) ([]byte, func(error), error) {
	if s.armed.CompareAndSwap(true, false) {
		s.rx.mu.Lock()
		for l := range s.rx.accepted {
			l.ctrl.Close()
		}
		s.rx.mu.Unlock()
		return nil, nil, &transport.Refusal{Code: transport.Internal, Message: "closed"}
	}
	return s.Slots.Accept(addr, n, key, tag)
}

// TestLaneClosedUnderAHeaderIsRetried: a pooled lane whose receiver
// closes it as a header arrives, unanswered, carried nothing: the write
// goes again on a new lane and lands once.
func TestLaneClosedUnderAHeaderIsRetried(t *testing.T) {
	f := newFabric()
	slots := mappedSlots(t, 1<<16)
	sink := &closingSink{Slots: slots}
	rx := listenT(t, f, Config{Memory: slots.Mem, Peer: peer.Config{Sink: sink}})
	sink.rx = rx
	tx := listenT(t, f, Config{Memory: mapT(t, 4096)})
	s, err := tx.Dial(ctxFor(t, 30*time.Second), rx.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	for i := range 2 {
		addr := uint64(i * 4096)
		w := transport.Write{Src: tx.cfg.Memory[:64], Remote: addr, Key: slots.Add(addr, 64), Tag: uint32(0x200 + i)}
		sink.armed.Store(i == 1)
		if _, err := s.Write(ctxFor(t, 30*time.Second), w); err != nil {
			t.Fatalf("write %d: %v", i, err)
		}
		if err := slots.Wait(ctxFor(t, 30*time.Second), w.Tag); err != nil {
			t.Fatal(err)
		}
		if n := slots.Delivered(w.Tag); n != 1 {
			t.Fatalf("write %d delivered %d times", i, n)
		}
	}
	if sink.armed.Load() {
		t.Fatal("the second write never reached the receiver's Sink")
	}
}

// TestEvictedLaneRedials: a stranger's connection into a full peer port
// takes the place of a peer's idle lane (the only place there is), whose
// queue pair goes with it; the peer's next write opens a new lane, which
// takes the stranger's place in turn, and lands without failing.
func TestEvictedLaneRedials(t *testing.T) {
	f := newFabric()
	slots := mappedSlots(t, 1<<16)
	rx := listenT(t, f, Config{Memory: slots.Mem, Peer: peer.Config{Sink: slots, Limits: connlimit.Limits{Total: 1, PerSource: 1}}})
	tx := listenT(t, f, Config{Memory: mapT(t, 4096)})
	s, err := tx.Dial(ctxFor(t, 30*time.Second), rx.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	write := func(i int) {
		t.Helper()
		addr := uint64(i * 4096)
		w := transport.Write{Src: tx.cfg.Memory[:32], Remote: addr, Key: slots.Add(addr, 32), Tag: uint32(0x300 + i)}
		if _, err := s.Write(ctxFor(t, 30*time.Second), w); err != nil {
			t.Fatalf("write %d: %v", i, err)
		}
		if err := slots.Wait(ctxFor(t, 30*time.Second), w.Tag); err != nil {
			t.Fatal(err)
		}
	}
	write(0)
	d := net.Dialer{LocalAddr: &net.TCPAddr{IP: net.ParseIP("127.0.0.2")}}
	stranger, err := d.Dial("tcp", rx.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer stranger.Close()
	waitFor(t, "the peer's lane evicted", func() bool {
		rx.mu.Lock()
		defer rx.mu.Unlock()
		return len(rx.accepted) == 0
	})
	write(1)
	stranger.SetReadDeadline(time.Now().Add(30 * time.Second))
	if _, err := stranger.Read(make([]byte, 1)); err == nil {
		t.Fatal("the stranger's connection was not closed for the peer's new lane")
	}
	if st := rx.PortStats(); st.Evicted != 2 {
		t.Fatalf("port stats %+v: want 2 evictions (the lane, then the stranger)", st)
	}
}

// TestWarningsAreRateLimited: the transport's WARN lines follow a peer's
// failures (a lost rail, a canceled write, a peer without RDMA), one per
// send, so a failing peer must not flood the log: at most loglimit.Burst
// a window reach the daemon's logger.
func TestWarningsAreRateLimited(t *testing.T) {
	var logs transporttest.Logs
	tr := listenT(t, newFabric(), Config{Peer: peer.Config{Logf: logs.Logf}})
	for i := range 10 * loglimit.Burst {
		tr.logf("rdma: a striped write to peer %d lost a rail", i)
	}
	if n := len(logs.Lines()); n == 0 || n > loglimit.Burst {
		t.Fatalf("%d warnings logged of %d, want 1 to %d", n, 10*loglimit.Burst, loglimit.Burst)
	}
}
