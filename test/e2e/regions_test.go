package e2e

import (
	"bytes"
	"encoding/json"
	"fmt"
	"net/http"
	"os"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/ferry-project/ferry/api"
	"github.com/ferry-project/ferry/client"
	"github.com/ferry-project/ferry/internal/memlimit"
)

// regionMemory makes a sealed memfd of n bytes and maps it here.
func regionMemory(t *testing.T, name string, n int64) (*os.File, []byte) {
	t.Helper()
	f, err := client.NewRegionFile(name, n)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { f.Close() })
	mem, err := unix.Mmap(int(f.Fd()), 0, int(n), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { unix.Munmap(mem) })
	return f, mem
}

// reversePages moves pages 0..63 of the sender's region "kv" (smem),
// reversed, into a slot for reqID made at the second MiB of the
// receiver's region "kv" (rmem), in one batch of 64 writes, none merged;
// it checks every page in the receiver's memory and returns the slot's
// descriptor and what the receiver says of it.
func reversePages(t *testing.T, snd, rcv *daemon, reqID string, smem, rmem []byte, wait time.Duration) (api.ReceiveSlot, api.Receive) {
	t.Helper()
	ctx := ctxT(t)
	slot, err := rcv.c.ReceiveWith(ctx, api.ReceiveRequest{ReqID: reqID, NBytes: 64 * 4096, Region: "kv", RegionOffset: 1 << 20})
	if err != nil {
		t.Fatal(err)
	}
	var items [][]int64
	for i := int64(0); i < 64; i++ {
		items = append(items, []int64{0, i * 4096, 0, (63 - i) * 4096, 4096})
	}
	started, err := snd.c.StartTransfer(ctx, api.TransferRequest{
		Sources: []api.TransferSource{{Region: "kv"}}, Destinations: []api.ReceiveSlot{slot}, Items: items,
	})
	if err != nil {
		t.Fatal(err)
	}
	if done, err := snd.c.WaitTransfer(ctx, started.ID, wait); err != nil || done.State != api.TransferDone {
		t.Fatalf("transfer: %+v, %v", done, err)
	}
	info, err := rcv.c.WaitInfo(ctx, reqID, wait)
	if err != nil {
		t.Fatal(err)
	}
	for i := 0; i < 64; i++ {
		if !bytes.Equal(rmem[1<<20+(63-i)*4096:1<<20+(64-i)*4096], smem[i*4096:(i+1)*4096]) {
			t.Fatalf("page %d did not land in the receiver's own memory", i)
		}
	}
	return slot, info
}

// unregisterKV unregisters each daemon's region "kv" and checks that
// none is left.
func unregisterKV(t *testing.T, ds ...*daemon) {
	t.Helper()
	ctx := ctxT(t)
	for _, d := range ds {
		if err := d.c.UnregisterRegion(ctx, "kv", 5*time.Second); err != nil {
			t.Fatal(err)
		}
		if gs, err := d.c.Regions(ctx); err != nil || len(gs) != 0 {
			t.Fatalf("regions after unregistering: %+v, %v", gs, err)
		}
	}
}

func TestRegionToRegionMovesClientMemoryWithoutTheArena(t *testing.T) {
	snd, rcv := pair(t)
	ctx := ctxT(t)
	const n = 4 << 20
	sf, smem := regionMemory(t, "kv-src", n)
	rf, rmem := regionMemory(t, "kv-dst", n)
	copy(smem, randomBytes(n, 41))
	if g, err := snd.c.RegisterRegion(ctx, "kv", sf, n); err != nil || g.NBytes != n || g.Kind != "host" || g.NIC != nil {
		t.Fatalf("register: %+v, %v", g, err)
	}
	if _, err := rcv.c.RegisterRegion(ctx, "kv", rf, n); err != nil {
		t.Fatal(err)
	}
	slot, info := reversePages(t, snd, rcv, "layer-3", smem, rmem, 10*time.Second)
	if !info.Arrived || info.Region != "kv" || info.Offset != 1<<20 || info.ArenaFile != "" {
		t.Fatalf("slot: %+v", info)
	}
	// The bytes went from one client's memory to the other's: neither
	// arena held any of them.
	for _, d := range []*daemon{snd, rcv} {
		if st, err := d.c.Status(ctx); err != nil || st.Memory.Used != 0 {
			t.Fatalf("arena used %d bytes (%v): a region transfer went through the arena", st.Memory.Used, err)
		}
	}
	// The raw read serves the region's bytes too.
	data, err := rcv.c.Wait(ctx, "layer-3", time.Second)
	if err != nil || !bytes.Equal(data, rmem[1<<20:1<<20+64*4096]) {
		t.Fatalf("GET of a region slot: %d bytes, %v", len(data), err)
	}

	// A region with a live slot is not taken back; once the slot is
	// freed it is, and its name is free again.
	wantErr(t, rcv.c.UnregisterRegion(ctx, "kv", time.Second), 409, api.CodeBusy, "layer-3")
	if err := rcv.c.FreeReceive(ctx, "layer-3"); err != nil {
		t.Fatal(err)
	}
	unregisterKV(t, snd, rcv)
	_, err = snd.c.StartTransfer(ctx, api.TransferRequest{
		Sources: []api.TransferSource{{Region: "kv"}}, Destinations: []api.ReceiveSlot{slot}, Items: api.Items{{0, 0, 0, 0, 4096}},
	})
	wantErr(t, err, 404, api.CodeNotFound, "region named kv")
}

func TestRegionRefusesMemoryItCannotHoldSafely(t *testing.T) {
	d := startDaemon(t, t.TempDir(), "d")
	ctx := ctxT(t)
	// A memfd not sealed against shrinking could be cut short under
	// ferryd's mapping, killing it on the next touch.
	fd, err := unix.MemfdCreate("unsealed", unix.MFD_CLOEXEC|unix.MFD_ALLOW_SEALING)
	if err != nil {
		t.Fatal(err)
	}
	unsealed := os.NewFile(uintptr(fd), "unsealed")
	defer unsealed.Close()
	unsealed.Truncate(1 << 20)
	_, err = d.c.RegisterRegion(ctx, "u", unsealed, 1<<20)
	wantErr(t, err, 400, api.CodeBadRequest, "F_SEAL_SHRINK")

	// A plain file allows no seals at all.
	plain, err := os.CreateTemp(t.TempDir(), "plain")
	if err != nil {
		t.Fatal(err)
	}
	defer plain.Close()
	plain.Truncate(1 << 20)
	_, err = d.c.RegisterRegion(ctx, "p", plain, 1<<20)
	wantErr(t, err, 400, api.CodeBadRequest, "memfd_create")

	// Asking for more than the memfd holds.
	small, _ := regionMemory(t, "small", 4096)
	_, err = d.c.RegisterRegion(ctx, "s", small, 8192)
	wantErr(t, err, 400, api.CodeBadRequest, "4096 bytes")

	// Without a descriptor, over the ordinary client.
	_, err = d.c.ReceiveWith(ctx, api.ReceiveRequest{ReqID: "x", NBytes: 1, Region: "none"})
	wantErr(t, err, 404, api.CodeNotFound, "region named none")

	// The one that is right, then a slot past its end and two that overlap.
	ok, _ := regionMemory(t, "ok", 8192)
	if _, err := d.c.RegisterRegion(ctx, "ok", ok, 8192); err != nil {
		t.Fatal(err)
	}
	_, err = d.c.RegisterRegion(ctx, "ok", ok, 8192)
	wantErr(t, err, 409, api.CodeExists, "ok")
	_, err = d.c.ReceiveWith(ctx, api.ReceiveRequest{ReqID: "past", NBytes: 4096, Region: "ok", RegionOffset: 4097})
	wantErr(t, err, 400, api.CodeBadRequest, "do not fit region ok")
	if _, err := d.c.ReceiveWith(ctx, api.ReceiveRequest{ReqID: "a", NBytes: 4096, Region: "ok"}); err != nil {
		t.Fatal(err)
	}
	_, err = d.c.ReceiveWith(ctx, api.ReceiveRequest{ReqID: "b", NBytes: 4096, Region: "ok", RegionOffset: 2048})
	wantErr(t, err, 400, api.CodeBadRequest, "overlap", "req_id a")
	d.alive(t)
}

func TestUnregisterWaitsForTheWritesReadingTheRegion(t *testing.T) {
	snd, rcv := pair(t)
	ctx := ctxT(t)
	const n = 1 << 20
	sf, smem := regionMemory(t, "src", n)
	copy(smem, randomBytes(n, 42))
	if _, err := snd.c.RegisterRegion(ctx, "src", sf, n); err != nil {
		t.Fatal(err)
	}
	slot, err := rcv.c.Receive(ctx, "held", n)
	if err != nil {
		t.Fatal(err)
	}
	// A receiver that takes no data: the transfer's write cannot complete.
	rcv.pause(t)
	started, err := snd.c.StartTransfer(ctx, api.TransferRequest{
		Sources: []api.TransferSource{{Region: "src"}}, Destinations: []api.ReceiveSlot{slot}, Items: [][]int64{{0, 0, 0, 0, n}},
	})
	if err != nil {
		t.Fatal(err)
	}
	wantErr(t, snd.c.UnregisterRegion(ctx, "src", 200*time.Millisecond), 504, api.CodeTimeout, "closing", "1 transfer")
	gs, err := snd.c.Regions(ctx)
	if err != nil || len(gs) != 1 || !gs[0].Closing || gs[0].Uses != 1 {
		t.Fatalf("a region unregistered under a running transfer: %+v, %v; want it listed, closing, in use", gs, err)
	}
	// Closed to new use meanwhile.
	_, err = snd.c.StartTransfer(ctx, api.TransferRequest{
		Sources: []api.TransferSource{{Region: "src"}}, Destinations: []api.ReceiveSlot{slot}, Items: [][]int64{{0, 0, 0, 0, 1}},
	})
	wantErr(t, err, 404, api.CodeNotFound, "src")
	rcv.signal(syscall.SIGCONT)
	if done, err := snd.c.WaitTransfer(ctx, started.ID, 20*time.Second); err != nil || done.State != api.TransferDone {
		t.Fatalf("transfer after the receiver resumed: %+v, %v", done, err)
	}
	// The transfer's end was the region's last use: it is unmapped and
	// gone. Its teardown runs on a goroutine of its own, which a DELETE
	// waits for (204), or finds done (404).
	if err := snd.c.UnregisterRegion(ctx, "src", 10*time.Second); err != nil && client.Code(err) != api.CodeNotFound {
		t.Fatalf("unregistering the region once the transfer ended: %v; want it gone, or going", err)
	}
	if gs, err := snd.c.Regions(ctx); err != nil || len(gs) != 0 {
		t.Fatalf("regions once the transfer ended: %+v, %v", gs, err)
	}
	wantErr(t, snd.c.UnregisterRegion(ctx, "src", time.Second), 404, api.CodeNotFound, "src")
	got, err := rcv.c.Wait(ctx, "held", 10*time.Second)
	if err != nil || !bytes.Equal(got, smem) {
		t.Fatalf("the held write's bytes: %d, %v", len(got), err)
	}
}

func TestRegisterWithoutADescriptorSaysHow(t *testing.T) {
	d := startDaemon(t, t.TempDir(), "d")
	hc := http.Client{Transport: &http.Transport{DialContext: client.UnixDialer(d.socket)}}
	resp, err := hc.Post("http://ferryd/v1/regions", "application/json", strings.NewReader(`{"name":"r","nbytes":4096}`))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var env api.ErrorBody
	if err := json.NewDecoder(resp.Body).Decode(&env); err != nil {
		t.Fatal(err)
	}
	if resp.StatusCode != 400 || !strings.Contains(env.Error.Message, "SCM_RIGHTS") {
		t.Fatalf("register without a descriptor: %d %+v", resp.StatusCode, env)
	}
}

// A client cannot have ferryd pin more host memory than max_region_bytes
// allows, 75% of the host's memory by default (or of the limit of the
// cgroup ferryd runs in, this test's, where that is less): a memfd sized
// past it, however sparse, is refused before ferryd maps it.
// --max-region-bytes sets the bound, which regions share.
func TestRegionsPastMaxRegionBytesAreRefused(t *testing.T) {
	var si unix.Sysinfo_t
	if err := unix.Sysinfo(&si); err != nil {
		t.Fatal(err)
	}
	total := int64(si.Totalram) * int64(si.Unit)
	base, of := total, "of physical memory"
	cg, limited, err := memlimit.Host.Read()
	if err != nil {
		t.Fatal(err)
	}
	if limited && cg.Bytes < base {
		base, of = cg.Bytes, "of ferryd's cgroup memory limit"
	}
	dir := t.TempDir()
	d := startDaemon(t, dir, "d")
	ctx := ctxT(t)
	st, err := d.c.Status(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if want := base / 4 * 3; st.Regions.HostLimit < want-1<<20 || st.Regions.HostLimit > want+1<<20 {
		t.Errorf("by default regions may hold %d bytes of host memory; want 75%% of %d (the host's %d, cgroup limit %+v)", st.Regions.HostLimit, base, total, cg)
	}
	sparse, err := client.NewRegionFile("sparse", total)
	if err != nil {
		t.Fatal(err)
	}
	defer sparse.Close()
	_, err = d.c.RegisterRegion(ctx, "sparse", sparse, total)
	wantErr(t, err, 413, api.CodeTooLarge, "region sparse", "max_region_bytes is 75% "+of)
	d.alive(t)

	small := startDaemon(t, dir, "small", "--max-region-bytes", "1MiB")
	kv, _ := regionMemory(t, "kv", 768<<10)
	if _, err := small.c.RegisterRegion(ctx, "kv", kv, 768<<10); err != nil {
		t.Fatal(err)
	}
	more, _ := regionMemory(t, "more", 512<<10)
	_, err = small.c.RegisterRegion(ctx, "more", more, 512<<10)
	wantErr(t, err, 409, api.CodeBusy, "region more", "max_region_bytes 1MiB")
	if st, err := small.c.Status(ctx); err != nil || st.Regions != (api.RegionsStatus{Count: 1, HostBytes: 768 << 10, HostLimit: 1 << 20}) {
		t.Fatalf("status: %+v, %v", st.Regions, err)
	}
}

// TestRDMARegionToRegionWithoutACopy: over RDMA each ferryd registers a
// host region with its NIC when the region is registered (GET
// /v1/regions says so), and a batch transfer from one's region into a
// slot in the other's moves the bytes with no CPU copy on either side:
// the copied-bytes, bounce and staging counters stay still while the
// writes go. A send that fills a slot in the region goes direct in
// windows mode. Unregistering drops the registration and the mapping.
func TestRDMARegionToRegionWithoutACopy(t *testing.T) {
	requireRDMA(t)
	snd, rcv := pair(t, "--transport", "rdma")
	ctx := ctxT(t)
	const n = 4 << 20
	sf, smem := regionMemory(t, "kv-src", n)
	rf, rmem := regionMemory(t, "kv-dst", n)
	copy(smem, randomBytes(n, 43))
	for _, c := range []struct {
		d *daemon
		f *os.File
	}{{snd, sf}, {rcv, rf}} {
		g, err := c.d.c.RegisterRegion(ctx, "kv", c.f, n)
		if err != nil || g.NIC == nil || !g.NIC.Registered || g.NIC.Error != "" {
			t.Fatalf("register over rdma: %+v (nic %+v), %v; want it registered with the NIC", g, g.NIC, err)
		}
	}
	st, err := rcv.c.Status(ctx)
	if err != nil || st.Transport.RDMA == nil {
		t.Fatalf("receiver's status: %+v, %v", st.Transport, err)
	}
	counters := []string{"ferry_rdma_copied_bytes_total", "ferry_rdma_bounced_sends_total", "ferry_rdma_staged_receives_total", "ferry_rdma_sends_total"}
	before := map[*daemon]map[string]float64{snd: snd.metrics(t), rcv: rcv.metrics(t)}
	reversePages(t, snd, rcv, "layer-5", smem, rmem, 30*time.Second)
	delta := map[string]float64{}
	for _, d := range []*daemon{snd, rcv} {
		after := d.metrics(t)
		for _, c := range counters {
			delta[c] += metricSum(after, c) - metricSum(before[d], c)
		}
	}
	fmt.Printf("== REGIONS rdma mode=%s writes=%.0f copied_bytes=%.0f bounced_sends=%.0f staged_receives=%.0f\n", st.Transport.RDMA.WriteMode,
		delta["ferry_rdma_sends_total"], delta["ferry_rdma_copied_bytes_total"], delta["ferry_rdma_bounced_sends_total"], delta["ferry_rdma_staged_receives_total"])
	if delta["ferry_rdma_sends_total"] != 64 || delta["ferry_rdma_copied_bytes_total"] != 0 || delta["ferry_rdma_bounced_sends_total"] != 0 || delta["ferry_rdma_staged_receives_total"] != 0 {
		t.Errorf("counters moved by %v; want 64 RDMA writes and nothing copied, bounced or staged", delta)
	}
	if err := rcv.c.FreeReceive(ctx, "layer-5"); err != nil {
		t.Fatal(err)
	}

	// A send of a staged embedding that fills a slot in the region: in
	// windows mode it goes direct through the slot's window.
	emb := randomBytes(embBytes, 44)
	if _, err := snd.c.Stage(ctx, "emb-5", embShape, "bf16", bytes.NewReader(emb), int64(len(emb))); err != nil {
		t.Fatal(err)
	}
	eslot, err := rcv.c.ReceiveWith(ctx, api.ReceiveRequest{ReqID: "emb-5", NBytes: embBytes, Region: "kv", RegionOffset: 2 << 20})
	if err != nil {
		t.Fatal(err)
	}
	direct := metricSum(snd.metrics(t), "ferry_rdma_direct_sends_total")
	if _, err := snd.c.Send(ctx, "emb-5", api.SendRequest{Session: eslot.Session, BufferAddress: eslot.BufferAddress, Key: eslot.Key, NBytes: eslot.NBytes}); err != nil {
		t.Fatal(err)
	}
	if _, err := rcv.c.WaitInfo(ctx, "emb-5", 30*time.Second); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(rmem[2<<20:2<<20+embBytes], emb) {
		t.Fatal("the embedding did not land in the receiver's region")
	}
	direct = metricSum(snd.metrics(t), "ferry_rdma_direct_sends_total") - direct
	fmt.Printf("== REGIONS rdma mode=%s whole-slot send into a region: direct=%.0f\n", st.Transport.RDMA.WriteMode, direct)
	if st.Transport.RDMA.WriteMode == "windows" && direct != 1 {
		t.Errorf("a whole-slot send into a region slot in windows mode went direct %v times, want 1", direct)
	}
	if err := rcv.c.FreeReceive(ctx, "emb-5"); err != nil {
		t.Fatal(err)
	}
	unregisterKV(t, snd, rcv)
	for _, d := range []*daemon{snd, rcv} {
		if got := metricSum(d.metrics(t), "ferry_region_registrations_total", `outcome="registered"`); got != 1 {
			t.Errorf("ferry_region_registrations_total{outcome=\"registered\"} %v, want 1", got)
		}
	}
}
