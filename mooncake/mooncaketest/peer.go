// Package mooncaketest is a Mooncake Transfer Engine peer for tests and
// benchmarks, speaking the protocol as package mooncake describes it: a
// segment with registered buffers that serves the handshake and the TCP
// data port (v1 or v2), and an initiator that writes into a segment as
// Mooncake's transfer_sync WRITE does.
package mooncaketest

import (
	"context"
	"fmt"
	"net"
	"strconv"
	"sync"
	"time"
	"unsafe"

	"github.com/ferry-project/ferry/mooncake"
	"github.com/ferry-project/ferry/rdma"
)

// Config is a Peer's setup.
type Config struct {
	// RDMA makes the segment an RDMA one on the machine's RDMA device
	// (rdma.go); the TCP data port stays up beside it.
	RDMA         bool
	Addr         string // handshake (RPC) port; default 127.0.0.1:0
	ProtoVersion int    // TCP protocol version advertised and spoken: 1 or 2 (default)
	BufferSize   int    // bytes of the one registered buffer; default 16 MiB
	// Base is the address the buffer is advertised at; 0: its real
	// address in this process, as Mooncake advertises. A restarted peer
	// given the same Base has the same buffer range and a new data port.
	Base uint64
}

// Peer is a Mooncake segment: one registered buffer in its memory.
type Peer struct {
	cfg  Config
	name string
	buf  []byte
	base uint64
	hs   *mooncake.Server
	data *mooncake.DataServer
	ts   string
	rdma *rdma.Transport // Config.RDMA
	eps  *mooncake.Endpoints[*rdma.MooncakeQP]

	mu         sync.Mutex
	registered bool
	notifies   []mooncake.NotifyDesc
	writes     int
	connects   int  // RDMA connection handshakes answered
	wrongRKey  bool // RDMA: advertise a key the NIC refuses
}

// Start runs a Peer.
func Start(cfg Config) (*Peer, error) {
	if cfg.Addr == "" {
		cfg.Addr = "127.0.0.1:0"
	}
	if cfg.ProtoVersion == 0 {
		cfg.ProtoVersion = 2
	}
	if cfg.BufferSize == 0 {
		cfg.BufferSize = 16 << 20
	}
	rpc, err := net.Listen("tcp", cfg.Addr)
	if err != nil {
		return nil, fmt.Errorf("mooncake test peer: RPC port: %w", err)
	}
	host, _, _ := net.SplitHostPort(rpc.Addr().String())
	dl, err := net.Listen("tcp", net.JoinHostPort(host, "0"))
	if err != nil {
		rpc.Close()
		return nil, fmt.Errorf("mooncake test peer: data port: %w", err)
	}
	buf := make([]byte, cfg.BufferSize)
	base := cfg.Base
	if base == 0 {
		base = uint64(uintptr(unsafe.Pointer(&buf[0])))
	}
	p := &Peer{
		cfg: cfg, name: rpc.Addr().String(), buf: buf, base: base,
		ts:         time.Now().Format("2006-01-02 15:04:05.000000"),
		registered: true,
	}
	h := mooncake.Handlers{Segment: p.Segment, Notify: p.notify}
	if cfg.RDMA {
		// The NIC needs memory outside Go's heap: startRDMA maps the
		// buffer anew, at its own address.
		if err := p.startRDMA(); err != nil {
			rpc.Close()
			dl.Close()
			return nil, fmt.Errorf("mooncake test peer: RDMA: %w", err)
		}
		h.Connect = p.connect
	}
	p.data = mooncake.ServeData(dl, p, mooncake.DataConfig{})
	p.hs = mooncake.Serve(rpc, h, mooncake.ServerConfig{})
	return p, nil
}

// Name is the segment name, "ip:rpcport": the session a sender uses.
func (p *Peer) Name() string { return p.name }

// Base is the registered buffer's address.
func (p *Peer) Base() uint64 { return p.base }

// Bytes returns a copy of n bytes at addr in the buffer.
func (p *Peer) Bytes(addr uint64, n int) []byte {
	p.mu.Lock() // orders this after the write's completion
	defer p.mu.Unlock()
	off := addr - p.base
	return append([]byte(nil), p.buf[off:off+uint64(n)]...)
}

// Writes counts the WRITEs that landed.
func (p *Peer) Writes() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.writes
}

// Notifies returns the notify messages received.
func (p *Peer) Notifies() []mooncake.NotifyDesc {
	p.mu.Lock()
	defer p.mu.Unlock()
	return append([]mooncake.NotifyDesc(nil), p.notifies...)
}

// Unregister drops the buffer, as Mooncake's unregisterLocalMemory does:
// it leaves the descriptor, and data requests into it are rejected.
func (p *Peer) Unregister() {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.registered = false
}

// Close stops both ports.
func (p *Peer) Close() {
	p.hs.Close()
	p.data.Close()
	p.closeRDMA()
}

// Segment is the descriptor the metadata handshake returns.
func (p *Peer) Segment() *mooncake.Segment {
	_, port, _ := net.SplitHostPort(p.data.Addr().String())
	dp, _ := strconv.Atoi(port)
	s := &mooncake.Segment{Name: p.name, Protocol: "tcp", TCPDataPort: dp, TCPProtoVersion: p.cfg.ProtoVersion, Timestamp: p.ts, Buffers: []mooncake.Buffer{}}
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.registered {
		s.Buffers = append(s.Buffers, mooncake.Buffer{Name: p.name, Addr: p.base, Length: uint64(len(p.buf))})
	}
	if p.rdma != nil {
		p.rdmaSegment(s)
	}
	return s
}

func (p *Peer) notify(_ net.Addr, n mooncake.NotifyDesc) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.notifies = append(p.notifies, n)
	return nil
}

func (p *Peer) span(addr, n uint64) ([]byte, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	end := addr + n
	if !p.registered || addr < p.base || end < addr || end > p.base+uint64(len(p.buf)) {
		return nil, fmt.Errorf("[%#x, %#x) is outside the registered buffers", addr, end)
	}
	return p.buf[addr-p.base : end-p.base], nil
}

// Write implements mooncake.Memory.
func (p *Peer) Write(addr, n uint64) ([]byte, func(error), error) {
	b, err := p.span(addr, n)
	if err != nil {
		return nil, nil, err
	}
	return b, func(err error) {
		if err == nil {
			p.mu.Lock()
			p.writes++
			p.mu.Unlock()
		}
	}, nil
}

// Read implements mooncake.Memory.
func (p *Peer) Read(addr, n uint64) ([]byte, func(), error) {
	b, err := p.span(addr, n)
	return b, func() {}, err
}

// WriteTo is the initiator: it fetches the descriptor of the segment at
// rpc (as transfer_sync's first use of a segment does) and WRITEs data to
// addr over the data port, in protocol v2 when the descriptor offers it
// and forceV1 is false.
func WriteTo(ctx context.Context, rpc string, addr uint64, data []byte, forceV1 bool) (*mooncake.Segment, error) {
	self := &mooncake.Segment{Name: "mooncake-test-initiator", Protocol: "tcp", Buffers: []mooncake.Buffer{}}
	seg, err := mooncake.FetchSegment(ctx, rpc, self)
	if err != nil {
		return nil, err
	}
	v2 := seg.TCPProtoVersion >= 2 && !forceV1
	return seg, mooncake.Write(ctx, mooncake.Request{Data: seg.DataAddr(rpc), Addr: addr, Buf: data, V2: v2})
}
