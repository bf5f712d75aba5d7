package mooncake

import (
	"context"
	"encoding/json"
	"errors"
	"net"
	"strings"
	"testing"
	"time"
)

// An rdma descriptor as Mooncake's encodeSegmentDesc writes one (keys
// from the protocol notes), with a 64-bit address beyond float64's exact
// range.
const rdmaDescriptor = `{"name":"10.0.0.5:15302","protocol":"rdma","tcp_data_port":0,"timestamp":"2026-08-22 10:00:00.000000",
 "devices":[{"name":"mlx5_0","lid":0,"gid":"00:00:00:00:00:00:00:00:00:00:ff:ff:0a:00:00:05"},
            {"name":"mlx5_1","lid":7,"gid":"fe:80:00:00:00:00:00:00:0a:0b:0c:0d:0e:0f:10:11"}],
 "buffers":[{"name":"cpu:0","addr":18446744073709486080,"length":4096,"rkey":[1111,2222],"lkey":[3333,4444]},
            {"name":"*","addr":4096,"length":4096,"rkey":[5,6],"lkey":[7,8]}],
 "priority_matrix":{"cpu:0":[["mlx5_1"],["mlx5_0"]]}}`

func TestRDMADescriptorAndTarget(t *testing.T) {
	s, err := DecodeSegment([]byte(rdmaDescriptor))
	if err != nil {
		t.Fatal(err)
	}
	if s.Buffers[0].Addr != 18446744073709486080 || s.Buffers[0].RKey[1] != 2222 {
		t.Fatalf("buffer 0 decoded as %+v", s.Buffers[0])
	}
	tg, ok, err := s.RDMATarget(18446744073709486080+100, 200)
	if !ok || err != nil {
		t.Fatalf("target in buffer 0: %v %v", ok, err)
	}
	// The preferred device of cpu:0 is mlx5_1, devices[1]: rkey[1].
	if tg.DevIndex != 1 || tg.RKey != 2222 || tg.NICPath != "10.0.0.5:15302@mlx5_1" || tg.Device.LID != 7 {
		t.Fatalf("target %+v, want mlx5_1 (index 1, rkey 2222)", tg)
	}
	// "*" is every device, in descriptor order.
	if tg, ok, err := s.RDMATarget(4096, 4096); !ok || err != nil || tg.DevIndex != 0 || tg.RKey != 5 {
		t.Fatalf("target in the wildcard buffer: %+v %v %v", tg, ok, err)
	}
	if _, ok, _ := s.RDMATarget(4096, 4097); ok {
		t.Fatal("a range past the buffer found one")
	}
	s.PriorityMatrix = Priority{"cpu:1": {{"mlx5_0"}, {}}}
	if _, ok, err := s.RDMATarget(18446744073709486080, 1); !ok || err == nil || !strings.Contains(err.Error(), "priority_matrix") {
		t.Fatalf("a buffer whose location the matrix lacks: %v %v", ok, err)
	}
}

func TestRDMADescriptorChecks(t *testing.T) {
	for _, c := range []struct{ from, to, want string }{
		{`"gid":"00:00:00:00:00:00:00:00:00:00:ff:ff:0a:00:00:05"`, `"gid":""`, "no gid"},
		{`"gid":"00:00:00:00:00:00:00:00:00:00:ff:ff:0a:00:00:05"`, `"gid":"::ffff:10.0.0.5"`, "GID"},
		{`"rkey":[1111,2222]`, `"rkey":[1111]`, "1 rkeys, 2 lkeys"},
		{`"addr":4096`, `"addr":0`, "lacks"},
	} {
		_, err := DecodeSegment([]byte(strings.Replace(rdmaDescriptor, c.from, c.to, 1)))
		if err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%s → %s: %v, want an error saying %q", c.from, c.to, err, c.want)
		}
	}
}

// The connection handshake's JSON, keys as Mooncake's
// TransferHandshakeUtil names them; no protocol key (Mooncake routes an
// empty one to its RDMA handler).
func TestHandshakeJSON(t *testing.T) {
	b, err := json.Marshal(HandshakeDesc{LocalNICPath: "a:1@rxe0", PeerNICPath: "b:2@rxe0", QPNum: []uint32{17, 18}, LocalGID: "00:00:00:00:00:00:00:00:00:00:ff:ff:0a:0b:0c:01"})
	if err != nil {
		t.Fatal(err)
	}
	want := `{"local_nic_path":"a:1@rxe0","peer_nic_path":"b:2@rxe0","local_lid":0,"local_gid":"00:00:00:00:00:00:00:00:00:00:ff:ff:0a:0b:0c:01","qp_num":[17,18],"reply_msg":""}`
	if string(b) != want {
		t.Fatalf("\n got %s\nwant %s", b, want)
	}
	// An old Mooncake's four keys decode, the rest zero.
	var d HandshakeDesc
	if err := json.Unmarshal([]byte(`{"local_nic_path":"x@d","peer_nic_path":"y@d","qp_num":[1,2],"reply_msg":""}`), &d); err != nil || d.LocalGID != "" || len(d.QPNum) != 2 {
		t.Fatalf("old four-key handshake: %+v %v", d, err)
	}
}

// ConnectQPs against a handshake server: a good reply, each way a reply
// is a refusal, and the null Mooncake sends when its setup fails.
func TestConnectQPsReplies(t *testing.T) {
	req := HandshakeDesc{LocalNICPath: "me:1@rxe0", PeerNICPath: "you:2@rxe0", QPNum: []uint32{5, 6}}
	good := HandshakeDesc{LocalNICPath: req.PeerNICPath, PeerNICPath: req.LocalNICPath, QPNum: []uint32{7, 8}}
	for _, c := range []struct {
		name  string
		reply func(HandshakeDesc) HandshakeDesc
		want  string
	}{
		{"good", func(HandshakeDesc) HandshakeDesc { return good }, ""},
		{"reply_msg", func(HandshakeDesc) HandshakeDesc { r := good; r.ReplyMsg = "no such device"; return r }, "refused it: no such device"},
		{"paths", func(HandshakeDesc) HandshakeDesc { r := good; r.LocalNICPath = "other@rxe0"; return r }, "not the paths asked for"},
		{"qp count", func(HandshakeDesc) HandshakeDesc { r := good; r.QPNum = []uint32{7}; return r }, "MC_NUM_QP_PER_EP"},
	} {
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		srv := Serve(ln, Handlers{Segment: func() *Segment { return &Segment{} }, Connect: func(_ context.Context, _ net.Addr, d HandshakeDesc) (HandshakeDesc, func()) {
			return c.reply(d), nil
		}}, ServerConfig{})
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		r, err := ConnectQPs(ctx, ln.Addr().String(), req)
		cancel()
		srv.Close()
		switch {
		case c.want == "" && (err != nil || len(r.QPNum) != 2 || r.QPNum[1] != 8):
			t.Errorf("%s: %+v %v", c.name, r, err)
		case c.want != "" && (err == nil || !strings.Contains(err.Error(), c.want)):
			t.Errorf("%s: %v, want an error saying %q", c.name, err, c.want)
		}
	}

	// null: a raw server answering as Mooncake's does on a failed setup.
	addr := answerOnce(t, Connect, []byte("null\n"))
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if _, err := ConnectQPs(ctx, addr, req); err == nil || !strings.Contains(err.Error(), "null reply") {
		t.Fatalf("a null reply: %v", err)
	}
}

// A multi-protocol build's descriptor lists its protocols in an array.
func TestMultiProtocolDescriptor(t *testing.T) {
	multi := strings.Replace(rdmaDescriptor, `"protocol":"rdma"`, `"protocol":["tcp","rdma"]`, 1)
	s, err := DecodeSegment([]byte(multi))
	if err != nil {
		t.Fatal(err)
	}
	if s.Protocol != "rdma" || !s.Offers("tcp") || len(s.Devices) != 2 {
		t.Fatalf("decoded %q offering %v with %d devices, want rdma chosen and tcp offered", s.Protocol, s.Offered, len(s.Devices))
	}
	for _, bad := range []string{`"protocol":[1]`, `"protocol":{}`} {
		if _, err := DecodeSegment([]byte(strings.Replace(rdmaDescriptor, `"protocol":"rdma"`, bad, 1))); err == nil {
			t.Errorf("%s accepted", bad)
		}
	}
	if s, err := DecodeSegment([]byte(`{"name":"a:1","protocol":"tcp","tcp_data_port":9,"buffers":[]}`)); err != nil || s.Protocol != "tcp" || s.Offers("rdma") {
		t.Fatalf("a plain tcp descriptor: %+v %v", s, err)
	}
}

// A connection handler runs within the connection's deadline and the
// server's life: Close ends its context, and a reply that can no longer
// be sent runs its undo.
func TestConnectContextAndUndo(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	started, undone := make(chan context.Context, 1), make(chan struct{})
	srv := Serve(ln, Handlers{Segment: func() *Segment { return &Segment{} },
		Connect: func(ctx context.Context, _ net.Addr, d HandshakeDesc) (HandshakeDesc, func()) {
			started <- ctx
			<-ctx.Done()
			return HandshakeDesc{LocalNICPath: d.PeerNICPath, PeerNICPath: d.LocalNICPath, QPNum: []uint32{7}}, func() { close(undone) }
		}}, ServerConfig{ReceiveTimeout: time.Minute})
	c, err := net.Dial("tcp", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if err := WriteFrame(c, Connect, []byte(`{"local_nic_path":"a:1@d","peer_nic_path":"b:2@d","qp_num":[5]}`)); err != nil {
		t.Fatal(err)
	}
	var ctx context.Context
	select {
	case ctx = <-started:
	case <-time.After(10 * time.Second):
		t.Fatal("the handler did not run")
	}
	if dl, ok := ctx.Deadline(); !ok || time.Until(dl) > time.Minute {
		t.Errorf("the handler's context has deadline %v (%v), want the connection's, within a minute", dl, ok)
	}
	srv.Close() // returns once the handler has
	if !errors.Is(ctx.Err(), context.Canceled) {
		t.Errorf("after Close the handler's context says %v, want canceled", ctx.Err())
	}
	select {
	case <-undone:
	default:
		t.Fatal("the reply could not be sent (the connection was closed), and undo did not run")
	}
}

// A multi-protocol segment reached over tcp (no RDMA here) must name a
// data port: without one the error says so, naming the segment.
func TestMultiProtocolWithoutDataPort(t *testing.T) {
	multi := strings.Replace(rdmaDescriptor, `"protocol":"rdma"`, `"protocol":["rdma","tcp"]`, 1)
	addr := answerOnce(t, Metadata, []byte(multi))
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	d := &Dialer{Self: &Segment{Name: "me:1", Buffers: []Buffer{}}}
	_, err := d.Dial(ctx, Scheme+addr)
	for _, want := range []string{"10.0.0.5:15302", "tcp_data_port 0", "1 to 65535"} {
		if err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("dialing a multi-protocol segment without a data port: %v, want an error saying %q", err, want)
		}
	}
}

// answerOnce serves one handshake request on loopback, answering it with
// a raw frame of type t whatever it asked; it returns the address.
func answerOnce(tb testing.TB, t MsgType, body []byte) string {
	tb.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { ln.Close() })
	go func() {
		c, err := ln.Accept()
		if err != nil {
			return
		}
		defer c.Close()
		if _, _, err := ReadFrame(c); err == nil {
			WriteFrame(c, t, body)
		}
	}()
	return ln.Addr().String()
}
