package daemon

import (
	"testing"

	"github.com/ferry-project/ferry/transport"
)

// A ferry peer's read carrying an engine segment's key is served from
// that segment's registered memory at its Mooncake addresses, byte for
// byte; past it is out of bounds, and a receive slot's key or a key no
// segment has reads nothing (no_slot): the arena and slots are never
// readable.
func TestEngineKeysServeFerryPeersReadsOfEngineMemoryOnly(t *testing.T) {
	r := newTestRegistry(t, 1<<16)
	const at = 0x7f0000000000
	a := hostRegion(make([]byte, 4096))
	copy(a[100:], "registered bytes")
	if _, err := r.addRegionAt("r", a, nil, nil, lend{mooncakeAddr: at, segment: "e1"}); err != nil {
		t.Fatal(err)
	}
	key := transport.NewKey()
	r.engineKeys = map[transport.Key]string{key: "e1"}
	src, done, err := r.ReadKeyed(at+100, 16, key)
	if err != nil || string(src) != "registered bytes" {
		t.Fatalf("read %q, %v", src, err)
	}
	done()
	if _, _, err := r.ReadKeyed(at+4000, 200, key); refusalCode(t, err) != transport.OutOfBounds {
		t.Fatalf("past the engine's memory: %v", err)
	}
	if _, _, err := r.ReadKeyed(at-1, 2, key); refusalCode(t, err) != transport.OutOfBounds {
		t.Fatalf("before the engine's memory: %v", err)
	}
	s, err := r.newSlot("slot", 64, false)
	if err != nil {
		t.Fatal(err)
	}
	if _, _, err := r.ReadKeyed(s.addr, 1, s.key); refusalCode(t, err) != transport.NoSlot {
		t.Fatalf("a receive slot's key: %v", err)
	}
	if _, _, err := r.ReadKeyed(at, 1, transport.NewKey()); refusalCode(t, err) != transport.NoSlot {
		t.Fatalf("a key no segment has: %v", err)
	}
}
