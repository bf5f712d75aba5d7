package rdma

import (
	"bytes"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ferry-project/ferry/transport"
)

// engineAddr is where the tests' engine "maps" its region: an address
// nothing maps in this process, as an engine's own address of its
// memory is unrelated to the daemon's mapping of it.
const engineAddr = 0x7e00_0000_0000

// TestEngineRegionMooncakeWrites: a Mooncake peer writes one-sidedly
// into an engine region at the engine's addresses under the engine
// registration's rkey, and the bytes land in the daemon's mapping of
// it; a write running past the region, or naming the daemon's own
// address of it, fails at the NIC with REM_ACCESS_ERR; once closed, the
// registration takes no write.
func TestEngineRegionMooncakeWrites(t *testing.T) {
	peer, ferry := mcPair(t, newFabric(), 0)
	mem := mapT(t, 1<<16)
	er, err := ferry.tr.RegisterEngineRegion(mem, engineAddr)
	if err != nil {
		t.Fatal(err)
	}
	ctx := ctxFor(t, 30*time.Second)
	data := bytes.Repeat([]byte("engine "), 3000)
	copy(peer.mem, data)
	if _, err := peer.qp.Write(ctx, peer.mem[:len(data)], engineAddr+100, er.RKey); err != nil {
		t.Fatalf("a write at the engine's address: %v", err)
	}
	if !bytes.Equal(mem[100:100+len(data)], data) {
		t.Fatal("the region does not hold the bytes written at the engine's address")
	}
	reconnect := func() {
		t.Helper()
		for _, s := range []*mcSide{&peer, &ferry} {
			if s.qp, err = s.tr.NewMooncakeQP(); err != nil {
				t.Fatal(err)
			}
		}
		for _, c := range [][2]mcSide{{peer, ferry}, {ferry, peer}} {
			_, lid, gid, err := c[1].tr.MooncakeNIC()
			if err != nil {
				t.Fatal(err)
			}
			if err := c[0].qp.Connect(gid, lid, c[1].qp.QPN(), 0); err != nil {
				t.Fatal(err)
			}
		}
	}
	before := bytes.Clone(mem)
	for _, c := range []struct {
		name   string
		remote uint64
	}{
		{"across the region's end", engineAddr + uint64(len(mem)) - 100},
		{"at the daemon's own address of the region", addrOf(mem)},
	} {
		_, err := peer.qp.Write(ctx, peer.mem[:4096], c.remote, er.RKey)
		if transport.StatusName(err) != "REM_ACCESS_ERR" {
			t.Errorf("a write %s: %v, want REM_ACCESS_ERR", c.name, err)
		}
		reconnect()
	}
	if !bytes.Equal(mem, before) {
		t.Error("a refused write changed the region")
	}
	if err := er.Close(); err != nil {
		t.Fatal(err)
	}
	if _, err := peer.qp.Write(ctx, peer.mem[:64], engineAddr, er.RKey); transport.StatusName(err) != "REM_ACCESS_ERR" {
		t.Errorf("a write under the closed registration: %v, want REM_ACCESS_ERR", err)
	}
}

// TestEngineRegionGrants: a ferry peer's write into an engine region
// (the daemon's Sink lends the region's bytes, as for engine memory) is
// granted at the engine's address under the engine registration's
// rkey: in place, with no registration per write and no staging copy,
// in grant and windows mode alike (a keyed engine write has no window).
func TestEngineRegionGrants(t *testing.T) {
	modes(t, func(t *testing.T, windows bool) {
		p := newRegionPair(t, windows)
		fill(p.txLent, 9)
		er, err := p.rx.RegisterEngineRegion(p.rxLent, engineAddr)
		if err != nil {
			t.Fatal(err)
		}
		defer er.Close()
		rx0 := p.rx.Stats()
		var remote atomic.Uint64
		var rkey atomic.Uint32
		p.txh.arm(func(h *hook) {
			h.edit = func(o *op) {
				if remote.CompareAndSwap(0, o.Remote) { // the first chunk's
					rkey.Store(o.RKey)
				}
			}
		})
		const n = 1<<20 + 7
		p.write(t, p.txLent[:n], regionHalf+4096, false)
		if got, want := remote.Load(), uint64(engineAddr+4096); got != want || rkey.Load() != er.RKey {
			t.Errorf("the write was granted at %#x under rkey %#x, want the engine's address %#x under %#x", got, rkey.Load(), want, er.RKey)
		}
		rx := p.rx.Stats()
		if rx.PerReceive != rx0.PerReceive || rx.Staged != rx0.Staged || rx.CopiedBytes != rx0.CopiedBytes {
			t.Errorf("receiver: %d registered per receive, %d staged, %d bytes copied; want none",
				rx.PerReceive-rx0.PerReceive, rx.Staged-rx0.Staged, rx.CopiedBytes-rx0.CopiedBytes)
		}
	})
}

// TestEngineRegionRefusals: an engine region of no bytes, or one whose
// addresses wrap, is refused naming what is wrong.
func TestEngineRegionRefusals(t *testing.T) {
	_, ferry := mcPair(t, newFabric(), 0)
	mem := mapT(t, 1<<16)
	for _, c := range []struct {
		mem  []byte
		iova uint64
		want string
	}{
		{nil, engineAddr, "no bytes"},
		{mem, ^uint64(0) - 100, "end of the address space"},
	} {
		if _, err := ferry.tr.RegisterEngineRegion(c.mem, c.iova); err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%d bytes at %#x: %v, want an error saying %q", len(c.mem), c.iova, err, c.want)
		}
	}
}

// TestEngineRegionMooncakeReads: a Mooncake peer reads an engine region
// at the engine's addresses over its QP (Mooncake's READ); the arena,
// whose rkey the same descriptor lists, it cannot read (REM_ACCESS_ERR,
// or REM_INV_REQ_ERR), nor past the region.
func TestEngineRegionMooncakeReads(t *testing.T) {
	peer, ferry := mcPair(t, newFabric(), 0)
	mem := mapT(t, 1<<16)
	fill(mem, 3)
	fill(ferry.mem, 5)
	er, err := ferry.tr.RegisterEngineRegion(mem, engineAddr)
	if err != nil {
		t.Fatal(err)
	}
	defer er.Close()
	_, lkey, _ := peer.tr.SharedKeys()
	arenaRKey, _, _ := ferry.tr.SharedKeys()
	read := func(remote uint64, rkey uint32, n uint32) completion {
		t.Helper()
		l := peer.qp.l
		if err := l.qp.Post([]op{{WRID: 7, Local: addrOf(peer.mem), Remote: remote, Len: n, LKey: lkey, RKey: rkey, Signaled: true, Read: true}}); err != nil {
			t.Fatal(err)
		}
		c, err := wait(l, l.wcs, time.Now().Add(30*time.Second), nil)
		if err != nil {
			t.Fatalf("waiting for the read's completion: %v", err)
		}
		return c
	}
	if c := read(engineAddr+512, er.RKey, 8192); c.Status != wcSuccess || !bytes.Equal(peer.mem[:8192], mem[512:512+8192]) {
		t.Fatalf("a read of the engine region at its owner's address: %s (equal %t)", c.Status.String(), bytes.Equal(peer.mem[:8192], mem[512:512+8192]))
	}
	clear(peer.mem)
	if c := read(addrOf(ferry.mem), arenaRKey, 4096); c.Status != wcRemAccessErr && c.Status != wcRemInvReqErr {
		t.Fatalf("a read of the arena over a Mooncake QP: %s, want REM_ACCESS_ERR", c.Status.String())
	}
	if !isZero(peer.mem[:4096]) {
		t.Error("a refused read brought the arena's bytes back")
	}
}
