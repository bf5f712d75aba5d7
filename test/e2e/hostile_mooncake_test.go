package e2e

import (
	"bytes"
	"context"
	"encoding/binary"
	"fmt"
	"net"
	"os"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ferry-project/ferry/api"
	"github.com/ferry-project/ferry/mooncake"
	"github.com/ferry-project/ferry/mooncake/mooncaketest"
)

// TestMooncakeAllowList: a writer whose address is not on
// --mooncake-allow is refused at both ports (its connection closed at
// accept), counted and logged naming the setting; one on it lands.
func TestMooncakeAllowList(t *testing.T) {
	rcv, seg := startMooncakeSegment(t, "--mooncake-allow", "127.0.0.1")
	ctx := ctxT(t)
	st, err := rcv.c.Status(ctx)
	if err != nil {
		t.Fatal(err)
	}
	slot, err := rcv.c.ReceiveWith(ctx, api.ReceiveRequest{ReqID: "mc-allow", NBytes: 4096, Mooncake: true})
	if err != nil {
		t.Fatal(err)
	}
	data := fmt.Sprintf("127.0.0.1:%d", st.Mooncake.DataPort)
	stranger := func() error {
		c, err := mooncaketest.DialPooled(ctx, data, "127.0.0.2")
		if err != nil {
			return err
		}
		defer c.Close()
		return c.Write(slot.BufferAddress, bytes.Repeat([]byte{0xEE}, 4096), 10*time.Second)
	}
	if err := stranger(); err == nil || mooncake.IsRejected(err) {
		t.Fatalf("a write from 127.0.0.2, not on --mooncake-allow: %v, want its connection closed", err)
	}
	d := net.Dialer{LocalAddr: &net.TCPAddr{IP: net.ParseIP("127.0.0.2")}}
	if c, err := d.DialContext(ctx, "tcp", seg); err == nil {
		c.SetDeadline(time.Now().Add(10 * time.Second))
		c.Write(mooncake.AppendFrame(nil, mooncake.Metadata, []byte("{}\n")))
		if _, _, err := mooncake.ReadFrame(c); err == nil {
			t.Fatal("a metadata request from 127.0.0.2 got the descriptor")
		}
		c.Close()
	}
	rcv.log.wait(t, 5*time.Second, "the refusal's WARN line", logSays("warn", "mooncake data port: refused a connection from 127.0.0.2:", "not on mooncake_allow"))
	rcv.log.wait(t, 5*time.Second, "the refusal's WARN line", logSays("warn", "mooncake RPC port: refused a connection from 127.0.0.2:", "not on mooncake_allow"))
	for _, port := range []string{"mooncake_data", "mooncake_rpc"} {
		if n := rcv.metric(t, `ferry_port_refused_connections_total{port="`+port+`",reason="not_allowed"}`); n != 1 {
			t.Errorf("%s refused %v connections not allowed, want 1", port, n)
		}
	}
	want := randomBytes(4096, 31)
	if _, err := mooncaketest.WriteTo(ctx, seg, slot.BufferAddress, want, false); err != nil {
		t.Fatalf("a write from 127.0.0.1, on --mooncake-allow: %v", err)
	}
	got, err := rcv.c.Wait(ctx, "mc-allow", 10*time.Second)
	if err != nil || !bytes.Equal(got, want) {
		t.Fatalf("the slot after the allowed write: %v, equal=%t", err, bytes.Equal(got, want))
	}
}

// Bounds the hostile test holds ferryd to while a flood holds a port:
// its open files at most its baseline, the port's cap and a margin for
// the writer's and the client's own; its resident memory at most its
// baseline and, per flood connection, hostileKiBPerConn (a goroutine,
// its socket, a header or a first read of a message), and
// hostileRSSFixedMiB (the RPC port's 16 MiB budget for large messages,
// and the heap's slack): without the budget, the RPC flood's 1 MiB
// descriptors alone took some 90 MiB more. A race-built ferryd
// (FERRY_E2E_RACE=1) keeps shadow memory for each: it gets
// hostileRaceFactor times as much.
const (
	hostileFDMargin    = 64
	hostileKiBPerConn  = 64
	hostileRSSFixedMiB = 32
	hostileRaceFactor  = 4
	hostileRounds      = 12
)

// hostileRSSGrowthMiB is how much ferryd's resident memory may grow
// under a flood of conns connections.
func hostileRSSGrowthMiB(conns int) int {
	growth := conns*hostileKiBPerConn>>10 + hostileRSSFixedMiB
	if os.Getenv("FERRY_E2E_RACE") == "1" {
		growth *= hostileRaceFactor
	}
	return growth
}

// TestHostileMooncakePorts floods each Mooncake port of a real ferryd,
// from addresses mooncake_allow lets in by default (loopback), with more
// connections than its cap: silent ones, garbage, lengths past every
// limit, the largest messages the port takes, bodies that stall, and on
// the data port writes at guessed addresses (the arena's base and the
// best-fit places after it). Meanwhile a Mooncake writer (its connection
// pool, and a metadata request per round) writes into a slot made with
// "mooncake": true, and an admitted client calls the API: every write
// lands byte-exact, no guessed write does, every call is answered, and
// ferryd's descriptors and memory stay bounded. One line per port:
//
//	== HOSTILE port=mooncake-rpc conns=N fds=N rss_mb=N peer_ok=N/M api_ok=N/M
func TestHostileMooncakePorts(t *testing.T) {
	raiseFileLimit(t, 8192)
	rcv, seg := startMooncakeSegment(t, "--io-timeout", "2s")
	pid := rcv.cmd.Process.Pid
	ctx := ctxT(t)
	st, err := rcv.c.Status(ctx)
	if err != nil {
		t.Fatal(err)
	}
	desc, err := mooncake.FetchSegment(ctx, seg, &mooncake.Segment{Name: "hostile-test", Protocol: "tcp", Buffers: []mooncake.Buffer{}})
	if err != nil {
		t.Fatal(err)
	}
	base := desc.Buffers[0].Addr
	// The flood's guessed writes aim at the arena's first 8 KiB, where
	// best fit put the first two slots; a keyed slot holds them, so no
	// round's Mooncake slot can be placed there by chance (the unit test
	// TestMooncakeSlotsAreNotWhereAGuessLands shows placement alone
	// avoids them), and the guesses meet a slot they cannot write.
	if guard, err := rcv.c.Receive(ctx, "hostile-guard", 8192); err != nil || guard.BufferAddress != base {
		t.Fatalf("a keyed slot for the arena's first 8 KiB: %+v, %v", guard, err)
	}
	data := fmt.Sprintf("127.0.0.1:%d", st.Mooncake.DataPort)
	pool := mooncaketest.NewPool(data, 4, nil)
	defer pool.Close()

	for _, p := range []struct {
		name  string
		addr  string
		cap   int
		conns int // flood connections held at once, from 5 addresses
		flood func(c net.Conn, i int)
	}{
		{"mooncake-rpc", seg, mooncake.DefaultServerLimits.Total, 320, floodRPC},
		{"mooncake-data", data, mooncake.DefaultDataLimits.Total, 1100, func(c net.Conn, i int) { floodData(c, i, base) }},
	} {
		baseFDs, baseRSS := openFDs(t, pid), mcRSSMiB(t, pid)
		t.Logf("%s: before the flood, %d files and %d MiB resident", p.name, baseFDs, baseRSS)
		stop := make(chan struct{})
		var wg sync.WaitGroup
		var held atomic.Int64
		for i := range p.conns {
			src := fmt.Sprintf("127.0.0.%d", 10+i%5)
			wg.Add(1)
			go func() {
				defer wg.Done()
				mcFlood(stop, &held, p.addr, src, func(c net.Conn) { p.flood(c, i) })
			}()
		}
		// The flood is under way once most of it is connected.
		for deadline := time.Now().Add(30 * time.Second); held.Load() < int64(p.conns)*3/4; time.Sleep(10 * time.Millisecond) {
			if time.Now().After(deadline) {
				t.Fatalf("%s: only %d of %d flood connections made in 30s", p.name, held.Load(), p.conns)
			}
		}
		peerOK, apiOK, maxFDs, maxRSS := 0, 0, 0, 0
		for round := range hostileRounds {
			if err := mcWriteRound(ctx, rcv, seg, pool, fmt.Sprintf("%s-%d", p.name, round)); err != nil {
				t.Errorf("%s round %d: the Mooncake writer: %v", p.name, round, err)
			} else {
				peerOK++
			}
			cctx, cancel := context.WithTimeout(ctx, 5*time.Second)
			if _, err := rcv.c.Status(cctx); err != nil {
				t.Errorf("%s round %d: the admitted client's status call: %v", p.name, round, err)
			} else {
				apiOK++
			}
			cancel()
			maxFDs, maxRSS = max(maxFDs, openFDs(t, pid)), max(maxRSS, mcRSSMiB(t, pid))
		}
		close(stop)
		wg.Wait()
		// The next port's baseline: once ferryd has closed this flood's
		// connections (a poll: nothing says when it has).
		for deadline := time.Now().Add(30 * time.Second); openFDs(t, pid) > baseFDs+hostileFDMargin; time.Sleep(10 * time.Millisecond) {
			if time.Now().After(deadline) {
				t.Fatalf("%s: ferryd still holds %d files 30s after the flood ended, %d before it", p.name, openFDs(t, pid), baseFDs)
			}
		}
		fmt.Printf("== HOSTILE port=%s conns=%d fds=%d rss_mb=%d peer_ok=%d/%d api_ok=%d/%d\n",
			p.name, p.conns, maxFDs, maxRSS, peerOK, hostileRounds, apiOK, hostileRounds)
		if limit := baseFDs + p.cap + hostileFDMargin; maxFDs > limit {
			t.Errorf("%s: ferryd held %d files under the flood, over %d (%d before, the port's cap %d, a margin of %d)", p.name, maxFDs, limit, baseFDs, p.cap, hostileFDMargin)
		}
		if limit := baseRSS + hostileRSSGrowthMiB(p.conns); maxRSS > limit {
			t.Errorf("%s: ferryd's resident memory reached %d MiB under the flood, over %d (%d before)", p.name, maxRSS, limit, baseRSS)
		}
	}
	rcv.alive(t)
}

// mcFlood holds connections to addr from src, one at a time, each fed
// by feed, reconnecting when ferryd closes one, until stop; held counts
// the connections open.
func mcFlood(stop <-chan struct{}, held *atomic.Int64, addr, src string, feed func(c net.Conn)) {
	d := net.Dialer{LocalAddr: &net.TCPAddr{IP: net.ParseIP(src)}, Timeout: 5 * time.Second}
	for {
		select {
		case <-stop:
			return
		default:
		}
		c, err := d.Dial("tcp", addr)
		if err != nil {
			select {
			case <-stop:
				return
			case <-time.After(50 * time.Millisecond): // refused: try again a little later
			}
			continue
		}
		held.Add(1)
		closed := make(chan struct{})
		go func() {
			select {
			case <-stop:
			case <-closed:
			}
			c.Close()
		}()
		feed(c)
		// Whatever ferryd answers, read until it closes the connection
		// (or the test ends).
		buf := make([]byte, 4096)
		for {
			if _, err := c.Read(buf); err != nil {
				break
			}
		}
		close(closed)
		held.Add(-1)
	}
}

// floodRPC is one hostile connection to the RPC port, by kind.
func floodRPC(c net.Conn, i int) {
	frame := func(length uint64, typ byte) []byte {
		return append(binary.LittleEndian.AppendUint64(nil, length), typ)
	}
	switch i % 5 {
	case 0: // silent
	case 1: // the largest descriptor a metadata request may carry, whole
		body := append(append([]byte{'"'}, bytes.Repeat([]byte{'x'}, mooncake.MaxMessage-4)...), '"', '\n')
		c.Write(mooncake.AppendFrame(nil, mooncake.Metadata, body))
	case 2: // garbage: an unknown type
		c.Write(append(frame(10, 9), "{\"x\":1}\n\n"...))
	case 3: // a largest descriptor that stalls after 64 KiB
		c.Write(append(frame(mooncake.MaxMessage, byte(mooncake.Metadata)), bytes.Repeat([]byte{' '}, 64<<10)...))
	case 4: // a length past every limit
		c.Write(frame(1<<40, byte(mooncake.Metadata)))
	}
}

// floodData is one hostile connection to the data port, by kind; base
// is the arena's address, which the descriptor tells anyone.
func floodData(c net.Conn, i int, base uint64) {
	header := func(size, addr uint64, op byte) []byte {
		b := binary.LittleEndian.AppendUint64(nil, size)
		b = binary.LittleEndian.AppendUint64(b, addr)
		return append(b, op, 0, 0, 0, 0, 0, 0, 0)
	}
	const v2Write = 0x81
	switch i % 5 {
	case 0: // silent
	case 1: // a write far larger than the arena
		c.Write(header(1<<40, base, v2Write))
	case 2: // garbage: an unknown opcode
		c.Write(header(8, base, 0x07))
	case 3: // a 1 MiB write whose body stalls after 4 KiB
		c.Write(append(header(1<<20, base+64<<20, v2Write), make([]byte, 4096)...))
	case 4: // the two-guess attack, over and over on one connection:
		// the arena's base and the best-fit place after a 4 KiB slot
		guess := bytes.Repeat([]byte{0xEE}, 4096)
		for k := range 64 {
			b := append(header(4096, base+uint64(k%2)*4096, v2Write), guess...)
			if _, err := c.Write(b); err != nil {
				return
			}
			var st [8]byte
			c.SetReadDeadline(time.Now().Add(10 * time.Second))
			if _, err := c.Read(st[:]); err != nil {
				return
			}
		}
	}
}

// mcWriteRound is one round of the Mooncake writer: a receive slot for
// Mooncake writers, its segment's descriptor fetched (a metadata
// request), the bytes written over the pool, read back byte-exact.
func mcWriteRound(ctx context.Context, rcv *daemon, seg string, pool *mooncaketest.Pool, id string) error {
	const n = 4096
	slot, err := rcv.c.ReceiveWith(ctx, api.ReceiveRequest{ReqID: id, NBytes: n, Mooncake: true})
	if err != nil {
		return err
	}
	defer rcv.c.FreeReceive(ctx, id)
	if _, err := mooncake.FetchSegment(ctx, seg, &mooncake.Segment{Name: "hostile-writer", Protocol: "tcp", Buffers: []mooncake.Buffer{}}); err != nil {
		return fmt.Errorf("fetching the descriptor: %w", err)
	}
	want := randomBytes(n, uint64(len(id)))
	if err := pool.Write(ctx, slot.BufferAddress, want, 10*time.Second); err != nil {
		return fmt.Errorf("writing: %w", err)
	}
	got, err := rcv.c.Wait(ctx, id, 10*time.Second)
	if err != nil {
		return err
	}
	if !bytes.Equal(got, want) {
		return fmt.Errorf("the slot holds other bytes than the writer's (a guessed write landed?)")
	}
	return nil
}

// mcRSSMiB is a process's resident memory (VmRSS), in MiB.
func mcRSSMiB(t *testing.T, pid int) int {
	t.Helper()
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		t.Fatal(err)
	}
	for _, line := range strings.Split(string(b), "\n") {
		if rest, ok := strings.CutPrefix(line, "VmRSS:"); ok {
			kb, err := strconv.Atoi(strings.TrimSuffix(strings.TrimSpace(rest), " kB"))
			if err != nil {
				t.Fatalf("VmRSS line %q: %v", line, err)
			}
			return kb >> 10
		}
	}
	t.Fatalf("/proc/%d/status has no VmRSS line", pid)
	return 0
}
