package e2e

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/ferry-project/ferry/api"
	"github.com/ferry-project/ferry/mooncake"
	"github.com/ferry-project/ferry/mooncake/mooncaketest"
)

// startMooncakePeer runs a Mooncake test segment in this process and
// stops it at the end of the test.
func startMooncakePeer(t *testing.T, cfg mooncaketest.Config) *mooncaketest.Peer {
	t.Helper()
	p, err := mooncaketest.Start(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(p.Close)
	return p
}

// raceFree fails the test if the (race-built) daemon reported a data
// race by the end of the test: its Mooncake paths are new.
func raceFree(t *testing.T, d *daemon) *daemon {
	t.Cleanup(func() {
		d.stop()
		<-d.log.done
		if strings.Contains(d.log.dump(), "DATA RACE") {
			t.Errorf("ferryd reported a data race:\n%s", d.log.dump())
		}
	})
	return d
}

// logSays matches a log line at level whose message contains every part.
func logSays(level string, parts ...string) func(map[string]any) bool {
	return func(m map[string]any) bool {
		s, _ := m["message"].(string)
		for _, p := range parts {
			if !strings.Contains(s, p) {
				return false
			}
		}
		return m["level"] == level
	}
}

// ferry → Mooncake: a ferryd sends into a Mooncake segment over TCP v2
// and v1, byte for byte; ferryctl send takes the segment too.
func TestMooncakeSendIntoASegment(t *testing.T) {
	snd := raceFree(t, startDaemon(t, t.TempDir(), "snd", "--slow-threshold", "1ns"))
	ctx := ctxT(t)
	for _, v := range []int{2, 1} {
		peer := startMooncakePeer(t, mooncaketest.Config{ProtoVersion: v, BufferSize: 4 << 20})
		id := fmt.Sprintf("mc-v%d", v)
		data := randomBytes(embBytes, uint64(v))
		if _, err := snd.c.Stage(ctx, id, embShape, "bf16", bytes.NewReader(data), int64(len(data))); err != nil {
			t.Fatal(err)
		}
		addr := peer.Base() + 1<<20 + 64
		res, err := snd.c.Send(ctx, id, api.SendRequest{Session: mooncake.Scheme + peer.Name(), BufferAddress: addr})
		if err != nil {
			t.Fatal(err)
		}
		if res.Transport != mooncake.TransportName || res.NBytes != embBytes || res.Attempts != 1 {
			t.Fatalf("v%d: send result %+v", v, res)
		}
		if !bytes.Equal(peer.Bytes(addr, embBytes), data) {
			t.Fatalf("v%d: the segment holds other bytes than the staged ones", v)
		}
		// The slow-transfer line as for ferry peers.
		snd.log.wait(t, 5*time.Second, "the slow-transfer line", func(m map[string]any) bool {
			return m["message"] == "slow transfer" && m["req_id"] == id && m["transport"] == mooncake.TransportName
		})
		s := sessionTo(t, snd, mooncake.Scheme+peer.Name())
		if s.State != "connected" || s.Transport != mooncake.TransportName || s.Sends != 1 {
			t.Fatalf("v%d: session %+v", v, s)
		}
	}

	peer := startMooncakePeer(t, mooncaketest.Config{})
	in := filepath.Join(t.TempDir(), "in")
	data := randomBytes(embBytes, 3)
	if err := os.WriteFile(in, data, 0o644); err != nil {
		t.Fatal(err)
	}
	for _, args := range [][]string{
		{"stage", "mc-cli", "--shape", "16,4096", "--dtype", "bf16", in},
		{"send", "mc-cli", "--session", mooncake.Scheme + peer.Name(), "--addr", fmt.Sprintf("%#x", peer.Base())},
	} {
		out, err := exec.Command(filepath.Join(bin, "ferryctl"), append([]string{"--socket", snd.socket}, args...)...).CombinedOutput()
		if err != nil {
			t.Fatalf("ferryctl %v: %v\n%s", args, err, out)
		}
	}
	if !bytes.Equal(peer.Bytes(peer.Base(), embBytes), data) {
		t.Fatal("ferryctl send: the segment holds other bytes")
	}
}

// A range outside the segment's buffers is a 400 naming the range and the
// buffers; the peer's own rejection and a closed peer are transfer_failed
// naming session, nbytes and what the peer said. Staged data is kept.
func TestMooncakeSendFailuresAreClear(t *testing.T) {
	snd := raceFree(t, startDaemon(t, t.TempDir(), "snd", "--send-retries", "0"))
	ctx := ctxT(t)
	peer := startMooncakePeer(t, mooncaketest.Config{BufferSize: 1 << 20})
	session := mooncake.Scheme + peer.Name()
	data := stageOn(t, snd, "mc-bad", embBytes, 4)

	_, err := snd.c.Send(ctx, "mc-bad", api.SendRequest{Session: session, BufferAddress: peer.Base() + 1<<20 - 100})
	start := fmt.Sprintf("%#x", peer.Base()+1<<20-100)
	wantErr(t, err, 400, api.CodeRefused, "mc-bad", session, start, "lies in none of the buffers", fmt.Sprintf("[%#x, %#x)", peer.Base(), peer.Base()+1<<20))

	_, err = snd.c.Send(ctx, "mc-bad", api.SendRequest{Session: "mooncake://nohostport"})
	wantErr(t, err, 400, api.CodeBadRequest, "mooncake://nohostport", "HOST:PORT")

	// The segment drops its buffer; the sender's cached descriptor still
	// lists it, so the write goes out and the peer rejects it (v2 status).
	peer.Unregister()
	_, err = snd.c.Send(ctx, "mc-bad", api.SendRequest{Session: session, BufferAddress: peer.Base()})
	wantErr(t, err, 502, api.CodeTransferFailed, "mc-bad", session, fmt.Sprint(embBytes), "ret=rejected", `status "rejected"`)

	peer.Close()
	_, err = snd.c.Send(ctx, "mc-bad", api.SendRequest{Session: session, BufferAddress: peer.Base()})
	wantErr(t, err, 502, api.CodeTransferFailed, "mc-bad", session, fmt.Sprint(embBytes), "ECONNREFUSED")

	// Still staged: a resend to a live segment delivers it.
	peer2 := startMooncakePeer(t, mooncaketest.Config{})
	if _, err := snd.c.Send(ctx, "mc-bad", api.SendRequest{Session: mooncake.Scheme + peer2.Name(), BufferAddress: peer2.Base()}); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(peer2.Bytes(peer2.Base(), embBytes), data) {
		t.Fatal("resent bytes differ")
	}
	snd.alive(t)
}

// A segment restarted on the same RPC port has a new data port and new
// buffers: the sender fetches the descriptor again and delivers.
func TestMooncakeSendFollowsAPeerRestart(t *testing.T) {
	snd := raceFree(t, startDaemon(t, t.TempDir(), "snd"))
	ctx := ctxT(t)
	peer := startMooncakePeer(t, mooncaketest.Config{BufferSize: 1 << 20})
	name := peer.Name()
	session := mooncake.Scheme + name
	stageOn(t, snd, "mc-r1", embBytes, 5)
	if _, err := snd.c.Send(ctx, "mc-r1", api.SendRequest{Session: session, BufferAddress: peer.Base()}); err != nil {
		t.Fatal(err)
	}
	before := sessionTo(t, snd, session).PeerInstance
	peer.Close()
	// Its buffer now sits elsewhere (a bigger one, allocated anew).
	peer2 := startMooncakePeer(t, mooncaketest.Config{Addr: name, BufferSize: 8 << 20})
	for i, addr := range []uint64{peer2.Base() + 7<<20, peer2.Base()} {
		id := fmt.Sprintf("mc-r2-%d", i)
		data := stageOn(t, snd, id, embBytes, uint64(6+i))
		res, err := snd.c.Send(ctx, id, api.SendRequest{Session: session, BufferAddress: addr})
		if err != nil {
			t.Fatalf("send %d after the restart: %v", i, err)
		}
		if !bytes.Equal(peer2.Bytes(addr, embBytes), data) {
			t.Fatalf("send %d after the restart: bytes differ (attempts %d)", i, res.Attempts)
		}
	}
	if after := sessionTo(t, snd, session).PeerInstance; after == before {
		t.Fatalf("peer instance %s did not change across the restart", after)
	}
}

// A segment restarted with the same buffer range but a new data port:
// the cached descriptor passes the range check, the write meets a closed
// port, the session is torn down and the retry fetches the new
// descriptor and delivers.
func TestMooncakeSendRetriesWithAFreshDescriptor(t *testing.T) {
	snd := raceFree(t, startDaemon(t, t.TempDir(), "snd"))
	ctx := ctxT(t)
	const base = 0x7f0000000000
	peer := startMooncakePeer(t, mooncaketest.Config{BufferSize: 1 << 20, Base: base})
	name, session := peer.Name(), mooncake.Scheme+peer.Name()
	stageOn(t, snd, "mc-f1", embBytes, 31)
	if _, err := snd.c.Send(ctx, "mc-f1", api.SendRequest{Session: session, BufferAddress: base}); err != nil {
		t.Fatal(err)
	}
	peer.Close()
	peer2 := startMooncakePeer(t, mooncaketest.Config{Addr: name, BufferSize: 1 << 20, Base: base})
	data := stageOn(t, snd, "mc-f2", embBytes, 32)
	res, err := snd.c.Send(ctx, "mc-f2", api.SendRequest{Session: session, BufferAddress: base + 4096})
	if err != nil {
		t.Fatal(err)
	}
	if res.Attempts != 2 {
		t.Fatalf("send took %d attempt(s); want 2: a failed write on the stale data port, then the retry", res.Attempts)
	}
	if !bytes.Equal(peer2.Bytes(base+4096, embBytes), data) {
		t.Fatal("bytes differ after the retry")
	}
	snd.log.wait(t, 5*time.Second, "the teardown line", func(m map[string]any) bool {
		return m["message"] == "write failed; session torn down, re-dialing and retrying" && m["req_id"] == "mc-f2" && m["ret"] == "ECONNREFUSED"
	})
}

// startMooncakeSegment runs a ferryd serving as a Mooncake segment and
// returns it with its segment name, from its log.
func startMooncakeSegment(t *testing.T, extra ...string) (*daemon, string) {
	t.Helper()
	return startMooncakeSegmentIn(t, nil, extra...)
}

// startMooncakeSegmentIn is startMooncakeSegment with a command prefix
// (startDaemonIn's).
func startMooncakeSegmentIn(t *testing.T, prefix []string, extra ...string) (*daemon, string) {
	t.Helper()
	rcv := raceFree(t, startDaemonIn(t, prefix, t.TempDir(), "rcv", append([]string{"--mooncake-listen", "127.0.0.1:0"}, extra...)...))
	line := rcv.log.wait(t, 5*time.Second, "the Mooncake segment line", msg("serving as a Mooncake segment"))
	name, _ := line["segment"].(string)
	st, err := rcv.c.Status(ctxT(t))
	if err != nil {
		t.Fatal(err)
	}
	if st.Mooncake == nil || st.Mooncake.Segment != name || st.Mooncake.DataPort == 0 {
		t.Fatalf("status says %+v; want segment %s and its data port", st.Mooncake, name)
	}
	out, err := exec.Command(filepath.Join(bin, "ferryctl"), "--socket", rcv.socket, "status").CombinedOutput()
	if err != nil || !strings.Contains(string(out), "mooncake   segment "+name) {
		t.Fatalf("ferryctl status does not name the segment %s: %v\n%s", name, err, out)
	}
	return rcv, name
}

// Mooncake → ferry: a Mooncake initiator fetches ferryd's descriptor (the
// arena as one buffer) and WRITEs into a receive slot at its
// buffer_address, in v2 and v1; the slot arrives byte-exact.
func TestMooncakeWritesIntoReceiveSlots(t *testing.T) {
	rcv, seg := startMooncakeSegment(t)
	ctx := ctxT(t)
	st, err := rcv.c.Status(ctx)
	if err != nil {
		t.Fatal(err)
	}
	for _, v1 := range []bool{false, true} {
		id := fmt.Sprintf("mc-in-v1-%t", v1)
		slot, err := rcv.c.ReceiveWith(ctx, api.ReceiveRequest{ReqID: id, NBytes: embBytes, Mooncake: true})
		if err != nil {
			t.Fatal(err)
		}
		if slot.MooncakeSession != seg {
			t.Fatalf("slot names Mooncake segment %q, want %q", slot.MooncakeSession, seg)
		}
		data := randomBytes(embBytes, 11)
		desc, err := mooncaketest.WriteTo(ctx, seg, slot.BufferAddress, data, v1)
		if err != nil {
			t.Fatalf("v1=%t: %v", v1, err)
		}
		if len(desc.Buffers) != 1 || desc.Buffers[0].Length != uint64(st.Memory.Size) || desc.TCPProtoVersion != 2 {
			t.Fatalf("descriptor %+v: want the arena (%d bytes) as its one buffer, protocol v2", desc, st.Memory.Size)
		}
		got, err := rcv.c.Wait(ctx, id, 10*time.Second)
		if err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(got, data) {
			t.Fatalf("v1=%t: the slot holds other bytes than were written", v1)
		}
	}

	// A transfer split into pieces (as Mooncake slices large ones)
	// arrives with its last byte, in whatever order the pieces come.
	slot, err := rcv.c.ReceiveWith(ctx, api.ReceiveRequest{ReqID: "mc-pieces", NBytes: embBytes, Mooncake: true})
	if err != nil {
		t.Fatal(err)
	}
	data := randomBytes(embBytes, 12)
	half := uint64(embBytes / 2)
	if _, err := mooncaketest.WriteTo(ctx, seg, slot.BufferAddress+half, data[half:], false); err != nil {
		t.Fatal(err)
	}
	if info, err := rcv.c.WaitInfo(ctx, "mc-pieces", 0); err != nil || info.Arrived {
		t.Fatalf("the slot arrived with half its bytes: %+v %v", info, err)
	}
	if _, err := mooncaketest.WriteTo(ctx, seg, slot.BufferAddress, data[:half], false); err != nil {
		t.Fatal(err)
	}
	got, err := rcv.c.Wait(ctx, "mc-pieces", 10*time.Second)
	if err != nil || !bytes.Equal(got, data) {
		t.Fatalf("pieced slot: %v, equal=%t", err, bytes.Equal(got, data))
	}
}

// Writes outside a live slot are rejected (v2: the rejected status; v1: a
// silent close), each with a WARN line; the daemon stays up.
func TestMooncakeWritesOutsideLiveSlotsAreRejected(t *testing.T) {
	rcv, seg := startMooncakeSegment(t)
	ctx := ctxT(t)
	slot, err := rcv.c.ReceiveWith(ctx, api.ReceiveRequest{ReqID: "mc-live", NBytes: 4096, Mooncake: true})
	if err != nil {
		t.Fatal(err)
	}
	freed, err := rcv.c.ReceiveWith(ctx, api.ReceiveRequest{ReqID: "mc-freed", NBytes: 4096, Mooncake: true})
	if err != nil {
		t.Fatal(err)
	}
	if err := rcv.c.FreeReceive(ctx, "mc-freed"); err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		name string
		addr uint64
		n    int
		log  string
	}{
		{"past the slot's end", slot.BufferAddress + 4000, 200, "does not fit the receive slot of req_id mc-live"},
		{"a freed slot", freed.BufferAddress, 64, "no live receive slot open to Mooncake writers"},
	} {
		for _, v1 := range []bool{false, true} {
			_, err := mooncaketest.WriteTo(ctx, seg, c.addr, make([]byte, c.n), v1)
			if !mooncake.IsRejected(err) {
				t.Fatalf("%s (v1=%t): want a rejection, got %v", c.name, v1, err)
			}
			rcv.log.wait(t, 5*time.Second, "the rejection's WARN line", logSays("warn", "rejected a WRITE", c.log))
		}
	}
	// A slot that did not ask for Mooncake writers is out of their reach,
	// though its address is known: only its key's holder writes there.
	keyed, err := rcv.c.Receive(ctx, "mc-keyed", 4096)
	if err != nil {
		t.Fatal(err)
	}
	if keyed.MooncakeSession != "" {
		t.Errorf("a keyed slot names Mooncake segment %q", keyed.MooncakeSession)
	}
	if _, err := mooncaketest.WriteTo(ctx, seg, keyed.BufferAddress, make([]byte, 4096), false); !mooncake.IsRejected(err) {
		t.Fatalf("a Mooncake write into a keyed slot: want a rejection, got %v", err)
	}
	if info, err := rcv.c.WaitInfo(ctx, "mc-keyed", 0); err != nil || info.Arrived || info.Mooncake {
		t.Fatalf("keyed slot after a Mooncake write: %+v %v", info, err)
	}
	if info, err := rcv.c.WaitInfo(ctx, "mc-live", 0); err != nil || info.Arrived || info.WritesInFlight != 0 {
		t.Fatalf("slot after rejected writes: %+v %v", info, err)
	}
	rcv.alive(t)
}

// Malformed handshakes get the connection closed and a WARN line naming
// what was wrong; probe, notify, metadata and the refused RDMA setup work.
func TestMooncakeHandshakesMalformedAndWellFormed(t *testing.T) {
	rcv, seg := startMooncakeSegment(t)
	raw := func(n uint64, rest ...byte) []byte { return append(binary.LittleEndian.AppendUint64(nil, n), rest...) }
	for _, c := range []struct {
		name string
		in   []byte
		want string
	}{
		{"wrong length", raw(40, 1, '{', '}'), "announces 40 bytes of metadata message but the connection ended after 3"},
		{"zero length", raw(0, 1), "length word is 0"},
		{"unknown type", raw(3, 9, '{', '}'), "unknown message type 9"},
		{"oversize JSON", raw(mooncake.MaxMessage+1, 1, '{'), "exceeds the 1048576-byte limit"},
		{"bad JSON", raw(3, 2, '{', '"'), "not a notify message"},
	} {
		conn, err := net.Dial("tcp", seg)
		if err != nil {
			t.Fatal(err)
		}
		conn.Write(c.in)
		conn.(*net.TCPConn).CloseWrite()
		conn.SetReadDeadline(time.Now().Add(10 * time.Second))
		b, err := io.ReadAll(conn)
		conn.Close()
		if len(b) != 0 || err != nil && !errors.Is(err, syscall.ECONNRESET) {
			t.Fatalf("%s: ferryd answered %q (%v); want the connection closed", c.name, b, err)
		}
		rcv.log.wait(t, 5*time.Second, c.name+"'s WARN line", logSays("warn", "mooncake handshake from", c.want))
	}
	rcv.alive(t)

	ctx := ctxT(t)
	if err := mooncake.ProbeSegment(ctx, seg); err != nil {
		t.Fatal(err)
	}
	if err := mooncake.SendNotify(ctx, seg, mooncake.NotifyDesc{Name: "sender", NotifyMsg: "req-1 done"}); err != nil {
		t.Fatal(err)
	}
	var reply mooncake.HandshakeDesc
	req := mooncake.HandshakeDesc{LocalNICPath: "10.0.0.9:15000@mlx5_0", PeerNICPath: seg + "@mlx5_0", QPNum: []uint32{7, 8}}
	if err := mooncake.Exchange(ctx, seg, mooncake.Connect, req, &reply); err != nil {
		t.Fatal(err)
	}
	if reply.ReplyMsg == "" || !strings.Contains(reply.ReplyMsg, "no RDMA") {
		t.Fatalf("RDMA setup answered %+v; want a reply_msg refusing it", reply)
	}
	if _, err := mooncake.FetchSegment(ctx, seg, &mooncake.Segment{Name: "x"}); err != nil {
		t.Fatal(err)
	}
}

// Two ferryd over Mooncake's wire: one sends to the other's Mooncake
// segment, into a receive slot; a send to a ferry peer port named as a
// Mooncake segment says what is wrong.
func TestMooncakeFerryToFerryOverMooncakeWire(t *testing.T) {
	rcv, seg := startMooncakeSegment(t)
	snd := raceFree(t, startDaemon(t, t.TempDir(), "snd"))
	ctx := ctxT(t)
	slot, err := rcv.c.ReceiveWith(ctx, api.ReceiveRequest{ReqID: "mc-ff", NBytes: embBytes, Mooncake: true})
	if err != nil {
		t.Fatal(err)
	}
	data := stageOn(t, snd, "mc-ff", embBytes, 21)
	res, err := snd.c.Send(ctx, "mc-ff", api.SendRequest{Session: mooncake.Scheme + slot.MooncakeSession, BufferAddress: slot.BufferAddress})
	if err != nil {
		t.Fatal(err)
	}
	if res.Transport != mooncake.TransportName || slot.MooncakeSession != seg {
		t.Fatalf("send %+v to slot %+v", res, slot)
	}
	got, err := rcv.c.Wait(ctx, "mc-ff", 10*time.Second)
	if err != nil || !bytes.Equal(got, data) {
		t.Fatalf("slot: %v, equal=%t", err, bytes.Equal(got, data))
	}

	stageOn(t, snd, "mc-wrong", 64, 22)
	_, err = snd.c.Send(ctx, "mc-wrong", api.SendRequest{Session: mooncake.Scheme + rcv.advertise, BufferAddress: slot.BufferAddress})
	wantErr(t, err, 502, api.CodeTransferFailed, "mc-wrong", "is "+rcv.advertise+" a Mooncake RPC port")
}
