package e2e

import (
	"bytes"
	"context"
	"fmt"
	"os/exec"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/ferry-project/ferry/api"
)

// The RDMA flow-control tests (docs/rdma.md, "Flow control"): a receiving
// ferryd that is stopped, or starved of CPU, while a sender keeps direct
// writes in flight costs time, never a failed send; one silent for
// longer than io_timeout fails them naming its silence. They run in the
// soft-RoCE VM (make test-rdma), where the NIC goes on placing writes
// while the receiving process is stopped, as a hardware NIC does.

const (
	flowBytes    = 64 << 10
	flowInFlight = 16 // sends in flight at once
)

// flowSend is one 64 KiB tensor staged on the sender, with its slot's
// send request when the slot is made.
type flowSend struct {
	id   string
	data []byte
	req  api.SendRequest
}

// stageFlow stages a flowBytes tensor on snd under id and, with slot,
// makes its slot on rcv: a send of the slot's whole size, which goes as
// one direct write.
func stageFlow(ctx context.Context, snd, rcv *daemon, id string, seed uint64, slot bool) (flowSend, error) {
	f := flowSend{id: id, data: randomBytes(flowBytes, seed)}
	if _, err := snd.c.Stage(ctx, id, []int64{flowBytes}, "u8", bytes.NewReader(f.data), flowBytes); err != nil {
		return f, fmt.Errorf("stage %s: %w", id, err)
	}
	if !slot {
		return f, nil
	}
	sl, err := rcv.c.Receive(ctx, id, flowBytes)
	if err != nil {
		return f, fmt.Errorf("receive slot %s: %w", id, err)
	}
	f.req = api.SendRequest{Session: sl.Session, BufferAddress: sl.BufferAddress, Key: sl.Key, NBytes: flowBytes}
	return f, nil
}

// verifyFlow waits for f's bytes at rcv and compares them.
func verifyFlow(ctx context.Context, rcv *daemon, f flowSend) error {
	got, err := rcv.c.Wait(ctx, f.id, 30*time.Second)
	switch {
	case err != nil:
		return fmt.Errorf("%s: sent, yet the receiver has no data: %w", f.id, err)
	case !bytes.Equal(got, f.data):
		return fmt.Errorf("%s: the receiver holds bytes that differ from those sent", f.id)
	}
	return nil
}

// sendAll sends every one of fs, flowInFlight at a time, and returns each
// send's error by index; started closes once after the first n sends
// completed, whatever their outcome.
func sendAll(ctx context.Context, snd *daemon, fs []flowSend, n int, started chan<- struct{}) []error {
	errs := make([]error, len(fs))
	next := make(chan int, len(fs))
	for i := range fs {
		next <- i
	}
	close(next)
	var done atomic.Int32
	var once sync.Once
	var wg sync.WaitGroup
	for range flowInFlight {
		wg.Go(func() {
			for i := range next {
				_, errs[i] = snd.c.Send(ctx, fs[i].id, fs[i].req)
				if int(done.Add(1)) >= n {
					once.Do(func() { close(started) })
				}
			}
		})
	}
	wg.Wait()
	once.Do(func() { close(started) })
	return errs
}

// flowCtx bounds a flow test's calls: longer than ctxT's minute, since
// the VM under a busy host moves a few dozen sends a second.
func flowCtx(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	t.Cleanup(cancel)
	return ctx
}

// creditStalls reads the sender's credit stalls and the seconds they took.
func creditStalls(t *testing.T, d *daemon) (float64, float64) {
	m := d.metrics(t)
	return m["ferry_rdma_credit_stalls_total"], m["ferry_rdma_credit_stall_seconds_total"]
}

// TestRDMAStoppedReceiver: the receiving ferryd is stopped (SIGSTOP) for
// 50 ms, 500 ms, and until its sender has run out of the lane's receive
// credits (a stall counted: 256 writes posted that the stopped daemon
// took none of), while the sender keeps 16 direct 64 KiB writes in
// flight on one lane, then resumed: every send succeeds and every byte
// arrives. (The last stop is not a fixed time: how many sends a busy
// host's VM makes in one varies, and a fixed 5 s sometimes ended before
// the sender had posted 256.) A stop longer than the sender's io_timeout
// fails the sends waiting on it, each naming the receiver's silence
// (ret=timeout), and the same tensors go once the receiver is back.
func TestRDMAStoppedReceiver(t *testing.T) {
	requireRDMA(t)
	args := []string{"--transport", "rdma", "--max-conns", "1", "--arena-size", "128MiB"}
	snd, rcv := pair(t, args...)
	const untilStall = 0 // the receiver stopped until its sender stalls for credits
	for i, c := range []struct {
		stop  time.Duration
		sends int // untilStall: more than the lane's 256 receives
	}{{50 * time.Millisecond, 120}, {500 * time.Millisecond, 120}, {untilStall, 400}} {
		stop, ctx := c.stop, flowCtx(t)
		fs := make([]flowSend, c.sends)
		for j := range fs {
			var err error
			if fs[j], err = stageFlow(ctx, snd, rcv, fmt.Sprintf("stop%d-%d", i, j), uint64(1000*i+j), true); err != nil {
				t.Fatal(err)
			}
		}
		stalls0, _ := creditStalls(t, snd)
		started := make(chan struct{})
		result := make(chan []error, 1)
		go func() { result <- sendAll(ctx, snd, fs, 2*flowInFlight, started) }()
		<-started
		rcv.pause(t)
		paused := time.Now()
		if stop == untilStall {
			for deadline := time.Now().Add(2 * time.Minute); ; time.Sleep(10 * time.Millisecond) {
				if now, _ := creditStalls(t, snd); now > stalls0 {
					break
				}
				if time.Now().After(deadline) {
					rcv.signal(syscall.SIGCONT)
					t.Fatalf("the receiver stopped for 2 minutes, and its sender with %d sends to make never stalled for credits", c.sends)
				}
			}
		} else {
			time.Sleep(stop) // the stimulus: how long the receiving daemon is stopped
		}
		what := stop.String()
		if stop == untilStall {
			what = fmt.Sprintf("until-credit-stall(%.1fs)", time.Since(paused).Seconds())
		}
		rcv.signal(syscall.SIGCONT)
		failed := 0
		for j, err := range <-result {
			if err != nil {
				failed++
				t.Errorf("stop %s: send %s: %v", what, fs[j].id, err)
			}
		}
		for _, f := range fs {
			if err := verifyFlow(ctx, rcv, f); err != nil {
				t.Errorf("stop %s: %v", what, err)
			}
		}
		stalls, secs := creditStalls(t, snd)
		fmt.Printf("== FLOW stop=%s sends=%d failed=%d credit_stalls=%.0f credit_stall_s=%.3f\n", what, len(fs), failed, stalls-stalls0, secs)
	}
}

// TestRDMASilentReceiver: a receiving ferryd stopped for longer than its
// sender's io_timeout fails the sends that waited on it, each in one
// attempt with a reason naming its silence (the session is sound: no
// teardown, no re-dial), and the same lane carries them once it resumes.
func TestRDMASilentReceiver(t *testing.T) {
	requireRDMA(t)
	args := []string{"--transport", "rdma", "--max-conns", "1", "--arena-size", "128MiB", "--io-timeout", "1s"}
	snd, rcv := pair(t, args...)
	ctx := flowCtx(t)
	fs := make([]flowSend, 320) // past the lane's 256 receives: some must wait for credits
	for j := range fs {
		var err error
		if fs[j], err = stageFlow(ctx, snd, rcv, fmt.Sprintf("silent-%d", j), uint64(j), true); err != nil {
			t.Fatal(err)
		}
	}
	started := make(chan struct{})
	result := make(chan []error, 1)
	go func() { result <- sendAll(ctx, snd, fs, flowInFlight, started) }()
	<-started
	rcv.pause(t)
	errs := <-result // with the receiver stopped, every send left ends
	rcv.signal(syscall.SIGCONT)
	var again []flowSend
	for j, err := range errs {
		if err == nil {
			continue
		}
		again = append(again, fs[j])
		if msg := err.Error(); !strings.Contains(msg, "the receiver made no progress for 1s") || !strings.Contains(msg, "ret=timeout") || !strings.Contains(msg, "after 1 attempt") {
			t.Errorf("send %s with the receiver silent: %v; want a timeout naming the receiver's silence", fs[j].id, err)
		}
	}
	fmt.Printf("== FLOW stop=silent io_timeout=1s sends=%d failed=%d\n", len(fs), len(again))
	if len(again) == 0 {
		t.Fatalf("all %d sends succeeded with the receiver stopped until they ended", len(fs))
	}
	for _, f := range again {
		if _, err := snd.c.Send(ctx, f.id, f.req); err != nil {
			t.Errorf("send %s again with the receiver back: %v", f.id, err)
		}
	}
	for _, f := range fs {
		if err := verifyFlow(ctx, rcv, f); err != nil {
			t.Error(err)
		}
	}
}

// TestRDMABusyCPUs: both CPUs kept busy by two loops at the receiving
// daemon's priority for a 30 s stream (at most 1800 sends) of direct
// 64 KiB writes, 16 in flight: no send fails, and every one is verified
// at the receiver.
func TestRDMABusyCPUs(t *testing.T) {
	requireRDMA(t)
	args := []string{"--transport", "rdma", "--max-conns", "2", "--arena-size", "128MiB"}
	snd, rcv := pair(t, args...)
	for range 2 {
		busy := exec.Command("sh", "-c", "while :; do :; done")
		if err := busy.Start(); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { busy.Process.Kill(); busy.Wait() })
	}
	const stream = 30 * time.Second
	// A freed slot's memory stays in quarantine for 30 s (direct writes
	// pin no slot), so the 128 MiB arena holds 2048 slots of 64 KiB in the
	// stream at most: a fast VM reached that, and its next slots found
	// the arena full. The stream ends at its time or at maxSends.
	const maxSends = 1800
	end := time.Now().Add(stream)
	var sent, failed, issued atomic.Int64
	var wg sync.WaitGroup
	for w := range flowInFlight {
		wg.Go(func() {
			for i := 0; time.Now().Before(end) && issued.Add(1) <= maxSends; i++ {
				ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
				err := busySend(ctx, snd, rcv, fmt.Sprintf("busy%d-%d", w, i), uint64(w<<20|i))
				cancel()
				if err != nil {
					failed.Add(1)
					t.Error(err)
					continue
				}
				sent.Add(1)
			}
		})
	}
	wg.Wait()
	stalls, secs := creditStalls(t, snd)
	fmt.Printf("== FLOW busy=%s verified=%d failed=%d credit_stalls=%.0f credit_stall_s=%.3f\n", stream, sent.Load(), failed.Load(), stalls, secs)
	if sent.Load() < 100 {
		t.Errorf("%d sends verified in %s, want at least 100", sent.Load(), stream)
	}
}

// busySend stages, sends and verifies one tensor.
func busySend(ctx context.Context, snd, rcv *daemon, id string, seed uint64) error {
	f, err := stageFlow(ctx, snd, rcv, id, seed, true)
	if err != nil {
		return err
	}
	if _, err := snd.c.Send(ctx, id, f.req); err != nil {
		return fmt.Errorf("send %s: %w", id, err)
	}
	return verifyFlow(ctx, rcv, f)
}
