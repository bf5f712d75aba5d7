package e2e

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"io"
	"net"
	"os"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ferry-project/ferry/api"
)

// Bounds on what a flood of the peer port may make ferryd hold: the
// port's per-address cap in connections (the flood and the peer share
// 127.0.0.1) and a few descriptors besides; 200 MB of memory, some three
// times what a race-built ferryd measured under this flood (64 MB; 20
// without the race detector), with a 64 MiB arena.
const (
	hostilePeerFDSlack = 16
	hostilePeerRSSMB   = 200
)

// TestHostilePeerPort: from the peer's own address (127.0.0.1), a flood
// of connections that say hello and hold on (each one closed redialing),
// that send garbage or a header claiming an enormous write, and that
// trickle a refused write's body, runs while a real peer ferryd sends to
// the target and a client of the target calls its API. Every send lands
// and every call is answered; the target's descriptors stay within the
// port's per-address cap and its memory under hostilePeerRSSMB.
func TestHostilePeerPort(t *testing.T) {
	const sends = 20
	snd, rcv := pair(t)
	pid := rcv.cmd.Process.Pid
	baseFDs := openFDs(t, pid)

	f := startPeerFlood(t, rcv.listen)
	// Let the flood fill the address's quota before the peer's first send.
	f.waitConns(t, 2*peerPortPerSource)

	var peerOK, apiOK, apiCalls int
	maxFDs, maxRSS := 0, 0
	sample := func() {
		maxFDs, maxRSS = max(maxFDs, openFDs(t, pid)), max(maxRSS, rssMB(t, pid))
	}
	call := func(what string, err error) bool {
		apiCalls++
		if err != nil {
			t.Errorf("the target's API under the flood: %s: %v", what, err)
			return false
		}
		apiOK++
		return true
	}
	for i := range sends {
		id := fmt.Sprintf("hostile-%d", i)
		data := stageOn(t, snd, id, 64<<10, uint64(300+i))
		slot, err := rcv.c.Receive(ctxT(t), id, int64(len(data)))
		if !call("POST /v1/receives", err) {
			continue
		}
		req := api.SendRequest{Session: slot.Session, BufferAddress: slot.BufferAddress, Key: slot.Key}
		if _, err := snd.c.Send(ctxT(t), id, req); err != nil {
			t.Errorf("send %d of %d under the flood: %v", i+1, sends, err)
		} else if got, err := rcv.c.Wait(ctxT(t), id, 30*time.Second); call("wait", err) {
			if bytes.Equal(got, data) {
				peerOK++
			} else {
				t.Errorf("send %d: the slot holds %d bytes, not the %d sent", i+1, len(got), len(data))
			}
		}
		call("DELETE /v1/receives", rcv.c.FreeReceive(ctxT(t), id))
		_, err = rcv.c.Status(ctxT(t))
		call("GET /v1/status", err)
		sample()
	}
	conns := f.stop(t)
	sample()
	fmt.Printf("== HOSTILE port=peer conns=%d fds=%d rss_mb=%d peer_ok=%d/%d api_ok=%d/%d\n",
		conns, maxFDs, maxRSS, peerOK, sends, apiOK, apiCalls)
	if limit := baseFDs + peerPortPerSource + hostilePeerFDSlack; maxFDs > limit {
		t.Errorf("ferryd held %d descriptors under the flood (%d before): more than %d, the per-address cap of %d and %d besides",
			maxFDs, baseFDs, limit, peerPortPerSource, hostilePeerFDSlack)
	}
	if maxRSS > hostilePeerRSSMB {
		t.Errorf("ferryd's RSS reached %d MB under the flood, over the bound of %d MB", maxRSS, hostilePeerRSSMB)
	}
	if peerOK != sends || apiOK != apiCalls {
		t.Errorf("under the flood %d of %d sends landed and %d of %d API calls were answered, want all", peerOK, sends, apiOK, apiCalls)
	}
	rcv.alive(t)
}

// rssMB is a process's resident memory (VmRSS), in MB.
func rssMB(t *testing.T, pid int) int {
	t.Helper()
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		t.Fatal(err)
	}
	for line := range strings.Lines(string(b)) {
		if rest, ok := strings.CutPrefix(line, "VmRSS:"); ok {
			kb, err := strconv.Atoi(strings.TrimSuffix(strings.TrimSpace(rest), " kB"))
			if err != nil {
				t.Fatalf("VmRSS line %q: %v", line, err)
			}
			return kb >> 10
		}
	}
	t.Fatalf("/proc/%d/status has no VmRSS line", pid)
	return 0
}

// peerFlood is the hostile clients of a peer port, each on its own
// goroutine until stop.
type peerFlood struct {
	addr   string
	done   chan struct{}
	wg     sync.WaitGroup
	opened atomic.Int64
	dialed chan struct{} // a token per connection opened, up to its capacity

	mu    sync.Mutex
	conns map[net.Conn]struct{} // open now, closed by stop; nil once stopped
}

// The flood's clients, by kind.
const (
	floodHolders   = 96 // hello, then hold on; redial once closed
	floodGarbage   = 4  // bytes that are no hello
	floodHuge      = 4  // a hello, then a header claiming 2^62 bytes
	floodTricklers = 8  // a refused write's body, a byte every 50 ms
)

func startPeerFlood(t *testing.T, addr string) *peerFlood {
	f := &peerFlood{addr: addr, done: make(chan struct{}), dialed: make(chan struct{}, 4*peerPortPerSource), conns: make(map[net.Conn]struct{})}
	garbage := bytes.Repeat([]byte("GET / HTTP/1.1\r\nX: "), 256)
	huge := binary.LittleEndian.AppendUint64(make([]byte, 8), 1<<62) // addr 0, len 2^62
	huge = append(huge, make([]byte, 24)...)                         // a key nobody holds
	trickled := binary.LittleEndian.AppendUint64(make([]byte, 8), 60000)
	trickled = append(trickled, make([]byte, 24)...)
	for range floodHolders {
		f.run(func(c net.Conn) {
			c.Write(peerHello())
			io.Copy(io.Discard, c) // the welcome, then nothing until closed
		})
	}
	for range floodGarbage {
		f.run(func(c net.Conn) {
			c.Write(garbage)
			io.Copy(io.Discard, c)
		})
	}
	for range floodHuge {
		f.run(func(c net.Conn) {
			c.Write(append(peerHello(), huge...))
			io.Copy(io.Discard, c)
		})
	}
	for range floodTricklers {
		f.run(func(c net.Conn) {
			c.Write(append(peerHello(), trickled...))
			tick := time.NewTicker(50 * time.Millisecond)
			defer tick.Stop()
			for {
				select {
				case <-f.done:
					return
				case <-tick.C:
				}
				if _, err := c.Write([]byte{0}); err != nil {
					return
				}
			}
		})
	}
	t.Cleanup(func() { f.stop(t) })
	return f
}

// run runs client on connection after connection until stop.
func (f *peerFlood) run(client func(c net.Conn)) {
	f.wg.Go(func() {
		d := net.Dialer{LocalAddr: &net.TCPAddr{IP: net.IPv4(127, 0, 0, 1)}, Timeout: 10 * time.Second}
		for {
			select {
			case <-f.done:
				return
			default:
			}
			c, err := d.Dial("tcp", f.addr)
			if err != nil {
				// Out of ports or descriptors for a moment: not the
				// daemon's doing, and no reason to spin.
				select {
				case <-f.done:
					return
				case <-time.After(10 * time.Millisecond):
				}
				continue
			}
			f.opened.Add(1)
			select {
			case f.dialed <- struct{}{}:
			default:
			}
			c.SetDeadline(time.Now().Add(60 * time.Second))
			f.mu.Lock()
			stopped := f.conns == nil
			if !stopped {
				f.conns[c] = struct{}{}
			}
			f.mu.Unlock()
			if stopped {
				c.Close()
				return
			}
			client(c)
			f.mu.Lock()
			delete(f.conns, c)
			f.mu.Unlock()
			c.Close()
		}
	})
}

// waitConns waits (10 s at most) until the flood has opened n
// connections (n up to dialed's capacity).
func (f *peerFlood) waitConns(t *testing.T, n int) {
	t.Helper()
	deadline := time.After(10 * time.Second)
	for i := range n {
		select {
		case <-f.dialed:
		case <-deadline:
			t.Fatalf("the flood opened %d connections in 10s, want %d", i, n)
		}
	}
}

// stop ends the flood: every connection closed, every client returned.
// It returns how many connections the flood opened.
func (f *peerFlood) stop(t *testing.T) int64 {
	select {
	case <-f.done:
		return f.opened.Load()
	default:
	}
	close(f.done)
	f.mu.Lock()
	for c := range f.conns {
		c.Close()
	}
	f.conns = nil // and those dialed from now on close at once
	f.mu.Unlock()
	ended := make(chan struct{})
	go func() { f.wg.Wait(); close(ended) }()
	select {
	case <-ended:
	case <-time.After(30 * time.Second):
		t.Errorf("the flood's clients did not end within 30s of their connections closing")
	}
	return f.opened.Load()
}
