// Package mooncake speaks the wire protocol of Mooncake's Transfer Engine
// (kvcache-ai/Mooncake), so ferryd can write into Mooncake segments and
// serve as one: the handshake on the RPC port (framing, segment
// descriptor, metadata/probe/notify), the TCP transport's data plane
// (header, v2 status word), and the RDMA transport's endpoints (their
// QP setup and table, over queue pairs package rdma makes: Verbs). It is
// written from the facts in the protocol notes, not from Mooncake's code.
//
// Handshake framing, one request and one reply per connection:
//
//	u64 length   little-endian; counts the type byte plus the JSON
//	u8  type     0 connection (RDMA QP setup), 1 metadata, 2 notify, 3 probe
//	JSON text    length-1 bytes
//
// A message is at most MaxMessage bytes, as Mooncake's
// MC_HANDSHAKE_MAX_LENGTH default, and a connection handshake or a
// notify at most MaxSmallMessage; a longer one is refused unread.
package mooncake

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io"
)

// MsgType is a handshake message's type byte.
type MsgType uint8

const (
	Connect  MsgType = 0 // RDMA QP setup (HandshakeDesc)
	Metadata MsgType = 1 // segment descriptor exchange (Segment)
	Notify   MsgType = 2 // a notify message (NotifyDesc)
	Probe    MsgType = 3 // liveness probe ({"status":"success"} back)
)

func (t MsgType) String() string {
	switch t {
	case Connect:
		return "connection"
	case Metadata:
		return "metadata"
	case Notify:
		return "notify"
	case Probe:
		return "probe"
	}
	return fmt.Sprintf("type %d", uint8(t))
}

// MaxMessage bounds a handshake message: type byte plus JSON.
const MaxMessage = 1 << 20

// MaxSmallMessage bounds a connection handshake (two NIC paths, a GID, at
// most MaxQPs QP numbers: well under 1 KiB from Mooncake) and a notify (a
// segment name and a message, for ferry a slot's address), requests and
// replies alike. Only segment descriptors (metadata, and the probe, whose
// body Mooncake leaves to the client) need MaxMessage.
const MaxSmallMessage = 16 << 10

// maxLength is the longest message of type t, type byte included.
func maxLength(t MsgType) int {
	if t == Connect || t == Notify {
		return MaxSmallMessage
	}
	return MaxMessage
}

// firstRead is the most a message's buffer holds before its bytes
// arrive; it grows as they do.
const firstRead = 4 << 10

// frameHeader is the length word before every message.
const frameHeader = 8

// ErrFrame marks a malformed handshake message (as opposed to a network
// failure), so a server can say the peer sent garbage.
var ErrFrame = errors.New("malformed Mooncake handshake")

func frameErr(format string, args ...any) error {
	return fmt.Errorf("%w: %s", ErrFrame, fmt.Sprintf(format, args...))
}

// AppendFrame appends one framed message to dst.
func AppendFrame(dst []byte, t MsgType, body []byte) []byte {
	dst = binary.LittleEndian.AppendUint64(dst, uint64(len(body))+1)
	dst = append(dst, byte(t))
	return append(dst, body...)
}

// WriteFrame sends one message; a body over its type's limit is not
// sent.
func WriteFrame(w io.Writer, t MsgType, body []byte) error {
	if most := maxLength(t); len(body)+1 > most {
		return errors.New(tooLong(t, uint64(len(body)+1)))
	}
	_, err := w.Write(AppendFrame(make([]byte, 0, frameHeader+1+len(body)), t, body))
	return err
}

// ReadFrame reads one message. It checks the length word before reading
// anything it announces, and the type byte and the length its type allows
// before the JSON, which it takes into a buffer that grows only as bytes
// arrive: a length announced and never sent costs nothing. A connection
// closed before the first byte returns io.EOF itself.
func ReadFrame(r io.Reader) (MsgType, []byte, error) {
	return readFrame(r, nil)
}

// readFrame is ReadFrame; reserve, if not nil, is told the body's length
// once the type byte has passed the checks and before the body is read,
// and may refuse it (its error is readFrame's).
func readFrame(r io.Reader, reserve func(n int) error) (MsgType, []byte, error) {
	var hdr [frameHeader + 1]byte
	if n, err := io.ReadFull(r, hdr[:frameHeader]); err != nil {
		if n == 0 && err == io.EOF {
			return 0, nil, io.EOF
		}
		if err == io.ErrUnexpectedEOF {
			return 0, nil, frameErr("the connection ended after %d of the %d bytes of the length word", n, frameHeader)
		}
		return 0, nil, fmt.Errorf("reading the handshake length: %w", err)
	}
	length := binary.LittleEndian.Uint64(hdr[:frameHeader])
	if err := checkLength(length); err != nil {
		return 0, nil, err
	}
	if _, err := io.ReadFull(r, hdr[frameHeader:]); err != nil {
		if err == io.EOF {
			return 0, nil, frameErr("length word announces %d bytes but the connection ended before the type byte", length)
		}
		return 0, nil, fmt.Errorf("reading the handshake type: %w", err)
	}
	t, err := checkType(hdr[frameHeader])
	if err != nil {
		return 0, nil, err
	}
	if most := maxLength(t); length > uint64(most) {
		return t, nil, frameErr("%s (a connection handshake or a notify is small; only segment descriptors take up to %d)", tooLong(t, length), MaxMessage)
	}
	if reserve != nil {
		if err := reserve(int(length - 1)); err != nil {
			return t, nil, err
		}
	}
	body, err := readBody(r, int(length-1))
	if err != nil {
		if err == io.EOF || err == io.ErrUnexpectedEOF {
			return t, nil, frameErr("length word announces %d bytes of %s message but the connection ended after %d", length, t, len(body)+1)
		}
		return t, nil, fmt.Errorf("reading the %s message: %w", t, err)
	}
	return t, body, nil
}

// readBody reads n bytes into a buffer of at most firstRead bytes at
// first, doubled (never past n) each time the bytes fill it. On an error
// it returns what arrived.
func readBody(r io.Reader, n int) ([]byte, error) {
	body := make([]byte, 0, min(n, firstRead))
	for len(body) < n {
		if len(body) == cap(body) {
			body = append(make([]byte, 0, min(2*cap(body), n)), body...)
		}
		m, err := r.Read(body[len(body):cap(body)])
		body = body[:len(body)+m]
		if err != nil && len(body) < n {
			return body, err
		}
	}
	return body, nil
}

// tooLong says that a message of type t is length bytes, past its limit.
func tooLong(t MsgType, length uint64) string {
	return fmt.Sprintf("%s message of %d bytes exceeds the %d bytes a %s message may have", t, length, maxLength(t), t)
}

func checkLength(length uint64) error {
	switch {
	case length == 0:
		return frameErr("length word is 0: it must count the type byte and the JSON after it")
	case length > MaxMessage:
		return frameErr("message of %d bytes exceeds the %d-byte limit (Mooncake's MC_HANDSHAKE_MAX_LENGTH)", length, MaxMessage)
	}
	return nil
}

func checkType(b byte) (MsgType, error) {
	switch {
	case b <= byte(Probe):
		return MsgType(b), nil
	case b == '{':
		return 0, frameErr("untyped message (JSON right after the length word: the format of Mooncake releases before typed handshakes), which ferry does not speak: upgrade the peer")
	}
	return 0, frameErr("unknown message type %d: want 0 (connection), 1 (metadata), 2 (notify) or 3 (probe)", b)
}
