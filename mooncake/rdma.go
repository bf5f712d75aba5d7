package mooncake

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"net"
	"strings"
)

// Mooncake's RDMA transport, as far as the handshake goes. A segment whose
// descriptor says protocol "rdma" lists its NICs (devices, index = device
// id) and, per buffer, one rkey per device (rkey[i] belongs to
// devices[i]). A sender picks a device for the buffer it writes into by
// the priority matrix, connects queue pairs to that device by a
// connection (type 0) handshake naming both ends by NIC path, and posts
// plain RDMA WRITEs with the buffer's rkey at that device's index.

// DefaultQPs is Mooncake's QPs per endpoint (MC_NUM_QP_PER_EP): both ends
// of a connection must create the same number. MaxQPs bounds what ferry
// connects for one endpoint, either side.
const (
	DefaultQPs = 2
	MaxQPs     = 16
)

// ReadsPerQP is how many pieces of a Session.Read go at once per queue
// pair of the endpoint: the calls on a QP share its send queue (package
// rdma's, 64 work requests; a piece up to 1 MiB is one), and half of it
// leaves room for the writes beside them.
const ReadsPerQP = 32

// DefaultMTU is Mooncake's cap on the path MTU (MC_MTU, bytes). Neither
// side of a connection tells the other its MTU: each QP uses the smaller
// of the cap and its port's active MTU, so both ends must come to the same.
const DefaultMTU = 4096

// NICPath names one NIC of a segment: "<segment name>@<device>".
func NICPath(segment, device string) string { return segment + "@" + device }

// SplitNICPath splits a NIC path at its first '@', as Mooncake does.
func SplitNICPath(p string) (segment, device string, ok bool) {
	return strings.Cut(p, "@")
}

// RDMATarget is where a write into an RDMA segment goes.
type RDMATarget struct {
	Buffer   Buffer
	Device   Device
	DevIndex int    // index into devices[] and into the buffer's rkeys
	RKey     uint32 // Buffer.RKey[DevIndex]
	NICPath  string // the peer NIC path the connection handshake names
}

// RDMATarget finds the buffer holding [addr, addr+n) and the device to
// reach it through: the first of the buffer location's preferred devices
// in the priority matrix, else the first available one (location "*"
// means every device). ok is false when no buffer holds the range.
func (s *Segment) RDMATarget(addr, n uint64) (RDMATarget, bool, error) {
	b, ok := s.Buffer(addr, n)
	if !ok {
		return RDMATarget{}, false, nil
	}
	var names []string
	if b.Name == "*" {
		for _, d := range s.Devices {
			names = append(names, d.Name)
		}
	} else {
		for _, list := range s.PriorityMatrix[b.Name] {
			names = append(names, list...)
		}
	}
	for _, name := range names {
		for i, d := range s.Devices {
			if d.Name != name {
				continue
			}
			if i >= len(b.RKey) {
				return RDMATarget{}, true, fmt.Errorf("segment %s: buffer %q has %d rkeys, none for device %d (%s)", s.Name, b.Name, len(b.RKey), i, name)
			}
			return RDMATarget{Buffer: b, Device: d, DevIndex: i, RKey: b.RKey[i], NICPath: NICPath(s.Name, name)}, true, nil
		}
	}
	return RDMATarget{}, true, fmt.Errorf("segment %s: no device of %s serves buffer %q (location %q): its priority_matrix %v names none of its devices", s.Name, s.describeDevices(), b.Name, b.Name, s.PriorityMatrix)
}

func (s *Segment) describeDevices() string {
	names := make([]string, len(s.Devices))
	for i, d := range s.Devices {
		names[i] = d.Name
	}
	return "[" + strings.Join(names, " ") + "]"
}

// checkRDMA is what Mooncake's own decoder requires of an rdma
// descriptor: named devices with GIDs, and buffers with an address, a
// length and as many rkeys as lkeys.
func (s *Segment) checkRDMA() error {
	for i, d := range s.Devices {
		if d.Name == "" || d.GID == "" {
			return fmt.Errorf("segment %s: device %d has no name or no gid", s.Name, i)
		}
		if _, err := ParseGID(d.GID); err != nil {
			return fmt.Errorf("segment %s: device %s: %w", s.Name, d.Name, err)
		}
	}
	for _, b := range s.Buffers {
		if b.Name == "" || b.Addr == 0 || b.Length == 0 || len(b.RKey) == 0 || len(b.RKey) != len(b.LKey) {
			return fmt.Errorf("segment %s: buffer %q at %#x of %d bytes lacks a name, an address, a length or its keys (%d rkeys, %d lkeys)", s.Name, b.Name, b.Addr, b.Length, len(b.RKey), len(b.LKey))
		}
	}
	return nil
}

// ConnectQPs runs the connection handshake as Mooncake's active side:
// req names both NIC paths and carries this side's QP numbers, GID and
// LID. The reply must be an object with an empty reply_msg, the paths
// swapped and as many QP numbers; a JSON null (what Mooncake answers
// whenever its setup fails) is a refusal.
func ConnectQPs(ctx context.Context, rpc string, req HandshakeDesc) (HandshakeDesc, error) {
	r, _, err := connectQPs(ctx, rpc, req)
	return r, err
}

// connectQPs is ConnectQPs, which also says the address it reached.
func connectQPs(ctx context.Context, rpc string, req HandshakeDesc) (_ HandshakeDesc, reached net.Addr, _ error) {
	var raw json.RawMessage
	reached, err := exchange(ctx, rpc, Connect, req, &raw)
	if err != nil {
		return HandshakeDesc{}, nil, err
	}
	fail := func(format string, args ...any) (HandshakeDesc, net.Addr, error) {
		return HandshakeDesc{}, nil, fmt.Errorf("mooncake connection handshake with %s (%s to %s): %s", rpc, req.LocalNICPath, req.PeerNICPath, fmt.Sprintf(format, args...))
	}
	if bytes.Equal(bytes.TrimSpace(raw), []byte("null")) {
		return fail("the peer refused it (a null reply: Mooncake's setup failed; its log says why, e.g. an unknown device, a QP count other than %d, or a stale endpoint)", len(req.QPNum))
	}
	var r HandshakeDesc
	if err := decodeStrict(raw, &r); err != nil {
		return fail("the reply is not a connection descriptor: %v", err)
	}
	switch {
	case r.ReplyMsg != "":
		return fail("the peer refused it: %s", r.ReplyMsg)
	case r.LocalNICPath != req.PeerNICPath || r.PeerNICPath != req.LocalNICPath:
		return fail("the reply names %s to %s, not the paths asked for", r.LocalNICPath, r.PeerNICPath)
	case len(r.QPNum) != len(req.QPNum):
		return fail("the peer has %d QPs per endpoint, this side %d: set both to the same (ferry's mooncake_qps_per_endpoint, Mooncake's MC_NUM_QP_PER_EP)", len(r.QPNum), len(req.QPNum))
	}
	return r, reached, nil
}
