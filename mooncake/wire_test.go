package mooncake

import (
	"bytes"
	"encoding/hex"
	"errors"
	"io"
	"strings"
	"testing"
)

// The byte layouts below are written out from the protocol notes, not
// produced by the encoders they check.

func TestFrameBytes(t *testing.T) {
	got := AppendFrame(nil, Probe, []byte("{}\n"))
	want, _ := hex.DecodeString("0400000000000000" + "03" + "7b7d0a")
	if !bytes.Equal(got, want) {
		t.Fatalf("probe frame\n got %x\nwant %x", got, want)
	}
	typ, body, err := ReadFrame(bytes.NewReader(want))
	if err != nil || typ != Probe || string(body) != "{}\n" {
		t.Fatalf("ReadFrame = %v %q %v", typ, body, err)
	}
}

func TestFrameErrorsNameTheProblem(t *testing.T) {
	le := func(n uint64) string {
		var b [8]byte
		for i := range b {
			b[i] = byte(n >> (8 * i))
		}
		return string(b[:])
	}
	for _, c := range []struct {
		name, in, want string
	}{
		{"zero length", le(0) + "\x01{}", "length word is 0"},
		{"oversize", le(MaxMessage+1) + "\x01{", "exceeds the 1048576-byte limit"},
		{"oversize metadata", le(MaxMessage) + "\x01{", "announces 1048576 bytes of metadata message"},
		{"oversize probe", le(MaxMessage) + "\x03{", "announces 1048576 bytes of probe message"},
		{"oversize connection", le(MaxSmallMessage+1) + "\x00{", "connection message of 16385 bytes exceeds the 16384 bytes a connection message may have"},
		{"oversize notify", le(MaxSmallMessage+1) + "\x02{", "notify message of 16385 bytes exceeds the 16384 bytes a notify message may have"},
		{"unknown type", le(3) + "\x07{}", "unknown message type 7"},
		{"untyped", le(2) + "{}", "untyped message"},
		{"short length word", "\x05\x00\x00", "ended after 3 of the 8 bytes of the length word"},
		{"short body", le(100) + "\x01{\"name\"", "announces 100 bytes of metadata message but the connection ended after 8"},
		{"no type byte", le(5), "ended before the type byte"},
	} {
		_, _, err := ReadFrame(strings.NewReader(c.in))
		if !errors.Is(err, ErrFrame) || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%s: got %v, want a frame error containing %q", c.name, err, c.want)
		}
	}
	if _, _, err := ReadFrame(strings.NewReader("")); err != io.EOF {
		t.Errorf("empty stream: got %v, want io.EOF", err)
	}
	for _, typ := range []MsgType{Connect, Metadata, Notify, Probe} {
		if err := WriteFrame(io.Discard, typ, make([]byte, maxLength(typ)-1)); err != nil {
			t.Errorf("WriteFrame refused a %s message at its limit: %v", typ, err)
		}
		if err := WriteFrame(io.Discard, typ, make([]byte, maxLength(typ))); err == nil || !strings.Contains(err.Error(), "exceeds the") {
			t.Errorf("WriteFrame sent a %s message over its limit: %v", typ, err)
		}
	}
}

// trickle is a connection that sends a message's first bytes a few at a
// time and then ends; most is the largest buffer a Read was given.
type trickle struct {
	data []byte
	most int
}

func (r *trickle) Read(p []byte) (int, error) {
	r.most = max(r.most, len(p))
	if len(r.data) == 0 {
		return 0, io.EOF
	}
	n := copy(p[:min(len(p), 1000)], r.data)
	r.data = r.data[n:]
	return n, nil
}

// TestFrameBufferGrowsAsBytesArrive: a length word announcing the most a
// message may have costs no buffer of that size until its bytes come
// (strangers announcing 1 MiB on every connection and sending nothing
// held 1 MiB each), and a message that does come whole gets a buffer no
// larger than it.
func TestFrameBufferGrowsAsBytesArrive(t *testing.T) {
	r := &trickle{data: AppendFrame(nil, Metadata, bytes.Repeat([]byte{' '}, MaxMessage-1))[:frameHeader+1+100]}
	if _, _, err := ReadFrame(r); !errors.Is(err, ErrFrame) || !strings.Contains(err.Error(), "ended after 101") {
		t.Fatalf("a message cut short: %v", err)
	}
	if r.most > firstRead {
		t.Fatalf("reading 100 bytes of an announced %d took a %d-byte buffer, want at most %d", MaxMessage, r.most, firstRead)
	}
	body := bytes.Repeat([]byte("0123456789"), 30_000)
	r = &trickle{data: AppendFrame(nil, Metadata, body)}
	typ, got, err := ReadFrame(r)
	if err != nil || typ != Metadata || !bytes.Equal(got, body) {
		t.Fatalf("a %d-byte message in pieces: %v %v, its bytes equal: %v", len(body), typ, err, bytes.Equal(got, body))
	}
	if cap(got) > len(body) {
		t.Fatalf("a %d-byte message took a %d-byte buffer", len(body), cap(got))
	}
}

func TestHeaderBytes(t *testing.T) {
	want, _ := hex.DecodeString(
		"0000100000000000" + // size 1 MiB
			"00105a3c667f0000" + // addr 0x7f663c5a1000
			"81" + "00000000000000") // WRITE | v2, padding
	h := Header{Size: 1 << 20, Addr: 0x7f663c5a1000, Op: OpWrite, V2: true}
	var b [HeaderSize]byte
	h.Encode(&b)
	if !bytes.Equal(b[:], want) {
		t.Fatalf("header\n got %x\nwant %x", b, want)
	}
	got, err := DecodeHeader(&b)
	if err != nil || got != h {
		t.Fatalf("DecodeHeader = %+v, %v", got, err)
	}
	b[16] = 0x00 // READ, v1
	if got, err := DecodeHeader(&b); err != nil || got.Op != OpRead || got.V2 {
		t.Fatalf("v1 READ decoded as %+v, %v", got, err)
	}
	b[16] = 0x82
	if _, err := DecodeHeader(&b); err == nil || !strings.Contains(err.Error(), "opcode byte 0x82") {
		t.Fatalf("opcode 0x82: %v", err)
	}
}

func TestStatusBytes(t *testing.T) {
	ok, _ := hex.DecodeString("00000000" + "5654434d")
	rej, _ := hex.DecodeString("01000000" + "5654434d")
	if b := EncodeStatus(StatusOK); !bytes.Equal(b[:], ok) {
		t.Fatalf("OK status %x, want %x", b, ok)
	}
	if b := EncodeStatus(StatusRejected); !bytes.Equal(b[:], rej) {
		t.Fatalf("rejected status %x, want %x", b, rej)
	}
	if st, err := DecodeStatus([8]byte(rej)); err != nil || st != StatusRejected {
		t.Fatalf("DecodeStatus(rejected) = %v, %v", st, err)
	}
	if _, err := DecodeStatus([8]byte{1, 0, 0, 0, 0, 0, 0, 0}); err == nil || !strings.Contains(err.Error(), "MCTV") {
		t.Fatalf("a status without the magic: %v", err)
	}
}

// The descriptor from the protocol notes, addr as a uint64 beyond 2^53.
func TestDecodeSegment(t *testing.T) {
	s, err := DecodeSegment([]byte(`{"name":"127.0.0.1:15302","protocol":"tcp","tcp_data_port":15089,
		"tcp_proto_version":2,"timestamp":"2026-08-22 10:00:00.000001","buffers":[{"name":"127.0.0.1:15302",
		"addr":18446603336221196288,"length":1073741824}]}`))
	if err != nil {
		t.Fatal(err)
	}
	if s.TCPDataPort != 15089 || s.TCPProtoVersion != 2 || len(s.Buffers) != 1 || s.Buffers[0].Addr != 18446603336221196288 {
		t.Fatalf("decoded %+v", s)
	}
	if got := s.DataAddr("127.0.0.1:15302"); got != "127.0.0.1:15089" {
		t.Fatalf("DataAddr = %s", got)
	}
	// A name naming another host does not send the data connection there.
	s.Name = "192.0.2.7:15302"
	if got := s.DataAddr("127.0.0.1:15302"); got != "127.0.0.1:15089" {
		t.Fatalf("DataAddr of a segment named %s fetched from 127.0.0.1:15302 = %s, want the host it was fetched from", s.Name, got)
	}
	if _, ok := s.Buffer(18446603336221196288+1<<30-8, 8); !ok {
		t.Fatal("the buffer's last 8 bytes are not in it")
	}
	if _, ok := s.Buffer(18446603336221196288+1<<30-8, 9); ok {
		t.Fatal("a range past the buffer's end is in it")
	}
	// RDMA fields, as an RDMA segment carries them.
	r, err := DecodeSegment([]byte(`{"name":"10.0.0.5:15302","protocol":"rdma","devices":[{"name":"mlx5_0","lid":0,"gid":"00:00:00:00:00:00:00:00:00:00:ff:ff:0a:00:00:05"}],
		"buffers":[{"name":"cpu:0","addr":4096,"length":8192,"rkey":[1234],"lkey":[5678]}],"priority_matrix":{"cpu:0":[["mlx5_0"],[]]}}`))
	if err != nil {
		t.Fatal(err)
	}
	if r.Devices[0].Name != "mlx5_0" || r.Buffers[0].RKey[0] != 1234 || r.PriorityMatrix["cpu:0"][0][0] != "mlx5_0" {
		t.Fatalf("RDMA fields: %+v", r)
	}
	for _, bad := range []string{`{"protocol":"tcp"}`, `{"name":"a:1","protocol":"tcp","tcp_data_port":0}`, `[1]`,
		`{"name":"a:1","protocol":"tcp","tcp_data_port":1,"Tcp_Data_Port":2}`,
		`{"name":"a:1","protocol":"tcp","tcp_data_port":1,"buffers":[{"addr":18446744073709551615,"length":2}]}`} {
		if _, err := DecodeSegment([]byte(bad)); err == nil {
			t.Errorf("DecodeSegment(%s) succeeded", bad)
		}
	}
}
