package daemon

import (
	"math/rand/v2"
	"strings"
	"testing"

	"github.com/ferry-project/ferry/transport"
)

// The set, built piece by piece in any order, stays sorted, disjoint and
// merged, and its running total matches a byte map of what was added.
func TestSpansMatchAByteMap(t *testing.T) {
	const size = 4096
	rng := rand.New(rand.NewPCG(1, 2))
	for round := 0; round < 50; round++ {
		var s spans
		var filled [size]bool
		for i := 0; i < 200; i++ {
			off := rng.Uint64N(size)
			n := rng.Uint64N(min(size-off, 64) + 1)
			grows := s.grows(off, n)
			before := len(s.set)
			got := s.add(off, n)
			for b := off; b < off+n; b++ {
				filled[b] = true
			}
			var want uint64
			for _, f := range filled {
				if f {
					want++
				}
			}
			if got != want {
				t.Fatalf("round %d: after [%d,+%d) the set covers %d bytes, the byte map %d", round, off, n, got, want)
			}
			if grows != (len(s.set) == before+1) {
				t.Fatalf("round %d: grows([%d,+%d)) = %v, but the set went from %d to %d spans", round, off, n, grows, before, len(s.set))
			}
			for k, x := range s.set {
				if x.start >= x.end || (k > 0 && s.set[k-1].end >= x.start) {
					t.Fatalf("round %d: set %v is not sorted, disjoint and merged at %d", round, s.set, k)
				}
				for b := x.start; b < x.end; b++ {
					if !filled[b] {
						t.Fatalf("round %d: span %v covers byte %d, which no piece wrote", round, x, b)
					}
				}
			}
		}
	}
}

// A slot tracks at most maxPieces separate pieces, counting those still
// being written; past that a new separate piece is refused, saying why,
// while a piece that joins existing ones is still taken.
func TestUnkeyedPiecesAreCapped(t *testing.T) {
	r := newTestRegistry(t, 1<<15)
	s, err := r.newSlot("p", 2*maxPieces+4, true)
	if err != nil {
		t.Fatal(err)
	}
	write := func(off uint64) (func(error), error) {
		_, done, err := r.AcceptUnkeyed(s.addr+off, 1)
		return done, err
	}
	for k := uint64(0); k < maxPieces-1; k++ {
		done, err := write(2 * k)
		if err != nil {
			t.Fatalf("piece %d: %v", k, err)
		}
		done(nil)
	}
	// The last one the limit allows is still in flight.
	last, err := write(2 * (maxPieces - 1))
	if err != nil {
		t.Fatal(err)
	}
	_, err = write(2 * maxPieces)
	if refusalCode(t, err) != transport.OutOfBounds || !strings.Contains(err.Error(), "4096 separate pieces") {
		t.Fatalf("a piece past the limit, one in flight: %v", err)
	}
	last(nil)
	if got := len(r.slots["p"].pieces.set); got != maxPieces {
		t.Fatalf("%d pieces tracked, want %d", got, maxPieces)
	}
	if _, err = write(2 * maxPieces); refusalCode(t, err) != transport.OutOfBounds {
		t.Fatalf("a piece past the limit: %v", err)
	}
	// Byte 1 joins [0,1) and [2,3): it is taken, and frees a place.
	done, err := write(1)
	if err != nil {
		t.Fatalf("a piece joining two others: %v", err)
	}
	done(nil)
	if done, err = write(2 * maxPieces); err != nil {
		t.Fatalf("a separate piece once the set shrank: %v", err)
	}
	done(nil)
}

// A slot whose pieces cover it arrives only once no write to it is in
// flight: a duplicate piece still being written holds it back, and its
// end delivers the slot, even when it failed.
func TestSlotArrivesWhenItsLastWriteEnds(t *testing.T) {
	for _, dupErr := range []error{nil, errBroken} {
		r := newTestRegistry(t, 8192)
		s, err := r.newSlot("d", 2000, true)
		if err != nil {
			t.Fatal(err)
		}
		arrived := func() bool { return r.receives()[0].Arrived }
		_, done, err := r.AcceptUnkeyed(s.addr, 1000)
		if err != nil {
			t.Fatal(err)
		}
		done(nil)
		_, dup, err := r.AcceptUnkeyed(s.addr+500, 1000) // a retry overlapping both halves
		if err != nil {
			t.Fatal(err)
		}
		_, done, err = r.AcceptUnkeyed(s.addr+1000, 1000)
		if err != nil {
			t.Fatal(err)
		}
		done(nil)
		if arrived() {
			t.Fatalf("duplicate ending with %v: the slot arrived while a duplicate piece was still being written", dupErr)
		}
		dup(dupErr)
		if !arrived() {
			t.Fatalf("duplicate ending with %v: the slot did not arrive when its last write ended", dupErr)
		}
		if got := r.receives()[0]; got.Received != 2000 || got.WritesInFlight != 0 {
			t.Fatalf("arrived slot %+v", got)
		}
	}
}
