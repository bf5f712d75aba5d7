package e2e

import (
	"bytes"
	"fmt"
	"os"
	"testing"
	"time"

	"github.com/ferry-project/ferry/rdma"
)

// TestRDMARails: two ferryd with --rdma-device all on a host with two
// RDMA devices (the soft-RoCE VM's rxe0 and rxe1): status lists both
// rails; a 1 MiB send goes through the first alone; a 64 MiB send is
// striped over both, half the bytes out of each NIC (within 10 %, in
// status and in /metrics), and lands byte-exact.
func TestRDMARails(t *testing.T) {
	requireRDMA(t)
	inv, err := rdma.Discover()
	if err != nil {
		t.Fatal(err)
	}
	if cs, _, err := rdma.ChooseRails(inv, []string{rdma.AllDevices}, rdma.Want{GIDIndex: -1}); err != nil || len(cs) < 2 {
		if os.Getenv("FERRY_RDMA_REQUIRED") == "1" {
			t.Fatalf("FERRY_RDMA_REQUIRED=1 but %d RDMA devices with a usable port (%v): the VM has two", len(cs), err)
		}
		t.Skipf("rails need two RDMA devices with a usable port; %d here", len(cs))
	}
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
