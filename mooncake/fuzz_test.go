package mooncake

import (
	"bytes"
	"encoding/json"
	"testing"
)

// FuzzReadFrame feeds arbitrary bytes to the handshake decoder and, for a
// frame it accepts, the JSON decoder of its type: neither may panic or
// accept what it cannot encode back.
func FuzzReadFrame(f *testing.F) {
	f.Add(AppendFrame(nil, Probe, []byte("{}\n")))
	f.Add(AppendFrame(nil, Metadata, []byte(`{"name":"127.0.0.1:15302","protocol":"tcp","tcp_data_port":15089,"tcp_proto_version":2,"buffers":[{"name":"b","addr":140366175010816,"length":1073741824}]}`)))
	f.Add(AppendFrame(nil, Metadata, []byte(`{"name":"10.0.0.5:15302","protocol":"rdma","devices":[{"name":"rxe0","lid":0,"gid":"00:00:00:00:00:00:00:00:00:00:ff:ff:0a:0b:0c:01"}],"buffers":[{"name":"cpu:0","addr":140366175010816,"length":4096,"rkey":[7],"lkey":[8]}],"priority_matrix":{"cpu:0":[["rxe0"],[]]}}`)))
	f.Add(AppendFrame(nil, Notify, []byte(`{"name":"x","notify_msg":"done"}`)))
	f.Add(AppendFrame(nil, Connect, []byte(`{"local_nic_path":"a:1@mlx5_0","peer_nic_path":"b:2@mlx5_0","local_lid":0,"local_gid":"fe80::1","qp_num":[1,2],"reply_msg":""}`)))
	f.Add([]byte{0, 0, 0, 0, 0, 0, 0, 0})
	f.Add([]byte{2, 0, 0, 0, 0, 0, 0, 0, '{', '}'})
	f.Fuzz(func(t *testing.T, in []byte) {
		typ, body, err := ReadFrame(bytes.NewReader(in))
		if err != nil {
			return
		}
		if typ > Probe || len(body)+1 > maxLength(typ) {
			t.Fatalf("accepted a %s frame of %d bytes", typ, len(body)+1)
		}
		if !bytes.Equal(AppendFrame(nil, typ, body), in[:frameHeader+1+len(body)]) {
			t.Fatal("the frame does not encode back to its bytes")
		}
		switch typ {
		case Metadata:
			if s, err := DecodeSegment(body); err == nil {
				out, _ := json.Marshal(s)
				if _, err := DecodeSegment(out); err != nil {
					t.Fatalf("a decoded segment does not decode again: %v", err)
				}
			}
		case Connect:
			var d HandshakeDesc
			_ = json.Unmarshal(body, &d)
		case Notify:
			var n NotifyDesc
			_ = json.Unmarshal(body, &n)
		}
	})
}

// FuzzDecodeHeader checks the data-plane header and status decoders.
func FuzzDecodeHeader(f *testing.F) {
	var b [HeaderSize]byte
	(&Header{Size: 1 << 20, Addr: 0x7f663c5a1000, Op: OpWrite, V2: true}).Encode(&b)
	f.Add(b[:])
	(&Header{Size: 64, Addr: 4096, Op: OpRead}).Encode(&b)
	f.Add(b[:])
	ok := EncodeStatus(StatusOK)
	f.Add(append(b[:], ok[:]...))
	f.Add(make([]byte, HeaderSize+StatusSize))
	f.Fuzz(func(t *testing.T, in []byte) {
		if len(in) < HeaderSize {
			return
		}
		h, err := DecodeHeader((*[HeaderSize]byte)(in))
		if err == nil {
			var out [HeaderSize]byte
			h.Encode(&out)
			if !bytes.Equal(out[:17], in[:17]) {
				t.Fatalf("header %x decodes to %+v, which encodes to %x", in[:HeaderSize], h, out)
			}
			if h.Addr+h.Size < h.Addr {
				t.Fatalf("accepted a wrapping range %+v", h)
			}
		}
		if len(in) >= HeaderSize+StatusSize {
			st, err := DecodeStatus([StatusSize]byte(in[HeaderSize:]))
			if err == nil && EncodeStatus(st) != [StatusSize]byte(in[HeaderSize:]) {
				t.Fatalf("status %x decodes to %v, which encodes differently", in[HeaderSize:], st)
			}
		}
	})
}
