package transport

import (
	"crypto/rand"
	"encoding/binary"
	"encoding/hex"
	"fmt"
)

// KeySize is a receive slot key's size in bytes: a 128-bit capability,
// so that no peer can find a live slot by guessing at any rate a
// network allows, then the 32-bit rkey of the slot's memory window.
const KeySize = 20

// capSize is the capability's part of a key.
const capSize = 16

// Key is a receive slot's key: a capability of 128 random bits from
// crypto/rand, fresh per slot (whoever holds it may write into that
// slot, and only into it), then the rkey of the NIC-enforced window over
// the slot (rdma's windows mode; 0 without one). In JSON and on the
// command line it is 40 lower-case hex digits, a string clients pass
// along as they got it.
type Key [KeySize]byte

// NewKey draws a fresh random key, with no window.
func NewKey() Key {
	var k Key
	_, _ = rand.Read(k[:capSize]) // crypto/rand.Read never fails on Linux
	return k
}

// Window is the rkey of the memory window over the key's slot, through
// which a sender writes it directly; 0 when the slot has none.
func (k Key) Window() uint32 { return binary.LittleEndian.Uint32(k[capSize:]) }

// WithWindow is k naming the window whose rkey is rkey.
func (k Key) WithWindow(rkey uint32) Key {
	binary.LittleEndian.PutUint32(k[capSize:], rkey)
	return k
}

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
