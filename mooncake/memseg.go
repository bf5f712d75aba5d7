package mooncake

import (
	"context"
	"fmt"
	"net"
	"strconv"
	"sync"
	"time"
	"unsafe"

	"github.com/ferry-project/ferry/transport"
)

// MemorySegment is a Mooncake segment in this process's memory, served as
// a Mooncake engine that registered one buffer serves it: the handshake
// on an RPC port (metadata, probe, notify, and the RDMA QP setup when
// configured) and the TCP data port, protocol v1 or v2, over the buffer.
// ferrybench runs one for its Mooncake runs to write into.
type MemorySegment struct {
	cfg  MemoryConfig
	name string
	hs   *Server
	data *DataServer
	ts   string

	mu         sync.Mutex
	registered bool
	notifies   []NotifyDesc
	writes     int
}

// MemoryConfig is a MemorySegment's setup.
type MemoryConfig struct {
	Addr         string // handshake (RPC) port; default 127.0.0.1:0
	ProtoVersion int    // TCP protocol version advertised and spoken: 1 or 2 (default)
	Buf          []byte // the buffer; required
	// Base is the address the buffer is advertised at; 0: its real
	// address in this process, as Mooncake advertises. A restarted
	// segment given the same Base has the same buffer range and a new
	// data port.
	Base uint64
	// Describe, if set, completes the descriptor a metadata request gets
	// (an RDMA segment's devices, keys and priority matrix).
	Describe func(*Segment)
	// Connect, if set, answers RDMA QP setup requests (Handlers.Connect).
	Connect func(ctx context.Context, from net.Addr, req HandshakeDesc) (HandshakeDesc, func())
}

// StartMemorySegment serves cfg.Buf on cfg.Addr and a data port on the
// same host.
func StartMemorySegment(cfg MemoryConfig) (*MemorySegment, error) {
	if cfg.Addr == "" {
		cfg.Addr = "127.0.0.1:0"
	}
	if cfg.ProtoVersion == 0 {
		cfg.ProtoVersion = 2
	}
	if cfg.Base == 0 {
		cfg.Base = uint64(uintptr(unsafe.Pointer(unsafe.SliceData(cfg.Buf))))
	}
	rpc, err := net.Listen("tcp", cfg.Addr)
	if err != nil {
		return nil, fmt.Errorf("mooncake segment: RPC port: %w", err)
	}
	host, _, _ := net.SplitHostPort(rpc.Addr().String())
	dl, err := net.Listen("tcp", net.JoinHostPort(host, "0"))
	if err != nil {
		rpc.Close()
		return nil, fmt.Errorf("mooncake segment: data port: %w", err)
	}
	s := &MemorySegment{
		cfg: cfg, name: rpc.Addr().String(),
		ts:         time.Now().Format("2006-01-02 15:04:05.000000"),
		registered: true,
	}
	s.data = ServeData(dl, s, DataConfig{})
	s.hs = Serve(rpc, Handlers{Segment: s.Segment, Notify: s.notify, Connect: cfg.Connect}, ServerConfig{})
	return s, nil
}

// Name is the segment name, "ip:rpcport": the session a sender uses.
func (s *MemorySegment) Name() string { return s.name }

// Base is the buffer's address, as descriptors give it.
func (s *MemorySegment) Base() uint64 { return s.cfg.Base }

// Bytes returns a copy of n bytes at addr in the buffer.
func (s *MemorySegment) Bytes(addr uint64, n int) []byte {
	s.mu.Lock() // orders this after the write's completion
	defer s.mu.Unlock()
	off := addr - s.cfg.Base
	return append([]byte(nil), s.cfg.Buf[off:off+uint64(n)]...)
}

// Writes counts the WRITEs that landed through the data port.
func (s *MemorySegment) Writes() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.writes
}

// Notifies returns the notify messages received.
func (s *MemorySegment) Notifies() []NotifyDesc {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]NotifyDesc(nil), s.notifies...)
}

// Unregister drops the buffer, as Mooncake's unregisterLocalMemory does:
// it leaves the descriptor, and data requests into it are rejected.
func (s *MemorySegment) Unregister() {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.registered = false
}

// Close stops both ports.
func (s *MemorySegment) Close() {
	s.hs.Close()
	s.data.Close()
}

// Segment is the descriptor the metadata handshake returns.
func (s *MemorySegment) Segment() *Segment {
	_, port, _ := net.SplitHostPort(s.data.Addr().String())
	dp, _ := strconv.Atoi(port)
	d := &Segment{Name: s.name, Protocol: "tcp", TCPDataPort: dp, TCPProtoVersion: s.cfg.ProtoVersion, Timestamp: s.ts, Buffers: []Buffer{}}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.registered {
		d.Buffers = append(d.Buffers, Buffer{Name: s.name, Addr: s.cfg.Base, Length: uint64(len(s.cfg.Buf))})
	}
	if s.cfg.Describe != nil {
		s.cfg.Describe(d)
	}
	return d
}

func (s *MemorySegment) notify(_ net.Addr, n NotifyDesc) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.notifies = append(s.notifies, n)
	return nil
}

func (s *MemorySegment) span(addr, n uint64) ([]byte, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	end := addr + n
	if !s.registered || addr < s.cfg.Base || end < addr || end > s.cfg.Base+uint64(len(s.cfg.Buf)) {
		return nil, fmt.Errorf("[%#x, %#x) is outside the registered buffers", addr, end)
	}
	return s.cfg.Buf[addr-s.cfg.Base : end-s.cfg.Base], nil
}

// Write implements Memory: the data port's WRITEs into the buffer.
func (s *MemorySegment) Write(addr, n uint64) (transport.Body, func(error), error) {
	b, err := s.span(addr, n)
	if err != nil {
		return nil, nil, err
	}
	return transport.Whole(b), func(err error) {
		if err == nil {
			s.mu.Lock()
			s.writes++
			s.mu.Unlock()
		}
	}, nil
}

// Read implements Memory: the data port's READs from the buffer.
func (s *MemorySegment) Read(addr, n uint64) ([]byte, func(), error) {
	b, err := s.span(addr, n)
	return b, func() {}, err
}
