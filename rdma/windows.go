package rdma

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"runtime"
	"sync"
	"time"

	"github.com/ferry-project/ferry/transport"
)

// Windows mode: the arena is registered for local access and window
// binding only (use windowBinding), so its own rkey lets no peer write,
// and each receive slot gets a type 1 memory window over exactly its
// bytes when it is made (the rkey goes in the slot's key), invalidated
// (a bind of length 0) before its memory is reused. The NIC then bounds
// every write to one live slot, whoever sends it: senders write whole
// slots directly (wire.go), authenticated or not.
//
// Type 1, not 2B: a type 2B window admits writes from the one QP that
// bound it, and a slot is made before anyone knows which lane of which
// sender will write it.
//
// Rails: a window is its NIC's (its protection domain's), so each rail
// that holds windows has a set of its own (windows), binding over that
// NIC's registrations. A slot's window goes on the rail nearest its
// memory: a region's home rail (regions.go: the first NIC named for it
// that registered it, a device arena's from the affinity table), rail 0
// for the arena and everything else. Rail 0's set is made as the
// transport starts; another rail's when a slot first needs it
// (slotWindows). The slot's key names the rail (transport.Key.Rail), and
// a sender writes it over a lane to that rail's NIC.

const (
	// minWindows are allocated when the transport starts (ibv_alloc_mw
	// is a syscall, and a firmware command on mlx5): enough for as many
	// live slots as most daemons have.
	minWindows = 1024
	// maxWindows bounds the windows allocated, one per live slot.
	maxWindows = 1 << 16
	// bindWait bounds the wait for a bind's completion; bindSpins polls
	// go before the first pause.
	bindWait  = 2 * time.Second
	bindSpins = 64
)

// windows binds and invalidates the windows over receive slots
// (transport.Windows). Binds go on a QP of its own, connected to a
// second one on the same port since only a QP in RTS binds; mu takes
// them one at a time, and each waits for its completion, so a slot's
// key goes out only once its window holds, and a freed slot's memory
// comes back only once nothing can write through its window.
type windows struct {
	mu       sync.Mutex
	rail     int // the rail whose NIC nic is
	nic      nic
	mr       region // the arena's registration, of size bytes at base; nil on rails other than 0
	base     uint64
	size     uint64
	lent     *lentRegions // windows over slots in them bind over their registrations
	qp, loop queuePair
	free     []window               // oldest first: an rkey recurs only after every free window was rebound
	bound    map[uint32]boundWindow // by rkey
	made     int
	seq      uint64
	broken   error // a bind that failed or never completed: the QP is in an unknown state
	closed   bool  // the transport closed: nothing writes through a window any more
	counts   *counters
}

// newWindows preallocates the windows over mr, which registers size
// bytes at base, and over the regions in lent registered on rail, and
// connects the binding QP, and binds and invalidates one window to prove
// the device does (on mr's memory: a NIC may bind over host memory and
// refuse over a dmabuf's; without mr, a rail other than 0, the first
// slot's bind is the proof).
func newWindows(n nic, rail int, mr region, base, size uint64, lent *lentRegions, c *counters) (_ *windows, err error) {
	w := &windows{rail: rail, nic: n, mr: mr, base: base, size: size, lent: lent, bound: make(map[uint32]boundWindow), counts: c}
	defer func() {
		if err != nil {
			w.close()
		}
	}()
	if w.qp, err = n.NewQP(2, 1); err != nil {
		return nil, fmt.Errorf("creating the binding queue pair: %w", err)
	}
	if w.loop, err = n.NewQP(1, 1); err != nil {
		return nil, fmt.Errorf("creating the binding queue pair's peer: %w", err)
	}
	a, b := n.Endpoint(), n.Endpoint()
	a.QPN, a.PSN = w.qp.QPN(), rand.Uint32()&0xffffff
	b.QPN, b.PSN = w.loop.QPN(), rand.Uint32()&0xffffff
	if err := w.qp.Connect(a.PSN, b); err != nil {
		return nil, fmt.Errorf("connecting the binding queue pair: %w", err)
	}
	if err := w.loop.Connect(b.PSN, a); err != nil {
		return nil, fmt.Errorf("connecting the binding queue pair's peer: %w", err)
	}
	if err := w.grow(minWindows); err != nil {
		return nil, err
	}
	if mr == nil {
		return w, nil
	}
	rkey, err := w.Open(base, min(size, 4096))
	if err != nil {
		return nil, err
	}
	if err := w.Close(rkey); err != nil {
		return nil, err
	}
	return w, nil
}

// boundWindow is a window bound, and the registration it is bound
// over, which its invalidation names too.
type boundWindow struct {
	mw window
	mr region
}

// grow allocates n more windows; w.mu is held, or w is not shared yet.
func (w *windows) grow(n int) error {
	for range n {
		mw, err := w.nic.AllocWindow()
		if err != nil {
			return fmt.Errorf("allocating memory window %d: %w", w.made+1, err)
		}
		w.made++
		w.free = append(w.free, mw)
	}
	return nil
}

// Open makes a window over [addr, addr+n), which must lie in the
// arena's registration or a region's on w's rail, enforced by the NIC
// once Open returns its rkey.
func (w *windows) Open(addr, n uint64) (uint32, error) {
	if n == 0 {
		return 0, errors.New("a memory window over no bytes")
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	switch {
	case w.closed:
		return 0, fmt.Errorf("memory windows: %w", transport.ErrClosed)
	case w.broken != nil:
		return 0, w.broken
	}
	if len(w.free) == 0 {
		if w.made >= maxWindows {
			return 0, fmt.Errorf("all %d memory windows are over live receive slots: free some slots", maxWindows)
		}
		if err := w.grow(min(minWindows, maxWindows-w.made)); err != nil {
			return 0, err
		}
	}
	under := w.lent.mrHolding(addr, n, w.rail)
	if w.mr != nil && spans(w.base, w.size, addr, n) {
		under = w.mr
	}
	if under == nil {
		// A bind the NIC refuses would leave the binding QP broken.
		return 0, fmt.Errorf("no registration on rail %d holds [%#x, +%d): a memory window goes over the arena or a registered region", w.rail, addr, n)
	}
	mw := w.free[0]
	rkey, err := w.bind(mw, under, addr, n)
	if err != nil {
		return 0, err
	}
	w.free = w.free[1:]
	w.bound[rkey] = boundWindow{mw, under}
	w.counts.windowBinds.Add(1)
	return rkey, nil
}

// Close invalidates the window rkey names, and once it returns no write lands through it. A window that
// could not be invalidated is kept out of use, and the caller must keep
// its memory too.
func (w *windows) Close(rkey uint32) error {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.closed {
		return nil // deallocated with the transport's queue pairs gone
	}
	b, ok := w.bound[rkey]
	if !ok {
		return fmt.Errorf("no memory window on rail %d has rkey %#x", w.rail, rkey)
	}
	if w.broken != nil {
		return w.broken
	}
	if _, err := w.bind(b.mw, b.mr, 0, 0); err != nil {
		return err
	}
	delete(w.bound, rkey)
	w.free = append(w.free, b.mw)
	w.counts.windowInvalidations.Add(1)
	return nil
}

// bind posts one bind of mw over [addr, addr+n) of mr and waits for its
// completion; w.mu is held. Any failure leaves the QP in an unknown
// state: every later bind fails.
func (w *windows) bind(mw window, mr region, addr, n uint64) (uint32, error) {
	w.seq++
	rkey, err := w.qp.Bind(mw, mr, addr, n, w.seq)
	if err == nil {
		err = w.await(w.seq)
	}
	if err != nil {
		what := fmt.Sprintf("binding a memory window over [%#x, +%d)", addr, n)
		if n == 0 {
			what = "invalidating a memory window"
		}
		err = fmt.Errorf("%s: %w", what, err)
		w.broken = fmt.Errorf("%w (no window binds since: restart ferryd)", err)
		return 0, err
	}
	return rkey, nil
}

// await polls for the completion of the bind wrid: the NIC carries a
// bind out at once (a local operation), so it spins a little, then
// backs off, for bindWait at most.
func (w *windows) await(wrid uint64) error {
	deadline := time.Now().Add(bindWait)
	var wc [1]completion
	pause := time.Microsecond
	for i := 0; ; i++ {
		n, err := w.qp.Poll(wc[:])
		switch {
		case err != nil:
			return err
		case n == 1 && wc[0].WRID != wrid:
			return fmt.Errorf("a completion for work request %d while waiting for %d", wc[0].WRID, wrid)
		case n == 1 && wc[0].Status != wcSuccess:
			return &CompletionError{Status: wc[0].Status, VendorErr: wc[0].VendorErr, Op: "memory window bind"}
		case n == 1:
			return nil
		case time.Now().After(deadline):
			return fmt.Errorf("no completion of the bind after %s", bindWait)
		case i < bindSpins:
			runtime.Gosched()
		default:
			time.Sleep(pause)
			pause = min(2*pause, time.Millisecond)
		}
	}
}

// close deallocates every window, bound or not, then the binding QPs.
// The registration under them goes after.
func (w *windows) close() error {
	w.mu.Lock()
	defer w.mu.Unlock()
	var errs []error
	for _, mw := range w.free {
		errs = append(errs, mw.Close())
	}
	for _, b := range w.bound {
		errs = append(errs, b.mw.Close())
	}
	w.free, w.bound, w.closed = nil, nil, true
	for _, q := range []queuePair{w.qp, w.loop} {
		if q != nil {
			errs = append(errs, q.Close())
		}
	}
	return errors.Join(errs...)
}
