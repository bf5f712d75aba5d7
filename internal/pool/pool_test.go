package pool

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"
)

// conns counts what the pool opened and shut.
type conns struct {
	mu     sync.Mutex
	next   int
	shut   map[int]int // times each was shut
	fail   error
	opened chan int
}

func newConns() *conns { return &conns{shut: make(map[int]int), opened: make(chan int, 100)} }

func (c *conns) open(ctx context.Context) (int, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.fail != nil {
		return 0, c.fail
	}
	c.next++
	c.opened <- c.next
	return c.next, nil
}

func (c *conns) close(n int) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.shut[n]++
}

func ctx(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
	t.Cleanup(cancel)
	return ctx
}

func TestLimitReuseAndWait(t *testing.T) {
	cs := newConns()
	p := New(2, cs.open, cs.close)
	a, err := p.Get(ctx(t))
	if err != nil {
		t.Fatal(err)
	}
	b, err := p.Get(ctx(t))
	if err != nil || a == b {
		t.Fatalf("second Get: %d, %v; want a new connection", b, err)
	}
	// At the limit: a third Get waits until one comes back.
	got := make(chan int)
	go func() {
		c, _ := p.Get(ctx(t))
		got <- c
	}()
	p.Put(a)
	if c := <-got; c != a {
		t.Errorf("waiting Get got %d, want the returned %d", c, a)
	}
	// A dropped connection is shut and frees its place for a new one.
	p.Drop(b)
	c, err := p.Get(ctx(t))
	if err != nil || c == a || c == b {
		t.Fatalf("Get after Drop: %d, %v; want a third connection", c, err)
	}
	if cs.shut[b] != 1 {
		t.Errorf("dropped connection shut %d times", cs.shut[b])
	}
	// Waiting at the limit ends with the caller's context.
	short, cancel := context.WithTimeout(t.Context(), 10*time.Millisecond)
	defer cancel()
	if _, err := p.Get(short); err != context.DeadlineExceeded {
		t.Errorf("Get at the limit with a short context: %v", err)
	}
}

func TestOpenFailureFreesItsPlace(t *testing.T) {
	cs := newConns()
	p := New(1, cs.open, cs.close)
	boom := errors.New("boom")
	cs.fail = boom
	if _, err := p.Get(ctx(t)); err != boom {
		t.Fatalf("Get with a failing open: %v", err)
	}
	cs.fail = nil
	if _, err := p.Get(ctx(t)); err != nil {
		t.Fatalf("Get after a failed open: %v", err)
	}
}

func TestClose(t *testing.T) {
	cs := newConns()
	p := New(3, cs.open, cs.close)
	if !p.Add(100) {
		t.Fatal("Add to an empty pool refused")
	}
	inUse, _ := p.Get(ctx(t)) // the added one, idle
	other, _ := p.Get(ctx(t))
	p.Put(other)
	p.Close()
	p.Close()
	if cs.shut[inUse] != 1 || cs.shut[other] != 1 {
		t.Errorf("Close shut the in-use connection %d times and the idle one %d times, want once each", cs.shut[inUse], cs.shut[other])
	}
	// A use that ends after Close does not shut it again.
	p.Drop(inUse)
	if cs.shut[inUse] != 1 {
		t.Errorf("connection shut %d times", cs.shut[inUse])
	}
	if _, err := p.Get(ctx(t)); err != ErrClosed {
		t.Errorf("Get after Close: %v, want ErrClosed", err)
	}
	if p.Add(7) || cs.shut[7] != 1 {
		t.Error("Add after Close kept the connection")
	}
}

// TestSweep: Sweep shuts the idle connections it is told are bad, frees
// their places, and keeps the others idle.
func TestSweep(t *testing.T) {
	cs := newConns()
	p := New(2, cs.open, cs.close)
	a, _ := p.Get(ctx(t))
	b, _ := p.Get(ctx(t))
	p.Put(a)
	p.Put(b)
	p.Sweep(func(c int) bool { return c == b })
	if cs.shut[b] != 1 || cs.shut[a] != 0 {
		t.Fatalf("shut %v after sweeping %d, want it alone shut", cs.shut, b)
	}
	got := map[int]bool{}
	for range 2 {
		c, err := p.Get(ctx(t))
		if err != nil {
			t.Fatal(err)
		}
		got[c] = true
	}
	if !got[a] || got[b] || len(got) != 2 {
		t.Fatalf("Gets after the sweep gave %v: want %d kept and a new one in %d's place", got, a, b)
	}
}
