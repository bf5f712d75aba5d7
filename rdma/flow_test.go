package rdma

import (
	"errors"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ferry-project/ferry/transport"
)

// TestSlowReceiverStallsSenders: a receiving daemon that takes none of
// its completions for a while (descheduled, or stopped) while its NIC
// goes on placing writes costs its senders time, never a failed write.
// The fake NIC fails a WRITE WITH IMM that finds no receive posted at
// once, so a sender that outran the receives would fail here every
// time. Sixteen writes are kept in flight on one lane; the receiver's
// polls are held until the senders are stalled (on credits for direct
// writes, on grants for granted ones), then let go: every write
// succeeds and lands. test/e2e's TestStoppedReceiver does the same to
// a real ferryd with SIGSTOP in the soft-RoCE VM.
func TestSlowReceiverStallsSenders(t *testing.T) {
	if onDevice(t) {
		t.Skip("holds the fake NIC's polls; on a device, test/e2e TestStoppedReceiver stops a real ferryd")
	}
	const inFlight, size = 16, 64 << 10
	const writes = recvPosted + 4*inFlight // past the receives posted: senders must stall
	for _, c := range []struct {
		name    string
		secret  []byte
		windows bool
	}{{ModeWindows, nil, true}, {ModeArenaRKey, testSecret, false}, {ModeGrant, nil, false}} {
		t.Run(c.name, func(t *testing.T) {
			p := newPair(t, newFabric(), size, writes*size, c.secret, 1, c.windows)
			if m := p.rx.Mode(); m != c.name {
				t.Fatalf("mode %q, want %q", m, c.name)
			}
			fill(p.src, 3)
			ws := make([]transport.Write, writes)
			next := make(chan transport.Write, writes)
			for i := range ws {
				ws[i] = p.slot(size)
				next <- ws[i]
			}
			close(next)
			release := p.rx.nic.(*fakeNIC).holdPolls()
			defer release()
			errs := make(chan error, writes)
			var failed atomic.Int32
			var wg sync.WaitGroup
			for range inFlight {
				wg.Go(func() {
					for w := range next {
						_, err := p.s.Write(ctxFor(t, 60*time.Second), w)
						if err != nil {
							failed.Add(1)
						}
						errs <- err
					}
				})
			}
			if c.name == ModeGrant {
				// The receiver grants recvDepth writes, and takes no
				// header more until it has taken their completions.
				waitFor(t, "the receiver's grants all used", func() bool { return p.tx.Stats().Sends >= recvDepth || failed.Load() > 0 })
			} else {
				waitFor(t, "a write stalled for want of credits", func() bool { return p.tx.Stats().CreditStalls > 0 || failed.Load() > 0 })
				if sent := p.tx.Stats().Sends; sent > recvPosted {
					t.Errorf("%d writes completed with the receiver's polls held, more than the %d receives it posted", sent, recvPosted)
				}
			}
			release()
			wg.Wait()
			close(errs)
			for err := range errs {
				if err != nil {
					t.Error(err)
				}
			}
			if t.Failed() {
				return
			}
			for _, w := range ws {
				p.landed(t, w)
			}
			st := p.tx.Stats()
			t.Logf("sends %d, credit messages %d, credit stalls %d (%s)", st.Sends, st.CreditMessages, st.CreditStalls, st.CreditStallTime)
			if st.Sends != writes {
				t.Errorf("%d sends completed, want %d", st.Sends, writes)
			}
		})
	}
}

// TestSilentReceiverFailsAfterIOTimeout: a receiver that takes no
// completion for longer than io_timeout fails the write waiting for a
// credit, naming the receiver's silence, with nothing posted; once the
// receiver takes its completions again the same lane carries the next
// writes, the failed one resent among them.
func TestSilentReceiverFailsAfterIOTimeout(t *testing.T) {
	if onDevice(t) {
		t.Skip("holds the fake NIC's polls; on a device, test/e2e TestStoppedReceiver stops a real ferryd")
	}
	const size, ioTimeout = 4096, 300 * time.Millisecond
	p := newPair(t, newFabric(), size, (recvPosted+2)*size, nil, 1, true, func(c *Config) { c.Peer.IOTimeout = ioTimeout })
	fill(p.src, 4)
	ws := make([]transport.Write, recvPosted+2) // made first: a window's bind polls the receiver's NIC
	for i := range ws {
		ws[i] = p.slot(size)
	}
	release := p.rx.nic.(*fakeNIC).holdPolls()
	defer release()
	for i, w := range ws[:recvPosted] {
		if _, err := p.s.Write(ctxFor(t, 30*time.Second), w); err != nil {
			t.Fatalf("write %d of the %d the receiver has receives posted for: %v", i+1, recvPosted, err)
		}
	}
	_, err := p.s.Write(ctxFor(t, 30*time.Second), ws[recvPosted])
	if err == nil || !strings.Contains(err.Error(), "the receiver made no progress for "+ioTimeout.String()) || !errors.Is(err, os.ErrDeadlineExceeded) || !errors.Is(err, transport.ErrStalled) {
		t.Fatalf("a write past the receives posted, the receiver silent: %v; want it to fail naming the receiver's silence, as a timeout", err)
	}
	if st := p.tx.Stats(); st.Sends != recvPosted || st.CreditStalls != 1 || st.CreditStallTime < ioTimeout {
		t.Errorf("sender stats %+v: want %d sends and one credit stall of at least %s", st, recvPosted, ioTimeout)
	}
	release()
	for _, w := range ws[recvPosted:] {
		if _, err := p.s.Write(ctxFor(t, 30*time.Second), w); err != nil {
			t.Fatalf("a write after the receiver came back: %v", err)
		}
	}
	for _, w := range ws {
		p.landed(t, w)
	}
}
