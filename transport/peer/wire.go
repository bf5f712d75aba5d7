package peer

// Wire protocol of the peer port, version 8 (8 carries RDMA rails in
// the lane's connect, rdma/wire.go: the rail a QP is on and how many
// NICs each side drives; and lets a write's key name an engine
// segment's memory instead of a receive slot: see "Engine memory"
// below; 7 returns receive credits
// on RDMA lanes, rdma/wire.go; 6 binds the address the
// client dialed into the challenge-response; 5 grew the write header's
// key by its window's rkey). Every integer is little-endian; every
// record has a fixed size except the message that may follow a reply.
// Both transports speak it on the one port: transport/tcp on its data
// connections, rdma on its lanes' control connections, whose exchange
// rdma/wire.go goes on with.
//
// Handshake, once when a connection opens:
//
//	client → server  hello, 24 bytes
//	  0  magic     [4]byte "FERY"
//	  4  version   u32     the client's protocol version
//	  8  instance  u64     the client daemon's process identity
//	 16  kind      u32     what the connection is for: 0 a TCP data
//	                       connection (below); 1 the control connection
//	                       of an RDMA lane (rdma/wire.go goes on); 2 a
//	                       read connection (read.go); 3 the control
//	                       connection of RDMA READs (rdma/reads.go)
//	 20  flags     u32     bit 0 (flagAuth): the sender holds a peer
//	                       secret; other bits 0
//
//	server → client  welcome, 28 bytes, then, when its flags carry
//	                 flagAuth, the server's nonce, 32 bytes
//	  0  hello     24 bytes, the server's (kind echoes the client's;
//	               flagAuth when it holds a secret)
//	 24  status    u32     0 ok, 1 version mismatch, 2 bad magic,
//	                       3 no RDMA here (the client falls back to
//	                       kind 0), 4 unknown kind, 5 secret required
//	                       (the server holds one, the client sent no
//	                       flagAuth), 6 no secret here (the other way
//	                       round)
//
// A server answers a bad hello with a non-zero status and closes the
// connection, so the client can name the reason. The hello is all a
// client sends before the welcome, so a server of any version reads it
// whole and can answer with its own version.
//
// When both sides hold a secret (the hello and the welcome both carry
// flagAuth and the status is 0), a mutual challenge-response follows
// before anything else:
//
//	client → server  the client's nonce, 32 bytes; dialedlen u16; dialed,
//	                 dialedlen bytes (1 to 512): the host:port the client
//	                 dialed, as it dialed it; proof("client"), 32 bytes
//	server → client  verdict, 36 bytes
//	  0  status    u32     0 ok, 7 proof mismatch, 8 dialed is not this
//	                       server's address, 9 dialedlen is 0 or above
//	                       512, or dialed is no host:port (the server
//	                       closes on any but 0)
//	  4  proof     [32]byte proof("server"); zero unless status is 0
//
// proof(role) is HMAC-SHA256 keyed with the secret over the label
// "ferry peer proof v4 " + role, then kind u32, dialedlen u16 and dialed,
// the client's instance u64 and nonce, the server's instance u64 and
// nonce. Nonces are fresh from crypto/rand on every connection, so a
// proof is never valid twice; the role makes a proof reflected back to
// its sender fail. The client proves first and takes the connection only
// once the server's proof checks out. A server whose proof check passes
// takes the connection only if dialed names it (its listen address, and
// its advertised address or, with none, the address the connection
// reached; hosts compare as IPs, or as names in any letter case): a host in between that
// relays a client's handshake to another server holding the secret
// leaves the client's proof naming the relay, which that server refuses
// with 8, and cannot rewrite dialed without breaking the proof. dialed
// travels in the clear so that the server can tell 8 from 7.
//
// Then, on a data connection, any number of writes, one at a time:
//
//	client → server  header, 40 bytes, then len bytes of body
//	  0  addr      u64     destination address in the server's arena
//	  8  len       u64     body length, at least 1
//	 16  key       [20]byte  the receive slot's key (transport.Key: the
//	                         120-bit capability, the rail, then its
//	                         window's rkey)
//	 36  tag       u32     delivered with the completion
//
//	server → client  reply, 8 bytes, then msglen bytes of message
//	  0  code      u32     transport.Code; 0 (OK) once every byte is placed
//	                       (code 2, bad_key, was retired in version 4: a
//	                       key that matches no slot is no_slot, whatever
//	                       lies at the address)
//	  4  flags     u16     bit 0: the server closes the connection after
//	                       this reply (the client must not reuse it)
//	  6  msglen    u16     at most MaxMessage; 0 for OK
//
// Engine memory (version 8, additive: no record changes). A write's key
// may be the key of a ferry engine's Mooncake segment (daemon/engines.go:
// memory a ferry.mooncake engine registered, at its owner's addresses),
// which that segment's descriptor publishes on its Mooncake RPC port
// ("ferry": {"peer": host:port of this port, "key": 40 hex digits}). addr
// is then the Mooncake address of the destination in that segment, len
// may span registered ranges that follow one another, and tag is 0; the
// reply is OK once every byte is in the engine's memory, out_of_bounds
// when the range lies outside what the engine registered, no_slot when
// the segment is gone. A version-7 receiver knows no such key (no_slot).
//
// A server refuses a write either before reading its body (and then reads
// and discards the body so the stream stays in step) or, when len exceeds
// its limit or the connection has sent MaxUnmatched writes that matched no
// slot, for good: it replies with the close flag and closes the
// connection without reading the body.

import (
	"crypto/sha256"
	"encoding/binary"
	"errors"
	"fmt"

	"github.com/ferry-project/ferry/transport"
)

const (
	magic   = "FERY"
	version = 8

	helloSize   = 24
	welcomeSize = 28
	nonceSize   = 32
	proofSize   = sha256.Size
	verdictSize = 4 + proofSize

	// maxDialed bounds the dialed address in a handshake: a DNS name
	// (253 bytes at most), a port and brackets fit twice over.
	maxDialed = 512

	// MinSecret is the shortest peer secret accepted: 128 bits.
	MinSecret = 16

	// HeaderSize and ReplySize are the sizes of a write's header and of
	// the fixed part of its reply.
	HeaderSize = 40
	ReplySize  = 8

	// MaxMessage bounds a refusal message, on both sides.
	MaxMessage = 1024

	// MaxUnmatched is how many writes matching no receive slot (a key
	// that is not, or no longer, a live slot's) one connection may send
	// before the receiver closes it: a sender racing a slot's expiry
	// meets a few, one guessing keys meets them all.
	MaxUnmatched = 16
)

// Kind is what a connection is for, as its hello asks.
type Kind uint32

const (
	KindData Kind = 0 // a TCP data connection (transport/tcp)
	KindRDMA Kind = 1 // the control connection of an RDMA lane (rdma)
)

// Handshake statuses.
const (
	statusOK         = 0
	statusBadVersion = 1
	statusBadMagic   = 2
	statusNoRDMA     = 3
	statusBadKind    = 4
	statusNeedSecret = 5
	statusNoSecret   = 6
	statusBadProof   = 7
	statusNotHere    = 8
	statusBadDialed  = 9
)

// flagAuth in a hello's flags: its sender holds a secret, and its nonce
// follows.
const flagAuth = 1

// FlagClose in a reply's flags: the server closes the connection after it.
const FlagClose = 1

type hello struct {
	magic    [4]byte
	version  uint32
	instance uint64
	kind     Kind
	flags    uint32
}

// ours is the hello this daemon sends, and the start of its welcome.
func ours(instance uint64, kind Kind, secret []byte) hello {
	h := hello{magic: [4]byte{magic[0], magic[1], magic[2], magic[3]}, version: version, instance: instance, kind: kind}
	if secret != nil {
		h.flags = flagAuth
	}
	return h
}

func (h *hello) auth() bool { return h.flags&flagAuth != 0 }

func (h *hello) encode(b *[helloSize]byte) {
	copy(b[0:4], h.magic[:])
	binary.LittleEndian.PutUint32(b[4:], h.version)
	binary.LittleEndian.PutUint64(b[8:], h.instance)
	binary.LittleEndian.PutUint32(b[16:], uint32(h.kind))
	binary.LittleEndian.PutUint32(b[20:], h.flags)
}

func (h *hello) decode(b *[helloSize]byte) {
	copy(h.magic[:], b[0:4])
	h.version = binary.LittleEndian.Uint32(b[4:])
	h.instance = binary.LittleEndian.Uint64(b[8:])
	h.kind = Kind(binary.LittleEndian.Uint32(b[16:]))
	h.flags = binary.LittleEndian.Uint32(b[20:])
}

type welcome struct {
	hello
	status uint32
}

func (w *welcome) encode(b *[welcomeSize]byte) {
	w.hello.encode((*[helloSize]byte)(b[:helloSize]))
	binary.LittleEndian.PutUint32(b[helloSize:], w.status)
}

func (w *welcome) decode(b *[welcomeSize]byte) {
	w.hello.decode((*[helloSize]byte)(b[:helloSize]))
	w.status = binary.LittleEndian.Uint32(b[helloSize:])
}

// Header announces one write: on a data connection its body follows; on
// an RDMA control connection the body moves by RDMA once the receiver
// has answered.
type Header struct {
	Addr, Len uint64
	Key       transport.Key
	Tag       uint32
}

func (h *Header) Encode(b *[HeaderSize]byte) {
	binary.LittleEndian.PutUint64(b[0:], h.Addr)
	binary.LittleEndian.PutUint64(b[8:], h.Len)
	copy(b[16:36], h.Key[:])
	binary.LittleEndian.PutUint32(b[36:], h.Tag)
}

func (h *Header) Decode(b *[HeaderSize]byte) {
	h.Addr = binary.LittleEndian.Uint64(b[0:])
	h.Len = binary.LittleEndian.Uint64(b[8:])
	copy(h.Key[:], b[16:36])
	h.Tag = binary.LittleEndian.Uint32(b[36:])
}

// EncodeReply writes a reply and its message into b and returns the bytes
// to send. A message longer than MaxMessage is cut.
func EncodeReply(b *[ReplySize + MaxMessage]byte, code transport.Code, flags uint16, msg string) []byte {
	if len(msg) > MaxMessage {
		msg = msg[:MaxMessage]
	}
	binary.LittleEndian.PutUint32(b[0:], uint32(code))
	binary.LittleEndian.PutUint16(b[4:], flags)
	binary.LittleEndian.PutUint16(b[6:], uint16(len(msg)))
	n := copy(b[ReplySize:], msg)
	return b[:ReplySize+n]
}

// DecodeReply parses a reply's fixed part and returns the message length.
func DecodeReply(b *[ReplySize]byte) (code transport.Code, flags uint16, msglen int, err error) {
	code = transport.Code(binary.LittleEndian.Uint32(b[0:]))
	flags = binary.LittleEndian.Uint16(b[4:])
	msglen = int(binary.LittleEndian.Uint16(b[6:]))
	if msglen > MaxMessage {
		return 0, 0, 0, fmt.Errorf("reply message of %d bytes exceeds the %d-byte limit", msglen, MaxMessage)
	}
	if code == transport.OK && msglen != 0 {
		return 0, 0, 0, fmt.Errorf("ok reply carries a %d-byte message", msglen)
	}
	return code, flags, msglen, nil
}

// Refusal turns a Sink's error into the code and message of a reply that
// is never OK.
func Refusal(err error) (transport.Code, string) {
	var rf *transport.Refusal
	if errors.As(err, &rf) && rf.Code != transport.OK {
		return rf.Code, rf.Message
	}
	return transport.Internal, err.Error()
}

func (h *hello) check() (status uint32, err error) {
	if string(h.magic[:]) != magic {
		return statusBadMagic, fmt.Errorf("not a ferry peer: bad magic %q", h.magic[:])
	}
	if h.version != version {
		return statusBadVersion, fmt.Errorf("protocol version mismatch: the peer speaks version %d, this daemon speaks version %d: upgrade the older daemon so both run the same ferry release", h.version, version)
	}
	if h.kind > KindRDMARead {
		return statusBadKind, fmt.Errorf("peer asks for connection kind %d, which this daemon does not know", h.kind)
	}
	return statusOK, nil
}

// verdict is the server's last word in an authenticated handshake.
type verdict struct {
	status uint32
	proof  [proofSize]byte
}

func (v *verdict) encode(b *[verdictSize]byte) {
	binary.LittleEndian.PutUint32(b[0:], v.status)
	copy(b[4:], v.proof[:])
}

func (v *verdict) decode(b *[verdictSize]byte) {
	v.status = binary.LittleEndian.Uint32(b[0:])
	copy(v.proof[:], b[4:])
}
