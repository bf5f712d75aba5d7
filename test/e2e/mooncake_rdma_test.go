package e2e

import (
	"bytes"
	"fmt"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/ferry-project/ferry/api"
	"github.com/ferry-project/ferry/mooncake"
	"github.com/ferry-project/ferry/mooncake/mooncaketest"
)

// Mooncake over RDMA, in the soft-RoCE VM: the test peer is an RDMA
// segment (its buffer registered, its descriptor protocol rdma), so
// ferryd's sends to it go through the connection handshake and plain
// RDMA WRITEs; and ferryd with --transport rdma --mooncake-listen serves
// an rdma segment that the peer writes into, a notify completing the slot.

// ferry → Mooncake over RDMA: byte-exact from the shared registration, in
// one attempt, on a mooncake-rdma session; a range outside the segment's
// buffers is refused naming them.
func TestMooncakeRDMASendIntoASegment(t *testing.T) {
	requireRDMA(t)
	snd := raceFree(t, startDaemon(t, t.TempDir(), "snd", "--transport", "rdma"))
	peer := startMooncakePeer(t, mooncaketest.Config{RDMA: true, BufferSize: 4 << 20})
	ctx := ctxT(t)
	session := mooncake.Scheme + peer.Name()
	for i, n := range []int{embBytes, 3<<20 + 5} {
		id := fmt.Sprintf("mcr-%d", i)
		data := stageOn(t, snd, id, n, uint64(20+i))
		addr := peer.Base() + 4096
		res, err := snd.c.Send(ctx, id, api.SendRequest{Session: session, BufferAddress: addr})
		if err != nil {
			t.Fatalf("%d bytes: %v", n, err)
		}
		if res.Transport != mooncake.RDMATransportName || !res.SharedMR || res.Attempts != 1 {
			t.Errorf("%d bytes: send result %+v, want %s from the shared registration in one attempt", n, res, mooncake.RDMATransportName)
		}
		if !bytes.Equal(peer.Bytes(addr, n), data) {
			t.Fatalf("%d bytes: the segment holds other bytes than were sent", n)
		}
	}
	stageOn(t, snd, "mcr-out", 4096, 30)
	_, err := snd.c.Send(ctx, "mcr-out", api.SendRequest{Session: session, BufferAddress: peer.Base() + 4<<20 - 100})
	if err == nil || !bytes.Contains([]byte(err.Error()), []byte("lies in none of the buffers")) {
		t.Fatalf("a send past the segment's buffer: %v, want a refusal naming its buffers", err)
	}
}

// Mooncake → ferry over RDMA: the descriptor says rdma and lists the
// Mooncake pool, with its own keys; the peer's WRITEs land in a receive
// slot (in the pool), which arrives when the
// peer's notify names its buffer_address; ferryd then writes back to the
// peer over the same endpoint. A notify naming no slot is a WARN line. A
// freed slot's memory stays quarantined (and shutdown does not wait on it).
func TestMooncakeRDMAWritesIntoReceiveSlots(t *testing.T) {
	requireRDMA(t)
	rcv, seg := startMooncakeSegment(t, "--transport", "rdma")
	peer := startMooncakePeer(t, mooncaketest.Config{RDMA: true, BufferSize: 4 << 20})
	ctx := ctxT(t)
	slot, err := rcv.c.ReceiveWith(ctx, api.ReceiveRequest{ReqID: "mcr-in", NBytes: embBytes, Mooncake: true})
	if err != nil {
		t.Fatal(err)
	}
	data := randomBytes(embBytes, 40)
	half := uint64(embBytes / 2)
	desc, err := peer.WriteRDMA(ctx, seg, slot.BufferAddress, data[:half], "")
	if err != nil {
		t.Fatal(err)
	}
	if desc.Protocol != "rdma" || len(desc.Devices) != 1 || len(desc.Buffers) != 1 || len(desc.Buffers[0].RKey) != 1 {
		t.Fatalf("descriptor %+v: want protocol rdma, one device, the Mooncake pool as one buffer with its rkey", desc)
	}
	st, err := rcv.c.Status(ctx)
	if err != nil {
		t.Fatal(err)
	}
	pool, b := st.Mooncake.RDMAPool, desc.Buffers[0]
	if pool == nil || b.Addr != pool.Addr || b.Length != uint64(pool.Size) || pool.Size != st.Memory.Size/4 || pool.Slots != 1 ||
		slot.BufferAddress < pool.Addr || slot.BufferAddress+embBytes > pool.Addr+uint64(pool.Size) {
		t.Fatalf("status's Mooncake pool %+v, the descriptor's buffer [%#x, +%d), the slot at %#x: want the buffer exactly the pool, a quarter of the %d-byte arena, holding the slot",
			pool, b.Addr, b.Length, slot.BufferAddress, st.Memory.Size)
	}
	if info, err := rcv.c.WaitInfo(ctx, "mcr-in", 0); err != nil || info.Arrived {
		t.Fatalf("the slot arrived before any notify: %+v %v", info, err)
	}
	if _, err := peer.WriteRDMA(ctx, seg, slot.BufferAddress+half, data[half:], fmt.Sprintf("%#x", slot.BufferAddress)); err != nil {
		t.Fatal(err)
	}
	got, err := rcv.c.Wait(ctx, "mcr-in", 10*time.Second)
	if err != nil || !bytes.Equal(got, data) {
		t.Fatalf("the notified slot: %v, equal=%t", err, bytes.Equal(got, data))
	}
	// Freed, the slot's memory stays in use for the quarantine: a late
	// one-sided WRITE must not land in a newer slot or staged entry.
	if err := rcv.c.FreeReceive(ctx, "mcr-in"); err != nil {
		t.Fatal(err)
	}
	if st, err := rcv.c.Status(ctx); err != nil || st.Receives != 0 || st.Memory.Used < embBytes {
		t.Fatalf("after freeing the slot: %d receives, %d arena bytes used (%v); want 0 and its %d bytes quarantined", st.Receives, st.Memory.Used, err, embBytes)
	}

	if err := mooncake.SendNotify(ctx, seg, mooncake.NotifyDesc{Name: peer.Name(), NotifyMsg: "12345"}); err != nil {
		t.Fatal(err)
	}
	rcv.log.wait(t, 5*time.Second, "the WARN line of a notify naming no slot", logSays("warn", "completed no receive slot"))

	back := stageOn(t, rcv, "mcr-back", 8192, 41)
	res, err := rcv.c.Send(ctx, "mcr-back", api.SendRequest{Session: mooncake.Scheme + peer.Name(), BufferAddress: peer.Base() + 8192})
	if err != nil {
		t.Fatal(err)
	}
	if res.Transport != mooncake.RDMATransportName || !bytes.Equal(peer.Bytes(peer.Base()+8192, len(back)), back) {
		t.Fatalf("ferryd writing back to the peer: %+v, equal=%t", res, bytes.Equal(peer.Bytes(peer.Base()+8192, len(back)), back))
	}

	// A slot made without "mooncake" lies outside the pool: a peer
	// writing there under the listed rkey is refused by ferryd's NIC.
	keyed, err := rcv.c.ReceiveWith(ctx, api.ReceiveRequest{ReqID: "mcr-keyed", NBytes: 4096})
	if err != nil {
		t.Fatal(err)
	}
	if keyed.BufferAddress+4096 > pool.Addr && keyed.BufferAddress < pool.Addr+uint64(pool.Size) {
		t.Fatalf("a slot made without mooncake at %#x lies in the Mooncake pool %+v", keyed.BufferAddress, pool)
	}
	tg, ok, err := desc.RDMATarget(b.Addr, 1)
	if err != nil || !ok {
		t.Fatalf("the pool's RDMA target: %v %v", ok, err)
	}
	err = peer.WriteRawRDMA(ctx, seg, tg, keyed.BufferAddress, randomBytes(4096, 43))
	if err == nil || !strings.Contains(err.Error(), "REM_ACCESS_ERR") {
		t.Fatalf("a Mooncake peer's write into a slot made without mooncake: %v; want REM_ACCESS_ERR", err)
	}
	if info, err := rcv.c.WaitInfo(ctx, "mcr-keyed", 0); err != nil || info.Arrived || info.Received != 0 {
		t.Fatalf("the slot the refused write aimed at: %+v %v", info, err)
	}
}

// A write the peer's NIC refuses (its descriptor lists a wrong rkey)
// fails with the completion status; each attempt tears the session and
// its QPs down and handshakes afresh; the answer is transfer_failed
// naming the session, nbytes and the status. Once the peer advertises
// its true key, the next send delivers.
func TestMooncakeRDMAFailedWritesTearDown(t *testing.T) {
	requireRDMA(t)
	snd := raceFree(t, startDaemon(t, t.TempDir(), "snd", "--transport", "rdma", "--send-retries", "1"))
	peer := startMooncakePeer(t, mooncaketest.Config{RDMA: true, BufferSize: 1 << 20})
	ctx := ctxT(t)
	session := mooncake.Scheme + peer.Name()
	peer.AdvertiseWrongRKey(true)
	data := stageOn(t, snd, "mcr-bad", embBytes, 50)
	_, err := snd.c.Send(ctx, "mcr-bad", api.SendRequest{Session: session, BufferAddress: peer.Base()})
	want := fmt.Sprintf("session=%s, nbytes=%d, ret=REM_ACCESS_ERR", session, embBytes)
	if err == nil || !strings.Contains(err.Error(), "transfer_failed") || !strings.Contains(err.Error(), want) {
		t.Fatalf("a send the NIC refuses: %v, want transfer_failed with %q", err, want)
	}
	if n := peer.Connects(); n != 2 {
		t.Fatalf("%d connection handshakes for 2 attempts, want one each (the failed QPs torn down)", n)
	}
	peer.AdvertiseWrongRKey(false)
	res, err := snd.c.Send(ctx, "mcr-bad", api.SendRequest{Session: session, BufferAddress: peer.Base()})
	if err != nil || res.Attempts != 1 || !bytes.Equal(peer.Bytes(peer.Base(), embBytes), data) {
		t.Fatalf("the send once the key is right: %+v, %v", res, err)
	}
}

// Per-send registration into a Mooncake segment: the send registers its
// range, says shared_mr false, and delivers; a ferryd whose arena has no
// shared registration serves its Mooncake segment over TCP, saying why.
func TestMooncakeRDMAPerSendRegistration(t *testing.T) {
	requireRDMA(t)
	snd, _ := startMooncakeSegment(t, "--transport", "rdma", "--rdma-registration", "per-send")
	line := snd.log.wait(t, 5*time.Second, "the segment's protocol", msg("serving as a Mooncake segment"))
	if line["protocol"] != "tcp" {
		t.Errorf("a per-send ferryd serves its segment as %v, want tcp", line["protocol"])
	}
	snd.log.wait(t, 5*time.Second, "why it speaks TCP only", logSays("warn", "speaks TCP only"))
	peer := startMooncakePeer(t, mooncaketest.Config{RDMA: true, BufferSize: 1 << 20})
	ctx := ctxT(t)
	data := stageOn(t, snd, "mcr-ps", embBytes, 60)
	res, err := snd.c.Send(ctx, "mcr-ps", api.SendRequest{Session: mooncake.Scheme + peer.Name(), BufferAddress: peer.Base()})
	if err != nil {
		t.Fatal(err)
	}
	if res.SharedMR || res.Transport != mooncake.RDMATransportName || !bytes.Equal(peer.Bytes(peer.Base(), embBytes), data) {
		t.Fatalf("per-send into a Mooncake segment: %+v (equal %t)", res, bytes.Equal(peer.Bytes(peer.Base(), embBytes), data))
	}
	if st, err := snd.c.Status(ctx); err != nil || st.Registration.PerSend != 1 {
		t.Errorf("status %+v, %v; want one per-send registration", st.Registration, err)
	}
}

// Notifies naming no receive slot, as fast as a stranger can send them,
// each with an 8 KiB notify_msg: at most 10 WARN lines a second, each
// with the message cut to 256 bytes, and summaries counting the rest.
func TestMooncakeRDMANotifyWarningsAreLimited(t *testing.T) {
	requireRDMA(t)
	rcv, seg := startMooncakeSegment(t, "--transport", "rdma")
	ctx := ctxT(t)
	long := strings.Repeat("7", 8<<10)
	const flood = 100
	start := time.Now()
	for range flood {
		if err := mooncake.SendNotify(ctx, seg, mooncake.NotifyDesc{Name: "stranger", NotifyMsg: long}); err != nil {
			t.Fatal(err)
		}
	}
	elapsed := time.Since(start)
	refused := logSays("warn", "completed no receive slot")
	logged, suppressed := rcv.log.waitAccounted(t, "mooncake", flood, refused)
	if windows := int(elapsed/time.Second) + 2; logged > 10*windows || suppressed == 0 {
		t.Fatalf("%d notifies naming no slot in %s: %d WARN lines, %d suppressed; want at most %d lines", flood, elapsed, logged, suppressed, 10*windows)
	}
	for _, m := range rcv.log.snapshot() {
		if m != nil && refused(m) {
			if s := m["message"].(string); len(s) > 1024 || !strings.Contains(s, "(8192 bytes)") {
				t.Fatalf("a %d-byte WARN line %.300q: want the notify_msg cut to 256 bytes, naming its length", len(s), s)
			}
		}
	}
	rcv.alive(t)
}

// Mooncake → ferry over RDMA without a notify, as transfer_sync_write
// sends none: the slot stays pending until its receiving client, told by
// its own channel, completes it; then the bytes are the written ones.
func TestMooncakeRDMAWriteCompletedByTheReceivingClient(t *testing.T) {
	requireRDMA(t)
	rcv, seg := startMooncakeSegment(t, "--transport", "rdma")
	peer := startMooncakePeer(t, mooncaketest.Config{RDMA: true, BufferSize: 4 << 20})
	ctx := ctxT(t)
	slot, err := rcv.c.ReceiveWith(ctx, api.ReceiveRequest{ReqID: "mcr-nonotify", NBytes: embBytes, Mooncake: true})
	if err != nil {
		t.Fatal(err)
	}
	data := randomBytes(embBytes, 42)
	if _, err := peer.WriteRDMA(ctx, seg, slot.BufferAddress, data, ""); err != nil {
		t.Fatal(err)
	}
	if info, err := rcv.c.WaitInfo(ctx, "mcr-nonotify", 0); err != nil || info.Arrived {
		t.Fatalf("the slot arrived with no notify and no word from its client: %+v %v", info, err)
	}
	if info, err := rcv.c.CompleteReceive(ctx, "mcr-nonotify"); err != nil || !info.Arrived {
		t.Fatalf("completing the slot: %+v %v", info, err)
	}
	got, err := rcv.c.Wait(ctx, "mcr-nonotify", 10*time.Second)
	if err != nil || !bytes.Equal(got, data) {
		t.Fatalf("the completed slot: %v, equal=%t", err, bytes.Equal(got, data))
	}
}

// ferry ← Mooncake over RDMA: POST /v1/reads of a Mooncake segment's
// buffer goes by plain RDMA READs under the rkey its descriptor lists, on
// the endpoint the writes to it took (one handshake for both), into the
// reader's arena or a region it registered, with no CPU copy (its
// DATAPLANE line), byte for byte. A piece outside the segment's buffers
// is refused naming the piece and the segment, nothing posted; a READ the
// peer's NIC refuses (a wrong rkey in its descriptor) is transfer_failed
// naming the completion status, and once the peer lists its true key the
// next read fetches the descriptor again and delivers.
func TestMooncakeRDMAReadsFromASegment(t *testing.T) {
	requireRDMA(t)
	snd := raceFree(t, startDaemon(t, t.TempDir(), "snd", "--transport", "rdma"))
	peer := startMooncakePeer(t, mooncaketest.Config{RDMA: true, BufferSize: 4 << 20})
	ctx := ctxT(t)
	session := mooncake.Scheme + peer.Name()
	const n = 3<<20 + 5
	data := stageOn(t, snd, "mcr-read", n, 70)
	addr := peer.Base() + 4096
	if _, err := snd.c.Send(ctx, "mcr-read", api.SendRequest{Session: session, BufferAddress: addr}); err != nil {
		t.Fatal(err)
	}
	const reads = 8
	before := snd.metrics(t)
	for i := 0; i < reads; i++ {
		at, m := uint64(i*4099), uint64(1<<20+i)
		got, err := snd.c.Read(ctx, api.ReadRequest{Session: peer.Name(), Pieces: [][2]uint64{{addr + at, m}, {addr + n - 10, 10}}})
		if err != nil {
			t.Fatalf("read %d of the segment: %v", i, err)
		}
		if !bytes.Equal(got, append(append([]byte(nil), data[at:at+m]...), data[n-10:]...)) {
			t.Fatalf("read %d: other bytes than the segment holds", i)
		}
	}
	after := snd.metrics(t)
	f, into := regionMemory(t, "read-into", 1<<20)
	if _, err := snd.c.RegisterRegionWith(ctx, api.RegionRequest{Name: "read-into", NBytes: 1 << 20}, f); err != nil {
		t.Fatal(err)
	}
	if res, err := snd.c.ReadInto(ctx, api.ReadRequest{Session: session, Pieces: [][2]uint64{{addr + 5, 1 << 19}, {addr, 100}},
		Region: "read-into", RegionOffsets: []uint64{0, 1<<20 - 100}}); err != nil || res.NBytes != 1<<19+100 {
		t.Fatalf("a read into a region: %+v, %v", res, err)
	}
	if !bytes.Equal(into[:1<<19], data[5:5+1<<19]) || !bytes.Equal(into[1<<20-100:], data[:100]) {
		t.Fatal("a read into a region: the region holds other bytes than the segment")
	}
	region := snd.metrics(t)
	per := func(a, b map[string]float64, series string, k float64) float64 { return (a[series] - b[series]) / k }
	line := fmt.Sprintf("posts_per_read=%.2f work_requests_per_read=%.2f cpu_copy_bytes_per_read=%.0f into_region_work_requests=%.0f into_region_cpu_copy_bytes=%.0f handshakes=%d",
		per(after, before, "ferry_rdma_posts_total", reads), per(after, before, "ferry_rdma_work_requests_total", reads), per(after, before, "ferry_rdma_copied_bytes_total", reads),
		per(region, after, "ferry_rdma_work_requests_total", 1), per(region, after, "ferry_rdma_copied_bytes_total", 1), peer.Connects())
	fmt.Printf("== DATAPLANE read ferry<-mooncake rdma pieces_per_read=2 reads=%d byte_exact=true %s\n", reads, line)
	if per(after, before, "ferry_rdma_posts_total", reads) < 2 || per(after, before, "ferry_rdma_copied_bytes_total", reads) != 0 ||
		per(region, after, "ferry_rdma_work_requests_total", 1) < 2 || per(region, after, "ferry_rdma_copied_bytes_total", 1) != 0 || peer.Connects() != 1 {
		t.Errorf("DATAPLANE %s: want RDMA READs posted (2 pieces a read), no CPU copy, and the one handshake the send made", line)
	}

	// Bounds: checked against the descriptor before anything is posted.
	_, err := snd.c.Read(ctx, api.ReadRequest{Session: session, Pieces: [][2]uint64{{addr, 8}, {peer.Base() + 4<<20 - 8, 16}}})
	wantErr(t, err, http.StatusBadRequest, api.CodeRefused, "piece 1", "lies in none of the buffers of Mooncake segment "+peer.Name())
	if st := snd.metrics(t); st["ferry_rdma_work_requests_total"] != region["ferry_rdma_work_requests_total"] {
		t.Errorf("a refused read posted %.0f work requests", st["ferry_rdma_work_requests_total"]-region["ferry_rdma_work_requests_total"])
	}

	// The NIC's refusal: a clear failure, then recovery. A peer whose
	// descriptor lists a wrong rkey from the start.
	bad := startMooncakePeer(t, mooncaketest.Config{RDMA: true, BufferSize: 1 << 20})
	bad.AdvertiseWrongRKey(true)
	_, err = snd.c.Read(ctx, api.ReadRequest{Session: bad.Name(), Pieces: [][2]uint64{{bad.Base(), 64}}})
	wantErr(t, err, http.StatusBadGateway, api.CodeTransferFailed, "rdma read of 64 bytes", "REM_ACCESS_ERR")
	bad.AdvertiseWrongRKey(false)
	if _, err := snd.c.Read(ctx, api.ReadRequest{Session: bad.Name(), Pieces: [][2]uint64{{bad.Base(), 64}}}); err != nil {
		t.Fatalf("the read once the peer lists its true key: %v (the descriptor is fetched again after a failed read)", err)
	}
}
