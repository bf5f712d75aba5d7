package transport

import (
	"crypto/rand"
	"encoding/binary"
	"encoding/hex"
	"fmt"
)

// KeySize is a receive slot key's size in bytes: a 120-bit capability,
// so that no peer can find a live slot by guessing at any rate a
// network allows (2^120 guesses: at a billion a second, 10^19 years),
// then the receiving slot's rail, then the 32-bit rkey of the slot's
// memory window on that rail.
//
//	bytes 0..14   capability, random (bytes 0..3 are also the tag)
//	byte  15      rail: the receiver's RDMA NIC (its index in that
//	              daemon's --rdma-device order) nearest the slot's
//	              device, the one its window is bound on
//	bytes 16..19  the window's rkey on that rail, little-endian; 0: none
const KeySize = 20

// capSize is the capability's part of a key; railAt is where the rail
// is, and the window's rkey follows.
const (
	capSize = 15
	railAt  = 15
)

// Key is a receive slot's key: a capability of 120 random bits from
// crypto/rand, fresh per slot (whoever holds it may write into that
// slot, and only into it), then the rail and the rkey of the
// NIC-enforced window over the slot (rdma's windows mode; 0 without
// one). A receiver compares a key whole: one with any byte changed, its
// rail too, names no slot. In JSON and on the command line it is 40
// lower-case hex digits, a string clients pass along as they got it.
type Key [KeySize]byte

// NewKey draws a fresh random key, on rail 0, with no window.
func NewKey() Key {
	var k Key
	_, _ = rand.Read(k[:capSize]) // crypto/rand.Read never fails on Linux
	return k
}

// Rail is the receiver's RDMA NIC the key's slot is reached through:
// where its window is bound, and where a sender with a lane to that NIC
// writes it.
func (k Key) Rail() uint8 { return k[railAt] }

// WithRail is k naming rail r.
func (k Key) WithRail(r uint8) Key {
	k[railAt] = r
	return k
}

// Window is the rkey of the memory window over the key's slot, through
// which a sender writes it directly; 0 when the slot has none.
func (k Key) Window() uint32 { return binary.LittleEndian.Uint32(k[railAt+1:]) }

// WithWindow is k naming the window whose rkey is rkey (on k's rail).
func (k Key) WithWindow(rkey uint32) Key {
	binary.LittleEndian.PutUint32(k[railAt+1:], rkey)
	return k
}

// WindowOn is the window k names: its rail and its rkey.
func (k Key) WindowOn() Window { return Window{Rail: k.Rail(), RKey: k.Window()} }

// WithWindowOn is k naming w: its rail and its rkey.
func (k Key) WithWindowOn(w Window) Key { return k.WithRail(w.Rail).WithWindow(w.RKey) }

// Tag is the key's first 32 bits: the slot's identity in the 32-bit tag
// (an RDMA immediate) a write carries to the receiver. A receiver keeps
// the tags of its live slots distinct.
func (k Key) Tag() uint32 { return binary.LittleEndian.Uint32(k[:4]) }

// IsZero reports a missing key: no slot has the zero key.
func (k Key) IsZero() bool { return k == Key{} }

func (k Key) String() string { return hex.EncodeToString(k[:]) }

func (k Key) MarshalText() ([]byte, error) { return []byte(k.String()), nil }

func (k *Key) UnmarshalText(b []byte) error {
	p, err := ParseKey(string(b))
	if err != nil {
		return err
	}
	*k = p
	return nil
}

// ParseKey reads a key written as String writes it.
func ParseKey(s string) (Key, error) {
	var k Key
	if len(s) != 2*KeySize {
		return k, fmt.Errorf("key %q has %d characters, not the %d hex digits of a receive slot's key: pass the key POST /v1/receives returned, unchanged", clip(s), len(s), 2*KeySize)
	}
	if _, err := hex.Decode(k[:], []byte(s)); err != nil {
		return k, fmt.Errorf("key %q is not hex: pass the key POST /v1/receives returned, unchanged", clip(s))
	}
	return k, nil
}

// clip keeps an error message short whatever a caller sent.
func clip(s string) string {
	if len(s) > 40 {
		return s[:40] + "..."
	}
	return s
}
