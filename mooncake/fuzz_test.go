package mooncake

import (
	"bytes"
	"context"
	"encoding/json"
	"net"
	"testing"
	"time"
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

// FuzzAccept feeds arbitrary connection handshakes, as the RPC port
// decodes them, to the passive side of an endpoint table: none may
// panic, a refusal leaves no queue pair behind and an acceptance holds
// exactly the QPs it answers with, and closing the table closes every
// one.
func FuzzAccept(f *testing.F) {
	const self = "127.0.0.1:15302"
	mine := NICPath(self, "fake1")
	for _, s := range []string{
		`{"local_nic_path":"10.0.0.9:1@mlx5_0","peer_nic_path":"` + mine + `","local_lid":0,"local_gid":"00:00:00:00:00:00:00:00:00:00:ff:ff:0a:00:00:09","qp_num":[1,2]}`,
		`{"local_nic_path":"10.0.0.9:1@mlx5_0","peer_nic_path":"` + mine + `","local_gid":"fe80::1","qp_num":[1]}`,
		`{"local_nic_path":"10.0.0.9:1@mlx5_0","peer_nic_path":"` + mine + `","qp_num":[1,2]}`,
		`{"local_nic_path":"no-at-sign","peer_nic_path":"` + mine + `","qp_num":[4294967295]}`,
		`{"local_nic_path":"","peer_nic_path":"` + mine + `","local_gid":"00:00:00:00:00:00:00:00:00:00:ff:ff:0a:00:00:09","qp_num":[1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16,17]}`,
		`{"local_nic_path":"x@y","peer_nic_path":"elsewhere@fake1","qp_num":[1]}`,
		`{"local_lid":65535,"local_gid":":::::::::::::::::::","qp_num":[]}`,
	} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, body []byte) {
		var req HandshakeDesc
		if decodeStrict(body, &req) != nil {
			return
		}
		v := newFabric().nic(1)
		eps := NewEndpoints(v, EndpointConfig{})
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		reply, undo := eps.Accept(ctx, Handshake{Self: self, From: &net.TCPAddr{IP: net.IPv4(10, 0, 0, 9), Port: 40000}}, req)
		switch open := v.openQPs(); {
		case reply.ReplyMsg != "" && (undo != nil || open != 0):
			t.Fatalf("refused (%s), yet undo %t and %d QPs open", reply.ReplyMsg, undo != nil, open)
		case reply.ReplyMsg == "" && (undo == nil || open != len(reply.QPNum) || open != len(req.QPNum)):
			t.Fatalf("accepted %d QP numbers with %d QPs open and %d in the reply", len(req.QPNum), open, len(reply.QPNum))
		}
		eps.Close()
		if open := v.openQPs(); open != 0 {
			t.Fatalf("%d QPs open after the table closed", open)
		}
	})
}
