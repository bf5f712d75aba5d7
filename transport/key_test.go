package transport

import (
	"bytes"
	"testing"
)

// TestKeyLayout: a key is 15 random bytes of capability (the tag its
// first 4), the rail at byte 15 and the window's rkey at 16..19,
// little-endian (key.go's table), written as 40 hex digits.
func TestKeyLayout(t *testing.T) {
	k := NewKey()
	if k[15] != 0 || k.Window() != 0 || k.Rail() != 0 {
		t.Fatalf("a new key %s names rail %d, window %#x: want rail 0, none", k, k.Rail(), k.Window())
	}
	w := k.WithWindowOn(Window{Rail: 3, RKey: 0x11223344})
	if !bytes.Equal(w[:15], k[:15]) || w[15] != 3 || !bytes.Equal(w[16:], []byte{0x44, 0x33, 0x22, 0x11}) {
		t.Fatalf("key %x with rail 3 and rkey 0x11223344: want the capability unchanged, then 03 44332211", w[:])
	}
	if w.WindowOn() != (Window{Rail: 3, RKey: 0x11223344}) || w.Tag() != k.Tag() {
		t.Fatalf("key %s reads back window %+v, tag %#x", w, w.WindowOn(), w.Tag())
	}
	if w.WithRail(0) == w || w.WithRail(0).WithRail(3) != w {
		t.Fatal("changing the rail byte does not change the key, or does more")
	}
	back, err := ParseKey(w.String())
	if err != nil || back != w || len(w.String()) != 40 {
		t.Fatalf("ParseKey(%s) = %s, %v", w, back, err)
	}
	// 120 random bits: keys drawn apart differ in their capability.
	if o := NewKey(); bytes.Equal(o[:15], k[:15]) {
		t.Fatal("two keys drew the same capability")
	}
}
