package daemon

import (
	"testing"

	"github.com/ferry-project/ferry/rdma"
	"github.com/ferry-project/ferry/transport"
)

// A ferry peer's write carrying an engine segment's key, wholly inside
// one of its GPU regions registered for peers' RDMA writes, is placed in
// place (AcceptEngine): at the daemon's device address of the engine's
// address, the region pinned until done. A write running past the
// region, into a GPU region not registered so, or carrying another key,
// is left to Accept (staged or refused there).
func TestAcceptEngineLandsInRegisteredGPUMemory(t *testing.T) {
	r := newTestRegistry(t, 1<<16)
	const at = 0x7f0000000000
	reg, plain := &deviceMemory{mem: make([]byte, 8192)}, &deviceMemory{mem: make([]byte, 4096)}
	if _, err := r.addRegionAt("k", reg, nil, nil, lend{mooncakeAddr: at, segment: "e1", mr: &rdma.EngineRegion{}}); err != nil {
		t.Fatal(err)
	}
	if _, err := r.addRegionAt("v", plain, nil, nil, lend{mooncakeAddr: at + 8192, segment: "e1"}); err != nil {
		t.Fatal(err)
	}
	key := transport.NewKey()
	r.engineKeys = map[transport.Key]string{key: "e1"}
	dev, done, in, err := r.AcceptEngine(at+100, 4000, key, 0)
	if err != nil || !in || dev != reg.Base()+100 {
		t.Fatalf("a write into registered GPU memory: at %#x, in %t, %v; want in place at %#x", dev, in, err, reg.Base()+100)
	}
	g := r.regions["k"]
	if g.uses != 1 {
		t.Fatalf("the region has %d uses while the write lands, want 1", g.uses)
	}
	done(nil)
	if g.uses != 0 {
		t.Fatalf("the region has %d uses after done, want 0", g.uses)
	}
	for _, c := range []struct {
		name    string
		addr, n uint64
		key     transport.Key
	}{
		{"past the registered region", at + 8000, 400, key},
		{"into a region not registered so", at + 8192, 100, key},
		{"with a key no engine has", at, 100, transport.NewKey()},
	} {
		if _, _, in, err := r.AcceptEngine(c.addr, c.n, c.key, 0); in || err != nil {
			t.Errorf("a write %s: in %t, %v; want it left to Accept", c.name, in, err)
		}
	}
	r.regions["k"].mr = nil // a stand-in: no registration to drop
}
