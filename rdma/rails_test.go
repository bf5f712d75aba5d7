package rdma

import (
	"bytes"
	"errors"
	"fmt"
	"net"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/ferry-project/ferry/transport"
	"github.com/ferry-project/ferry/transport/peer"
)

// stripeSink is a receiver's Sink over one slot that takes writes of
// pieces side by side, as the daemon's registry does: each write that
// lands adds its range (a range landed twice counts once), and the slot
// arrives once, when landed ranges cover it and no write is in flight.
// It records whether the slot's bytes were right at that moment.
type stripeSink struct {
	mem  []byte
	want []byte
	key  transport.Key

	mu       sync.Mutex
	windows  transport.Windows
	covered  map[uint64]uint64 // landed ranges by offset
	total    uint64
	writes   int
	failed   int // writes whose done reported an error
	arrivals int
	exact    bool // the slot's bytes were want's when it arrived
	direct   int  // direct writes heard of (Arrived)
	arrived  chan struct{}
}

// windowedSink is stripeSink as a WindowSink: its slot gets a window.
type windowedSink struct{ *stripeSink }

func (w windowedSink) UseWindows(ws transport.Windows) { w.windows = ws }

// open makes the slot over all of mem, expecting want.
func (s *stripeSink) open(t *testing.T, want []byte) {
	s.want, s.covered, s.arrived = want, make(map[uint64]uint64), make(chan struct{})
	s.total, s.failed, s.arrivals, s.exact, s.direct = 0, 0, 0, false, 0
	s.key = transport.NewKey()
	if s.windows != nil {
		rkey, err := s.windows.Open(addrOf(s.mem), uint64(len(s.mem)))
		if err != nil {
			t.Fatal(err)
		}
		s.key = s.key.WithWindowOn(rkey)
	}
}

func (s *stripeSink) Accept(addr, n uint64, key transport.Key, tag uint32) ([]byte, func(error), error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	base := addrOf(s.mem)
	if key != s.key || addr < base || n == 0 || addr-base+n > uint64(len(s.mem)) {
		return nil, nil, &transport.Refusal{Code: transport.NoSlot, Message: fmt.Sprintf("no slot at %#x with that key", addr)}
	}
	off := addr - base
	s.writes++
	return s.mem[off : off+n : off+n], func(err error) {
		s.mu.Lock()
		defer s.mu.Unlock()
		s.writes--
		if err != nil {
			s.failed++
		} else if s.covered[off] == 0 {
			s.covered[off] = n
			s.total += n
		}
		if s.total == uint64(len(s.mem)) && s.writes == 0 && s.arrivals == 0 {
			s.arrivals++
			s.exact = bytes.Equal(s.mem, s.want)
			close(s.arrived)
		}
	}, nil
}

// Arrived takes a direct write of the whole slot (an unstriped send).
func (s *stripeSink) Arrived(tag uint32, n uint64) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.direct++
	if n != uint64(len(s.mem)) || s.arrivals != 0 {
		return &transport.Refusal{Code: transport.SlotBusy, Message: "not the whole slot, or it arrived already"}
	}
	s.arrivals++
	s.exact = bytes.Equal(s.mem, s.want)
	close(s.arrived)
	return nil
}

// railNIC is a NIC of a rails test, fake or real: it counts the bytes
// its queue pairs post in writes, and once they reach breakAt (when
// set) it breaks each queue pair before its next post, whose work
// requests the NIC then flushes: a rail failing mid-transfer, the same
// on the fake NIC and on rxe in the soft-RoCE VM.
type railNIC struct {
	nic
	posted, breakAt *atomic.Uint64
}

func (n railNIC) deviceName() string { return nicName(n.nic, "") }

func (n railNIC) NewQP(sendDepth, recvDepth int) (queuePair, error) {
	q, err := n.nic.NewQP(sendDepth, recvDepth)
	if err != nil {
		return nil, err
	}
	return railQP{q, n}, nil
}

type railQP struct {
	queuePair
	n railNIC
}

func (q railQP) Post(ops []op) error {
	if b := q.n.breakAt.Load(); b > 0 && q.n.posted.Load() >= b {
		q.Break()
	}
	for _, o := range ops {
		q.n.posted.Add(uint64(o.Len))
	}
	return q.queuePair.Post(ops)
}

// realRails are the soft-RoCE VM's two devices (rxe0 and rxe1, test/rxevm/init.sh),
// when the tests run on a real RDMA port.
var realRails = sync.OnceValues(func() ([]Choice, error) {
	inv, err := Discover()
	if err != nil {
		return nil, err
	}
	cs, _, err := ChooseRails(inv, []string{AllDevices}, Want{GIDIndex: -1})
	if err == nil && len(cs) < 2 {
		err = fmt.Errorf("%d RDMA device(s) with a usable port (%v), and rails need two", len(cs), names(inv.NICs))
	}
	return cs, err
})

// railNICs opens n NICs for a rails test: the real devices when the
// tests run on a real port (the VM has two), else fake NICs of f
// numbered from first.
func railNICs(t *testing.T, f *fabric, first byte, n int) []railNIC {
	t.Helper()
	var out []railNIC
	for i := range n {
		var one nic
		if onDevice(t) {
			cs, err := realRails()
			if err != nil {
				t.Fatalf("rails on a real RDMA port: %v", err)
			}
			vn, err := openNIC(cs[i])
			if err != nil {
				t.Fatal(err)
			}
			one = vn
		} else {
			one = f.nic(first + byte(i))
		}
		out = append(out, railNIC{nic: one, posted: new(atomic.Uint64), breakAt: new(atomic.Uint64)})
	}
	return out
}

// railsPair is a sender and a receiver, each with rails NICs (fake, or
// the VM's two rxe devices), in windows mode or not, and a session
// between them.
type railsPair struct {
	tx, rx   *Transport
	txNICs   []railNIC
	s        transport.Session
	sink     *stripeSink
	src      []byte
	windowed bool
}

func newRailsPair(t *testing.T, txRails, rxRails, size int, windows bool) *railsPair {
	t.Helper()
	f := newFabric()
	f.windows = windows
	p := &railsPair{src: mapT(t, size), sink: &stripeSink{mem: mapT(t, size)}, windowed: windows}
	fill(p.src, 7)
	var sink transport.Sink = p.sink
	if windows {
		sink = windowedSink{p.sink}
	}
	start := func(cfg Config, first byte, n int) (*Transport, []railNIC) {
		nics := railNICs(t, f, first, n)
		var more []nic
		for _, n := range nics[1:] {
			more = append(more, n)
		}
		tr, err := listen(testConfig(t, cfg), nics[0], more...)
		if err != nil {
			for _, n := range nics {
				n.Close()
			}
			t.Fatal(err)
		}
		closeAtEnd(t, tr)
		return tr, nics
	}
	p.tx, p.txNICs = start(Config{Memory: p.src, StripeMin: 8 << 20, Peer: peer.Config{MaxConnsPerPeer: 8}}, 1, txRails)
	p.rx, _ = start(Config{Memory: p.sink.mem, Peer: peer.Config{Sink: sink}}, 0x41, rxRails)
	if windows && p.rx.Mode() != ModeWindows {
		t.Skipf("the receiver's NIC has no windows: %s", p.rx.ModeWhy())
	}
	p.s = dialT(t, p.tx, p.rx)
	return p
}

// send writes all of src into the slot, whole, and checks that the slot
// arrived once, byte-exact, and by pieces (no direct write) when the
// write is striped. The receiver takes its completions after the
// sender's NIC reported them: the arrival is waited for.
func (p *railsPair) send(t *testing.T, striped bool) transport.Report {
	t.Helper()
	p.sink.open(t, p.src)
	w := transport.Write{Src: p.src, Remote: addrOf(p.sink.mem), Key: p.sink.key, Tag: p.sink.key.Tag(), Whole: true}
	rep, err := p.s.Write(ctxFor(t, 60*time.Second), w)
	if err != nil {
		t.Fatal(err)
	}
	p.sink.await(t)
	p.sink.mu.Lock()
	defer p.sink.mu.Unlock()
	if p.sink.arrivals != 1 || !p.sink.exact || striped && p.sink.direct != 0 {
		t.Fatalf("the slot arrived %d times, exact %v, with %d direct writes heard of: want once, exact, none when striped", p.sink.arrivals, p.sink.exact, p.sink.direct)
	}
	return rep
}

// await waits for the open slot to arrive, for 30 s at most.
func (k *stripeSink) await(t *testing.T) {
	t.Helper()
	select {
	case <-k.arrived:
	case <-time.After(30 * time.Second):
		k.mu.Lock()
		t.Fatalf("the slot did not arrive within 30s of the write's return: %d writes in flight, %d of %d bytes landed, %d failed", k.writes, k.total, len(k.mem), k.failed)
	}
}

func modes(t *testing.T, run func(t *testing.T, windows bool)) {
	for _, windows := range []bool{true, false} {
		t.Run(map[bool]string{true: "windows", false: "grant"}[windows], func(t *testing.T) { run(t, windows) })
	}
}

// TestRailsStripeEvenly: a write from the arena of at least StripeMin
// goes in 1 MiB pieces over both rail pairs, half the bytes out of each
// NIC (counted by the transport, by what the NICs were posted, and on
// the fake by what it placed), and the slot arrives once, byte-exact; a
// smaller one goes on rail 0 alone, unstriped.
func TestRailsStripeEvenly(t *testing.T) {
	modes(t, func(t *testing.T, windows bool) {
		const size = 16 << 20
		p := newRailsPair(t, 2, 2, size, windows)
		rep := p.send(t, true)
		if want := peer.Messages * size / stripePiece; rep.Messages != want {
			t.Errorf("report: %d messages, want %d (a header and a grant per piece)", rep.Messages, want)
		}
		rails := p.tx.Rails()
		if len(rails) != 2 || rails[0].NIC != nicName(p.txNICs[0], "") || rails[1].NIC != nicName(p.txNICs[1], "") || rails[0].NIC == rails[1].NIC {
			t.Fatalf("rails %+v, want the two NICs' names", rails)
		}
		for i, r := range rails {
			if r.Bytes != size/2 || r.Sends != size/stripePiece/2 {
				t.Errorf("rail %s carried %d bytes in %d pieces, want %d in %d", r.NIC, r.Bytes, r.Sends, size/2, size/stripePiece/2)
			}
			if got := p.txNICs[i].posted.Load(); got != size/2 {
				t.Errorf("NIC %s was posted %d bytes, want %d", r.NIC, got, size/2)
			}
			if fn, ok := p.txNICs[i].nic.(*fakeNIC); ok && fn.wrote.Load() != size/2 {
				t.Errorf("NIC %s placed %d bytes, want %d", r.NIC, fn.wrote.Load(), size/2)
			}
		}
		if st := p.tx.Stats(); st.Striped != 1 || st.Sends != 1 || st.Failovers != 0 {
			t.Errorf("stats: striped %d, sends %d, failovers %d; want 1, 1, 0", st.Striped, st.Sends, st.Failovers)
		}

		// Below StripeMin: rail 0 only.
		small := p.src[:1<<20]
		before := p.tx.Stats()
		if _, err := p.s.Write(ctxFor(t, 30*time.Second), transport.Write{Src: small, Remote: addrOf(p.sink.mem), Key: p.sink.key, Tag: 99}); err != nil {
			t.Fatal(err)
		}
		after := p.tx.Rails()
		if after[0].Bytes != size/2+1<<20 || after[1].Bytes != size/2 {
			t.Errorf("a 1 MiB write moved the rails to %+v: want it on rail 0 alone", after)
		}
		if st := p.tx.Stats(); st.Striped != before.Striped {
			t.Errorf("a 1 MiB write was striped")
		}
	})
}

// TestRailsFailover: a 64 MiB write striped evenly over two NICs, one
// through the first NIC alone and another striped (timed, side by side,
// on lanes already open), then a striped one during which one sending NIC fails after 3 MiB more (its
// queue pairs break: the NIC flushes what was posted on them): its
// pieces left go out of the other NIC, the write succeeds, and the slot
// arrives once, byte-exact. In the soft-RoCE VM it runs on rxe0 and
// rxe1 and prints the RAILS line.
func TestRailsFailover(t *testing.T) {
	modes(t, func(t *testing.T, windows bool) {
		const size = 64 << 20
		p := newRailsPair(t, 2, 2, size, windows)
		p.send(t, true) // opens the lanes of both rail pairs
		even := p.tx.Rails()
		if even[0].Bytes != size/2 || even[1].Bytes != size/2 {
			t.Fatalf("the first 64 MiB went %+v, want half out of each NIC", even)
		}
		p.tx.cfg.StripeMin = 0 // no write of this session is in flight
		fill(p.src, 9)
		clear(p.sink.mem)
		start := time.Now()
		p.send(t, false)
		oneNIC := time.Since(start)
		p.tx.cfg.StripeMin = 8 << 20
		mid := p.tx.Rails()
		if mid[0].Bytes != even[0].Bytes+size || mid[1].Bytes != even[1].Bytes {
			t.Fatalf("the unstriped 64 MiB moved the rails from %+v to %+v, want it all on rail 0", even, mid)
		}
		fill(p.src, 10)
		clear(p.sink.mem)
		start = time.Now()
		p.send(t, true)
		striped := time.Since(start)
		mid = p.tx.Rails()
		p.txNICs[1].breakAt.Store(p.txNICs[1].posted.Load() + 3<<20)
		fill(p.src, 11)
		clear(p.sink.mem)
		p.send(t, true)
		rails := p.tx.Rails()
		second := [2]uint64{rails[0].Bytes - mid[0].Bytes, rails[1].Bytes - mid[1].Bytes}
		if second[0]+second[1] != size || second[1] >= size/2 {
			t.Errorf("the second write went %v bytes over the rails: want rail 1 short of half (it failed after 3 MiB) and rail 0 the rest", second)
		}
		if fn, ok := p.txNICs[1].nic.(*fakeNIC); ok && fn.wrote.Load() < rails[1].Bytes {
			t.Errorf("NIC %s placed %d bytes, fewer than the %d the transport counts", rails[1].NIC, fn.wrote.Load(), rails[1].Bytes)
		}
		st := p.tx.Stats()
		if st.Failovers != 1 || st.Striped != 3 {
			t.Fatalf("stats: failovers %d, striped %d; want 1, 3", st.Failovers, st.Striped)
		}
		mbps := func(d time.Duration) float64 { return size / d.Seconds() / 1e6 }
		fmt.Printf("== RAILS mode=%s nic=%s bytes=%d nic=%s bytes=%d striped=%d failover=ok striped_MBps=%.1f one_nic_MBps=%.1f (the write during the failure: %s %d, %s %d after it failed)%s\n",
			p.rx.Mode(), even[0].NIC, even[0].Bytes, even[1].NIC, even[1].Bytes, st.Striped, mbps(striped), mbps(oneNIC),
			rails[0].NIC, second[0], rails[1].NIC, second[1], sysfsSent(even))
	})
}

// sysfsSent is what a real NIC's own counters say it sent (rxe's
// hw_counters), beside the transport's count; "" on the fake.
func sysfsSent(rails []RailStats) string {
	var out string
	for _, r := range rails {
		b, err := os.ReadFile("/sys/class/infiniband/" + r.NIC + "/ports/1/hw_counters/sent_pkts")
		if err == nil {
			out += fmt.Sprintf(" %s_sent_pkts=%s", r.NIC, strings.TrimSpace(string(b)))
		}
	}
	return out
}

// TestRailsAllDown: with every sending NIC failing, a striped write
// fails naming each rail.
func TestRailsAllDown(t *testing.T) {
	p := newRailsPair(t, 2, 2, 16<<20, true)
	p.txNICs[0].breakAt.Store(2 << 20)
	p.txNICs[1].breakAt.Store(2 << 20)
	p.sink.open(t, p.src)
	_, err := p.s.Write(ctxFor(t, 60*time.Second), transport.Write{Src: p.src, Remote: addrOf(p.sink.mem), Key: p.sink.key, Tag: p.sink.key.Tag(), Whole: true})
	for _, want := range []string{"every rail failed", "rail " + nicName(p.txNICs[0], ""), "rail " + nicName(p.txNICs[1], "")} {
		if err == nil || !strings.Contains(err.Error(), want) {
			t.Fatalf("write error %v, want it to say %q", err, want)
		}
	}
	if p.sink.arrivals != 0 {
		t.Fatal("the slot arrived from a write that failed")
	}
}

// TestRailsPairOnlyWhatBothHave: a sender with two NICs and a receiver
// with one stripe nothing (one rail pair); a receiver asked for a rail
// it lacks refuses the lane, naming its NICs.
func TestRailsPairOnlyWhatBothHave(t *testing.T) {
	const size = 16 << 20
	p := newRailsPair(t, 2, 1, size, true)
	p.send(t, false)
	if rails := p.tx.Rails(); rails[0].Bytes != size || rails[1].Bytes != 0 {
		t.Errorf("rails carried %+v: want all on rail 0", rails)
	}
	if st := p.tx.Stats(); st.Striped != 0 {
		t.Errorf("striped %d writes to a peer with one NIC", st.Striped)
	}
	_, _, _, err := p.tx.dialLane(ctxFor(t, 30*time.Second), p.rx.Addr().String(), pair{1, 1})
	if err == nil || !strings.Contains(err.Error(), "rail 1") || !strings.Contains(err.Error(), "drives 1 RDMA device") {
		t.Fatalf("a lane on the receiver's missing rail 1: %v", err)
	}
}

// TestConnectRecordRails: the connect record carries the rail at byte
// 28 and the rail count at 29 (rdma/wire.go), in both directions.
func TestConnectRecordRails(t *testing.T) {
	a := accept{endpoint: endpoint{QPN: 0x11223344}, peerRegion: peerRegion{Rails: 3}, Rail: 2}
	var b [acceptSize]byte
	a.encode(&b)
	if b[28] != 2 || b[29] != 3 || b[30] != 0 || b[31] != 0 {
		t.Fatalf("reply bytes 28..31 %v, want 2 3 0 0", b[28:32])
	}
	var back accept
	b[29] = 0 // a record without the count: one rail
	back.decode(&b)
	if back.Rail != 2 || back.Rails != 1 {
		t.Fatalf("decoded rail %d of %d, want 2 of 1", back.Rail, back.Rails)
	}
}

// TestConnectReplyChecked: a connect reply on another rail than asked,
// or claiming more rails than the wire allows (a session would open a
// pool of lanes per rail its keys name), is refused, naming what is
// wrong; 16 rails pass.
func TestConnectReplyChecked(t *testing.T) {
	for _, c := range []struct {
		rail, rails byte
		want        string
	}{
		{1, 16, ""},
		{2, 16, "connected one on rail 2"},
		{1, 17, "drives 17 RDMA devices"},
		{1, 255, "drives 255 RDMA devices"},
	} {
		var b [acceptSize]byte
		b[28], b[29] = c.rail, c.rails
		var a accept
		a.decode(&b)
		err := a.check(1)
		if c.want == "" && err != nil || c.want != "" && (err == nil || !strings.Contains(err.Error(), c.want)) {
			t.Errorf("a reply on rail %d of %d: %v, want %q", c.rail, c.rails, err, c.want)
		}
	}
}

var _ transport.WindowSink = windowedSink{}

// TestChooseRails: no device is today's one choice; a list is each in
// its order, any unusable one failing; all is the advertised address's
// device first, then the others with a usable port, the rest skipped
// with why.
func TestChooseRails(t *testing.T) {
	port := func(ip, dev string, active bool) Port {
		state := "DOWN"
		if active {
			state = "ACTIVE"
		}
		return Port{Num: 1, State: state, Active: active, LinkLayer: "Ethernet", MTU: 1024,
			GIDs: []GID{{Index: 1, GID: net.ParseIP(ip).String(), Type: "RoCE v2", Netdev: dev}}}
	}
	inv := Inventory{NICs: []NIC{
		{Name: "rxe0", Ports: []Port{port("10.0.0.5", "eth0", true)}},
		{Name: "rxe1", Ports: []Port{port("10.0.1.5", "eth1", true)}},
		{Name: "rxe2", Ports: []Port{port("10.0.2.5", "eth2", false)}},
	}}
	names := func(cs []Choice) string {
		var out []string
		for _, c := range cs {
			out = append(out, c.Device)
		}
		return strings.Join(out, ",")
	}
	w := Want{GIDIndex: -1, Addr: net.ParseIP("10.0.1.5")}
	for _, c := range []struct {
		name    string
		devices []string
		want    string
		skipped int
		fail    string
	}{
		{"None", nil, "rxe1", 0, ""},
		{"List", []string{"rxe0", "rxe1"}, "rxe0,rxe1", 0, ""},
		{"ListWithADownPort", []string{"rxe0", "rxe2"}, "", 0, "rxe2 port 1 is DOWN"},
		{"All", []string{AllDevices}, "rxe1,rxe0", 1, ""},
	} {
		t.Run(c.name, func(t *testing.T) {
			got, skipped, err := ChooseRails(inv, c.devices, w)
			if c.fail != "" {
				if err == nil || !strings.Contains(err.Error(), c.fail) {
					t.Fatalf("got %s, %v; want an error saying %q", names(got), err, c.fail)
				}
				return
			}
			if err != nil || names(got) != c.want || len(skipped) != c.skipped {
				t.Fatalf("got %s, skipped %q, %v; want %s, %d skipped", names(got), skipped, err, c.want, c.skipped)
			}
		})
	}
}

// TestRailsNeedTheSharedRegistration: several NICs over an arena whose
// shared registration failed (the memlock limit) refuse to start, saying
// what to do, and close nothing they do not own.
func TestRailsNeedTheSharedRegistration(t *testing.T) {
	f := newFabric()
	f.failRegister = 1 << 20
	n0, n1 := f.nic(1), f.nic(2)
	_, err := listen(testConfig(t, Config{Memory: mapT(t, 4<<20)}), n0, n1)
	if err == nil || !strings.Contains(err.Error(), "2 RDMA devices asked for") || !strings.Contains(err.Error(), "name one device") {
		t.Fatalf("listen over two NICs without a shared registration: %v", err)
	}
	for _, n := range []*fakeNIC{n0, n1} {
		if err := n.Close(); err != nil {
			t.Errorf("closing a NIC the failed listen left to its caller: %v", err)
		}
	}
}

// regionOnRail1 maps a region of size bytes on p's sender, registers it
// on rail 1's NIC (and a NIC the sender does not drive, which it
// names in Why), and makes it the source p.send writes.
func (p *railsPair) regionOnRail1(t *testing.T, size int) {
	t.Helper()
	region := mapT(t, size)
	fill(region, 5)
	rails := p.tx.Rails()
	c, on, err := p.tx.RegisterRegionOn(region, []string{rails[1].NIC, "mlx5_9"})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	if len(on.NICs) != 1 || on.NICs[0] != rails[1].NIC || !strings.Contains(on.Why, "mlx5_9 is not one of the RDMA devices") {
		t.Fatalf("registered on %+v: want %s alone, and why mlx5_9 is not", on, rails[1].NIC)
	}
	p.src = region
}

// TestRailsRegionOnItsNIC: a send from a region registered on rail 1
// goes out through rail 1 alone. In windows mode it is one direct write
// into the slot's rail 0 (its key's), no control message. Otherwise
// it goes in granted pieces (below StripeMin too) to the peer's rail 1,
// and the slot arrives once, byte-exact; when rail 1's NIC fails
// mid-send, rail 0 takes the pieces left and the send succeeds.
func TestRailsRegionOnItsNIC(t *testing.T) {
	modes(t, func(t *testing.T, windows bool) {
		const size = 4 << 20
		p := newRailsPair(t, 2, 2, size, windows)
		p.regionOnRail1(t, size)
		rep := p.send(t, !windows)
		rails := p.tx.Rails()
		if rails[0].Bytes != 0 || rails[1].Bytes != size || p.txNICs[0].posted.Load() != 0 || p.txNICs[1].posted.Load() != size {
			t.Fatalf("rails %+v, NICs posted %d and %d bytes: want all %d out of rail 1", rails, p.txNICs[0].posted.Load(), p.txNICs[1].posted.Load(), size)
		}
		if st := p.tx.Stats(); st.RegionRails != 1 || st.Striped != 0 || st.Sends != 1 {
			t.Errorf("stats: region_rails %d, striped %d, sends %d; want 1, 0, 1", st.RegionRails, st.Striped, st.Sends)
		}
		in := p.rx.Rails()
		if windows {
			if rep.Messages != 0 || p.tx.Stats().Direct != 1 || in[0].ReceivedBytes != size || in[1].ReceivedBytes != 0 {
				t.Fatalf("report %+v, %d direct, received %+v: want one direct write, no message, into the slot's rail 0", rep, p.tx.Stats().Direct, in)
			}
			return
		}
		if want := peer.Messages * size / stripePiece; rep.Messages != want {
			t.Errorf("report: %d messages, want %d (a header and a grant per piece)", rep.Messages, want)
		}
		if in[0].ReceivedBytes != 0 || in[1].ReceivedBytes != size || in[1].Received != size/stripePiece {
			t.Errorf("the receiver took %+v: want %d pieces, all %d bytes, in through rail 1", in, size/stripePiece, size)
		}

		p.txNICs[1].breakAt.Store(p.txNICs[1].posted.Load() + 1<<20)
		fill(p.src, 6)
		clear(p.sink.mem)
		p.send(t, true)
		after := p.tx.Rails()
		if after[0].Bytes == 0 || after[0].Bytes+after[1].Bytes-rails[1].Bytes != size {
			t.Fatalf("with rail 1 failing the send went %+v: want rail 0 to take the pieces left", after)
		}
		if st := p.tx.Stats(); st.Failovers != 1 || st.RegionRails != 2 {
			t.Errorf("stats: failovers %d, region_rails %d; want 1, 2", st.Failovers, st.RegionRails)
		}
	})
}

// TestRailsRegionPeerHasOneRail: to a peer with one NIC, a send from a
// region registered on rail 1 still goes out through rail 1, to the
// peer's rail 0.
func TestRailsRegionPeerHasOneRail(t *testing.T) {
	modes(t, func(t *testing.T, windows bool) {
		const size = 2 << 20
		p := newRailsPair(t, 2, 1, size, windows)
		p.regionOnRail1(t, size)
		p.send(t, false)
		if rails := p.tx.Rails(); rails[0].Bytes != 0 || rails[1].Bytes != size {
			t.Errorf("rails carried %+v: want all out of rail 1", rails)
		}
		if in := p.rx.Rails(); len(in) != 1 || in[0].ReceivedBytes != size {
			t.Errorf("the receiver took %+v: want all %d bytes on its one rail", in, size)
		}
		if st := p.tx.Stats(); st.RegionRails != 1 {
			t.Errorf("stats: region_rails %d, want 1", st.RegionRails)
		}
	})
}

// slotOnRail1 moves p's slot into a region of the receiver's registered
// on its rail 1 (a device arena whose nearest NIC that is): in windows
// mode its window, and so its key, are rail 1's.
func (p *railsPair) slotOnRail1(t *testing.T) {
	t.Helper()
	region := mapT(t, len(p.sink.mem))
	c, on, err := p.rx.RegisterRegionOn(region, []string{p.rx.Rails()[1].NIC})
	if err != nil || len(on.NICs) != 1 || on.NICs[0] != p.rx.Rails()[1].NIC {
		t.Fatalf("a region registered on the receiver's rail 1: %+v, %v", on, err)
	}
	// Before the transport closes: the window over it holds it, and
	// the transport's close drops both.
	t.Cleanup(func() { c.Close() })
	p.sink.mem = region
}

// TestRailsKeyNamesTheSlotsRail: in windows mode a slot in memory the
// receiver registered on its rail 1 gets its window there, and its key
// names rail 1: a write from the sender's arena leaves through the
// sender's rail 0 and arrives through the receiver's rail 1, direct,
// with no control message either side, byte-exact. The key with its
// rail byte changed names no slot: through windows the receiver's rail
// 0 NIC refuses the window's rkey (it is rail 1's), and a granted write
// is refused by the Sink, which compares keys whole.
func TestRailsKeyNamesTheSlotsRail(t *testing.T) {
	const size = 2<<20 + 3
	p := newRailsPair(t, 2, 2, size, true)
	p.slotOnRail1(t)
	p.sink.open(t, p.src)
	if p.sink.key.Rail() != 1 || p.sink.key.Window() == 0 {
		t.Fatalf("the slot's key names rail %d, window %#x: want rail 1's window", p.sink.key.Rail(), p.sink.key.Window())
	}
	altered := p.sink.key.WithRail(0)
	w := transport.Write{Src: p.src, Remote: addrOf(p.sink.mem), Key: altered, Tag: altered.Tag(), Whole: true}
	if _, err := p.s.Write(ctxFor(t, 30*time.Second), w); err == nil || !strings.Contains(err.Error(), "REM_ACCESS_ERR") {
		t.Fatalf("a direct write under the key with its rail byte changed: %v, want the NIC's refusal", err)
	}
	if in := p.rx.Rails(); in[0].Received != 0 || in[1].Received != 0 || p.sink.direct != 0 {
		t.Fatalf("the refused write was taken: received %+v, %d direct", in, p.sink.direct)
	}

	txBefore, rxBefore := p.tx.Stats(), p.rx.Stats()
	w.Key = p.sink.key
	rep, err := p.s.Write(ctxFor(t, 30*time.Second), w)
	if err != nil {
		t.Fatal(err)
	}
	p.sink.await(t)
	p.sink.mu.Lock()
	exact, direct := p.sink.exact, p.sink.direct
	p.sink.mu.Unlock()
	if !exact || direct != 1 || rep.Messages != 0 {
		t.Fatalf("exact %v, %d direct writes, %d messages: want the one write direct, byte-exact", exact, direct, rep.Messages)
	}
	out, in := p.tx.Rails(), p.rx.Rails()
	if out[0].Bytes != size || out[1].Bytes != 0 || in[0].ReceivedBytes != 0 || in[1].ReceivedBytes != size || in[1].Received != 1 {
		t.Fatalf("sent %+v, received %+v: want %d bytes out of the sender's rail 0, into the receiver's rail 1", out, in, size)
	}
	if tx, rx := p.tx.Stats(), p.rx.Stats(); tx.ControlMessages != txBefore.ControlMessages || rx.ControlMessages != rxBefore.ControlMessages || tx.Direct != 1 {
		t.Errorf("control messages %d->%d (sender), %d->%d (receiver), %d direct: want none, one direct write",
			txBefore.ControlMessages, tx.ControlMessages, rxBefore.ControlMessages, rx.ControlMessages, tx.Direct)
	}

	// A granted write (a piece) under the altered key: the Sink refuses it.
	_, err = p.s.Write(ctxFor(t, 30*time.Second), transport.Write{Src: p.src[:4096], Remote: addrOf(p.sink.mem), Key: altered, Tag: 7})
	var refused *transport.Refusal
	if !errors.As(err, &refused) || refused.Code != transport.NoSlot {
		t.Fatalf("a granted write under the key with its rail byte changed: %v, want refused (no slot)", err)
	}
}

// TestRailsKeyRailWithoutWindows: in grant mode a key names its slot's
// rail all the same (the daemon sets it from the arena's nearest NIC):
// a write leaves through the sender's rail 0, asks the receiver's rail
// 1, lands under a registration of its bytes on that NIC, and arrives
// there, byte-exact.
func TestRailsKeyRailWithoutWindows(t *testing.T) {
	const size = 1<<20 + 9
	p := newRailsPair(t, 2, 2, size, false)
	p.slotOnRail1(t)
	p.sink.open(t, p.src)
	p.sink.key = p.sink.key.WithRail(1)
	rep, err := p.s.Write(ctxFor(t, 30*time.Second), transport.Write{Src: p.src, Remote: addrOf(p.sink.mem), Key: p.sink.key, Tag: p.sink.key.Tag(), Whole: true})
	if err != nil {
		t.Fatal(err)
	}
	p.sink.await(t)
	p.sink.mu.Lock()
	exact := p.sink.exact
	p.sink.mu.Unlock()
	if !exact {
		t.Fatal("the slot's bytes differ")
	}
	out, in := p.tx.Rails(), p.rx.Rails()
	if out[0].Bytes != size || out[1].Bytes != 0 || in[0].Received != 0 || in[1].ReceivedBytes != size || rep.Messages != peer.Messages {
		t.Fatalf("sent %+v, received %+v, %d messages: want one granted write out of rail 0, into rail 1", out, in, rep.Messages)
	}
	if st := p.rx.Stats(); st.PerReceive != 1 {
		t.Errorf("the receiver made %d per-receive registrations, want 1 (on rail 1's NIC)", st.PerReceive)
	}
}

// inPlaceSink is a stripeSink over device memory the NIC reaches: the
// transport hands out no memory for its writes (AcceptInPlace).
type inPlaceSink struct{ windowedSink }

func (s inPlaceSink) AcceptInPlace(addr, n uint64, key transport.Key, tag uint32) (func(error), error) {
	_, done, err := s.Accept(addr, n, key, tag)
	return done, err
}

// TestRailsDeviceRegionOnItsNIC: with GPU arenas on both sides (the
// second GPU's arena stands as a CUDA region registered on rail 1's NIC,
// as ferryd registers it), a send from that region goes out through rail
// 1 alone into a slot in the receiver's GPU arena, in place, and lands
// byte-exact: in windows mode one direct write into the slot's rail 0
// (its window's); otherwise in pieces arriving on rail 1, under a
// registration of their bytes on that NIC, the arena's being rail 0's.
// The fake NIC's keys are each its own NIC's, as a real one's are.
func TestRailsDeviceRegionOnItsNIC(t *testing.T) {
	if onDevice(t) {
		t.Skip("on rxe, test/e2e's TestRDMARailsPerDevice runs this between two ferryd")
	}
	modes(t, func(t *testing.T, windows bool) {
		f := newFabric()
		f.noDMABuf, f.windows = syscall.EOPNOTSUPP, windows
		const n = 2<<20 + 7
		txDev, rxDev := mapT(t, 2*regionHalf), mapT(t, 2*regionHalf)
		sink := &stripeSink{mem: rxDev[:n]}
		start := func(cfg Config, first byte) *Transport {
			tr, err := listen(testConfig(t, cfg), f.nic(first), f.nic(first+1))
			if err != nil {
				t.Fatal(err)
			}
			closeAtEnd(t, tr)
			return tr
		}
		tx := start(Config{Device: gpuArenaIn(t, f, txDev, regionHalf, ""), Peer: peer.Config{MaxConnsPerPeer: 8}}, 1)
		rx := start(Config{Peer: peer.Config{Sink: inPlaceSink{windowedSink{sink}}}, Device: gpuArenaIn(t, f, rxDev, regionHalf, "")}, 0x41)
		rail1 := tx.Rails()[1].NIC
		lent := transport.Range{Addr: addrOf(txDev) + regionHalf, Len: regionHalf - regionTail}
		c, on, err := tx.RegisterDeviceRegionOn(lent, []string{rail1})
		if err != nil || len(on.NICs) != 1 || on.NICs[0] != rail1 || on.Why != "" {
			t.Fatalf("a CUDA region registered on %s: %+v, %v", rail1, on, err)
		}
		t.Cleanup(func() { c.Close() })
		s := dialT(t, tx, rx)
		fill(txDev, 7)
		sink.open(t, txDev[regionHalf:regionHalf+n])
		w := transport.Write{Device: transport.Range{Addr: lent.Addr, Len: n}, Remote: addrOf(sink.mem), Key: sink.key, Tag: sink.key.Tag(), Whole: true}
		if _, err := s.Write(ctxFor(t, 60*time.Second), w); err != nil {
			t.Fatal(err)
		}
		select {
		case <-sink.arrived:
		case <-time.After(30 * time.Second):
			t.Fatal("the slot did not arrive within 30s of the write's return")
		}
		sink.mu.Lock()
		if sink.arrivals != 1 || !sink.exact || windows != (sink.direct == 1) {
			t.Fatalf("the slot arrived %d times, exact %v, %d direct writes: want once, exact, direct in windows mode, else in granted pieces", sink.arrivals, sink.exact, sink.direct)
		}
		sink.mu.Unlock()
		if rails, st := tx.Rails(), tx.Stats(); rails[0].Bytes != 0 || rails[1].Bytes != n || st.Failovers != 0 || st.RegionRails != 1 {
			t.Fatalf("rails %+v, %d failovers, region_rails %d: want all %d bytes out of %s, none failing, one send", rails, st.Failovers, st.RegionRails, n, rail1)
		}
		want := map[bool]uint64{true: 0, false: 3}[windows]
		if st := rx.Stats(); st.PerReceive != want {
			t.Errorf("the receiver made %d per-receive registrations, want %d (none through the window, else one per piece on rail 1)", st.PerReceive, want)
		}
	})
}
