package e2e

import (
	"bytes"
	"fmt"
	"os"
	"testing"
	"time"

	"github.com/ferry-project/ferry/api"
	"github.com/ferry-project/ferry/internal/fakecuda"
	"github.com/ferry-project/ferry/rdma"
)

// requireRails skips (or fails, with FERRY_RDMA_REQUIRED=1) unless the
// host has two RDMA devices with a usable port, and returns them.
func requireRails(t *testing.T) []rdma.Choice {
	t.Helper()
	requireRDMA(t)
	inv, err := rdma.Discover()
	if err != nil {
		t.Fatal(err)
	}
	cs, _, err := rdma.ChooseRails(inv, []string{rdma.AllDevices}, rdma.Want{GIDIndex: -1})
	if err != nil || len(cs) < 2 {
		if os.Getenv("FERRY_RDMA_REQUIRED") == "1" {
			t.Fatalf("FERRY_RDMA_REQUIRED=1 but %d RDMA devices with a usable port (%v): the VM has two", len(cs), err)
		}
		t.Skipf("rails need two RDMA devices with a usable port; %d here", len(cs))
	}
	return cs
}

// TestRDMARails: two ferryd with --rdma-device all on a host with two
// RDMA devices (the soft-RoCE VM's rxe0 and rxe1): status lists both
// rails; a 1 MiB send goes through the first alone; a 64 MiB send is
// striped over both, half the bytes out of each NIC (within 10 %, in
// status and in /metrics), and lands byte-exact.
func TestRDMARails(t *testing.T) {
	requireRails(t)
	snd, rcv := pair(t, "--transport", "rdma", "--rdma-device", "all", "--arena-size", "160MiB")
	ctx := ctxT(t)
	st, err := snd.c.Status(ctx)
	if err != nil {
		t.Fatal(err)
	}
	rails := st.Transport.RDMA.Rails
	if len(rails) != 2 || rails[0].Device != st.Transport.RDMA.Chosen.Device || st.Transport.RDMA.StripeMin != 8<<20 {
		t.Fatalf("status rails %+v (chosen %+v, stripe_min %d): want both devices, the chosen first, 8 MiB", rails, st.Transport.RDMA.Chosen, st.Transport.RDMA.StripeMin)
	}

	send := func(id string, n int, seed uint64) {
		t.Helper()
		data := randomBytes(n, seed)
		if _, err := snd.c.Stage(ctx, id, []int64{int64(n)}, "u8", bytes.NewReader(data), int64(n)); err != nil {
			t.Fatal(err)
		}
		if _, err := snd.c.Send(ctx, id, slotFor(t, rcv, id, int64(n))); err != nil {
			t.Fatal(err)
		}
		got, err := rcv.c.Wait(ctx, id, 30*time.Second)
		if err != nil || !bytes.Equal(got, data) {
			t.Fatalf("%d bytes over the rails: %v (equal %v)", n, err, bytes.Equal(got, data))
		}
	}
	nicBytes := func() (status [2]float64, metric [2]float64) {
		st, err := snd.c.Status(ctx)
		if err != nil {
			t.Fatal(err)
		}
		for i, r := range st.Transport.RDMA.Rails {
			status[i] = float64(r.Bytes)
			metric[i] = snd.metric(t, fmt.Sprintf(`ferry_rdma_nic_sent_bytes_total{nic="%s"}`, r.Device))
		}
		return status, metric
	}

	send("rails-small", 1<<20, 31)
	small, _ := nicBytes()
	if small[0] != 1<<20 || small[1] != 0 {
		t.Fatalf("a 1 MiB send left through the rails as %v bytes: want all through %s", small, rails[0].Device)
	}
	send("rails-big", 64<<20, 32)
	status, metric := nicBytes()
	big := [2]float64{status[0] - small[0], status[1] - small[1]}
	if big[0]+big[1] != 64<<20 || big[0] < 0.9*big[1] || big[1] < 0.9*big[0] {
		t.Fatalf("the 64 MiB send left through the rails as %v bytes: want them within 10 %% of each other", big)
	}
	if metric != status {
		t.Errorf("/metrics counts %v bytes per NIC, status %v", metric, status)
	}
	if n := snd.metric(t, "ferry_rdma_striped_sends_total"); n != 1 {
		t.Errorf("ferry_rdma_striped_sends_total %v, want 1", n)
	}
	fmt.Printf("== RAILS e2e nic=%s bytes=%.0f nic=%s bytes=%.0f striped=1 (a 64 MiB send between two ferryd --rdma-device all; a 1 MiB one went through %s alone)\n",
		rails[0].Device, big[0], rails[1].Device, big[1], rails[0].Device)
}

// TestRDMARailsPerDevice: two ferryd with an arena on each of two
// stand-in GPUs (--device cuda:0,1), --rdma-device all and each GPU
// mapped to its own NIC (--affinity cuda:0=<rail 0>,cuda:1=<rail 1>): the
// second GPU's arena is registered on its NIC (status says which), an
// entry staged on each device and sent into a slot on the receiver
// arrives byte-exact, and each send is counted on its device's NIC
// alone (status and /metrics).
func TestRDMARailsPerDevice(t *testing.T) {
	cs := requireRails(t)
	nics := [2]string{cs[0].Device, cs[1].Device}
	env := []string{"env", "LD_LIBRARY_PATH=" + fakecuda.Build(t, fakecuda.Working), "FAKECUDA_BUS_IDS=0000:3b:00.0,0000:86:00.0"}
	dir := t.TempDir()
	args := []string{"--device", "cuda:0,1", "--arena-size", "32MiB", "--bounce-size", "8MiB", "--transport", "rdma",
		"--rdma-device", "all", "--affinity", fmt.Sprintf("cuda:0=%s,cuda:1=%s", nics[0], nics[1])}
	snd := startDaemonIn(t, env, dir, "snd", args...)
	rcv := startDaemonIn(t, env, dir, "rcv", args...)
	ctx := ctxT(t)
	status := func() api.Status {
		t.Helper()
		st, err := snd.c.Status(ctx)
		if err != nil {
			t.Fatal(err)
		}
		return st
	}
	st := status()
	if r := st.Transport.RDMA.Rails; len(r) != 2 || r[0].Device != nics[0] || r[1].Device != nics[1] {
		t.Fatalf("status rails %+v: want %v in that order", r, nics)
	}
	if len(st.Arenas) != 2 {
		t.Fatalf("status arenas %+v: want cuda:0 and cuda:1", st.Arenas)
	}
	for i, a := range st.Arenas {
		if a.NIC == nil || !a.NIC.Registered || len(a.NIC.NICs) != 1 || a.NIC.NICs[0] != nics[i] || a.NIC.NICsWhy != "" {
			t.Fatalf("arena %s's NIC status %+v: want it registered on %s alone", a.Device, a.NIC, nics[i])
		}
	}

	const n = 4<<20 + 5 // several 1 MiB pieces, not a whole number of them
	var sent [2]float64
	for i, dev := range []string{"cuda:0", "cuda:1"} {
		id := "rails-" + dev
		data := randomBytes(n, uint64(70+i))
		if e, err := snd.c.StageOn(ctx, dev, id, []int64{n}, "u8", bytes.NewReader(data), n); err != nil || e.Device != dev {
			t.Fatalf("stage on %s: %+v, %v", dev, e, err)
		}
		before := status().Transport.RDMA.Rails
		if _, err := snd.c.Send(ctx, id, slotFor(t, rcv, id, n)); err != nil {
			t.Fatalf("send from %s: %v", dev, err)
		}
		if got, err := rcv.c.Wait(ctx, id, 30*time.Second); err != nil || !bytes.Equal(got, data) {
			t.Fatalf("%s: %d bytes back, %v: the bytes differ", dev, len(got), err)
		}
		after := status().Transport.RDMA.Rails
		for r := range after {
			moved, want := after[r].Bytes-before[r].Bytes, uint64(0)
			if r == i {
				want = n
			}
			if moved != want {
				t.Fatalf("the send from %s moved %d bytes out of %s, want %d: rails before %+v, after %+v", dev, moved, after[r].Device, want, before, after)
			}
		}
		sent[i] = snd.metric(t, fmt.Sprintf(`ferry_rdma_nic_sent_bytes_total{nic="%s"}`, nics[i]))
		if sent[i] != float64(after[i].Bytes) {
			t.Errorf("/metrics counts %v bytes out of %s, status %d", sent[i], nics[i], after[i].Bytes)
		}
	}
	if v := snd.metric(t, "ferry_rdma_arena_rail_sends_total"); v != 1 {
		t.Errorf("ferry_rdma_arena_rail_sends_total = %v, want 1 (the send from cuda:1)", v)
	}
	fmt.Printf("== RAILS devices cuda:0->%s bytes=%.0f cuda:1->%s bytes=%.0f (an entry staged on each stand-in GPU, sent between two ferryd --device cuda:0,1 --rdma-device all, each verified byte-exact)\n",
		nics[0], sent[0], nics[1], sent[1])
}

// railsDevicePair starts two ferryd with an arena on each of two
// stand-in GPUs (--device cuda:0,1), --rdma-device all, and each GPU
// mapped to its own NIC (--affinity cuda:0=nics[0],cuda:1=nics[1]).
func railsDevicePair(t *testing.T, nics [2]string) (snd, rcv *daemon) {
	t.Helper()
	env := []string{"env", "LD_LIBRARY_PATH=" + fakecuda.Build(t, fakecuda.Working), "FAKECUDA_BUS_IDS=0000:3b:00.0,0000:86:00.0"}
	dir := t.TempDir()
	args := []string{"--device", "cuda:0,1", "--arena-size", "32MiB", "--bounce-size", "8MiB", "--transport", "rdma",
		"--rdma-device", "all", "--affinity", fmt.Sprintf("cuda:0=%s,cuda:1=%s", nics[0], nics[1])}
	return startDaemonIn(t, env, dir, "snd", args...), startDaemonIn(t, env, dir, "rcv", args...)
}

// TestRDMARailsCrossDevice: between two such ferryd, an entry staged on
// the sender's cuda:0 and sent into a slot on the receiver's cuda:1
// leaves through cuda:0's NIC and comes in through cuda:1's, the NIC
// the slot's key names (its rail byte), and lands byte-exact: the
// sender's bytes per NIC and the receiver's received bytes per NIC, in
// status and /metrics, say which NICs carried it.
func TestRDMARailsCrossDevice(t *testing.T) {
	cs := requireRails(t)
	nics := [2]string{cs[0].Device, cs[1].Device}
	snd, rcv := railsDevicePair(t, nics)
	ctx := ctxT(t)
	rails := func(d *daemon) (api.RDMAStatus, []api.Rail) {
		t.Helper()
		st, err := d.c.Status(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if r := st.Transport.RDMA.Rails; len(r) != 2 || r[0].Device != nics[0] || r[1].Device != nics[1] {
			t.Fatalf("status rails %+v: want %v in that order", r, nics)
		}
		return *st.Transport.RDMA, st.Transport.RDMA.Rails
	}

	const n = 4<<20 + 5
	const id = "rails-cross"
	data := randomBytes(n, 90)
	if e, err := snd.c.StageOn(ctx, "cuda:0", id, []int64{n}, "u8", bytes.NewReader(data), n); err != nil || e.Device != "cuda:0" {
		t.Fatalf("stage on cuda:0: %+v, %v", e, err)
	}
	slot, err := rcv.c.ReceiveOn(ctx, "cuda:1", id, n)
	if err != nil {
		t.Fatal(err)
	}
	if slot.Key.Rail() != 1 {
		t.Fatalf("the key of a slot on cuda:1 names rail %d, want 1 (%s, cuda:1's NIC)", slot.Key.Rail(), nics[1])
	}
	_, outBefore := rails(snd)
	_, inBefore := rails(rcv)
	if _, err := snd.c.Send(ctx, id, api.SendRequest{Session: slot.Session, BufferAddress: slot.BufferAddress, Key: slot.Key}); err != nil {
		t.Fatalf("send from cuda:0 into a slot on cuda:1: %v", err)
	}
	if got, err := rcv.c.Wait(ctx, id, 30*time.Second); err != nil || !bytes.Equal(got, data) {
		t.Fatalf("%d bytes back, %v: the bytes differ", len(got), err)
	}
	_, outAfter := rails(snd)
	rst, inAfter := rails(rcv)
	var out, in [2]uint64
	for r := range 2 {
		out[r] = outAfter[r].Bytes - outBefore[r].Bytes
		in[r] = inAfter[r].ReceivedBytes - inBefore[r].ReceivedBytes
	}
	if out != [2]uint64{n, 0} || in != [2]uint64{0, n} {
		t.Fatalf("the send left through the sender's NICs as %v bytes and came in through the receiver's as %v: want all out of %s (cuda:0's), all in through %s (cuda:1's)",
			out, in, nics[0], nics[1])
	}
	for r, nic := range nics {
		if m := rcv.metric(t, fmt.Sprintf(`ferry_rdma_nic_received_bytes_total{nic="%s"}`, nic)); m != float64(inAfter[r].ReceivedBytes) {
			t.Errorf("/metrics counts %v bytes in through %s, status %d", m, nic, inAfter[r].ReceivedBytes)
		}
	}
	fmt.Printf("== RAILS cross cuda:0->cuda:1 out=%s in=%s bytes=%d mode=%s (an entry staged on the sender's cuda:0, sent into a slot on the receiver's cuda:1 whose key names %s, verified byte-exact)\n",
		nics[0], nics[1], n, rst.WriteMode, nics[1])

	// A client's GPU memory on cuda:1, lent as a region, is registered on
	// cuda:1's NIC too, and its slots' keys name that NIC.
	own := startCUDAOwner(t, fakecuda.Build(t, fakecuda.Working), n, 91)
	if g, err := rcv.c.RegisterCUDARegion(ctx, "kv1", "cuda:1", own.handle, 0, n); err != nil || g.NIC == nil || !g.NIC.Registered {
		t.Fatalf("register a CUDA region on cuda:1: %+v, %v", g, err)
	}
	const rid = "rails-cross-region"
	if _, err := snd.c.StageOn(ctx, "cuda:0", rid, []int64{n}, "u8", bytes.NewReader(data), n); err != nil {
		t.Fatal(err)
	}
	rslot, err := rcv.c.ReceiveWith(ctx, api.ReceiveRequest{ReqID: rid, NBytes: n, Region: "kv1"})
	if err != nil {
		t.Fatal(err)
	}
	if rslot.Key.Rail() != 1 {
		t.Fatalf("the key of a slot in a CUDA region on cuda:1 names rail %d, want 1 (%s)", rslot.Key.Rail(), nics[1])
	}
	_, inBefore = rails(rcv)
	if _, err := snd.c.Send(ctx, rid, api.SendRequest{Session: rslot.Session, BufferAddress: rslot.BufferAddress, Key: rslot.Key}); err != nil {
		t.Fatalf("send from cuda:0 into a CUDA region's slot on cuda:1: %v", err)
	}
	if _, err := rcv.c.WaitInfo(ctx, rid, 30*time.Second); err != nil {
		t.Fatal(err)
	}
	if got := own.read(t, 0, n); !bytes.Equal(got, data) {
		t.Fatal("the send did not land in the owner's GPU memory")
	}
	_, inAfter = rails(rcv)
	if in1 := inAfter[1].ReceivedBytes - inBefore[1].ReceivedBytes; in1 != n || inAfter[0].ReceivedBytes != inBefore[0].ReceivedBytes {
		t.Fatalf("into the CUDA region: %d bytes in through %s, %d through %s; want all through %s",
			in1, nics[1], inAfter[0].ReceivedBytes-inBefore[0].ReceivedBytes, nics[0], nics[1])
	}
	fmt.Printf("== RAILS cross-region cuda:0->region on cuda:1 in=%s bytes=%d (a client's GPU memory lent as a region on cuda:1, its slot's key naming %s, verified in the owner's memory)\n",
		nics[1], n, nics[1])
}
