package daemon

import (
	"context"
	"fmt"
	"sort"
	"strings"
	"sync"
	"time"

	"github.com/ferry-project/ferry/api"
	"github.com/ferry-project/ferry/mooncake"
	"github.com/ferry-project/ferry/transport"
)

// peer is the daemon's record of one peer daemon: the live session, if
// any, and counters that outlive teardowns so an operator sees the history.
type peer struct {
	addr string

	dialMu sync.Mutex // one dial at a time per peer
	gone   bool       // under dialMu: taken out of the table

	mu       sync.Mutex
	sess     transport.Session
	dialedAt time.Time
	sends    uint64
	failures uint64
	lastErr  string
}

// sessions is the table of peers, keyed by their "host:port", or
// "mooncake://host:port" for a Mooncake segment.
type sessions struct {
	tr       transport.Transport
	mooncake *mooncake.Dialer

	mu    sync.Mutex
	peers map[string]*peer
}

func newSessions(tr transport.Transport, mc *mooncake.Dialer) *sessions {
	return &sessions{tr: tr, mooncake: mc, peers: make(map[string]*peer)}
}

// get returns the live session to addr, dialing one if there is none.
// Concurrent sends to a new peer share one record and one dial. A peer that
// was never reached is forgotten again, so mistyped addresses leave nothing
// behind.
func (s *sessions) get(ctx context.Context, addr string) (transport.Session, *peer, error) {
	for {
		s.mu.Lock()
		p := s.peers[addr]
		if p == nil {
			p = &peer{addr: addr}
			s.peers[addr] = p
		}
		s.mu.Unlock()

		p.dialMu.Lock()
		if p.gone {
			// Taken out of the table while this caller waited: a session
			// dialed on it now would be out of reach, never torn down.
			p.dialMu.Unlock()
			continue
		}
		sess, err := s.dial(ctx, p)
		p.dialMu.Unlock()
		return sess, p, err
	}
}

// dial returns p's session, dialing one if there is none; callers hold
// p.dialMu.
func (s *sessions) dial(ctx context.Context, p *peer) (transport.Session, error) {
	p.mu.Lock()
	sess, reached := p.sess, !p.dialedAt.IsZero()
	p.mu.Unlock()
	if sess != nil {
		return sess, nil
	}
	dial := s.tr.Dial
	if strings.HasPrefix(p.addr, mooncake.Scheme) {
		dial = s.mooncake.Dial // fetches the segment's descriptor afresh
	}
	sess, err := dial(ctx, p.addr)
	if err != nil {
		if !reached {
			s.forget(p)
		}
		return nil, err
	}
	p.mu.Lock()
	p.sess, p.dialedAt = sess, time.Now()
	p.mu.Unlock()
	return sess, nil
}

// sentToMooncake reports whether this daemon has reached the Mooncake
// segment named "host:port" (its RPC port) for a send, and keeps its
// record: the one kind of segment it dials back for a descriptor.
func (s *sessions) sentToMooncake(segment string) bool {
	s.mu.Lock()
	p := s.peers[mooncake.Scheme+segment]
	s.mu.Unlock()
	if p == nil {
		return false
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	return !p.dialedAt.IsZero()
}

// forget takes p out of the table; callers hold p.dialMu.
func (s *sessions) forget(p *peer) {
	p.gone = true
	s.mu.Lock()
	if s.peers[p.addr] == p {
		delete(s.peers, p.addr)
	}
	s.mu.Unlock()
}

// outcome records a send's result against p.
func (p *peer) outcome(err error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.sends++
	if err != nil {
		p.failures++
		p.lastErr = err.Error()
	}
}

// teardown closes sess if it is still p's session (a racing send may have
// re-dialed already; that fresh session stays).
func (p *peer) teardown(sess transport.Session) {
	p.mu.Lock()
	if sess == nil || p.sess != sess {
		p.mu.Unlock()
		return
	}
	p.sess = nil
	p.mu.Unlock()
	_ = sess.Close()
}

func (p *peer) describe(transportName string) api.Session {
	p.mu.Lock()
	defer p.mu.Unlock()
	d := api.Session{
		ID: p.addr, Peer: p.addr, Transport: transportName, State: "down",
		Sends: p.sends, Failures: p.failures, LastError: p.lastErr,
	}
	if p.sess != nil {
		d.Transport = p.sess.Transport() // tcp when an rdma daemon's peer has no RDMA
		d.State = "connected"
		d.DialedAt = p.dialedAt
		d.PeerInstance = fmt.Sprintf("%016x", p.sess.PeerInstance())
	}
	return d
}

func (s *sessions) list() []api.Session {
	s.mu.Lock()
	peers := make([]*peer, 0, len(s.peers))
	for _, p := range s.peers {
		peers = append(peers, p)
	}
	s.mu.Unlock()
	out := make([]api.Session, 0, len(peers))
	for _, p := range peers {
		name := s.tr.Name()
		if strings.HasPrefix(p.addr, mooncake.Scheme) {
			name = mooncake.TransportName
		}
		out = append(out, p.describe(name))
	}
	sort.Slice(out, func(i, j int) bool { return out[i].ID < out[j].ID })
	return out
}

// states counts the peers with a live session and those torn down.
func (s *sessions) states() (connected, down int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, p := range s.peers {
		p.mu.Lock()
		if p.sess != nil {
			connected++
		} else {
			down++
		}
		p.mu.Unlock()
	}
	return connected, down
}

// remove tears down and forgets the peer with this id. A dial to it in
// progress finishes first, so that its session is torn down too.
func (s *sessions) remove(id string) bool {
	s.mu.Lock()
	p, ok := s.peers[id]
	s.mu.Unlock()
	if !ok {
		return false
	}
	p.dialMu.Lock()
	s.forget(p)
	p.mu.Lock()
	sess := p.sess
	p.mu.Unlock()
	p.dialMu.Unlock()
	p.teardown(sess)
	return true
}

// closeAll tears every session down (shutdown).
func (s *sessions) closeAll() {
	s.mu.Lock()
	ids := make([]string, 0, len(s.peers))
	for id := range s.peers {
		ids = append(ids, id)
	}
	s.mu.Unlock()
	for _, id := range ids {
		s.remove(id)
	}
}
