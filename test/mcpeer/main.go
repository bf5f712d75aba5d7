// Command mcpeer is a Mooncake-protocol peer for the Python tests
// (python/tests/test_mooncake_peer_replays.py): a mooncaketest.Peer on
// loopback TCP driven by JSON lines on stdin, one JSON line answering
// each on stdout. It exits at stdin's end, so it never outlives the test
// that started it. make test-python builds it into bin/.
//
// Its first line is {"session", "base", "size"}: the segment's name and
// its one registered buffer. Then, per command line:
//
//	{"op":"write","session":S,"seed":K,"pieces":[[addr,n],...]}
//	    WRITEs the pieces into segment S as a Mooncake initiator running
//	    with MC_TCP_ENABLE_CONNECTION_POOL=1 does (one v2 data connection),
//	    their bytes the SHAKE128 stream of K cut in order: {} when every
//	    write said OK. S may be the peer's own session (to fill its buffer).
//	{"op":"read","session":S,"pieces":[[addr,n],...]}
//	    READs the pieces from segment S, one data connection each, as
//	    Mooncake's default TCP transport does: {"digests": [sha256 hex]}.
//	{"op":"digest","pieces":[[addr,n],...]}
//	    {"digests": [...]} of the pieces of its own buffer.
//
// A command that fails answers {"error": "..."} and the peer goes on.
package main

import (
	"bufio"
	"context"
	"crypto/sha256"
	"crypto/sha3"
	"encoding/hex"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"os"
	"time"

	"github.com/ferry-project/ferry/mooncake"
	"github.com/ferry-project/ferry/mooncake/mooncaketest"
)

type command struct {
	Op      string      `json:"op"`
	Session string      `json:"session"`
	Seed    string      `json:"seed"`
	Pieces  [][2]uint64 `json:"pieces"`
}

// timeout bounds each command: the test's own deadline is on its reply.
const timeout = 60 * time.Second

func main() {
	size := flag.Int("buffer-size", 16<<20, "bytes of the registered buffer")
	flag.Parse()
	p, err := mooncaketest.Start(mooncaketest.Config{BufferSize: *size})
	if err != nil {
		fmt.Fprintln(os.Stderr, "mcpeer:", err)
		os.Exit(1)
	}
	defer p.Close()
	out := json.NewEncoder(os.Stdout)
	out.Encode(map[string]any{"session": p.Name(), "base": p.Base(), "size": *size})
	in := bufio.NewScanner(os.Stdin)
	in.Buffer(nil, 64<<20)
	for in.Scan() {
		var c command
		reply, err := map[string]any{}, json.Unmarshal(in.Bytes(), &c)
		if err == nil {
			reply, err = run(p, *size, c)
		}
		if err != nil {
			reply = map[string]any{"error": err.Error()}
		}
		out.Encode(reply)
	}
}

func run(p *mooncaketest.Peer, size int, c command) (map[string]any, error) {
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	switch c.Op {
	case "write":
		return map[string]any{}, write(ctx, c)
	case "read":
		seg, err := mooncake.FetchSegment(ctx, c.Session, self())
		if err != nil {
			return nil, err
		}
		var sums []string
		for _, pc := range c.Pieces {
			buf := make([]byte, pc[1])
			r := mooncake.Request{Data: seg.DataAddr(c.Session), Addr: pc[0], Buf: buf, V2: seg.TCPProtoVersion >= 2}
			if err := mooncake.Read(ctx, r); err != nil {
				return nil, fmt.Errorf("reading %d bytes at %#x from %s: %w", pc[1], pc[0], c.Session, err)
			}
			sums = append(sums, digest(buf))
		}
		return map[string]any{"digests": sums}, nil
	case "digest":
		var sums []string
		for _, pc := range c.Pieces {
			if pc[0] < p.Base() || pc[0]+pc[1] < pc[0] || pc[0]+pc[1] > p.Base()+uint64(size) {
				return nil, fmt.Errorf("[%#x, +%d) is outside this peer's buffer", pc[0], pc[1])
			}
			sums = append(sums, digest(p.Bytes(pc[0], int(pc[1]))))
		}
		return map[string]any{"digests": sums}, nil
	}
	return nil, fmt.Errorf("unknown op %q: want write, read or digest", c.Op)
}

func write(ctx context.Context, c command) error {
	seg, err := mooncake.FetchSegment(ctx, c.Session, self())
	if err != nil {
		return err
	}
	if seg.TCPProtoVersion < 2 {
		return fmt.Errorf("segment %s speaks TCP protocol v%d: this peer pools v2 connections only", c.Session, seg.TCPProtoVersion)
	}
	conn, err := mooncaketest.DialPooled(ctx, seg.DataAddr(c.Session), "")
	if err != nil {
		return err
	}
	defer conn.Close()
	stream := sha3.NewSHAKE128()
	stream.Write([]byte(c.Seed))
	for _, pc := range c.Pieces {
		buf := make([]byte, pc[1])
		io.ReadFull(stream, buf)
		if err := conn.Write(pc[0], buf, timeout); err != nil {
			return fmt.Errorf("writing %d bytes at %#x into %s: %w", pc[1], pc[0], c.Session, err)
		}
	}
	return nil
}

func self() *mooncake.Segment {
	return &mooncake.Segment{Name: "mcpeer", Protocol: "tcp", Buffers: []mooncake.Buffer{}}
}

func digest(b []byte) string {
	s := sha256.Sum256(b)
	return hex.EncodeToString(s[:])
}
