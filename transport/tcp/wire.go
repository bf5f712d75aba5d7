package tcp

// Wire protocol, version 1. Every integer is little-endian; every record
// has a fixed size except the message that may follow a reply.
//
// Handshake, once when a connection opens:
//
//	client → server  hello, 16 bytes
//	  0  magic     [4]byte "FERY"
//	  4  version   u32     the client's protocol version
//	  8  instance  u64     the client daemon's process identity
//
//	server → client  welcome, 20 bytes
//	  0  magic     [4]byte "FERY"
//	  4  version   u32     the server's protocol version
//	  8  instance  u64     the server daemon's process identity
//	 16  status    u32     0 ok, 1 version mismatch, 2 bad magic
//
// A server answers a bad hello with a non-zero status and closes the
// connection, so the client can name the reason.
//
// Then any number of writes, one at a time per connection:
//
//	client → server  header, 24 bytes, then len bytes of body
//	  0  addr      u64     destination address in the server's arena
//	  8  len       u64     body length
//	 16  key       u32     the receive slot's key
//	 20  tag       u32     delivered with the completion
//
//	server → client  reply, 8 bytes, then msglen bytes of message
//	  0  code      u32     transport.Code; 0 (OK) once every byte is placed
//	  4  flags     u16     bit 0: the server closes the connection after
//	                       this reply (the client must not reuse it)
//	  6  msglen    u16     at most maxMessage; 0 for OK
//
// A server refuses a write either before reading its body (and then reads
// and discards the body so the stream stays in step) or, when len exceeds
// its limit, for good: it replies with the close flag and closes the
// connection without reading the body.

import (
	"encoding/binary"
	"fmt"

	"github.com/ferry-project/ferry/transport"
)

const (
	magic   = "FERY"
	version = 1

	helloSize   = 16
	welcomeSize = 20
	headerSize  = 24
	replySize   = 8

	// maxMessage bounds a refusal message, on both sides.
	maxMessage = 1024
)

// Handshake statuses.
const (
	statusOK         = 0
	statusBadVersion = 1
	statusBadMagic   = 2
)

const flagClose = 1

type hello struct {
	magic    [4]byte
	version  uint32
	instance uint64
}

// ours is the hello this daemon sends, and the start of its welcome.
func ours(instance uint64) hello {
	return hello{magic: [4]byte{magic[0], magic[1], magic[2], magic[3]}, version: version, instance: instance}
}

func (h *hello) encode(b *[helloSize]byte) {
	copy(b[0:4], h.magic[:])
	binary.LittleEndian.PutUint32(b[4:], h.version)
	binary.LittleEndian.PutUint64(b[8:], h.instance)
}

func (h *hello) decode(b *[helloSize]byte) {
	copy(h.magic[:], b[0:4])
	h.version = binary.LittleEndian.Uint32(b[4:])
	h.instance = binary.LittleEndian.Uint64(b[8:])
}

type welcome struct {
	hello
	status uint32
}

func (w *welcome) encode(b *[welcomeSize]byte) {
	w.hello.encode((*[helloSize]byte)(b[:helloSize]))
	binary.LittleEndian.PutUint32(b[16:], w.status)
}

func (w *welcome) decode(b *[welcomeSize]byte) {
	w.hello.decode((*[helloSize]byte)(b[:helloSize]))
	w.status = binary.LittleEndian.Uint32(b[16:])
}

type header struct {
	addr, len uint64
	key, tag  uint32
}

func (h *header) encode(b *[headerSize]byte) {
	binary.LittleEndian.PutUint64(b[0:], h.addr)
	binary.LittleEndian.PutUint64(b[8:], h.len)
	binary.LittleEndian.PutUint32(b[16:], h.key)
	binary.LittleEndian.PutUint32(b[20:], h.tag)
}

func (h *header) decode(b *[headerSize]byte) {
	h.addr = binary.LittleEndian.Uint64(b[0:])
	h.len = binary.LittleEndian.Uint64(b[8:])
	h.key = binary.LittleEndian.Uint32(b[16:])
	h.tag = binary.LittleEndian.Uint32(b[20:])
}

// encodeReply writes a reply and its message into b and returns the bytes
// to send. A message longer than maxMessage is cut.
func encodeReply(b *[replySize + maxMessage]byte, code transport.Code, flags uint16, msg string) []byte {
	if len(msg) > maxMessage {
		msg = msg[:maxMessage]
	}
	binary.LittleEndian.PutUint32(b[0:], uint32(code))
	binary.LittleEndian.PutUint16(b[4:], flags)
	binary.LittleEndian.PutUint16(b[6:], uint16(len(msg)))
	n := copy(b[replySize:], msg)
	return b[:replySize+n]
}

// decodeReply parses a reply header and returns the message length.
func decodeReply(b *[replySize]byte) (code transport.Code, flags uint16, msglen int, err error) {
	code = transport.Code(binary.LittleEndian.Uint32(b[0:]))
	flags = binary.LittleEndian.Uint16(b[4:])
	msglen = int(binary.LittleEndian.Uint16(b[6:]))
	if msglen > maxMessage {
		return 0, 0, 0, fmt.Errorf("reply message of %d bytes exceeds the %d-byte limit", msglen, maxMessage)
	}
	if code == transport.OK && msglen != 0 {
		return 0, 0, 0, fmt.Errorf("ok reply carries a %d-byte message", msglen)
	}
	return code, flags, msglen, nil
}

func (h *hello) check() (status uint32, err error) {
	if string(h.magic[:]) != magic {
		return statusBadMagic, fmt.Errorf("not a ferry peer: bad magic %q", h.magic[:])
	}
	if h.version != version {
		return statusBadVersion, fmt.Errorf("protocol version mismatch: peer speaks version %d, this daemon speaks version %d", h.version, version)
	}
	return statusOK, nil
}
