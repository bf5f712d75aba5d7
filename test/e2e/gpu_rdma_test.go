package e2e

import (
	"bytes"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/ferry-project/ferry/api"
	"github.com/ferry-project/ferry/cuda/cudatest"
	"github.com/ferry-project/ferry/internal/fakecuda"
)

// TestGPUArenaOverRDMA: two ferryd with GPU arenas on the stand-in driver
// (whose device memory is host memory and whose dmabuf is /dev/null), over
// soft-RoCE (make test-rdma). rdma_rxe registers no dmabuf, so auto falls
// back to peer memory and says why; each slot then gets a memory window
// over its device memory, and sends go NIC to NIC from and into device
// memory with no copy, direct through the slots' windows with no peer
// secret, and test/rxevm prints their DATAPLANE line.
// --gpu-registration bounce registers the pinned bounce area once: each
// transfer is copied to and from it by the GPU, with no registration
// and no CPU copy per write, and asks first even between authenticated
// peers.
func TestGPUArenaOverRDMA(t *testing.T) {
	requireRDMA(t)
	env := []string{"env", "LD_LIBRARY_PATH=" + fakecuda.Build(t, fakecuda.Working)}
	dir := t.TempDir()
	secret := secretFile(t, dir, "peer.secret", "gpu-arena-over-rdma-secret-0123456789")
	cases := []struct {
		asked, path, mode, line string
		notTaken                []string // the paths not taken, each failed or not tried
		secret                  bool     // --peer-secret-file
	}{
		{"auto", "peermem", "windows",
			"control_msgs_per_send=0.00 posts_per_send=1.00 signaled_per_send=1.00 reg_mr_per_send=0.00 cpu_copy_bytes_per_send=0",
			[]string{`dmabuf failed: ibv_reg_dmabuf_mr`, "bounce not tried: peermem was taken first"}, false},
		{"bounce", "bounce", "grant",
			"control_msgs_per_send=2.00 posts_per_send=1.00 signaled_per_send=1.00 reg_mr_per_send=0.00 cpu_copy_bytes_per_send=0",
			[]string{"dmabuf not tried: --gpu-registration bounce", "peermem not tried: --gpu-registration bounce"}, true},
	}
	for _, c := range cases {
		t.Run(c.asked, func(t *testing.T) {
			args := []string{"--device", "cuda:0", "--transport", "rdma", "--gpu-registration", c.asked, "--bounce-size", "8MiB"}
			if c.secret {
				args = append(args, "--peer-secret-file", secret)
			}
			snd := startDaemonIn(t, env, dir, c.asked+"-snd", args...)
			rcv := startDaemonIn(t, env, dir, c.asked+"-rcv", args...)
			ctx := ctxT(t)
			for _, d := range []*daemon{snd, rcv} {
				st, err := d.c.Status(ctx)
				if err != nil {
					t.Fatal(err)
				}
				g := st.Registration.GPU
				if g == nil || string(g.Path) != c.path || st.Registration.Mode != api.RegistrationShared || st.Transport.RDMA.WriteMode != c.mode {
					t.Fatalf("registration %+v (gpu %+v), write mode %s; want %s, shared, %s", st.Registration, g, st.Transport.RDMA.WriteMode, c.path, c.mode)
				}
				why := notTaken(g)
				for i, w := range c.notTaken {
					if i >= len(why) || !strings.HasPrefix(why[i], w) {
						t.Fatalf("paths not taken %q, want %q", why, c.notTaken)
					}
				}
				if c.asked == "auto" && !strings.Contains(why[0], "--gpu-registration bounce") {
					t.Errorf("dmabuf's reason %q says nothing of what to do", why[0])
				}
				if d == snd {
					fmt.Println(gpuRegistrationLine(st))
				}
				if v := d.metric(t, fmt.Sprintf(`ferry_gpu_registration{outcome="taken",path=%q}`, c.path)); v != 1 {
					t.Errorf("ferry_gpu_registration taken %s = %v, want 1", c.path, v)
				}
			}

			const sends = 16
			data := make([][]byte, sends+1)
			for i := range data {
				data[i] = randomBytes(embBytes, uint64(100+i))
				if _, err := snd.c.Stage(ctx, fmt.Sprint("g", i), embShape, "bf16", bytes.NewReader(data[i]), embBytes); err != nil {
					t.Fatal(err)
				}
			}
			send := func(i int) {
				t.Helper()
				req := slotFor(t, rcv, fmt.Sprint("g", i), embBytes)
				req.NBytes = embBytes // the slot's size: a direct write where the peer takes them
				if res, err := snd.c.Send(ctx, fmt.Sprint("g", i), req); err != nil || !res.SharedMR || res.Transport != "rdma" {
					t.Fatalf("send %d: %+v, %v", i, res, err)
				}
				if _, err := rcv.c.WaitInfo(ctx, fmt.Sprint("g", i), 30*time.Second); err != nil {
					t.Fatal(err)
				}
			}
			send(0) // warm-up: the session's lane
			sb, rb := snd.metrics(t), rcv.metrics(t)
			for i := 1; i <= sends; i++ {
				send(i)
			}
			sa, ra := snd.metrics(t), rcv.metrics(t)
			delta := func(a, b map[string]float64, series string) float64 { return a[series] - b[series] }
			n := delta(sa, sb, "ferry_rdma_sends_total")
			if n != sends {
				t.Fatalf("%v RDMA sends counted, want %d", n, sends)
			}
			per := func(series string) float64 { return delta(sa, sb, series) / n }
			line := fmt.Sprintf("control_msgs_per_send=%.2f posts_per_send=%.2f signaled_per_send=%.2f reg_mr_per_send=%.2f cpu_copy_bytes_per_send=%.0f",
				per("ferry_rdma_control_messages_total"), per("ferry_rdma_posts_total"), per("ferry_rdma_signaled_total"),
				per(`ferry_registrations_total{mode="per-send"}`), per("ferry_rdma_copied_bytes_total"))
			// Credits come back asynchronously (one per 32 writes a lane
			// carried): printed, bounded, not matched.
			credits, stalls := per("ferry_rdma_credit_messages_total"), delta(sa, sb, "ferry_rdma_credit_stalls_total")
			fmt.Printf("== DATAPLANE arena=gpu registration=%s mode=%s %s credit_msgs_per_send=%.2f credit_stalls=%.0f\n", c.path, c.mode, line, credits, stalls)
			if line != c.line || credits > 1.0/32 || stalls != 0 {
				t.Errorf("DATAPLANE %s credit_msgs_per_send=%.2f credit_stalls=%.0f\nwant      %s credit_msgs_per_send=(at most 0.03) credit_stalls=0", line, credits, stalls, c.line)
			}
			// What the GPU copied besides: nothing where the NIC reaches
			// the arena; each send out of it and each receive into it
			// through the bounce area otherwise.
			wantGPU := 0.0
			if c.path == "bounce" {
				wantGPU = sends * embBytes
			}
			for what, got := range map[string]float64{
				"sender's copies to host":        delta(sa, sb, `ferry_gpu_copied_bytes_total{direction="to_host"}`),
				"receiver's copies to device":    delta(ra, rb, `ferry_gpu_copied_bytes_total{direction="to_device"}`),
				"receiver's RDMA copies":         delta(ra, rb, "ferry_rdma_copied_bytes_total"),
				"receiver's per-write registers": delta(ra, rb, `ferry_registrations_total{mode="per-send"}`) * embBytes,
			} {
				want := wantGPU
				if strings.HasPrefix(what, "receiver's RDMA") || strings.HasPrefix(what, "receiver's per-write") {
					want = 0
				}
				if got != want {
					t.Errorf("%s: %v bytes during the sends, want %v", what, got, want)
				}
			}
			for _, d := range []*daemon{snd, rcv} {
				if v := d.metric(t, "ferry_gpu_bounce_fallbacks_total"); v != 0 {
					t.Errorf("%v copies fell back to pageable memory", v)
				}
			}
			// The bytes, end to end (read back through a copy out).
			for i := range data {
				got, err := rcv.c.Wait(ctx, fmt.Sprint("g", i), 10*time.Second)
				if err != nil || !bytes.Equal(got, data[i]) {
					t.Fatalf("embedding %d: %d bytes back, %v: the bytes differ", i, len(got), err)
				}
			}
		})
	}
}

// notTaken is each registration path not taken: "PATH failed: why" or
// "PATH not tried: why".
func notTaken(g *api.GPURegistrationStatus) []string {
	var why []string
	for _, n := range g.NotTaken {
		outcome := "not tried"
		if n.Failed {
			outcome = "failed"
		}
		why = append(why, fmt.Sprintf("%s %s: %s", n.Path, outcome, strings.TrimPrefix(n.Reason, "not tried: ")))
	}
	return why
}

// gpuRegistrationLine is what make test-rdma and make test-gpu print of a
// GPU arena's registration: the path taken and why the others were not,
// or why there was nothing to register.
func gpuRegistrationLine(st api.Status) string {
	g := st.Registration.GPU
	if g == nil {
		return fmt.Sprintf("== GPU registration: none, transport %s (%s): %s", st.Transport.Name, st.Transport.Reason, st.Registration.Reason)
	}
	path := string(g.Path)
	if path == "" {
		path = "none"
	}
	return fmt.Sprintf("== GPU registration asked=%s path=%s (%s)", g.Asked, path, strings.Join(notTaken(g), "; "))
}

// TestGPURegistrationReport: what a GPU host's ferryd registers its arena
// by, for make test-gpu's report: the path and why not the others, or,
// with no RDMA NIC there, that there is none. On the real driver when
// there is a GPU, else on the stand-in driver.
func TestGPURegistrationReport(t *testing.T) {
	var env []string
	if cudatest.Probe() != nil && !cudatest.Required() {
		env = []string{"env", "LD_LIBRARY_PATH=" + fakecuda.Build(t, fakecuda.Working)}
	}
	d := startDaemonIn(t, env, t.TempDir(), "d", "--device", "cuda:0", "--transport", "auto", "--arena-size", "64MiB", "--bounce-size", "16MiB")
	st, err := d.c.Status(ctxT(t))
	if err != nil {
		t.Fatal(err)
	}
	line := gpuRegistrationLine(st)
	fmt.Println(line)
	switch {
	case st.Transport.Name == "tcp":
		if st.Registration.GPU != nil || !strings.Contains(line, "no usable RDMA port") && !strings.Contains(line, "--transport") {
			t.Errorf("no RDMA: %s", line)
		}
	case st.Registration.GPU == nil || len(st.Registration.GPU.NotTaken) != 2:
		t.Errorf("RDMA with a GPU arena: %s", line)
	}
}
