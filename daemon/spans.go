package daemon

import "sort"

// spans is a set of byte ranges, kept merged: which parts of a receive
// slot the pieces of an unkeyed (Mooncake) transfer have filled. A piece
// sent twice (a retry) counts once.
type spans []span

type span struct{ start, end uint64 }

// add puts [off, off+n) in the set and returns how many bytes it covers.
func (s *spans) add(off, n uint64) uint64 {
	set := append(*s, span{off, off + n})
	sort.Slice(set, func(i, j int) bool { return set[i].start < set[j].start })
	merged := set[:1]
	for _, x := range set[1:] {
		last := &merged[len(merged)-1]
		if x.start <= last.end {
			last.end = max(last.end, x.end)
		} else {
			merged = append(merged, x)
		}
	}
	*s = merged
	var total uint64
	for _, x := range merged {
		total += x.end - x.start
	}
	return total
}
