// Package connlimit bounds what strangers can make the daemon hold
// through a port anyone may reach: the connections each port accepted
// (Listener), and the Mooncake endpoints set up through one (a Table of
// its own). Members are capped in total and per source address. At the
// total cap a newcomer takes the place of the member a stranger most
// likely holds, never of one in use; with none to take, it is refused.
//
// Which member goes (Table.Admit): first those that have carried no
// successful traffic yet (a connection that only said hello, an endpoint
// nobody wrote through), of those first the quiet ones, that finished
// their handshake or a request and wait for nothing (a peer's connection
// goes on to a write at once; one still in its handshake may be a peer's
// not served yet), then those from the source that holds the most, then
// the least recently used. A source at its own cap displaces only
// its own unproven members, the least recently used first, and is
// refused when all of them are proven or in use. So a stranger flooding
// the port pushes out its own and other strangers' members before any
// peer that has done real work, one address cannot take more than its
// share, and a stranger sharing a peer's address (the same host, one
// NAT) cannot lock the peer out: the peer's proven members stay, and its
// newcomers take the stranger's places.
package connlimit

import (
	"fmt"
	"net"
	"sync"
)

// Limits caps a table. Zero means no cap.
type Limits struct {
	Total     int // members at once
	PerSource int // members at once from one source (see Source)
}

// Or is l with d's caps where l has none: a configuration's limits over
// its defaults.
func (l Limits) Or(d Limits) Limits {
	if l.Total <= 0 {
		l.Total = d.Total
	}
	if l.PerSource <= 0 {
		l.PerSource = d.PerSource
	}
	return l
}

// Reasons a member is refused or closed early, as metrics label them.
const (
	ReasonTotal     = "total"      // refused: the table is full of members in use
	ReasonPerSource = "per_source" // refused: its source is at its cap, its members proven or in use
	ReasonEvicted   = "evicted"    // closed to make room for a newcomer
	ReasonIdle      = "idle"       // closed by its port's idle timeout
	ReasonTimeout   = "handshake"  // closed: it did not say who it is in time
)

// Refusal is Admit's answer to a newcomer it has no room for.
type Refusal struct {
	Reason string // ReasonTotal or ReasonPerSource
	Limit  int
}

func (r *Refusal) Error() string {
	if r.Reason == ReasonPerSource {
		return fmt.Sprintf("its address already holds %d, the most one address may, each proven or in use", r.Limit)
	}
	return fmt.Sprintf("all %d places are in use", r.Limit)
}

// Stats counts what a table did.
type Stats struct {
	Open             int
	RefusedTotal     uint64
	RefusedPerSource uint64
	Evicted          uint64
	Idle             uint64 // closed by an idle timeout (Member.Closing)
	Timeout          uint64 // closed by a handshake deadline (Member.Closing)
	// RefusedNotAllowed counts connections closed at accept because
	// their address is not on the port's allow-list: the port's owner
	// fills it in (a Mooncake port's mooncake_allow).
	RefusedNotAllowed uint64
	// Failures counts what the port's owner warned of and a remote party
	// can cause at will (a failed handshake, a malformed request): the
	// owner fills it in; the table does not see them.
	Failures uint64
}

// Table holds members of type V under Limits.
type Table[V any] struct {
	lim Limits

	mu    sync.Mutex
	all   map[*Member[V]]struct{}
	per   map[string]int
	tick  uint64
	stats Stats
}

// Member is one admitted V.
type Member[V any] struct {
	Value  V
	t      *Table[V]
	source string
	proven bool   // has carried successful traffic
	quiet  bool   // finished its handshake or a request, and waits for nothing
	busy   bool   // in use: never evicted
	used   uint64 // the table's tick when last used
	gone   bool   // released or evicted
}

// NewTable makes a table under lim.
func NewTable[V any](lim Limits) *Table[V] {
	return &Table[V]{lim: lim, all: make(map[*Member[V]]struct{}), per: make(map[string]int)}
}

// Limits is the table's caps.
func (t *Table[V]) Limits() Limits { return t.lim }

// Admit adds v from source ("" for members the daemon itself made, which
// no per-source cap binds). At the total cap it evicts a member (see the
// package comment) and returns it, already out of the table, for the
// caller to close. A newcomer it has no room for gets a *Refusal.
func (t *Table[V]) Admit(source string, v V) (m *Member[V], evicted *Member[V], err error) {
	return t.Replace(nil, source, v)
}

// Replace admits v from source, as Admit does, in old's place: old (nil,
// or out of the table already, for none) leaves the table only if v gets
// in, and while v is weighed old's place is free, so replacing a member
// evicts nobody and counts against no cap. v keeps what old proved: a
// replacement is no newcomer to evict first.
func (t *Table[V]) Replace(old *Member[V], source string, v V) (m *Member[V], evicted *Member[V], err error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if old != nil && !old.gone {
		t.remove(old)
		defer func() {
			if err != nil {
				t.add(old)
			}
		}()
	}
	switch {
	case source != "" && t.lim.PerSource > 0 && t.per[source] >= t.lim.PerSource:
		if evicted = t.victim(source); evicted == nil {
			t.stats.RefusedPerSource++
			return nil, nil, &Refusal{Reason: ReasonPerSource, Limit: t.lim.PerSource}
		}
	case t.lim.Total > 0 && len(t.all) >= t.lim.Total:
		if evicted = t.victim(""); evicted == nil {
			t.stats.RefusedTotal++
			return nil, nil, &Refusal{Reason: ReasonTotal, Limit: t.lim.Total}
		}
	}
	if evicted != nil {
		t.remove(evicted)
		t.stats.Evicted++
	}
	t.tick++
	m = &Member[V]{Value: v, t: t, source: source, used: t.tick, proven: old != nil && old.proven}
	t.add(m)
	return m, evicted, nil
}

// add puts m in the table. t.mu is held.
func (t *Table[V]) add(m *Member[V]) {
	m.gone = false
	t.all[m] = struct{}{}
	t.per[m.source]++
}

// victim is the member to evict: not in use; unproven before proven;
// then quiet before the rest; then from the source holding the most;
// then the least recently used. With a source, only that source's
// unproven members are weighed: a newcomer over its address's cap never
// displaces what proved itself there, nor anyone elsewhere. t.mu is
// held.
func (t *Table[V]) victim(source string) *Member[V] {
	var v *Member[V]
	for m := range t.all {
		if m.busy || source != "" && (m.source != source || m.proven) {
			continue
		}
		if v == nil {
			v = m
			continue
		}
		if a, b := m.rank(), v.rank(); a != b {
			if a < b {
				v = m
			}
			continue
		}
		if a, b := t.per[m.source], t.per[v.source]; a != b {
			if a > b {
				v = m
			}
			continue
		}
		if m.used < v.used {
			v = m
		}
	}
	return v
}

// rank orders members for eviction, the lowest first: quiet, unproven
// (0); unproven (1); proven (2).
func (m *Member[V]) rank() int {
	switch {
	case m.proven:
		return 2
	case m.quiet:
		return 0
	}
	return 1
}

// remove takes m out of the table. t.mu is held.
func (t *Table[V]) remove(m *Member[V]) {
	m.gone = true
	delete(t.all, m)
	if t.per[m.source]--; t.per[m.source] == 0 {
		delete(t.per, m.source)
	}
}

// Members returns the members now in the table.
func (t *Table[V]) Members() []*Member[V] {
	t.mu.Lock()
	defer t.mu.Unlock()
	out := make([]*Member[V], 0, len(t.all))
	for m := range t.all {
		out = append(out, m)
	}
	return out
}

// ProveSource marks every member from source proven and used now: its
// owner did something only a legitimate peer can (a Mooncake notify that
// completed a receive slot, for endpoints ferry cannot watch).
func (t *Table[V]) ProveSource(source string) {
	t.mu.Lock()
	defer t.mu.Unlock()
	for m := range t.all {
		if m.source == source {
			t.tick++
			m.proven, m.used = true, t.tick
		}
	}
}

// Stats is what the table did so far, and how many members it holds.
func (t *Table[V]) Stats() Stats {
	t.mu.Lock()
	defer t.mu.Unlock()
	s := t.stats
	s.Open = len(t.all)
	return s
}

// Busy marks m in use, so it is not evicted, and reports false when it
// was evicted already (its owner should stop).
func (m *Member[V]) Busy() bool {
	t := m.t
	t.mu.Lock()
	defer t.mu.Unlock()
	if m.gone {
		return false
	}
	t.tick++
	m.busy, m.quiet, m.used = true, false, t.tick
	return true
}

// Greeted marks m as having finished its handshake: quiet until its
// first request (Busy), it is evicted before the unproven members still
// in theirs.
func (m *Member[V]) Greeted() {
	t := m.t
	t.mu.Lock()
	defer t.mu.Unlock()
	m.quiet = true
}

// Idle marks m no longer in use, and used now: quiet.
func (m *Member[V]) Idle() {
	t := m.t
	t.mu.Lock()
	defer t.mu.Unlock()
	t.tick++
	m.busy, m.quiet, m.used = false, true, t.tick
}

// Prove marks m as having carried successful traffic, and used now.
func (m *Member[V]) Prove() {
	t := m.t
	t.mu.Lock()
	defer t.mu.Unlock()
	t.tick++
	m.proven, m.used = true, t.tick
}

// Closing counts why m's owner closes it, for ReasonIdle or
// ReasonTimeout.
func (m *Member[V]) Closing(reason string) {
	t := m.t
	t.mu.Lock()
	defer t.mu.Unlock()
	switch reason {
	case ReasonIdle:
		t.stats.Idle++
	case ReasonTimeout:
		t.stats.Timeout++
	}
}

// Release takes m out of the table, if it is still there. It reports
// whether it was (false: it was evicted, or released before).
func (m *Member[V]) Release() bool {
	t := m.t
	t.mu.Lock()
	defer t.mu.Unlock()
	if m.gone {
		return false
	}
	t.remove(m)
	return true
}

// Source is the key per-source caps count a peer address under: an IPv4
// address, or an IPv6 address's /64 (one host may hold a whole /64).
func Source(a net.Addr) string {
	ta, ok := a.(*net.TCPAddr)
	if !ok {
		return a.String()
	}
	if ip4 := ta.IP.To4(); ip4 != nil {
		return ip4.String()
	}
	return ta.IP.Mask(net.CIDRMask(64, 128)).String() + "/64"
}
