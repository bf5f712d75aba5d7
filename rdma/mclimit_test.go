package rdma

import (
	"fmt"
	"net"
	"strings"
	"testing"
	"time"

	"github.com/ferry-project/ferry/mooncake"
)

// TestMooncakeQPsCappedAcrossSegments: every Mooncake endpoint table on
// a transport (ferryd's own segment's, each engine segment's) draws its
// queue pairs from one cap: hostile handshakes spread over two tables,
// each far below its own caps, stop at the transport's, refused with a
// reply_msg naming it and counted; a table closing gives its queue
// pairs back, and the next handshake is taken.
func TestMooncakeQPsCappedAcrossSegments(t *testing.T) {
	const limit = 6
	tr := listenFake(t, newFabric(), Config{Memory: mapT(t, 1<<16), MooncakeQPs: limit})
	segs := []string{"127.0.0.1:1001", "127.0.0.1:1002"}
	tables := make([]*mooncake.Endpoints[*MooncakeQP], len(segs))
	for i := range tables {
		tables[i] = mooncake.NewEndpoints(tr, mooncake.EndpointConfig{})
		defer tables[i].Close()
	}
	dev, _, gid, err := tr.MooncakeNIC()
	if err != nil {
		t.Fatal(err)
	}
	n := 0
	handshake := func(i int) mooncake.HandshakeDesc {
		n++
		req := mooncake.HandshakeDesc{
			LocalNICPath: fmt.Sprintf("10.0.0.9:%d@evil%d", 2000+n, n), PeerNICPath: mooncake.NICPath(segs[i], dev),
			QPNum: []uint32{1, 2}, LocalGID: mooncake.FormatGID(gid),
		}
		r, _ := tables[i].Accept(ctxFor(t, 30*time.Second), mooncake.Handshake{Self: segs[i], From: &net.TCPAddr{IP: net.IPv4(10, 0, 0, 9)}}, req)
		return r
	}
	// Two QPs per handshake, alternating tables: three fit.
	for i := range limit / 2 {
		if r := handshake(i % 2); r.ReplyMsg != "" {
			t.Fatalf("handshake %d, under the cap: refused: %s", i, r.ReplyMsg)
		}
	}
	r := handshake(1)
	if !strings.Contains(r.ReplyMsg, "6 Mooncake queue pairs, the most it keeps across all its Mooncake segments") {
		t.Fatalf("a handshake past the cap: reply_msg %q, want the cap named", r.ReplyMsg)
	}
	st := tr.MooncakeQPStats()
	if st.Open != limit || st.Limit != limit || st.Refused != 1 {
		t.Fatalf("stats %+v: want %d open, the limit %d, 1 refused", st, limit, limit)
	}
	if got := tables[0].Stats().Open + tables[1].Stats().Open; got != limit/2 {
		t.Fatalf("the tables hold %d endpoints, want %d", got, limit/2)
	}
	tables[0].Close()
	if st := tr.MooncakeQPStats(); st.Open != 2 {
		t.Fatalf("after a table closed: %d queue pairs open, want 2", st.Open)
	}
	if r := handshake(1); r.ReplyMsg != "" {
		t.Fatalf("a handshake once a table gave its queue pairs back: refused: %s", r.ReplyMsg)
	}
}
