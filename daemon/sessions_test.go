package daemon

import (
	"context"
	"errors"
	"io"
	"net"
	"sync"
	"testing"
	"time"

	"github.com/ferry-project/ferry/transport"
	peerport "github.com/ferry-project/ferry/transport/peer"
	"github.com/ferry-project/ferry/transport/tcp"
)

// gatedPeer is a real ferry peer behind a loopback proxy that holds each
// connection until the test says whether it fails (closed) or goes through.
type gatedPeer struct {
	addr     string
	accepted chan chan bool // one per connection: send true to pass it through
}

func newGatedPeer(t *testing.T) *gatedPeer {
	t.Helper()
	peer, err := tcp.Listen(peerport.Config{Addr: "127.0.0.1:0", Sink: newTestRegistry(t, 1<<16)})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { peer.Close() })
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	g := &gatedPeer{addr: ln.Addr().String(), accepted: make(chan chan bool)}
	var wg sync.WaitGroup
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(func() { cancel(); ln.Close(); wg.Wait() })
	wg.Go(func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			pass := make(chan bool, 1)
			select {
			case g.accepted <- pass:
			case <-ctx.Done():
				c.Close()
				return
			}
			wg.Go(func() {
				defer c.Close()
				select {
				case ok := <-pass:
					if !ok {
						return
					}
				case <-ctx.Done():
					return
				}
				up, err := net.Dial("tcp", peer.Addr().String())
				if err != nil {
					return
				}
				stop := context.AfterFunc(ctx, func() { c.Close(); up.Close() })
				defer stop()
				go func() { io.Copy(up, c); up.Close() }()
				io.Copy(c, up)
			})
		}
	})
	return g
}

func newTestSessions(t *testing.T) *sessions {
	t.Helper()
	tr, err := tcp.Listen(peerport.Config{Addr: "127.0.0.1:0", Sink: newTestRegistry(t, 1<<16), HandshakeTimeout: 10 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { tr.Close() })
	return newSessions(tr, nil)
}

type got struct {
	sess transport.Session
	err  error
}

func getAsync(ctx context.Context, s *sessions, addr string) <-chan got {
	ch := make(chan got, 1)
	go func() {
		sess, _, err := s.get(ctx, addr)
		ch <- got{sess, err}
	}()
	return ch
}

// isClosed says whether sess was closed, by trying to write on it.
func isClosed(t *testing.T, sess transport.Session) bool {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	_, err := sess.Write(ctx, transport.Write{Src: []byte{1}, Remote: 1, Key: transport.Key{1}})
	return errors.Is(err, transport.ErrClosed)
}

// A session dialed while its peer is removed from the table must not
// outlive the removal: nothing could reach it to tear it down.
func TestRemoveTearsDownASessionBeingDialed(t *testing.T) {
	peer := newGatedPeer(t)
	s := newTestSessions(t)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()

	dialed := getAsync(ctx, s, peer.addr)
	pass := <-peer.accepted // the dial is in progress
	removed := make(chan bool, 1)
	go func() { removed <- s.remove(peer.addr) }()
	pass <- true
	r := <-dialed
	if r.err != nil {
		t.Fatal(r.err)
	}
	if !<-removed {
		t.Fatal("remove did not find the peer being dialed")
	}
	if !isClosed(t, r.sess) {
		t.Fatal("the session dialed during the removal is still open, out of the table's reach")
	}
	if l := s.list(); len(l) != 0 {
		t.Fatalf("the table still lists %+v", l)
	}
}

// Two first sends to a peer: the first dial fails, the second succeeds.
// The second session must be the one the table holds.
func TestFailedFirstDialLeavesNoOrphan(t *testing.T) {
	peer := newGatedPeer(t)
	s := newTestSessions(t)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()

	first := getAsync(ctx, s, peer.addr)
	fail := <-peer.accepted
	second := getAsync(ctx, s, peer.addr) // waits for the first dial
	fail <- false
	if r := <-first; r.err == nil {
		t.Fatal("the first dial should fail")
	}
	(<-peer.accepted) <- true
	r := <-second
	if r.err != nil {
		t.Fatal(r.err)
	}
	l := s.list()
	if len(l) != 1 || l[0].State != "connected" {
		t.Fatalf("the table should hold the second dial's session: %+v", l)
	}
	if !s.remove(peer.addr) || !isClosed(t, r.sess) {
		t.Fatal("removing the peer did not tear down the second dial's session")
	}
}

// ferryd dials a Mooncake segment for a descriptor a handshake lacked only
// when it sent there, or the segment is on mooncake_fetch_allow.
func TestMayFetchMooncake(t *testing.T) {
	d, _ := serveTestDaemon(t, t.TempDir(), "mf", func(c *Config) { c.MooncakeFetch = []string{"10.0.0.0/24", "fd00::7"} })
	may := d.mayFetchMooncake()
	for seg, want := range map[string]bool{
		"10.0.0.9:15302": true, "10.0.1.9:15302": false, "[fd00::7]:15302": true, "[fd00::8]:15302": false,
		"[::ffff:10.0.0.3]:1": true, "not-an-address": false,
	} {
		if got := may(seg); got != want {
			t.Errorf("may fetch from %s: %t, want %t", seg, got, want)
		}
	}
}
