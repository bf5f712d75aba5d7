package daemon

import (
	"context"
	"sync"
	"time"

	"github.com/ferry-project/ferry/api"
)

// maxEvents is how many recent events the daemon keeps for GET
// /v1/events: a scheduler that falls further behind is told how many it
// missed, and lists what it waits for once.
const maxEvents = 4096

// eventLog is the ordered record of arrivals and batch endings that GET
// /v1/events serves, so a scheduler waits on one long poll instead of
// polling per request.
type eventLog struct {
	mu      sync.Mutex
	ring    []api.Event // the most recent events; ring[(seq-1)%maxEvents] holds seq
	last    uint64      // seq of the newest event; the first is 1
	changed chan struct{}
}

func newEventLog() *eventLog {
	return &eventLog{ring: make([]api.Event, maxEvents), changed: make(chan struct{})}
}

// add records ev under the next seq and wakes the waiters.
func (l *eventLog) add(ev api.Event) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.last++
	ev.Seq, ev.Time = l.last, time.Now()
	l.ring[(l.last-1)%maxEvents] = ev
	close(l.changed)
	l.changed = make(chan struct{})
}

// after answers the events past seq after, waiting up to wait for the
// first one; an empty answer means none came in time.
func (l *eventLog) after(ctx context.Context, after uint64, wait time.Duration) api.Events {
	deadline := time.NewTimer(wait)
	defer deadline.Stop()
	for {
		l.mu.Lock()
		if after > l.last {
			after = 0 // a seq from before this daemon started: all it has is news
		}
		if l.last > after || wait == 0 {
			defer l.mu.Unlock()
			return l.collect(after)
		}
		changed := l.changed
		l.mu.Unlock()
		select {
		case <-changed:
		case <-ctx.Done():
			wait = 0
		case <-deadline.C:
			wait = 0
		}
	}
}

// collect lists the kept events past after; callers hold mu.
func (l *eventLog) collect(after uint64) api.Events {
	out := api.Events{Next: l.last, Events: []api.Event{}}
	oldest := uint64(1)
	if l.last > maxEvents {
		oldest = l.last - maxEvents + 1
	}
	if after+1 < oldest {
		out.Missed = oldest - after - 1
		after = oldest - 1
	}
	for seq := after + 1; seq <= l.last; seq++ {
		out.Events = append(out.Events, l.ring[(seq-1)%maxEvents])
	}
	return out
}
