package mooncaketest

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"sync"
	"time"

	"github.com/ferry-project/ferry/mooncake"
)

// Pooled is one data connection of a Mooncake initiator running with
// MC_TCP_ENABLE_CONNECTION_POOL=1: it stays open between requests, for
// as long as the initiator likes, and carries one v2 WRITE after another.
type Pooled struct {
	c net.Conn
}

// DialPooled opens a pooled data connection to the data port at data,
// from the local address src ("" for any): tests play several hosts from
// 127.0.0.0/8.
func DialPooled(ctx context.Context, data, src string) (*Pooled, error) {
	d := net.Dialer{}
	if src != "" {
		d.LocalAddr = &net.TCPAddr{IP: net.ParseIP(src)}
	}
	c, err := d.DialContext(ctx, "tcp", data)
	if err != nil {
		return nil, fmt.Errorf("pooled connection to %s: %w", data, err)
	}
	return &Pooled{c: c}, nil
}

// Write WRITEs data to addr over the connection (v2) and reads the
// status word, within timeout.
func (p *Pooled) Write(addr uint64, data []byte, timeout time.Duration) error {
	p.c.SetDeadline(time.Now().Add(timeout))
	defer p.c.SetDeadline(time.Time{})
	h := mooncake.Header{Size: uint64(len(data)), Addr: addr, Op: mooncake.OpWrite, V2: true}
	var hb [mooncake.HeaderSize]byte
	h.Encode(&hb)
	if _, err := p.c.Write(append(hb[:], data...)); err != nil {
		return fmt.Errorf("sending a WRITE on a pooled connection: %w", err)
	}
	var sb [mooncake.StatusSize]byte
	if _, err := io.ReadFull(p.c, sb[:]); err != nil {
		return fmt.Errorf("failed to read WRITE ack frame on a pooled connection: %w", err)
	}
	st, err := mooncake.DecodeStatus(sb)
	if err == nil && st != mooncake.StatusOK {
		err = fmt.Errorf("the WRITE of %d bytes at %#x was %s: %w", len(data), addr, st,
			&mooncake.RejectedError{Op: mooncake.OpWrite, Addr: addr, Size: uint64(len(data)), V2: true})
	}
	return err
}

// Close closes the connection.
func (p *Pooled) Close() error { return p.c.Close() }

// Pool is an initiator's connection pool to one data port, as Mooncake's
// TCP transport runs it with MC_TCP_ENABLE_CONNECTION_POOL=1: a write
// takes an idle lane (the one that went idle last); with none idle it
// waits, and the pool opens one more lane (one dial at a time, up to
// Lanes) for whichever write is waiting when it connects. A lane that
// connects after the queue emptied stays idle until a later write takes
// it, however long after. A rejected write leaves its lane in the pool
// (the status came: the stream is in step); any other failure closes the
// lane and fails the write, without a retry, as Mooncake does.
type Pool struct {
	data  string
	lanes int
	// dial opens lane number n (1, 2, ...): tests gate it to choose when
	// a lane connects.
	dial func(ctx context.Context, n int) (net.Conn, error)

	mu      sync.Mutex
	idle    []*Pooled // the last to go idle at the end
	open    int       // lanes connected or connecting
	dialing bool
	dials   int
	waiting int
	wake    chan struct{} // closed, and replaced, when a lane goes idle
	closed  bool
	all     map[*Pooled]struct{}
}

// NewPool is a pool of at most lanes connections to the data port at
// data; dial, if not nil, opens lane n (default: a plain TCP dial).
func NewPool(data string, lanes int, dial func(ctx context.Context, n int) (net.Conn, error)) *Pool {
	if dial == nil {
		dial = func(ctx context.Context, _ int) (net.Conn, error) {
			var d net.Dialer
			return d.DialContext(ctx, "tcp", data)
		}
	}
	return &Pool{data: data, lanes: lanes, dial: dial, wake: make(chan struct{}), all: map[*Pooled]struct{}{}}
}

// PoolStats is a pool's lanes: open (connected or connecting), idle,
// dials made so far, and the writes waiting for a lane.
type PoolStats struct{ Open, Idle, Dials, Waiting int }

// Stats is the pool's lanes now.
func (p *Pool) Stats() PoolStats {
	p.mu.Lock()
	defer p.mu.Unlock()
	return PoolStats{Open: p.open, Idle: len(p.idle), Dials: p.dials, Waiting: p.waiting}
}

// Write WRITEs data to addr (v2) on a lane of the pool, within timeout
// once it has one.
func (p *Pool) Write(ctx context.Context, addr uint64, data []byte, timeout time.Duration) error {
	lane, err := p.take(ctx)
	if err != nil {
		return err
	}
	err = lane.Write(addr, data, timeout)
	var rejected *mooncake.RejectedError
	if err == nil || errors.As(err, &rejected) {
		p.put(lane)
		return err
	}
	p.drop(lane)
	return err
}

// take waits for an idle lane, opening one more when none is and the
// pool has room and no dial under way.
func (p *Pool) take(ctx context.Context) (*Pooled, error) {
	p.mu.Lock()
	p.waiting++
	defer func() {
		p.mu.Lock()
		p.waiting--
		p.mu.Unlock()
	}()
	for {
		if p.closed {
			p.mu.Unlock()
			return nil, fmt.Errorf("pool to %s: closed", p.data)
		}
		if n := len(p.idle); n > 0 {
			lane := p.idle[n-1]
			p.idle = p.idle[:n-1]
			p.mu.Unlock()
			return lane, nil
		}
		if !p.dialing && p.open < p.lanes {
			p.dialing = true
			p.open++
			p.dials++
			go p.grow(p.dials)
		}
		wake := p.wake
		p.mu.Unlock()
		select {
		case <-wake:
		case <-ctx.Done():
			return nil, fmt.Errorf("pool to %s: waiting for a lane: %w", p.data, ctx.Err())
		}
		p.mu.Lock()
	}
}

// grow dials lane n and puts it idle, for whichever write wants it, if
// any; then opens the next one while writes still wait.
func (p *Pool) grow(n int) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	c, err := p.dial(ctx, n)
	cancel()
	p.mu.Lock()
	p.dialing = false
	if err != nil {
		p.open--
		p.signal()
		p.mu.Unlock()
		return
	}
	lane := &Pooled{c: c}
	if p.closed {
		p.mu.Unlock()
		c.Close()
		return
	}
	p.all[lane] = struct{}{}
	p.idle = append(p.idle, lane)
	if p.waiting > 1 && p.open < p.lanes {
		p.dialing = true
		p.open++
		p.dials++
		go p.grow(p.dials)
	}
	p.signal()
	p.mu.Unlock()
}

func (p *Pool) put(lane *Pooled) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.idle = append(p.idle, lane)
	p.signal()
}

func (p *Pool) drop(lane *Pooled) {
	lane.Close()
	p.mu.Lock()
	defer p.mu.Unlock()
	delete(p.all, lane)
	p.open--
	p.signal()
}

// signal wakes the writes waiting for a lane. p.mu is held.
func (p *Pool) signal() {
	close(p.wake)
	p.wake = make(chan struct{})
}

// Close closes every lane; writes under way fail.
func (p *Pool) Close() {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.closed = true
	for lane := range p.all {
		lane.Close()
	}
	p.signal()
}
