package rdma

import (
	"bytes"
	"io"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/ferry-project/ferry/api"
	"github.com/ferry-project/ferry/transport"
	"github.com/ferry-project/ferry/transport/peer"
	"github.com/ferry-project/ferry/transport/transporttest"
)

// regionPair is two transports whose memory is half arena, half region
// but its last regionTail bytes (one mapping each, the region registered
// with RegisterRegion): the receiver's slots span both halves.
type regionPair struct {
	tx, rx         *Transport
	txh            *hook // steers the sender's posts
	s              transport.Session
	slots          *transporttest.Slots // over the receiver's whole mapping
	src            []byte               // the sender's whole mapping
	txLent, rxLent []byte               // the region halves
	txReg, rxReg   interface{ Close() error }
}

// regionHalf is the arena's size and the mapping's rest; regionTail,
// the bytes of the mapping past the region's end.
const (
	regionHalf = 8 << 20
	regionTail = 64 << 10
)

func newRegionPair(t *testing.T, windows bool) *regionPair {
	t.Helper()
	f := newFabric()
	p := &regionPair{src: mapT(t, 2*regionHalf), slots: mappedSlots(t, 2*regionHalf), txh: &hook{}}
	p.slots.Base = addrOf(p.slots.Mem)
	var sink transport.Sink = p.slots
	if windows {
		f.windows = true
		sink = transporttest.WindowSlots{Slots: p.slots}
	}
	p.tx = listenHooked(t, f, Config{Memory: p.src[:regionHalf]}, p.txh)
	p.rx = listenT(t, f, Config{Peer: peer.Config{Sink: sink}, Memory: p.slots.Mem[:regionHalf]})
	if got, want := p.rx.Mode() == ModeWindows, windows; got != want {
		t.Fatalf("receiver's mode %q (%s), windows wanted: %v", p.rx.Mode(), p.rx.ModeWhy(), want)
	}
	p.txLent, p.rxLent = p.src[regionHalf:2*regionHalf-regionTail], p.slots.Mem[regionHalf:2*regionHalf-regionTail]
	var err error
	if p.txReg, err = p.tx.RegisterRegion(p.txLent); err != nil {
		t.Fatal(err)
	}
	if p.rxReg, err = p.rx.RegisterRegion(p.rxLent); err != nil {
		t.Fatal(err)
	}
	if p.s, err = p.tx.Dial(ctxFor(t, 30*time.Second), p.rx.Addr().String()); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { p.s.Close() })
	return p
}

// write sends src into a fresh slot at offset off of the receiver's
// mapping, waits for it, checks the bytes, frees the slot, and returns
// the sender's report.
func (p *regionPair) write(t *testing.T, src []byte, off uint64, whole bool) transport.Report {
	t.Helper()
	key := p.slots.Add(off, uint64(len(src)))
	w := transport.Write{Src: src, Remote: p.slots.Base + off, Key: key, Tag: key.Tag(), Whole: whole}
	rep, err := p.s.Write(ctxFor(t, 60*time.Second), w)
	if err != nil {
		t.Fatalf("a %d-byte write to offset %#x: %v", len(src), off, err)
	}
	if err := p.slots.Wait(ctxFor(t, 30*time.Second), w.Tag); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(p.slots.Mem[off:off+uint64(len(src))], src) {
		t.Fatalf("the %d-byte write to offset %#x landed wrong", len(src), off)
	}
	if err := p.slots.Remove(key); err != nil {
		t.Fatal(err)
	}
	return rep
}

// TestRegions: a region registered once with RegisterRegion is reached
// by the NIC where it lies, on both sides, in the grant and windows
// modes: a write from it reports the registration made once and copies
// nothing (no bounce), and a granted write into a slot in it lands in
// place (no staging buffer, nothing copied); in windows mode the slot's
// window binds over the region's registration, and a whole-slot write
// goes direct through it; in grant mode each write into a region is
// registered for itself (the region's own rkey lets no peer write:
// TestRegionRKeysStayHome). A source running past the region's end is
// not taken as inside it (bounced), and once the slots are freed both
// regions deregister (the NIC refuses to while a window is bound over
// one).
func TestRegions(t *testing.T) {
	for _, windows := range []bool{false, true} {
		name := ModeGrant
		if windows {
			name = ModeWindows
		}
		t.Run(name, func(t *testing.T) {
			p := newRegionPair(t, windows)
			fill(p.src, 5)
			tx0, rx0 := p.tx.Stats(), p.rx.Stats()
			const n = 1<<20 + 7
			// Region to region, and arena to region, piecewise and whole.
			want := transport.Report{Registration: transport.RegisteredShared, Messages: peer.Messages}
			for i, c := range []struct {
				src   []byte
				off   uint64
				whole bool
			}{
				{p.txLent[:n], regionHalf, false},
				{p.txLent[3*n : 4*n], regionHalf + 2*n, true},
				{p.src[:n], regionHalf + 4*n, true},
				{p.txLent[:n], 0, true}, // region to the receiver's arena
			} {
				rep := p.write(t, c.src, c.off, c.whole)
				wantRep := want
				if c.whole && p.rx.Mode() == ModeWindows {
					wantRep.Messages = 0 // direct, through the slot's window, in the arena or a region
				}
				if rep != wantRep {
					t.Errorf("write %d reported %+v, want %+v", i, rep, wantRep)
				}
			}
			tx, rx := p.tx.Stats(), p.rx.Stats()
			if d := tx.Bounced - tx0.Bounced; d != 0 || tx.CopiedBytes != tx0.CopiedBytes || tx.PerSend != tx0.PerSend {
				t.Errorf("sender: %d bounced, %d bytes copied, %d registered per send; want none", d, tx.CopiedBytes-tx0.CopiedBytes, tx.PerSend-tx0.PerSend)
			}
			if d := rx.Staged - rx0.Staged; d != 0 || rx.CopiedBytes != rx0.CopiedBytes {
				t.Errorf("receiver: %d staged, %d bytes copied; want none", d, rx.CopiedBytes-rx0.CopiedBytes)
			}
			if got, want := rx.PerReceive-rx0.PerReceive, regionReceives(windows, 3); got != want {
				t.Errorf("receiver: %d registered per receive, want %d", got, want)
			}

			// From the region's last page into the page after its end, in
			// the same mapping: not inside the region, so bounced.
			end := uint64(len(p.txLent))
			straddle := p.src[regionHalf+end-4096 : regionHalf+end+4096]
			before := p.tx.Stats()
			if rep := p.write(t, straddle, regionHalf+6*n, false); rep.Registration != transport.RegisteredNone || rep.Copied != int64(len(straddle)) {
				t.Errorf("a source straddling the region's end reported %+v, want copied through the bounce buffer", rep)
			}
			if d := p.tx.Stats().Bounced - before.Bounced; d != 1 {
				t.Errorf("a source straddling the region's end bounced %d times, want 1", d)
			}

			// Deregistered once no slot (window) holds them.
			for _, h := range []interface{ Close() error }{p.txReg, p.rxReg} {
				if err := h.Close(); err != nil {
					t.Fatalf("deregistering a region after use: %v", err)
				}
			}
			if windows {
				return // a slot in unregistered memory gets no window, as the daemon makes them
			}
			// Then the region is memory like any other: copied.
			before = p.tx.Stats()
			rxBefore := p.rx.Stats()
			if rep := p.write(t, p.txLent[:4096], regionHalf, false); rep.Copied != 4096 {
				t.Errorf("a write from a deregistered region reported %+v, want copied", rep)
			}
			if d := p.rx.Stats().Staged - rxBefore.Staged; d != 1 {
				t.Errorf("a write into a deregistered region staged %d times, want 1", d)
			}
			if d := p.tx.Stats().Bounced - before.Bounced; d != 1 {
				t.Errorf("a write from a deregistered region bounced %d times, want 1", d)
			}
		})
	}
}

// regionReceives is how many registrations per receive n granted writes
// into regions make: one each outside windows mode, none in it.
func regionReceives(windows bool, n uint64) uint64 {
	if windows {
		return 0
	}
	return n
}

// TestRegionRKeysStayHome: outside windows mode a region is registered
// for local access only, and a granted write into a slot in it goes
// under a registration of the slot's bytes made for that write alone:
// neither the region's own rkey nor the rkey an earlier grant named lets
// a peer write the region. The sender's NIC reports REM_ACCESS_ERR for
// each (a write granted into the arena, sent to the region's bytes
// under that rkey instead), nothing is delivered, the region's bytes
// stay as they were, and a good write after each goes through on a new
// lane.
func TestRegionRKeysStayHome(t *testing.T) {
	p := newRegionPair(t, false)
	fill(p.src, 7)
	const n = 4096
	victim := uint64(regionHalf) // a slot's offset in the receiver's region
	var granted atomic.Uint32
	p.txh.arm(func(h *hook) { h.edit = func(o *op) { granted.Store(o.RKey) } })
	p.write(t, p.txLent[:n], victim, false)
	own := p.rx.lent.holdingBytes(p.rxLent).mr.RKey()
	if own == 0 {
		// rxe gives a registration without remote access rkey 0; its
		// lkey is what a peer would try.
		own = p.rx.lent.holdingBytes(p.rxLent).mr.LKey()
	}
	for _, c := range []struct {
		name string
		rkey uint32
	}{
		{"under an earlier grant's rkey", granted.Load()},
		{"under the region's own rkey", own},
	} {
		t.Run(c.name, func(t *testing.T) {
			defer p.write(t, p.txLent[:n], victim, false)
			before := bytes.Clone(p.slots.Mem[victim : victim+n])
			hostile := p.src[1 : n+1] // the pattern moved by a byte
			if bytes.Equal(before, hostile) {
				t.Fatal("the hostile write's bytes are the region's already: it would show nothing")
			}
			key := p.slots.Add(0, n) // in the arena: granted under its rkey
			w := transport.Write{Src: hostile, Remote: p.slots.Base, Key: key, Tag: key.Tag()}
			p.txh.arm(func(h *hook) { h.edit = func(o *op) { o.Remote, o.RKey = p.slots.Base+victim, c.rkey } })
			_, err := p.s.Write(ctxFor(t, 60*time.Second), w)
			if got := transport.StatusName(err); got != "REM_ACCESS_ERR" {
				t.Fatalf("a write %s: %v (status %q), want REM_ACCESS_ERR", c.name, err, got)
			}
			t.Logf("a write %s: %v", c.name, err)
			if err := p.slots.WaitIdle(ctxFor(t, 30*time.Second)); err != nil {
				t.Fatal(err)
			}
			if d := p.slots.Delivered(w.Tag); d != 0 {
				t.Errorf("a write %s was delivered %d times", c.name, d)
			}
			if !bytes.Equal(before, p.slots.Mem[victim:victim+n]) {
				t.Errorf("a write %s changed the region", c.name)
			}
			if err := p.slots.Remove(key); err != nil {
				t.Fatal(err)
			}
		})
	}
}

// TestRegionWindowHoldsRegistration: the NIC does not drop a region's
// registration while a window over a slot in it is bound; once the
// slot's window is closed it does.
func TestRegionWindowHoldsRegistration(t *testing.T) {
	p := newRegionPair(t, true)
	key := p.slots.Add(regionHalf, 4096)
	if err := p.rxReg.Close(); err == nil {
		t.Fatal("a region's registration was dropped with a window bound over a slot in it")
	}
	if err := p.slots.Remove(key); err != nil {
		t.Fatal(err)
	}
	if err := p.rxReg.Close(); err != nil {
		t.Fatalf("deregistering once the window was closed: %v", err)
	}
}

// TestRegionRegistrationRefused: a region the NIC will not register (the
// locked-memory limit, most often) is refused with the reason and the
// fix, and its writes are then copied: bounced from, staged into. On
// the fake NIC, whose refusal the test sets.
func TestRegionRegistrationRefused(t *testing.T) {
	if onDevice(t) {
		t.Skip("the fake NIC's refusal")
	}
	f := newFabric()
	const size = 8 << 20 // more than a bounce buffer, which the NIC must take
	src, slots := mapT(t, 2*size), mappedSlots(t, 2*size)
	slots.Base = addrOf(slots.Mem)
	tx := listenFake(t, f, Config{Memory: src[:size]})
	rx := listenFake(t, f, Config{Peer: peer.Config{Sink: slots}, Memory: slots.Mem[:size]})
	f.mu.Lock()
	f.failRegister = size // the arenas are in; the regions are refused
	f.mu.Unlock()
	for _, c := range []struct {
		tr  *Transport
		mem []byte
	}{{tx, src[size:]}, {rx, slots.Mem[size:]}} {
		if reg, err := c.tr.RegisterRegion(c.mem); err == nil || !strings.Contains(err.Error(), "RLIMIT_MEMLOCK") || !strings.Contains(err.Error(), "copied through bounce and staging buffers") {
			t.Fatalf("registering a region the NIC refuses: %v, %v; want the reason and what happens instead", reg, err)
		}
	}
	s, err := tx.Dial(ctxFor(t, 30*time.Second), rx.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	fill(src, 9)
	key := slots.Add(size, 64<<10)
	w := transport.Write{Src: src[size : size+64<<10], Remote: slots.Base + size, Key: key, Tag: key.Tag()}
	if rep, err := s.Write(ctxFor(t, 60*time.Second), w); err != nil || rep.Copied != 64<<10 {
		t.Fatalf("a write from an unregistered region: %+v, %v; want it copied through the bounce buffer", rep, err)
	}
	if err := slots.Wait(ctxFor(t, 30*time.Second), w.Tag); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(slots.Mem[size:size+64<<10], src[size:size+64<<10]) {
		t.Fatal("the write landed wrong")
	}
	if st := rx.Stats(); st.Staged != 1 {
		t.Errorf("receiver stats %+v: want the write staged and copied in", st)
	}
}

// TestCUDARegions: a CUDA region (device memory on the GPU arena's
// device, at its device pointer) registered once with
// RegisterDeviceRegion, where the NIC reaches the GPU arena by peer
// memory (dmabuf refused), is reached by the NIC where it lies on both
// sides, in the grant and windows modes: a write from it (Write.Device)
// goes from its registration with nothing copied or bounced, and a
// granted write into a slot in it lands in place (AcceptInPlace: no
// staging buffer, no per-receive registration, nothing copied); in
// windows mode the slot's window binds over the region's registration
// and a whole-slot write goes direct through it. A source running past
// the region's end is refused, and so is one from it once deregistered,
// naming what the NIC reaches.
func TestCUDARegions(t *testing.T) {
	for _, windows := range []bool{false, true} {
		name := ModeGrant
		if windows {
			name = ModeWindows
		}
		t.Run(name, func(t *testing.T) {
			if onDevice(t) && !windows {
				t.Skip("soft-RoCE has windows: the fake NIC shows the grant mode")
			}
			f := newFabric()
			f.noDMABuf, f.windows = syscall.EOPNOTSUPP, windows
			// Each side's device memory: the arena, then a region.
			txDev, rxDev := mapT(t, 2*regionHalf), mapT(t, 2*regionHalf)
			slots := transporttest.NewSlots(0)
			slots.Mem, slots.Base = rxDev, addrOf(rxDev)
			var sink transport.Sink = slots
			if windows {
				sink = transporttest.WindowSlots{Slots: slots}
			}
			tx := listenT(t, f, Config{Device: gpuArenaIn(t, f, txDev, regionHalf, "")})
			rx := listenT(t, f, Config{Peer: peer.Config{Sink: sink}, Device: gpuArenaIn(t, f, rxDev, regionHalf, "")})
			if got := rx.Mode(); got != name {
				t.Fatalf("receiver's mode %q (%s), want %s", got, rx.ModeWhy(), name)
			}
			lent := func(dev []byte) transport.Range {
				return transport.Range{Addr: addrOf(dev) + regionHalf, Len: regionHalf - regionTail}
			}
			txLent, rxLent := lent(txDev), lent(rxDev)
			txReg, err := tx.RegisterDeviceRegion(txLent)
			if err != nil {
				t.Fatal(err)
			}
			rxReg, err := rx.RegisterDeviceRegion(rxLent)
			if err != nil {
				t.Fatal(err)
			}
			s, err := tx.Dial(ctxFor(t, 30*time.Second), rx.Addr().String())
			if err != nil {
				t.Fatal(err)
			}
			defer s.Close()
			fill(txDev, 7)
			// write sends n device bytes at src into a fresh slot at
			// offset off of the receiver's device memory, waits for it,
			// checks the bytes and frees the slot.
			write := func(src, off, n uint64, whole bool) (transport.Report, error) {
				t.Helper()
				key := slots.Add(off, n)
				defer func() {
					if err := slots.Remove(key); err != nil {
						t.Fatal(err)
					}
				}()
				w := transport.Write{Device: transport.Range{Addr: src, Len: n}, Remote: slots.Base + off, Key: key, Tag: key.Tag(), Whole: whole}
				rep, err := s.Write(ctxFor(t, 60*time.Second), w)
				if err != nil {
					return rep, err
				}
				if err := slots.Wait(ctxFor(t, 30*time.Second), w.Tag); err != nil {
					t.Fatal(err)
				}
				if s := src - addrOf(txDev); !bytes.Equal(rxDev[off:off+n], txDev[s:s+n]) {
					t.Fatalf("the %d-byte write to offset %#x landed wrong", n, off)
				}
				return rep, nil
			}
			tx0, rx0 := tx.Stats(), rx.Stats()
			const n = 1<<20 + 7
			for i, c := range []struct {
				src, off uint64
				whole    bool
			}{
				{txLent.Addr, regionHalf, false},
				{txLent.Addr + 3*n, regionHalf + 2*n, true},
				{addrOf(txDev), regionHalf + 4*n, true}, // arena to region
				{txLent.Addr, 0, true},                  // region to the receiver's arena
			} {
				rep, err := write(c.src, c.off, n, c.whole)
				if err != nil {
					t.Fatalf("write %d: %v", i, err)
				}
				want := transport.Report{Registration: transport.RegisteredShared, Messages: peer.Messages}
				if c.whole && windows {
					want.Messages = 0 // direct, through the slot's window, in the arena or a region
				}
				if rep != want {
					t.Errorf("write %d reported %+v, want %+v", i, rep, want)
				}
			}
			txs, rxs := tx.Stats(), rx.Stats()
			if txs.Bounced != tx0.Bounced || txs.CopiedBytes != tx0.CopiedBytes || txs.PerSend != tx0.PerSend {
				t.Errorf("sender: %d bounced, %d bytes copied, %d registered per send; want none",
					txs.Bounced-tx0.Bounced, txs.CopiedBytes-tx0.CopiedBytes, txs.PerSend-tx0.PerSend)
			}
			if rxs.Staged != rx0.Staged || rxs.CopiedBytes != rx0.CopiedBytes {
				t.Errorf("receiver: %d staged, %d bytes copied; want none", rxs.Staged-rx0.Staged, rxs.CopiedBytes-rx0.CopiedBytes)
			}
			if got, want := rxs.PerReceive-rx0.PerReceive, regionReceives(windows, 3); got != want {
				t.Errorf("receiver: %d registered per receive, want %d", got, want)
			}

			// From the region's last page past its end: outside it.
			end := txLent.Addr + txLent.Len
			if _, err := write(end-4096, regionHalf+6*n, 8192, false); err == nil || !strings.Contains(err.Error(), "lie outside the device memory the NIC reaches") {
				t.Errorf("a device source straddling the region's end: %v", err)
			}
			// Deregistered once no slot (window) holds them; then a
			// source in the sender's is out of the NIC's reach.
			for _, h := range []io.Closer{txReg, rxReg} {
				if err := h.Close(); err != nil {
					t.Fatalf("deregistering a CUDA region after use: %v", err)
				}
			}
			if _, err := write(txLent.Addr, 0, 4096, false); err == nil || !strings.Contains(err.Error(), "lie outside the device memory the NIC reaches") {
				t.Errorf("a device source in a deregistered region: %v", err)
			}
		})
	}
}

// TestCUDARegionRefusals: a CUDA region is registered by peer memory
// only where the NIC reaches the GPU arena itself; elsewhere, or where
// peer memory fails, RegisterDeviceRegion says why and what the region
// falls back to. On the fake NIC, whose refusals a test sets.
func TestCUDARegionRefusals(t *testing.T) {
	if onDevice(t) {
		t.Skip("the fake NIC's refusals")
	}
	for _, c := range []struct {
		name                string
		path                api.GPURegistration
		noDMABuf, noPeerMem error
		want                []string
	}{
		{"bounce arena", api.GPURegistrationBounce, nil, nil, []string{"the GPU arena went by the bounce path (--gpu-registration bounce)", "pinned bounce area"}},
		{"no peermem", "", nil, syscall.EFAULT, []string{"by its device pointer (peermem", "EFAULT", "modprobe nvidia-peermem", "pinned bounce area"}},
		{"overlaps the arena", "", nil, nil, []string{"overlaps the GPU arena"}},
	} {
		t.Run(c.name, func(t *testing.T) {
			f := newFabric()
			f.noDMABuf, f.noPeerMem = c.noDMABuf, c.noPeerMem
			dev := mapT(t, 2*regionHalf)
			tr := listenFake(t, f, Config{Device: gpuArenaIn(t, f, dev, regionHalf, c.path)})
			r := transport.Range{Addr: addrOf(dev) + regionHalf, Len: regionHalf}
			if c.name == "overlaps the arena" {
				r.Addr -= 4096
			}
			h, err := tr.RegisterDeviceRegion(r)
			if err == nil {
				h.Close()
				t.Fatal("registered")
			}
			for _, w := range c.want {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("error %q does not say %q", err, w)
				}
			}
		})
	}
}

// TestRegionDeregistersOutsideTheLock: a region's deregistration, which
// unpins every page of it, runs outside the lock that a write arriving
// into another region takes to find its registration.
func TestRegionDeregistersOutsideTheLock(t *testing.T) {
	a, b := mapT(t, 1<<20), mapT(t, 1<<20)
	var tr *Transport
	looked := make(chan bool, 1)
	n := deregHookNIC{nic: testNIC(t, newFabric(), 1), mem: addrOf(a), before: func() {
		go func() { looked <- tr.lent.holdingBytes(b) != nil }()
		select {
		case found := <-looked:
			if !found {
				t.Error("the region left registered was not found while another deregistered")
			}
		case <-time.After(10 * time.Second):
			t.Error("finding a region waited for another's deregistration")
		}
	}}
	tr, err := listen(testConfig(t, Config{}), n)
	if err != nil {
		t.Fatal(err)
	}
	closeAtEnd(t, tr)
	ha, err := tr.RegisterRegion(a)
	if err != nil {
		t.Fatal(err)
	}
	hb, err := tr.RegisterRegion(b)
	if err != nil {
		t.Fatal(err)
	}
	defer hb.Close()
	if err := ha.Close(); err != nil {
		t.Fatal(err)
	}
	if tr.lent.holdingBytes(a) != nil {
		t.Error("a region deregistered is still listed")
	}
}

// deregHookNIC runs before as the registration of the memory at mem is
// closed.
type deregHookNIC struct {
	nic
	mem    uint64
	before func()
}

func (n deregHookNIC) Register(mem []byte, u use) (region, error) {
	r, err := n.nic.Register(mem, u)
	if err != nil || addrOf(mem) != n.mem {
		return r, err
	}
	return deregHook{r, n.before}, nil
}

type deregHook struct {
	region
	before func()
}

func (r deregHook) Close() error {
	r.before()
	return r.region.Close()
}
