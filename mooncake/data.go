package mooncake

// TCP data plane of Mooncake's TCP transport, on the segment's
// tcp_data_port. Each request is a 24-byte little-endian header:
//
//	 0  size    u64  bytes to move
//	 8  addr    u64  absolute address in the target's memory
//	16  opcode  u8   READ 0, WRITE 1; bit 0x80 set for protocol v2
//	17  pad     7 bytes, zero
//
// v1: a WRITE is the header and size bytes, nothing comes back; a READ is
// answered with size bytes. A rejected request is a silent close.
// v2: a WRITE's bytes are answered with a status word once they are in
// memory; a READ gets the status word first, then the bytes. The status is
// a little-endian u64: high 32 bits "MCTV" (0x4D435456), low 32 bits 0 OK
// or 1 rejected (the address range lies in no registered buffer), after
// which Mooncake's server closes the connection (ferry's keeps it, for a
// connection pool's next request: target.go).

import (
	"encoding/binary"
	"fmt"
)

// HeaderSize and StatusSize are the data plane's fixed records.
const (
	HeaderSize = 24
	StatusSize = 8
)

// Opcode is a data-plane request's operation.
type Opcode uint8

const (
	OpRead  Opcode = 0
	OpWrite Opcode = 1
	v2Bit          = 0x80
)

func (o Opcode) String() string {
	switch o {
	case OpRead:
		return "READ"
	case OpWrite:
		return "WRITE"
	}
	return fmt.Sprintf("opcode %d", uint8(o))
}

// Header is one data-plane request.
type Header struct {
	Size, Addr uint64
	Op         Opcode
	V2         bool // the requester expects status words
}

func (h *Header) Encode(b *[HeaderSize]byte) {
	binary.LittleEndian.PutUint64(b[0:], h.Size)
	binary.LittleEndian.PutUint64(b[8:], h.Addr)
	op := byte(h.Op)
	if h.V2 {
		op |= v2Bit
	}
	b[16] = op
	clear(b[17:])
}

// DecodeHeader parses a header; an opcode other than READ or WRITE (with
// or without the v2 bit) is an error. Padding is not checked, as
// Mooncake does not check it.
func DecodeHeader(b *[HeaderSize]byte) (Header, error) {
	h := Header{
		Size: binary.LittleEndian.Uint64(b[0:]),
		Addr: binary.LittleEndian.Uint64(b[8:]),
		V2:   b[16]&v2Bit != 0,
		Op:   Opcode(b[16] &^ v2Bit),
	}
	if h.Op != OpRead && h.Op != OpWrite {
		return h, fmt.Errorf("data request with opcode byte %#x: want READ (0) or WRITE (1), with bit 0x80 for protocol v2", b[16])
	}
	if h.Addr+h.Size < h.Addr {
		return h, fmt.Errorf("data request of %d bytes at %#x wraps around the address space", h.Size, h.Addr)
	}
	return h, nil
}

// Status is the low half of a v2 status word.
type Status uint32

const (
	StatusOK       Status = 0
	StatusRejected Status = 1
	statusMagic           = 0x4D435456 // "MCTV"
)

func (s Status) String() string {
	switch s {
	case StatusOK:
		return "ok"
	case StatusRejected:
		return "rejected"
	}
	return fmt.Sprintf("status %d", uint32(s))
}

func EncodeStatus(s Status) [StatusSize]byte {
	var b [StatusSize]byte
	binary.LittleEndian.PutUint64(b[:], uint64(statusMagic)<<32|uint64(s))
	return b
}

// DecodeStatus parses a status word; a wrong magic means the peer does
// not speak v2 (or the stream is out of step).
func DecodeStatus(b [StatusSize]byte) (Status, error) {
	w := binary.LittleEndian.Uint64(b[:])
	if w>>32 != statusMagic {
		return 0, fmt.Errorf("status word %#016x lacks the \"MCTV\" magic %#x in its high 32 bits: the peer does not speak TCP protocol v2 or the stream is out of step", w, statusMagic)
	}
	return Status(uint32(w)), nil
}
