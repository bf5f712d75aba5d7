package rdma

import (
	"bytes"
	"fmt"
	"net"
	"strings"
	"sync"
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
	s.key = transport.NewKey()
	if s.windows != nil {
		rkey, err := s.windows.Open(addrOf(s.mem), uint64(len(s.mem)))
		if err != nil {
			t.Fatal(err)
		}
		s.key = s.key.WithWindow(rkey)
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

// railsPair is a sender and a receiver on fake NICs, each with rails
// NICs, in windows mode or not, and a session between them.
type railsPair struct {
	tx, rx   *Transport
	txNICs   []*fakeNIC
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
	nics := func(first byte, n int) (nic, []nic, []*fakeNIC) {
		var all []*fakeNIC
		var more []nic
		for i := range n {
			fn := f.nic(first + byte(i))
			all = append(all, fn)
			if i > 0 {
				more = append(more, fn)
			}
		}
		return all[0], more, all
	}
	start := func(cfg Config, first byte, n int) (*Transport, []*fakeNIC) {
		n0, more, all := nics(first, n)
		tr, err := listen(testConfig(t, cfg), n0, more...)
		if err != nil {
			t.Fatal(err)
		}
		closeAtEnd(t, tr)
		return tr, all
	}
	p.tx, p.txNICs = start(Config{Memory: p.src, StripeMin: 8 << 20, Peer: peer.Config{MaxConnsPerPeer: 8}}, 1, txRails)
	p.rx, _ = start(Config{Memory: p.sink.mem, Peer: peer.Config{Sink: sink}}, 0x41, rxRails)
	s, err := p.tx.Dial(ctxFor(t, 30*time.Second), p.rx.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close() })
	p.s = s
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
	select {
	case <-p.sink.arrived:
	case <-time.After(30 * time.Second):
		t.Fatal("the slot did not arrive within 30s of the write's return")
	}
	p.sink.mu.Lock()
	defer p.sink.mu.Unlock()
	if p.sink.arrivals != 1 || !p.sink.exact || striped && p.sink.direct != 0 {
		t.Fatalf("the slot arrived %d times, exact %v, with %d direct writes heard of: want once, exact, none when striped", p.sink.arrivals, p.sink.exact, p.sink.direct)
	}
	return rep
}

func modes(t *testing.T, run func(t *testing.T, windows bool)) {
	for _, windows := range []bool{true, false} {
		t.Run(map[bool]string{true: "windows", false: "grant"}[windows], func(t *testing.T) { run(t, windows) })
	}
}

// TestRailsStripeEvenly: a write from the arena of at least StripeMin
// goes in 1 MiB pieces over both rail pairs, half the bytes out of each
// NIC (counted by the transport and, independently, by the fake NICs),
// and the slot arrives once, byte-exact; a smaller one goes on rail 0
// alone, unstriped.
func TestRailsStripeEvenly(t *testing.T) {
	modes(t, func(t *testing.T, windows bool) {
		const size = 16 << 20
		p := newRailsPair(t, 2, 2, size, windows)
		rep := p.send(t, true)
		if want := peer.Messages * size / stripePiece; rep.Messages != want {
			t.Errorf("report: %d messages, want %d (a header and a grant per piece)", rep.Messages, want)
		}
		rails := p.tx.Rails()
		if len(rails) != 2 || rails[0].NIC != "fake1" || rails[1].NIC != "fake2" {
			t.Fatalf("rails %+v, want fake1 and fake2", rails)
		}
		for i, r := range rails {
			if r.Bytes != size/2 || r.Sends != size/stripePiece/2 {
				t.Errorf("rail %s carried %d bytes in %d pieces, want %d in %d", r.NIC, r.Bytes, r.Sends, size/2, size/stripePiece/2)
			}
			if got := p.txNICs[i].wrote.Load(); got != size/2 {
				t.Errorf("NIC %s placed %d bytes, want %d", r.NIC, got, size/2)
			}
		}
		if st := p.tx.Stats(); st.Striped != 1 || st.Sends != 1 || st.Failovers != 0 {
			t.Errorf("stats: striped %d, sends %d, failovers %d; want 1, 1, 0", st.Striped, st.Sends, st.Failovers)
		}

		// Below StripeMin: rail 0 only, and in windows mode direct.
		small := p.src[:1<<20]
		key := p.sink.key
		before := p.tx.Stats()
		if _, err := p.s.Write(ctxFor(t, 30*time.Second), transport.Write{Src: small, Remote: addrOf(p.sink.mem), Key: key, Tag: 99}); err != nil {
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

// TestRailsFailover: one sending NIC goes down after 3 MiB of a 16 MiB
// striped write; its pieces left go out of the other NIC, the write
// succeeds, and the slot arrives once, byte-exact.
func TestRailsFailover(t *testing.T) {
	modes(t, func(t *testing.T, windows bool) {
		const size = 16 << 20
		p := newRailsPair(t, 2, 2, size, windows)
		p.txNICs[1].downAt.Store(3 << 20)
		p.send(t, true)
		rails := p.tx.Rails()
		if rails[0].Bytes+rails[1].Bytes != size || rails[1].Bytes < 3<<20 || rails[1].Bytes >= size/2 {
			t.Errorf("rails carried %+v: want rail 1 to stop short of half (it went down after 3 MiB) and rail 0 to carry the rest", rails)
		}
		if got := p.txNICs[1].wrote.Load(); got != rails[1].Bytes {
			t.Errorf("NIC fake2 placed %d bytes, the transport counts %d", got, rails[1].Bytes)
		}
		if st := p.tx.Stats(); st.Failovers != 1 || st.Striped != 1 {
			t.Errorf("stats: failovers %d, striped %d; want 1, 1", st.Failovers, st.Striped)
		}
		if p.sink.failed == 0 {
			t.Errorf("the receiver saw no piece fail: the NIC went down after every piece was out")
		}
	})
}

// TestRailsAllDown: with every sending NIC down, a striped write fails
// naming each rail.
func TestRailsAllDown(t *testing.T) {
	p := newRailsPair(t, 2, 2, 16<<20, true)
	p.txNICs[0].downAt.Store(2 << 20)
	p.txNICs[1].downAt.Store(2 << 20)
	p.sink.open(t, p.src)
	_, err := p.s.Write(ctxFor(t, 60*time.Second), transport.Write{Src: p.src, Remote: addrOf(p.sink.mem), Key: p.sink.key, Tag: p.sink.key.Tag(), Whole: true})
	if err == nil || !strings.Contains(err.Error(), "every rail failed") || !strings.Contains(err.Error(), "rail fake1") || !strings.Contains(err.Error(), "rail fake2") {
		t.Fatalf("write error %v, want every rail failed, naming both", err)
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
	_, _, _, err := p.tx.dialLane(ctxFor(t, 30*time.Second), p.rx.Addr().String(), 1)
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
