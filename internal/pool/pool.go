// Package pool keeps a session's connections to one peer: at most a fixed
// number open, idle ones reused, new ones opened on demand while under the
// limit. transport/tcp pools TCP connections with it, rdma its lanes (an
// RC queue pair and its control connection).
package pool

import (
	"context"
	"errors"
	"sync"
)

// ErrClosed is Get's answer once Close has run.
var ErrClosed = errors.New("pool closed")

// Pool holds up to n connections of type C.
type Pool[C comparable] struct {
	open   func(context.Context) (C, error)
	shut   func(C)
	idle   chan C        // connections between uses
	tokens chan struct{} // one per open (or opening) connection
	done   chan struct{} // closed by Close

	mu     sync.Mutex
	closed bool
	all    map[C]struct{} // every open connection, for Close
}

// New makes a pool of at most n connections that open opens and shut
// closes.
func New[C comparable](n int, open func(context.Context) (C, error), shut func(C)) *Pool[C] {
	return &Pool[C]{
		open: open, shut: shut,
		idle:   make(chan C, n),
		tokens: make(chan struct{}, n),
		done:   make(chan struct{}),
		all:    make(map[C]struct{}),
	}
}

// Add puts a connection opened elsewhere (the session's first) into the
// pool as idle. It reports false, having shut c, when the pool is full or
// closed.
func (p *Pool[C]) Add(c C) bool {
	select {
	case p.tokens <- struct{}{}:
	default:
		p.shut(c)
		return false
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		p.shut(c)
		return false
	}
	p.all[c] = struct{}{}
	p.idle <- c
	return true
}

// Get takes an idle connection, or opens one while under the limit, or
// waits for one to come back. Its errors are ErrClosed, ctx's, or open's.
func (p *Pool[C]) Get(ctx context.Context) (C, error) {
	var zero C
	if p.Closed() {
		return zero, ErrClosed
	}
	select {
	case c := <-p.idle:
		return c, nil
	default:
	}
	select {
	case c := <-p.idle:
		return c, nil
	case p.tokens <- struct{}{}:
	case <-p.done:
		return zero, ErrClosed
	case <-ctx.Done():
		return zero, ctx.Err()
	}
	c, err := p.open(ctx)
	if err != nil {
		<-p.tokens
		if p.Closed() {
			err = errors.Join(ErrClosed, err)
		}
		return zero, err
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		p.shut(c)
		<-p.tokens
		return zero, ErrClosed
	}
	p.all[c] = struct{}{}
	return c, nil
}

// Put returns a connection that is fit for another use.
func (p *Pool[C]) Put(c C) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		return // Close shut it
	}
	p.idle <- c // never blocks: idle holds at most one per token
}

// Drop shuts a connection that is broken or out of step.
func (p *Pool[C]) Drop(c C) {
	p.mu.Lock()
	_, open := p.all[c]
	delete(p.all, c)
	p.mu.Unlock()
	if open {
		p.shut(c)
	}
	<-p.tokens
}

// Sweep shuts the idle connections bad reports, and keeps the others: a
// connection found broken while idle (rdma's lanes of a rail gone down)
// need not wait for the next Get to be shut.
func (p *Pool[C]) Sweep(bad func(C) bool) {
	for range len(p.idle) {
		select {
		case c := <-p.idle:
			if bad(c) {
				p.Drop(c)
			} else {
				p.Put(c)
			}
		default:
			return
		}
	}
}

// Close shuts every open connection, idle or in use; uses in flight fail
// and their connections come back through Put or Drop.
func (p *Pool[C]) Close() {
	p.mu.Lock()
	if p.closed {
		p.mu.Unlock()
		return
	}
	p.closed = true
	close(p.done)
	all := p.all
	p.all = make(map[C]struct{})
	p.mu.Unlock()
	for c := range all {
		p.shut(c)
	}
}

// Closed reports whether Close has run.
func (p *Pool[C]) Closed() bool {
	select {
	case <-p.done:
		return true
	default:
		return false
	}
}

// Done is closed by Close.
func (p *Pool[C]) Done() <-chan struct{} { return p.done }
