package daemon

import (
	"errors"
	"strings"
	"testing"

	"github.com/ferry-project/ferry/api"
	"github.com/ferry-project/ferry/client"
	"github.com/ferry-project/ferry/transport"
)

// A ferry peer's read carrying an engine segment's key is served from
// that segment's registered memory at its Mooncake addresses, byte for
// byte; past it is out of bounds, and a receive slot's key or a key no
// segment has reads nothing (no_slot): the arena and slots are never
// readable.
func TestEngineKeysServeFerryPeersReadsOfEngineMemoryOnly(t *testing.T) {
	r := newTestRegistry(t, 1<<16)
	const at = 0x7f0000000000
	a := hostRegion(make([]byte, 4096))
	copy(a[100:], "registered bytes")
	if _, err := r.addRegionAt("r", a, nil, nil, lend{mooncakeAddr: at, segment: "e1"}); err != nil {
		t.Fatal(err)
	}
	key := transport.NewKey()
	r.engineKeys = map[transport.Key]string{key: "e1"}
	src, done, err := r.ReadKeyed(at+100, 16, key)
	if err != nil || string(src) != "registered bytes" {
		t.Fatalf("read %q, %v", src, err)
	}
	done()
	if _, _, err := r.ReadKeyed(at+4000, 200, key); refusalCode(t, err) != transport.OutOfBounds {
		t.Fatalf("past the engine's memory: %v", err)
	}
	if _, _, err := r.ReadKeyed(at-1, 2, key); refusalCode(t, err) != transport.OutOfBounds {
		t.Fatalf("before the engine's memory: %v", err)
	}
	s, err := r.newSlot("slot", 64, false)
	if err != nil {
		t.Fatal(err)
	}
	if _, _, err := r.ReadKeyed(s.addr, 1, s.key); refusalCode(t, err) != transport.NoSlot {
		t.Fatalf("a receive slot's key: %v", err)
	}
	if _, _, err := r.ReadKeyed(at, 1, transport.NewKey()); refusalCode(t, err) != transport.NoSlot {
		t.Fatalf("a key no segment has: %v", err)
	}
}

// A read landing in a region: each piece at its offset there; a piece
// running past the region, offsets that do not match the pieces, or
// GPU memory are refused naming the fix.
func TestReadsLandInARegion(t *testing.T) {
	host := make([]byte, 4096)
	req := api.ReadRequest{Session: "h:1", Pieces: [][2]uint64{{0x1000, 10}, {0x2000, 6}}, Region: "r", RegionOffsets: []uint64{100, 4090}}
	reads := make([]transport.Read, 2)
	if err := landInRegion(reads, req, host); err != nil {
		t.Fatal(err)
	}
	if &reads[0].Dst[0] != &host[100] || len(reads[1].Dst) != 6 || &reads[1].Dst[0] != &host[4090] || reads[1].Addr != 0x2000 {
		t.Fatalf("reads %+v do not land at the offsets asked", reads)
	}
	for _, c := range []struct {
		offsets []uint64
		host    []byte
		want    string
	}{
		{[]uint64{100, 4091}, host, "land it inside the region"},
		{[]uint64{100}, host, "one offset into region r per piece"},
		{[]uint64{100, 0}, nil, "GPU memory"},
	} {
		req.RegionOffsets = c.offsets
		if err := landInRegion(reads, req, c.host); !isCode(err, api.CodeBadRequest) || !strings.Contains(err.Error(), c.want) {
			t.Errorf("offsets %v: %v, want a bad_request saying %q", c.offsets, err, c.want)
		}
	}
}

// POST /v1/reads refuses what it cannot read before it dials anyone:
// no pieces, an empty or oversized piece, more bytes than one read
// takes, a session that is no "host:port".
func TestReadRequestsAreBounded(t *testing.T) {
	c := serveDaemon(t, newTestDaemon(t, t.TempDir(), "r", nil))
	for _, tc := range []struct {
		req  api.ReadRequest
		code string
		want string
	}{
		{api.ReadRequest{Session: "127.0.0.1:1"}, api.CodeBadRequest, "no pieces"},
		{api.ReadRequest{Session: "127.0.0.1:1", Pieces: [][2]uint64{{1, 0}}}, api.CodeBadRequest, "is empty"},
		{api.ReadRequest{Session: "127.0.0.1:1", Pieces: [][2]uint64{{1, 1 << 63}, {2, 1 << 63}}}, api.CodeBadRequest, "longer than"},
		{api.ReadRequest{Session: "127.0.0.1:1", Pieces: [][2]uint64{{1, maxReadBytes}, {2, 1}}}, api.CodeTooLarge, "read in several"},
		{api.ReadRequest{Session: "nohost", Pieces: [][2]uint64{{1, 1}}}, api.CodeBadRequest, "host:rpc_port"},
	} {
		_, err := c.Read(t.Context(), tc.req)
		var ce *client.Error
		if !errors.As(err, &ce) || ce.Code != tc.code || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%+v: %v, want %s saying %q", tc.req.Pieces, err, tc.code, tc.want)
		}
	}
}
