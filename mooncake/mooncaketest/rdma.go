package mooncaketest

import (
	"context"
	"fmt"
	"net"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/ferry-project/ferry/mooncake"
	"github.com/ferry-project/ferry/rdma"
	"github.com/ferry-project/ferry/transport/peer"
	"github.com/ferry-project/ferry/transport/tcp"
	"github.com/ferry-project/ferry/transport/transporttest"
)

// An RDMA peer (Config.RDMA) is a segment as Mooncake's RDMA transport
// makes one: its buffer is mapped memory registered with the NIC for
// peers' writes and reads (as Mooncake registers its buffers: remote
// write and read), its descriptor says protocol "rdma" with the device,
// that registration's rkey and lkey and a priority matrix, and its RPC
// port answers connection handshakes by connecting QPs (the passive
// side). As an initiator it connects QPs by a handshake and posts plain
// RDMA WRITEs. The endpoints
// are package mooncake's, on package rdma's queue pairs.

// location is the buffer's memory location, as Mooncake names it and
// keys the priority matrix by.
const location = "cpu:0"

// startRDMA maps the buffer and opens the NIC the machine offers.
func (p *Peer) startRDMA() error {
	inv, err := rdma.Discover()
	if err != nil {
		return err
	}
	choice, err := rdma.Choose(inv, rdma.Want{GIDIndex: -1})
	if err != nil {
		return err
	}
	buf, err := unix.Mmap(-1, 0, len(p.buf), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
	if err != nil {
		return fmt.Errorf("mapping the buffer: %w", err)
	}
	tr, err := rdma.Listen(rdma.Config{Memory: buf, Peer: peer.Config{Addr: "127.0.0.1:0", Sink: transporttest.NewSlots(0)},
		TCP: func(p *peer.Port) rdma.Fallback { return tcp.Over(p) }}, choice)
	if err != nil {
		unix.Munmap(buf)
		return err
	}
	if _, _, ok := tr.SharedKeys(); !ok {
		tr.Close()
		unix.Munmap(buf)
		return fmt.Errorf("the buffer has no shared registration: %v", tr.Registration().Err)
	}
	// The registration the descriptor lists, at the buffer's own address:
	// one that lets peers read too (the shared one lets them write only).
	reg, err := tr.RegisterEngineRegion(buf, uint64(uintptr(unsafe.Pointer(&buf[0]))))
	if err != nil {
		tr.Close()
		unix.Munmap(buf)
		return err
	}
	p.rdma, p.buf, p.reg = tr, buf, reg
	p.eps = mooncake.NewEndpoints(tr, mooncake.EndpointConfig{})
	return nil
}

func (p *Peer) closeRDMA() {
	if p.rdma != nil {
		p.eps.Close()
		p.reg.Close()
		p.rdma.Close()
		unix.Munmap(p.buf)
	}
}

// rdmaSegment fills in what an rdma descriptor adds.
func (p *Peer) rdmaSegment(s *mooncake.Segment) {
	dev, _ := p.eps.Device()
	rk, lk := p.reg.RKey, p.reg.LKey
	if p.wrongRKey {
		rk++
	}
	s.Protocol = "rdma"
	s.Devices = []mooncake.Device{dev}
	s.PriorityMatrix = mooncake.Priority{location: {{dev.Name}, {}}}
	for i := range s.Buffers {
		s.Buffers[i].Name, s.Buffers[i].RKey, s.Buffers[i].LKey = location, []uint32{rk}, []uint32{lk}
	}
}

// connect answers a connection handshake; like Mooncake's passive side
// it fetches the descriptor of whatever segment an initiator without
// local_gid names.
func (p *Peer) connect(ctx context.Context, from net.Addr, req mooncake.HandshakeDesc) (mooncake.HandshakeDesc, func()) {
	p.mu.Lock()
	p.connects++
	p.mu.Unlock()
	return p.eps.Accept(ctx, mooncake.Handshake{Self: p.Name(), From: from, MayFetch: func(string) bool { return true }}, req)
}

// Connects counts the connection handshakes the peer answered.
func (p *Peer) Connects() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.connects
}

// AdvertiseWrongRKey makes the descriptor list rkey+1 (on) or the true
// rkey (off): a peer whose NIC refuses every write (REM_ACCESS_ERR).
func (p *Peer) AdvertiseWrongRKey(on bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.wrongRKey = on
}

// WriteRDMA is the RDMA initiator, as Mooncake's transfer_sync WRITE
// (and, when notify is not empty, submitTransferWithNotify): it copies
// data to the start of its own buffer, fetches the descriptor of the
// segment at rpc, picks the device and rkey for [addr, +len(data)), and
// writes them with plain RDMA WRITEs over QPs it connects by a connection
// handshake (or reuses); then it sends the notify.
func (p *Peer) WriteRDMA(ctx context.Context, rpc string, addr uint64, data []byte, notify string) (*mooncake.Segment, error) {
	if p.rdma == nil {
		return nil, fmt.Errorf("mooncake test peer %s was started without RDMA", p.Name())
	}
	seg, err := mooncake.FetchSegment(ctx, rpc, p.Segment())
	if err != nil {
		return nil, err
	}
	if seg.Protocol != "rdma" {
		return seg, fmt.Errorf("segment %s speaks %q, not rdma", seg.Name, seg.Protocol)
	}
	tg, ok, err := seg.RDMATarget(addr, uint64(len(data)))
	if err != nil {
		return seg, err
	}
	if !ok {
		return seg, fmt.Errorf("[%#x, +%d) lies in no buffer of %s: %s", addr, len(data), seg.Name, seg.DescribeBuffers())
	}
	if len(data) > len(p.buf) {
		return seg, fmt.Errorf("%d bytes exceed this peer's %d-byte buffer", len(data), len(p.buf))
	}
	src := p.buf[:len(data)]
	copy(src, data)
	if _, err := p.eps.WriteRDMA(ctx, mooncake.RDMAWrite{Self: p.Name(), RPC: rpc, Target: tg, Remote: addr, Src: src}); err != nil {
		return seg, err
	}
	if notify != "" {
		return seg, mooncake.SendNotify(ctx, rpc, mooncake.NotifyDesc{Name: p.Name(), NotifyMsg: notify})
	}
	return seg, nil
}

// WriteRawRDMA writes data to addr with the rkey and device of tg, whatever
// the descriptor says of the range: a misbehaving initiator, for tests of
// what the NIC refuses.
func (p *Peer) WriteRawRDMA(ctx context.Context, rpc string, tg mooncake.RDMATarget, addr uint64, data []byte) error {
	src := p.buf[:len(data)]
	copy(src, data)
	_, err := p.eps.WriteRDMA(ctx, mooncake.RDMAWrite{Self: p.Name(), RPC: rpc, Target: tg, Remote: addr, Src: src})
	return err
}
