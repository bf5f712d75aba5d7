package mooncake

import (
	"context"
	"sync"
)

// budget is a number of bytes connections share: each takes what a
// message needs before reading it, waiting its turn while others hold
// the rest, and gives it back once the message is answered. So the
// memory messages hold at once is bounded whatever the number of
// connections, and nothing is kept pooled after.
type budget struct {
	size int64

	mu   sync.Mutex
	held int64
	peak int64         // the most held at once
	wake chan struct{} // closed, and replaced, when bytes are given back
}

func newBudget(size int64) *budget {
	return &budget{size: size, wake: make(chan struct{})}
}

// acquire takes n bytes (at most size), waiting until they are free or
// ctx ends.
func (b *budget) acquire(ctx context.Context, n int64) error {
	for {
		b.mu.Lock()
		if b.held+n <= b.size {
			b.held += n
			b.peak = max(b.peak, b.held)
			b.mu.Unlock()
			return nil
		}
		wake := b.wake
		b.mu.Unlock()
		select {
		case <-wake:
		case <-ctx.Done():
			return ctx.Err()
		}
	}
}

// release gives back n bytes taken by acquire.
func (b *budget) release(n int64) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.held -= n
	close(b.wake)
	b.wake = make(chan struct{})
}

// BudgetStats is what a budget holds and held.
type BudgetStats struct {
	Size, Held, Peak int64
}

func (b *budget) stats() BudgetStats {
	b.mu.Lock()
	defer b.mu.Unlock()
	return BudgetStats{Size: b.size, Held: b.held, Peak: b.peak}
}
