package rdma

// The control connection of an RDMA lane. It opens with the peer port's
// handshake (transport/peer/wire.go, a hello of kind rdma, and with a
// peer secret its challenge-response), then goes on here. Integers are
// little-endian.
//
// Connect, once:
//
//	client → server  connect, 32 bytes: the client QP's endpoint
//	  0  gid       [16]byte
//	 16  qpn       u32
//	 20  psn       u32     the first PSN the client sends
//	 24  lid       u16     0 on RoCE
//	 26  mtu       u8      the port's active MTU (enum ibv_mtu)
//	 27  flags     u8      0 from the client; in the server's reply, bit 0
//	                       (acceptDirect): it takes direct writes, below
//	 28  rail      u8      from the client: the server's rail (its NIC, in
//	                       the order of its --rdma-device) the lane's QP is
//	                       to be on; in the reply, the rail it is on
//	 29  rails     u8      how many rails (RDMA NICs) the sender of the
//	                       record drives, 1 to 16 (version 8)
//	 30  reserved  [2]byte
//
//	server → client  a reply (peer.EncodeReply): code 0, or a code and a
//	                 message saying why no lane (no QP, shutting down);
//	                 after code 0, 56 bytes:
//	  0  endpoint  32 bytes, the server QP's, as above
//	 32  base      u64     the server's shared registration: its address,
//	 40  size      u64     size and rkey, given only with acceptDirect in
//	 48  rkey      u32     mode 1 (an authenticated dialer); else 0, 0, 0
//	 52  mode      u32     1 shared, 2 per-send, 0 none, 3 windows (shared,
//	                       for windows only: each slot's key carries the
//	                       rkey of a window over it, transport.Key.Window)
//
// Both sides then move their QP to RTS; the path MTU is the smaller of
// the two. The reply's endpoint is the GID of the rail's NIC; on rail 0
// base, size, rkey and mode are the arena's registration, and on another
// rail only the mode, with acceptDirect in mode 3 (a slot's key names
// the rail its window is on: transport.Key.Rail). A dialer opens its
// first lane from its rail 0 to the server's rail 0, learns the server's
// rails from the reply, and opens lanes to other rails, from whichever
// of its own NICs it picks, as writes need them (rails.go): a write
// goes to the rail its key names, and striped writes go rail i to rail
// i. A server asked for a rail it does not have refuses the connect
// (code internal). The dialer holds grants to the receiver's
// registration: one that names the shared rkey must lie inside base
// and size.
//
// Direct writes. A server sets acceptDirect when it has the shared
// registration, its Sink is a transport.DirectSink, whose slot addresses
// are the addresses of their bytes, and either it has windows (mode 3,
// windows.go) or the port is authenticated (both daemons proved the
// peer secret: arena-rkey mode). A client may then send a write that is
// its slot's whole content (transport.Write.Whole) and whose tag is its
// key's tag with no header at all: one RDMA WRITE WITH IMM of the whole
// write (at most directMax bytes, from registered memory) to the slot's
// address, the immediate the tag, under the rkey of the slot's window
// (its key's Window) in windows mode, any client, wherever the slot
// lies (the arena, or a region the server registered: the window
// bounds the write); else, an authenticated client only, under the
// shared rkey, into the arena only. The server learns of it from the receive
// completion alone: the immediate names the slot, byte_len says how
// many bytes it placed, and the Sink takes them as the slot's content
// (Arrived) when that is the slot's size. Nothing is refused before the
// bytes land, and the client's success is its NIC's completion: the NIC
// placed the bytes; whether the Sink took them the client does not
// learn. A completion that counts for nothing (no live slot has the
// tag, the slot holds its data already, the length is not the slot's)
// is counted and logged, and the lane carries on: the bytes are in
// place already. Any write the client cannot send so (a piece of a
// slot, another tag, a source it copies through its bounce buffer, more
// than directMax bytes) asks first, as below, on the same lane. The server tells them apart by order: a
// completion that matches the oldest grant outstanding is that grant's;
// any other is a direct write's.
//
// Then any number of writes, several in flight per lane:
//
//	client → server  peer.Header, 40 bytes (addr, len, key, tag)
//	server → client  a reply: a refusal (transport.Code and message, as on
//	                 a TCP data connection), or code 0 and a grant, 16
//	                 bytes:
//	  0  addr      u64     where the NIC is to place the bytes
//	  8  rkey      u32     the registration covering [addr, addr+len)
//	 12  reserved  u32
//
// The server answers each header, in the order they came. A client sends
// a header, waits for its answer and, after a grant, posts the body to
// the granted range as RDMA WRITEs of 1 MiB each (the last one shorter),
// the last one WITH IMM carrying the tag. Once every message of a write
// is posted (and the write is at most flyingChunks messages), the client
// may send the next header without waiting for the write's completion:
// up to flyingMax writes per lane wait for their completions while
// another is granted and posted. The server takes headers while it has
// fewer than recvDepth writes granted and not completed (one posted
// receive each), and grants without waiting for the earlier writes.
//
// A write's completion on the client is its completion: RC acknowledges
// it once the peer's NIC has placed the bytes, and RC's ordering means
// every earlier message of the lane was placed before it. Since a client
// posts a write's messages only after its grant, and the next write's
// only after all of them, the WITH IMM messages arrive in the order of
// the grants: the server matches each receive completion against its
// oldest grant outstanding, and takes the write as delivered when the
// completion shows that grant's tag and the length of the last message
// it implies. Anything else (a mismatch, a completion with no grant
// outstanding) is rejected, counted and logged, and never delivered;
// the server then fails every write it had granted on the lane.
//
// Credits. Every WRITE WITH IMM, granted or direct, consumes one receive
// the server posted; with none posted the server's NIC answers RNR and,
// its retries spent (about 8 ms), fails the client's QP. The server
// posts recvPosted receives before its connect reply, and the client
// starts with that many credits; it takes one before it sends a write's
// header (or, direct, posts the write) and posts no WRITE WITH IMM
// without one. The server reposts receives recvBatch at a time as it
// takes their completions, and after each repost sends a credit:
//
//	server → client  a reply with code 0, flags bit 2 (flagCredit), no
//	                 message, and a 16-byte body:
//	  0  count     u32     receives posted again: the client's credits
//	  4  reserved  [12]byte
//
// A credit may come at any point between other replies; it answers no
// header. A client out of credits waits for one, for io_timeout at most
// (the receiving daemon made no progress), and its write then fails
// with nothing posted.
//
// A server that fails granted writes (a receive completed in error, a
// completion did not match its grant, it is stopping) sends a reply with
// flags bit 1 (flagFailed) and the reason, and closes the lane: that
// reply may come at any point, and ends every write on the lane.
//
// A write whose caller gives up (canceled, or past its deadline) spares
// the lane's other writes where it can. Waiting for its answer, the
// client posts nothing: the lane is out of step (the answer still comes)
// but sound, so it takes no more headers, and once the writes flying on
// it have ended the client reads the answer (for drainWait at most) and
// closes the lane. The server, seeing the control connection end with
// that grant outstanding, breaks its QP: writes whose completions came
// are delivered, and the unused grant's receive is flushed and its memory
// let go undelivered. With every message posted, the client waits (for
// drainWait at most) for the write's completion, and when it comes the
// lane carries on. With messages left to post the grant can never
// complete, and the QP breaks, but only after the writes flying on the
// lane, posted before, have completed (for drainWait at most).
//
// What the NIC enforces: a write needs an rkey of the receiver's
// protection domain with remote write access, must stay inside that
// registration (or window), and must come from the QP this lane
// connected. In windows mode the registration's own rkey allows no
// remote write: every write, direct or granted (the grant names the
// slot's window), goes through the window over its slot, so the NIC
// bounds it to that slot's live bytes, and after the slot is freed
// refuses it (REM_ACCESS_ERR at the sender); what follows is about the
// other modes. What
// ferry checks: the receiver grants only after its Sink accepted the
// header (a live slot, its key, the bounds), and it delivers only a
// completion that matches the oldest grant outstanding. A peer that
// writes without asking (holding an rkey from an earlier grant, or
// several from grants outstanding at once) is stopped by the NIC only at
// the registration's bounds: with the shared registration that is the
// whole arena. Memory windows bound per grant would close that gap.
// Direct writes open it on purpose, between authenticated peers only:
// what protects a slot then is the peer secret (only a daemon holding it
// gets a lane), the tag and length check on completion (a write the
// Sink does not take is counted and logged, never delivered), and the
// receiver's quarantine of freed slots' memory (a late write lands in
// memory no newer slot holds yet). A write past its slot's end lands in
// whatever lies there before the length check shows it.

import (
	"encoding/binary"
	"fmt"
	"io"
	"net"

	"github.com/ferry-project/ferry/transport"
	"github.com/ferry-project/ferry/transport/peer"
)

const (
	endpointSize = 32
	acceptSize   = endpointSize + 24
	grantSize    = 16
)

// flagFailed in a reply's flags: the reply reports the failure of the
// write in flight, and the lane closes (FlagClose is set too).
const flagFailed = 2

// flagCredit in a reply's flags: the reply returns credits (see above)
// and answers no header.
const flagCredit = 4

// acceptDirect in a connect reply's flags: the server takes direct
// writes.
const acceptDirect = 1

// Where the connect record carries the rail and the rail count.
const (
	connectRail  = 28
	connectRails = 29
)

// Registration modes as the connect reply carries them.
const (
	modeNone    = 0
	modeShared  = 1
	modePerSend = 2
	modeWindows = 3
)

func (e *endpoint) encode(b []byte) {
	copy(b[0:16], e.GID[:])
	binary.LittleEndian.PutUint32(b[16:], e.QPN)
	binary.LittleEndian.PutUint32(b[20:], e.PSN)
	binary.LittleEndian.PutUint16(b[24:], e.LID)
	b[26] = byte(e.MTU)
	clear(b[27:endpointSize]) // flags, rail and rails are the caller's
}

func (e *endpoint) decode(b []byte) {
	copy(e.GID[:], b[0:16])
	e.QPN = binary.LittleEndian.Uint32(b[16:])
	e.PSN = binary.LittleEndian.Uint32(b[20:])
	e.LID = binary.LittleEndian.Uint16(b[24:])
	e.MTU = mtu(b[26])
}

// peerRegion is what a connect reply says about the server's memory.
type peerRegion struct {
	Base, Size uint64
	RKey       uint32
	Mode       uint32
	Direct     bool // acceptDirect
	Rails      int  // the server's rails: its RDMA NICs
}

// direct finds where a direct write of n bytes to addr lands: in
// windows mode under the slot's window (0: none), which bounds it
// wherever the slot lies (the arena or a region); else inside the
// shared registration, which the server offers to direct writes, under
// its rkey.
func (r peerRegion) direct(addr, n uint64, window uint32) (grant, bool) {
	switch {
	case !r.Direct || n == 0:
	case r.Mode == modeWindows && window != 0:
		return grant{Addr: addr, RKey: window}, true
	case r.Mode == modeShared && spans(r.Base, r.Size, addr, n):
		return grant{Addr: addr, RKey: r.RKey}, true
	}
	return grant{}, false
}

// check refuses a grant that names the shared registration's rkey for a
// range outside it: the NIC would fail the write with REM_ACCESS_ERR;
// this says which side is wrong before posting anything. Only a dialer
// told that rkey (arena-rkey mode) can tell; elsewhere it passes all.
func (r peerRegion) check(g grant, n uint64) error {
	if r.Mode != modeShared || g.RKey != r.RKey || n == 0 {
		return nil
	}
	if g.Addr < r.Base || g.Addr-r.Base > r.Size || n > r.Size-(g.Addr-r.Base) {
		return fmt.Errorf("the receiver granted [%#x, +%d) under the rkey of its registration [%#x, +%d), which does not hold it", g.Addr, n, r.Base, r.Size)
	}
	return nil
}

// accept is the server's part of the connect exchange.
type accept struct {
	endpoint
	peerRegion
	Rail int // the rail the server's QP is on
}

func (a *accept) encode(b *[acceptSize]byte) {
	a.endpoint.encode(b[:endpointSize])
	if a.Direct {
		b[27] = acceptDirect
	}
	b[connectRail], b[connectRails] = byte(a.Rail), byte(a.Rails)
	binary.LittleEndian.PutUint64(b[32:], a.Base)
	binary.LittleEndian.PutUint64(b[40:], a.Size)
	binary.LittleEndian.PutUint32(b[48:], a.RKey)
	binary.LittleEndian.PutUint32(b[52:], a.Mode)
}

func (a *accept) decode(b *[acceptSize]byte) {
	a.endpoint.decode(b[:endpointSize])
	a.Direct = b[27]&acceptDirect != 0
	a.Rail, a.Rails = int(b[connectRail]), max(1, int(b[connectRails]))
	a.Base = binary.LittleEndian.Uint64(b[32:])
	a.Size = binary.LittleEndian.Uint64(b[40:])
	a.RKey = binary.LittleEndian.Uint32(b[48:])
	a.Mode = binary.LittleEndian.Uint32(b[52:])
}

// check refuses a reply to a connect that asked for rail: a lane on
// another rail, or more rails than the wire allows. A session opens a
// pool of lanes per rail pair its writes need, a slot's key naming the
// peer's rail, so a peer claiming 255 rails could have ferryd hold
// pools of lanes to 255 of them (docs/security.md).
func (a *accept) check(rail int) error {
	switch {
	case a.Rail != rail:
		return fmt.Errorf("asked the peer for a lane on its rail %d, and it connected one on rail %d", rail, a.Rail)
	case a.Rails > maxRails:
		return fmt.Errorf("the peer says it drives %d RDMA devices, and a daemon drives at most %d: it is not a ferryd of this protocol", a.Rails, maxRails)
	}
	return nil
}

// grant is where a receiver lets one write land.
type grant struct {
	Addr uint64
	RKey uint32
}

func (g *grant) encode(b *[grantSize]byte) {
	binary.LittleEndian.PutUint64(b[0:], g.Addr)
	binary.LittleEndian.PutUint32(b[8:], g.RKey)
	binary.LittleEndian.PutUint32(b[12:], 0)
}

func (g *grant) decode(b *[grantSize]byte) {
	g.Addr = binary.LittleEndian.Uint64(b[0:])
	g.RKey = binary.LittleEndian.Uint32(b[8:])
}

// credit is a flagCredit reply's body.
func encodeCredit(n uint32) (b [grantSize]byte) {
	binary.LittleEndian.PutUint32(b[0:], n)
	return b
}

func decodeCredit(b *[grantSize]byte) uint32 { return binary.LittleEndian.Uint32(b[0:]) }

// writeReply sends a reply, followed by body when the code is OK.
func writeReply(c net.Conn, code transport.Code, flags uint16, msg string, body []byte) error {
	var b [peer.ReplySize + peer.MaxMessage + acceptSize]byte
	n := len(peer.EncodeReply((*[peer.ReplySize + peer.MaxMessage]byte)(b[:peer.ReplySize+peer.MaxMessage]), code, flags, msg))
	if code == transport.OK {
		n += copy(b[n:], body)
	}
	if _, err := c.Write(b[:n]); err != nil {
		return fmt.Errorf("sending a %s reply: %w", code, err)
	}
	return nil
}

// readReply reads a reply; after an OK one it fills body.
func readReply(c io.Reader, body []byte) (peer.Reply, error) {
	var b [peer.ReplySize]byte
	r, _, err := peer.ReadReply(c, &b, body)
	return r, err
}
