// Package mooncaketest is a Mooncake Transfer Engine peer for tests,
// speaking the protocol as package mooncake describes it: a segment with
// one registered buffer (a mooncake.MemorySegment) that serves the
// handshake and the TCP data port (v1 or v2) and, on a machine with an
// RDMA device, Mooncake's RDMA transport, and initiators that write into
// a segment as Mooncake's transfer_sync WRITE does.
package mooncaketest

import (
	"context"
	"fmt"
	"sync"

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
	*mooncake.MemorySegment
	buf  []byte
	rdma *rdma.Transport // Config.RDMA
	reg  *rdma.EngineRegion
	eps  *mooncake.Endpoints[*rdma.MooncakeQP]

	mu        sync.Mutex
	connects  int  // RDMA connection handshakes answered
	wrongRKey bool // RDMA: advertise a key the NIC refuses
}

// Start runs a Peer.
func Start(cfg Config) (*Peer, error) {
	if cfg.BufferSize == 0 {
		cfg.BufferSize = 16 << 20
	}
	p := &Peer{buf: make([]byte, cfg.BufferSize)}
	mc := mooncake.MemoryConfig{Addr: cfg.Addr, ProtoVersion: cfg.ProtoVersion, Buf: p.buf, Base: cfg.Base}
	if cfg.RDMA {
		// The NIC needs memory outside Go's heap: startRDMA maps the
		// buffer anew, at its own address.
		if err := p.startRDMA(); err != nil {
			return nil, fmt.Errorf("mooncake test peer: RDMA: %w", err)
		}
		mc.Buf, mc.Base, mc.Describe, mc.Connect = p.buf, 0, p.rdmaSegment, p.connect
	}
	seg, err := mooncake.StartMemorySegment(mc)
	if err != nil {
		p.closeRDMA()
		return nil, fmt.Errorf("mooncake test peer: %w", err)
	}
	p.MemorySegment = seg
	return p, nil
}

// Close stops the segment's ports and its RDMA transport.
func (p *Peer) Close() {
	p.MemorySegment.Close()
	p.closeRDMA()
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
