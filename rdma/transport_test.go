package rdma

import (
	"bytes"
	"strings"
	"testing"
	"time"

	"github.com/ferry-project/ferry/transport"
	"github.com/ferry-project/ferry/transport/peer"
	"github.com/ferry-project/ferry/transport/tcp"
	"github.com/ferry-project/ferry/transport/transporttest"
)

// pairOver makes a sender whose Memory is src and a receiver whose Sink is
// slots over mapped memory it declares as its Memory, and a session
// between them.
func pairOver(t *testing.T, f *fabric, src []byte, slots *transporttest.Slots, perSend bool) (tx, rx *Transport, s transport.Session) {
	t.Helper()
	tx = listenT(t, f, Config{Memory: src, PerSend: perSend})
	rx = listenT(t, f, Config{Peer: peer.Config{Sink: slots}, Memory: slots.Mem, PerSend: perSend})
	s = dialT(t, tx, rx)
	return tx, rx, s
}

// mappedSlots is a transporttest.Slots over n bytes of mapped memory, the
// way the daemon's registry hands out its arena.
func mappedSlots(t *testing.T, n int) *transporttest.Slots {
	s := transporttest.NewSlots(0)
	s.Mem = mapT(t, n)
	t.Cleanup(func() {
		if err := s.Err(); err != nil {
			t.Error(err)
		}
	})
	return s
}

// writeAll writes src[:n] for each n in sizes to consecutive slots and
// checks that each landed byte-exact.
// writeAll writes each of sizes from src into slots, one after another,
// each reporting want.
func writeAll(t *testing.T, s transport.Session, slots *transporttest.Slots, src []byte, sizes []int, want transport.Report) {
	t.Helper()
	addr := uint64(0)
	for i, n := range sizes {
		for j := range src[:n] {
			src[j] = byte(j*13 + i)
		}
		key := slots.Add(addr, uint64(n))
		tag := uint32(500 + i)
		rep, err := s.Write(ctxFor(t, 60*time.Second), transport.Write{Src: src[:n], Remote: addr, Key: key, Tag: tag})
		if err != nil {
			t.Fatalf("%d-byte write: %v", n, err)
		}
		if rep != want {
			t.Errorf("%d-byte write reported %+v, want %+v", n, rep, want)
		}
		if err := slots.Wait(ctxFor(t, 30*time.Second), tag); err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(slots.Mem[addr:addr+uint64(n)], src[:n]) {
			t.Fatalf("%d-byte write landed wrong", n)
		}
		addr += uint64(n+4095) &^ 4095
	}
}

var modeSizes = []int{1, 4 << 10, 1<<20 + 7, 16 << 20}

func modeTotal() int {
	total := 0
	for _, n := range modeSizes {
		total += (n + 4095) &^ 4095
	}
	return total
}

// TestSharedRegistration: writes from and into declared memory go
// straight through the NIC under the one registration each side made at
// start: no per-write registration, no copy.
func TestSharedRegistration(t *testing.T) {
	f := newFabric()
	src := mapT(t, 16<<20)
	slots := mappedSlots(t, modeTotal()+4096)
	tx, rx, s := pairOver(t, f, src, slots, false)
	for _, tr := range []*Transport{tx, rx} {
		if r := tr.Registration(); r.Mode != "shared" || r.Err != nil || r.Took <= 0 {
			t.Errorf("registration %+v, want shared with its time", r)
		}
	}
	writeAll(t, s, slots, src, modeSizes, transport.Report{Registration: transport.RegisteredShared, Messages: 2})
	for _, tr := range []*Transport{tx, rx} {
		if st := tr.Stats(); st.PerSend+st.PerReceive+st.Bounced+st.Staged+st.CopiedBytes != 0 {
			t.Errorf("stats %+v, want no per-write registration or copy", st)
		}
	}
	// Memory outside the registration goes through a bounce buffer.
	addr := uint64(modeTotal())
	rep, err := s.Write(ctxFor(t, 60*time.Second), transport.Write{Src: make([]byte, 10), Remote: addr, Key: slots.Add(addr, 10), Tag: 9})
	if want := (transport.Report{Registration: transport.RegisteredNone, Copied: 10, Messages: 2}); err != nil || rep != want {
		t.Errorf("a write from Go memory: %+v, %v; want %+v", rep, err, want)
	}
}

// TestPerSendRegistration: with the shared registration off, every write
// registers its source and its destination, and drops both after.
func TestPerSendRegistration(t *testing.T) {
	f := newFabric()
	src := mapT(t, 16<<20)
	slots := mappedSlots(t, modeTotal())
	tx, rx, s := pairOver(t, f, src, slots, true)
	if r := tx.Registration(); r.Mode != "per-send" {
		t.Errorf("registration %+v, want per-send", r)
	}
	writeAll(t, s, slots, src, modeSizes, transport.Report{Registration: transport.RegisteredPerSend, Messages: 2})
	n := uint64(len(modeSizes))
	if st := tx.Stats(); st.PerSend != n || st.Bounced != 0 {
		t.Errorf("sender stats %+v, want %d per-send registrations", st, n)
	}
	if st := rx.Stats(); st.PerReceive != n || st.Staged != 0 {
		t.Errorf("receiver stats %+v, want %d per-receive registrations", st, n)
	}
}

// TestSharedRegistrationFails: a shared registration the NIC refuses (a
// low locked-memory limit) leaves the transport in per-send mode with the
// errno and the fix, and writes still go. The fake NIC refuses it: a
// root process in the VM is not bound by RLIMIT_MEMLOCK.
func TestSharedRegistrationFails(t *testing.T) {
	f := newFabric()
	f.failRegister = 32 << 20
	mem := mapT(t, 32<<20)
	tr := listenFake(t, f, Config{Memory: mem})
	r := tr.Registration()
	if r.Mode != "per-send" || r.Err == nil {
		t.Fatalf("registration %+v, want per-send with the reason", r)
	}
	for _, want := range []string{"ENOMEM", "LimitMEMLOCK=infinity", "per-send mode", "33554432 bytes"} {
		if !strings.Contains(r.Err.Error(), want) {
			t.Errorf("%q does not say %q", r.Err, want)
		}
	}
	slots := mappedSlots(t, 1<<20)
	rx := listenFake(t, f, Config{Peer: peer.Config{Sink: slots}, Memory: slots.Mem})
	s, err := tr.Dial(ctxFor(t, 30*time.Second), rx.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	writeAll(t, s, slots, mem[:1<<20], []int{1 << 20}, transport.Report{Registration: transport.RegisteredPerSend, Messages: 2})
	if st := tr.Stats(); st.PerSend != 1 {
		t.Errorf("stats %+v, want the write registered per send", st)
	}
}

// TestPeerQPBrokenMidWrite: the receiver's QP fails while a write is on
// the wire; the sender's write fails naming the verbs status that broke
// it, and a write on a fresh session, as the daemon's retry makes, lands.
func TestPeerQPBrokenMidWrite(t *testing.T) {
	f := newFabric()
	const size = 16 << 20
	src := mapT(t, size)
	slots := mappedSlots(t, 2*size)
	granted := make(chan struct{}, 1)
	sink := &watch{Slots: slots, accepted: granted}
	tx := listenT(t, f, Config{Memory: src})
	rx := listenT(t, f, Config{Peer: peer.Config{Sink: sink}, Memory: slots.Mem})
	s, err := tx.Dial(ctxFor(t, 30*time.Second), rx.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	if !onDevice(t) {
		f.hold = make(chan struct{}) // keep the write on the wire
	}
	for i := range src {
		src[i] = byte(i * 3)
	}
	w := transport.Write{Src: src, Remote: 0, Key: slots.Add(0, size), Tag: 1}
	res := make(chan error, 1)
	go func() {
		_, err := s.Write(ctxFor(t, 60*time.Second), w)
		res <- err
	}()
	select {
	case <-granted:
	case <-time.After(30 * time.Second):
		t.Fatal("the write never reached the receiver")
	}
	rx.mu.Lock()
	for l := range rx.accepted {
		l.qp.Break()
	}
	rx.mu.Unlock()
	if f.hold != nil {
		close(f.hold)
	}
	// The sender learns it from its NIC (RETRY_EXC_ERR, where the NIC
	// gives up on a peer QP that no longer answers) or from the receiver,
	// whose receive was flushed (WR_FLUSH_ERR) and which says so before
	// closing the lane; either way the error names the verbs status.
	err = <-res
	switch {
	case err == nil:
		// On a real NIC the write may have finished before the break.
		t.Log("the write completed before its peer's QP broke")
	case transport.IsRefusal(err):
		t.Fatalf("write to a broken QP: got a refusal: %v", err)
	case !strings.Contains(err.Error(), "RETRY_EXC_ERR") && !strings.Contains(err.Error(), "WR_FLUSH_ERR"):
		t.Fatalf("write to a broken QP: %v; want the verbs status that broke it", err)
	default:
		t.Logf("write to a broken QP: %v", err)
		if n := slots.Delivered(1); n != 0 {
			t.Errorf("the broken write was delivered %d times", n)
		}
	}
	// The daemon tears the session down and dials again.
	s.Close()
	s2, err := tx.Dial(ctxFor(t, 30*time.Second), rx.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer s2.Close()
	w.Remote, w.Key, w.Tag = size, slots.Add(size, size), 2
	if _, err := s2.Write(ctxFor(t, 60*time.Second), w); err != nil {
		t.Fatalf("retry on a fresh session: %v", err)
	}
	if err := slots.Wait(ctxFor(t, 30*time.Second), 2); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(slots.Mem[size:2*size], src) {
		t.Error("the retried write landed wrong")
	}
}

// watch is a Sink that reports each accepted write.
type watch struct {
	*transporttest.Slots
	accepted chan struct{}
}

func (w *watch) Accept(addr, n uint64, key transport.Key, tag uint32) ([]byte, func(error), error) {
	dst, done, err := w.Slots.Accept(addr, n, key, tag)
	if err == nil {
		select {
		case w.accepted <- struct{}{}:
		default:
		}
	}
	return dst, done, err
}

// TestRejectsMismatchedCompletion: a sender that writes to its grant but
// carries another immediate gets nothing delivered; the receiver counts
// and logs the rejection, releases the slot, and ends the lane.
func TestRejectsMismatchedCompletion(t *testing.T) {
	f := newFabric()
	slots := mappedSlots(t, 1<<20)
	var logs transporttest.Logs
	src := mapT(t, 4096)
	tx := listenT(t, f, Config{Memory: src})
	rx := listenT(t, f, Config{Peer: peer.Config{Sink: slots, Logf: logs.Logf}, Memory: slots.Mem})
	l, _, _, err := tx.dialLane(ctxFor(t, 30*time.Second), rx.Addr().String(), pair{})
	if err != nil {
		t.Fatal(err)
	}
	defer l.close()
	key := slots.Add(0, 4096)
	h := peer.Header{Addr: 0, Len: 4096, Key: key, Tag: 0x11}
	var hb [peer.HeaderSize]byte
	h.Encode(&hb)
	l.ctrl.Write(hb[:])
	a, err := wait(l, l.answers, time.Now().Add(30*time.Second), nil)
	if err != nil || a.Code != transport.OK {
		t.Fatalf("grant: %+v, %v", a, err)
	}
	g := a.grant
	src[0] = 0xaa
	err = l.qp.Post([]op{{WRID: 1, Local: addrOf(src), Remote: g.Addr, Len: 4096, LKey: tx.shared.LKey(), RKey: g.RKey,
		Imm: 0x22, Signaled: true, WithImm: true}})
	if err != nil {
		t.Fatal(err)
	}
	if err := slots.WaitIdle(ctxFor(t, 30*time.Second)); err != nil {
		t.Fatal(err)
	}
	if n := slots.Delivered(0x11) + slots.Delivered(0x22); n != 0 {
		t.Errorf("a mismatched write was delivered %d times", n)
	}
	if got := rx.Stats().Rejected; got != 1 {
		t.Errorf("rejected completions counted: %d, want 1", got)
	}
	logs.Wait(t, "rejected a completion that does not match its grant", "immediate 0x22", "granted tag 0x11")
	// The sender hears why, then the lane ends.
	if _, err := wait[answer](l, nil, time.Now().Add(30*time.Second), nil); err != errDead {
		t.Fatalf("waiting for the receiver's word: %v", err)
	}
	if w := l.lastWord; w.Code != transport.Internal || w.Flags&flagFailed == 0 || !strings.Contains(w.Msg, "does not match its grant") {
		t.Errorf("the sender heard %+v, want the rejection", w)
	}
}

// TestFallbackToTCP: a peer without RDMA answers the lane's hello with
// "no RDMA here"; the session goes over TCP, and the log says so.
func TestFallbackToTCP(t *testing.T) {
	var logs transporttest.Logs
	tx := listenT(t, newFabric(), Config{Peer: peer.Config{Logf: logs.Logf}})
	slots := mappedSlots(t, 1<<20)
	rx, err := tcp.Listen(peer.Config{Addr: "127.0.0.1:0", Sink: slots})
	if err != nil {
		t.Fatal(err)
	}
	defer rx.Close()
	s, err := tx.Dial(ctxFor(t, 30*time.Second), rx.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	logs.Wait(t, rx.Addr().String(), "serves no RDMA", "falls back to TCP")
	if s.Transport() != "tcp" {
		t.Errorf("fallback session runs on %q, want tcp", s.Transport())
	}
	writeAll(t, s, slots, make([]byte, 1<<20), []int{1 << 20}, transport.Report{Messages: 2})
}

func TestGrantOutsideTheSharedRegistration(t *testing.T) {
	r := peerRegion{Base: 0x10000, Size: 0x1000, RKey: 7, Mode: modeShared}
	for _, c := range []struct {
		g    grant
		n    uint64
		fail bool
	}{
		{grant{Addr: 0x10000, RKey: 7}, 0x1000, false},
		{grant{Addr: 0x10800, RKey: 7}, 0x800, false},
		{grant{Addr: 0x10800, RKey: 7}, 0x801, true},
		{grant{Addr: 0xf000, RKey: 7}, 1, true},
		{grant{Addr: 0xf000, RKey: 8}, 1, false}, // another registration (staging)
	} {
		if err := r.check(c.g, c.n); (err != nil) != c.fail {
			t.Errorf("grant %+v of %d bytes: %v", c.g, c.n, err)
		}
	}
}
