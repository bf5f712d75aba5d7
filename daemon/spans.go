package daemon

import "sort"

// maxPieces bounds the disjoint ranges one slot tracks: a sender that
// scatters tiny pieces cannot grow the registry's memory (or the time
// each piece holds its lock) without limit. Mooncake slices a transfer
// into pieces that are contiguous or nearly so, so a legitimate transfer
// stays far below it.
const maxPieces = 4096

// spans is a set of byte ranges, kept sorted and merged: which parts of a
// receive slot the writes into it have filled.
// A piece sent twice (a retry) counts once. Adding a piece costs a binary
// search and a merge with its neighbours, not a pass over the whole set.
type spans struct {
	set   []span // sorted by start; disjoint and not touching
	total uint64 // bytes the set covers
}

type span struct{ start, end uint64 }

// near returns the indices [i, j) of the spans that [off, end) overlaps or
// touches: those it would merge with.
func (s *spans) near(off, end uint64) (i, j int) {
	i = sort.Search(len(s.set), func(k int) bool { return s.set[k].end >= off })
	j = i
	for j < len(s.set) && s.set[j].start <= end {
		j++
	}
	return i, j
}

// grows reports whether adding [off, off+n) would add a disjoint range
// rather than extend or join existing ones.
func (s *spans) grows(off, n uint64) bool {
	if n == 0 {
		return false
	}
	i, j := s.near(off, off+n)
	return i == j
}

// add puts [off, off+n) in the set and returns how many bytes it covers.
func (s *spans) add(off, n uint64) uint64 {
	if n == 0 {
		return s.total
	}
	end := off + n
	i, j := s.near(off, end)
	if i == j {
		s.set = append(s.set, span{})
		copy(s.set[i+1:], s.set[i:])
		s.set[i] = span{off, end}
		s.total += n
		return s.total
	}
	merged := span{min(off, s.set[i].start), max(end, s.set[j-1].end)}
	for _, x := range s.set[i:j] {
		s.total -= x.end - x.start
	}
	s.total += merged.end - merged.start
	s.set[i] = merged
	s.set = append(s.set[:i+1], s.set[j:]...)
	return s.total
}
