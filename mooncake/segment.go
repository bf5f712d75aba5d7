package mooncake

import (
	"encoding/json"
	"fmt"
	"hash/fnv"
	"net"
	"strconv"
	"strings"

	"github.com/ferry-project/ferry/internal/strictjson"
	"github.com/ferry-project/ferry/transport"
)

// Segment is a Mooncake segment descriptor, the reply to a metadata
// handshake. A TCP segment names its data port; an RDMA one lists its
// devices, per-buffer keys (one per device, same index) and the priority
// matrix instead. Unknown fields are ignored: newer Mooncakes add some.
type Segment struct {
	Name            string   `json:"name"`     // "ip:rpcport", the session_id senders use
	Protocol        string   `json:"protocol"` // "tcp" or "rdma"
	Offered         []string `json:"-"`        // a multi-protocol segment's list (protocols.go)
	TCPDataPort     int      `json:"tcp_data_port"`
	TCPProtoVersion int      `json:"tcp_proto_version"` // 2: WRITEs are answered with a status word
	Timestamp       string   `json:"timestamp,omitempty"`
	Devices         []Device `json:"devices,omitempty"`
	Buffers         []Buffer `json:"buffers"`
	PriorityMatrix  Priority `json:"priority_matrix,omitempty"`
	// Ferry, in a ferry engine's segment, is how a ferryd sends into it
	// instead of over Mooncake's wire: ferry's own peer protocol
	// (transport/peer/wire.go, version 8). Mooncake ignores the field.
	Ferry *FerryTarget `json:"ferry,omitempty"`
}

// FerryTarget names a ferry engine segment's memory on ferry's peer
// port: writes there carry Key and land at their Mooncake addresses.
type FerryTarget struct {
	Peer string        `json:"peer"` // the receiving ferryd's peer port, host:port
	Key  transport.Key `json:"key"`  // the engine segment's key (40 hex digits)
}

// Buffer is one registered memory range of a segment. Addr is an absolute
// address in the segment owner's memory (a uint64 in the JSON).
type Buffer struct {
	Name   string   `json:"name"`
	Addr   uint64   `json:"addr"`
	Length uint64   `json:"length"`
	RKey   []uint32 `json:"rkey,omitempty"` // RDMA: remote key per device
	LKey   []uint32 `json:"lkey,omitempty"` // RDMA: local key per device
}

// Device is an RDMA NIC of a segment.
type Device struct {
	Name string `json:"name"` // e.g. mlx5_0
	LID  uint16 `json:"lid"`
	GID  string `json:"gid"` // colon-separated hex
}

// Priority is the RDMA priority matrix: per memory location (e.g.
// "cpu:0"), lists of device names (preferred first, then the others).
type Priority map[string][][]string

// DecodeSegment parses a descriptor and checks what a sender relies on.
func DecodeSegment(b []byte) (*Segment, error) {
	var s Segment
	if err := decodeStrict(b, &s); err != nil {
		return nil, fmt.Errorf("segment descriptor is not valid JSON of a Mooncake segment: %w", err)
	}
	if err := s.check(); err != nil {
		return nil, err
	}
	return &s, nil
}

func (s *Segment) check() error {
	if s.Name == "" {
		return fmt.Errorf("segment descriptor has no name")
	}
	if s.Protocol == "tcp" && (s.TCPDataPort <= 0 || s.TCPDataPort > 65535) {
		return fmt.Errorf("segment %s: tcp_data_port %d is not a port number", s.Name, s.TCPDataPort)
	}
	if s.Protocol == "rdma" {
		if err := s.checkRDMA(); err != nil {
			return err
		}
	}
	for _, b := range s.Buffers {
		if b.Addr+b.Length < b.Addr {
			return fmt.Errorf("segment %s: buffer %q at %#x of %d bytes wraps around the address space", s.Name, b.Name, b.Addr, b.Length)
		}
	}
	return nil
}

// Buffer returns the buffer holding all of [addr, addr+n).
func (s *Segment) Buffer(addr, n uint64) (Buffer, bool) {
	end := addr + n
	if end < addr {
		return Buffer{}, false
	}
	for _, b := range s.Buffers {
		if addr >= b.Addr && end <= b.Addr+b.Length {
			return b, true
		}
	}
	return Buffer{}, false
}

// DescribeBuffers lists the buffers as [start, end) ranges, for errors.
func (s *Segment) DescribeBuffers() string {
	if len(s.Buffers) == 0 {
		return "none registered"
	}
	parts := make([]string, len(s.Buffers))
	for i, b := range s.Buffers {
		parts[i] = fmt.Sprintf("%s [%#x, %#x) %d bytes", b.Name, b.Addr, b.Addr+b.Length, b.Length)
	}
	return strings.Join(parts, "; ")
}

// DataAddr is the host:port of the segment's TCP data port: the host its
// descriptor was fetched from (the RPC address dialed) and tcp_data_port.
// Never the host the descriptor's name gives: a hostile peer's name could
// send ferryd's data connection, and the caller's bytes, to a third host.
func (s *Segment) DataAddr(fetchedFrom string) string {
	host, _, _ := net.SplitHostPort(fetchedFrom)
	return net.JoinHostPort(host, strconv.Itoa(s.TCPDataPort))
}

// Identity is a fingerprint of the descriptor: a restarted peer gets a new
// timestamp, data port or buffer addresses, and so a new identity.
func (s *Segment) Identity() uint64 {
	h := fnv.New64a()
	fmt.Fprintf(h, "%s|%s|%d|%d|%s", s.Name, s.Protocol, s.TCPDataPort, s.TCPProtoVersion, s.Timestamp)
	for _, b := range s.Buffers {
		fmt.Fprintf(h, "|%x+%x", b.Addr, b.Length)
	}
	return h.Sum64() | 1
}

// HandshakeDesc is the body of a connection (type 0) message: the RDMA
// QP exchange. A non-empty ReplyMsg in a reply is the server's refusal.
type HandshakeDesc struct {
	Protocol     string   `json:"protocol,omitempty"`
	LocalNICPath string   `json:"local_nic_path"` // "<segment name>@<device>"
	PeerNICPath  string   `json:"peer_nic_path"`
	LocalLID     uint16   `json:"local_lid"`
	LocalGID     string   `json:"local_gid"`
	QPNum        []uint32 `json:"qp_num"`
	ReadyAck     *bool    `json:"ready_ack,omitempty"` // absent: the peer predates the ack
	ReplyMsg     string   `json:"reply_msg"`
	Payload      string   `json:"payload,omitempty"`
}

// NotifyDesc is the body of a notify (type 2) message.
type NotifyDesc struct {
	Name      string `json:"name"`
	NotifyMsg string `json:"notify_msg"`
}

// NotifyReply is the reply to a notify: notify_msg "success" when the
// receiver kept it. A refusal has an empty notify_msg, which Mooncake's
// sender reads as "rejected" (it checks for an empty one), and ferry's
// reason in Error, a field Mooncake ignores.
type NotifyReply struct {
	Name      string `json:"name"`
	NotifyMsg string `json:"notify_msg"`
	Error     string `json:"error,omitempty"`
}

// ProbeReply is the body of a probe (type 3) reply.
type ProbeReply struct {
	Status string `json:"status"`
}

// decodeStrict decodes a JSON message from a peer, refusing one with a key
// twice (in any case): encoding/json would keep the last, and a peer could
// show one value to a log or proxy and another to ferry.
func decodeStrict(b []byte, v any) error {
	if err := strictjson.NoDuplicateKeys(b); err != nil {
		return err
	}
	return json.Unmarshal(b, v)
}
