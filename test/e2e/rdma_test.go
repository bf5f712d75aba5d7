package e2e

import (
	"bufio"
	"bytes"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/ferry-project/ferry/api"
	"github.com/ferry-project/ferry/rdma"
	"github.com/ferry-project/ferry/transport/peer"
)

// The RDMA tests need a usable RDMA port: the soft-RoCE VM (make
// test-rdma) has one and sets FERRY_RDMA_REQUIRED=1, so that there they
// fail rather than skip without it.

var rdmaPort = sync.OnceValue(func() error {
	inv, err := rdma.Discover()
	if err == nil {
		_, err = rdma.Choose(inv, rdma.Want{GIDIndex: -1})
	}
	return err
})

func requireRDMA(t *testing.T) {
	t.Helper()
	if err := rdmaPort(); err != nil {
		if os.Getenv("FERRY_RDMA_REQUIRED") == "1" {
			t.Fatalf("FERRY_RDMA_REQUIRED=1 but: %v", err)
		}
		t.Skipf("%v: make test-rdma runs this in the soft-RoCE VM", err)
	}
}

// TestRDMATransportChoice: --transport auto takes RDMA when there is a
// usable port and says why not otherwise; --transport rdma without one
// refuses to start, naming what is missing.
func TestRDMATransportChoice(t *testing.T) {
	dir := t.TempDir()
	d := startDaemon(t, dir, "auto", "--transport", "auto")
	st, err := d.c.Status(ctxT(t))
	if err != nil {
		t.Fatal(err)
	}
	chosen := d.log.wait(t, 5*time.Second, `"transport chosen"`, msg("transport chosen"))
	if st.Transport.RDMA == nil {
		t.Fatalf("status has no RDMA inventory under --transport auto: %+v", st.Transport)
	}
	if rdmaPort() != nil {
		if os.Getenv("FERRY_RDMA_REQUIRED") == "1" {
			t.Fatalf("FERRY_RDMA_REQUIRED=1 but: %v", rdmaPort())
		}
		if st.Transport.Name != "tcp" || !strings.Contains(st.Transport.Reason, "no usable RDMA port") ||
			st.Registration.Mode != "none" || chosen["transport"] != "tcp" {
			t.Errorf("auto without RDMA: status %+v, registration %+v, log %v", st.Transport, st.Registration, chosen)
		}
		cmd := exec.Command(filepath.Join(bin, "ferryd"), "--socket", filepath.Join(dir, "rdma.sock"),
			"--listen", "127.0.0.1:0", "--arena-size", "64MiB", "--transport", "rdma")
		out, err := cmd.CombinedOutput()
		if err == nil || !strings.Contains(string(out), "--transport rdma: no usable RDMA port") {
			t.Errorf("ferryd --transport rdma without RDMA: %v, %q; want a refusal to start naming what is missing", err, out)
		}
		return
	}
	c := st.Transport.RDMA.Chosen
	if st.Transport.Name != "rdma" || c == nil || c.Device == "" || c.Why == "" || chosen["transport"] != "rdma" {
		t.Fatalf("auto with RDMA: status %+v, log %v", st.Transport, chosen)
	}
	t.Logf("chose %s port %d GID %d (%s): %s", c.Device, c.Port, c.GIDIndex, c.GID, c.Why)
	if st.Registration.Mode != "shared" || st.Registration.Bytes != 64<<20 || st.Registration.Millis <= 0 {
		t.Errorf("registration %+v, want the 64 MiB arena registered once, with its time", st.Registration)
	}
	// soft-RoCE has memory windows: every slot gets one.
	if r := st.Transport.RDMA; r.WriteMode != "windows" || r.WriteModeWhy != "" {
		t.Errorf("write mode %q (%s), want windows", r.WriteMode, r.WriteModeWhy)
	}
	out, err := exec.Command(filepath.Join(bin, "ferryctl"), "--socket", d.socket, "status").CombinedOutput()
	if err != nil || !strings.Contains(string(out), "protection windows\n") {
		t.Errorf("ferryctl status: %v\n%s\nwant a line \"protection windows\"", err, out)
	}
	d.log.wait(t, 5*time.Second, "the registration line", msg("arena registered with the NIC once"))
}

// TestRDMASendUploadAndZeroCopy: two daemons send an embedding over RDMA
// from the shared registration, staged by upload and zero-copy.
func TestRDMASendUploadAndZeroCopy(t *testing.T) {
	requireRDMA(t)
	snd, rcv := pair(t, "--transport", "rdma", "--slow-threshold", "1ns")
	ctx := ctxT(t)
	data := randomBytes(embBytes, 11)
	if _, err := snd.c.Stage(ctx, "rd-up", embShape, "bf16", bytes.NewReader(data), int64(len(data))); err != nil {
		t.Fatal(err)
	}
	res, err := snd.c.Send(ctx, "rd-up", slotFor(t, rcv, "rd-up", embBytes))
	if err != nil {
		t.Fatal(err)
	}
	if res.Transport != "rdma" || !res.SharedMR || res.Attempts != 1 {
		t.Errorf("send result %+v, want rdma from the shared registration in one attempt", res)
	}
	got, err := rcv.c.Wait(ctx, "rd-up", 10*time.Second)
	if err != nil || !bytes.Equal(got, data) {
		t.Fatalf("upload-staged embedding over RDMA: %v (equal %v)", err, bytes.Equal(got, data))
	}
	line := snd.log.wait(t, 5*time.Second, "slow transfer", msg("slow transfer"))
	if line["transport"] != "rdma" || line["shared_mr"] != true {
		t.Errorf("slow-transfer line %v, want transport rdma and shared_mr true", line)
	}

	// Zero-copy: the client writes into the arena through its mapping.
	data = randomBytes(embBytes, 12)
	sl, err := snd.c.Slice(ctx, "rd-zc", api.SliceRequest{Shape: embShape, DType: "bf16"})
	if err != nil {
		t.Fatal(err)
	}
	writeInPlace(t, snd, sl, data)
	if _, err := snd.c.Commit(ctx, "rd-zc", embShape, "bf16"); err != nil {
		t.Fatal(err)
	}
	if res, err = snd.c.Send(ctx, "rd-zc", slotFor(t, rcv, "rd-zc", embBytes)); err != nil || !res.SharedMR {
		t.Fatalf("zero-copy send over RDMA: %+v, %v", res, err)
	}
	info, err := rcv.c.WaitInfo(ctx, "rd-zc", 10*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	if in := readInPlace(t, rcv, info); !bytes.Equal(in, data) {
		t.Fatal("zero-copy embedding read in place differs from what was staged")
	}
	sessions, err := snd.c.Sessions(ctx)
	if err != nil || len(sessions) != 1 || sessions[0].Transport != "rdma" {
		t.Errorf("sessions %+v, %v; want one rdma session", sessions, err)
	}
	for _, d := range []*daemon{snd, rcv} {
		if st, err := d.c.Status(ctx); err != nil || st.Registration.PerSend != 0 {
			t.Errorf("status %+v, %v; want no per-send registration", st.Registration, err)
		}
	}
}

// TestRDMAPerSendRegistration: with the shared registration off, each
// send registers its range, says so in its result and in an INFO line
// (shared_mr=false, as the seeds' log did), and still delivers.
func TestRDMAPerSendRegistration(t *testing.T) {
	requireRDMA(t)
	snd, rcv := pair(t, "--transport", "rdma", "--rdma-registration", "per-send")
	ctx := ctxT(t)
	st, err := snd.c.Status(ctx)
	if err != nil || st.Registration.Mode != "per-send" || !strings.Contains(st.Registration.Reason, "per-send") {
		t.Fatalf("status registration %+v, %v; want per-send with its reason", st.Registration, err)
	}
	// No shared registration, no windows and no direct writes: a grant
	// per write, and status says why.
	if r := st.Transport.RDMA; r.WriteMode != "grant" || !strings.Contains(r.WriteModeWhy, "registered per send") {
		t.Errorf("write mode %q (%s), want grant, for want of a shared registration", r.WriteMode, r.WriteModeWhy)
	}
	data := randomBytes(embBytes, 13)
	if _, err := snd.c.Stage(ctx, "rd-ps", embShape, "bf16", bytes.NewReader(data), int64(len(data))); err != nil {
		t.Fatal(err)
	}
	res, err := snd.c.Send(ctx, "rd-ps", slotFor(t, rcv, "rd-ps", embBytes))
	if err != nil {
		t.Fatal(err)
	}
	if res.SharedMR || res.Transport != "rdma" {
		t.Errorf("send result %+v, want rdma with shared_mr false", res)
	}
	line := snd.log.wait(t, 5*time.Second, "a per-send INFO line", func(m map[string]any) bool {
		return m["req_id"] == "rd-ps" && (m["message"] == "transfer with a per-send registration" || m["message"] == "slow transfer")
	})
	if line["level"] != "info" || line["shared_mr"] != false || line["req_id"] != "rd-ps" {
		t.Errorf("per-send line %v, want INFO with shared_mr false", line)
	}
	got, err := rcv.c.Wait(ctx, "rd-ps", 10*time.Second)
	if err != nil || !bytes.Equal(got, data) {
		t.Fatalf("per-send embedding: %v", err)
	}
	for _, d := range []*daemon{snd, rcv} {
		if st, err := d.c.Status(ctx); err != nil || st.Registration.PerSend != 1 {
			t.Errorf("status %+v, %v; want one per-send registration on each side", st.Registration, err)
		}
	}
}

// TestRDMAFallbackToTCPPeer: an RDMA daemon sending to a TCP-only one
// falls back to TCP for that session, and logs it.
func TestRDMAFallbackToTCPPeer(t *testing.T) {
	requireRDMA(t)
	dir := t.TempDir()
	snd := startDaemon(t, dir, "snd", "--transport", "rdma")
	rcv := startDaemon(t, dir, "rcv", "--transport", "tcp")
	ctx := ctxT(t)
	data := randomBytes(embBytes, 14)
	if _, err := snd.c.Stage(ctx, "rd-fb", embShape, "bf16", bytes.NewReader(data), int64(len(data))); err != nil {
		t.Fatal(err)
	}
	res, err := snd.c.Send(ctx, "rd-fb", slotFor(t, rcv, "rd-fb", embBytes))
	if err != nil || res.Transport != "tcp" {
		t.Fatalf("send to a TCP-only peer: %+v, %v; want it over tcp", res, err)
	}
	snd.log.wait(t, 5*time.Second, "the fallback line", func(m map[string]any) bool {
		s, _ := m["message"].(string)
		return strings.Contains(s, "serves no RDMA") && strings.Contains(s, "falls back to TCP")
	})
	if got, err := rcv.c.Wait(ctx, "rd-fb", 10*time.Second); err != nil || !bytes.Equal(got, data) {
		t.Fatalf("embedding over the fallback: %v", err)
	}
}

// TestRDMAPeerDownRetry: over RDMA as over TCP, a send to a peer that
// died tears the session down, re-dials, retries, and fails with
// transfer_failed naming what broke, keeping the staged data; the resend
// to the restarted peer delivers.
func TestRDMAPeerDownRetry(t *testing.T) {
	requireRDMA(t)
	peerDownScenario(t, "rd-down", "rdma")
}

// TestRDMAReceiverKilledMidTransfer: the receiving ferryd is SIGKILLed
// after it granted a 32 MiB write and before the sender posted it (the
// sender held stopped in between), so the write's RDMA WRITEs go to a
// queue pair the kernel destroyed with the process. The sender fails the
// request clearly, keeps its data, resends it to the restarted receiver,
// and leaks nothing (receiverKilledScenario).
func TestRDMAReceiverKilledMidTransfer(t *testing.T) {
	requireRDMA(t)
	dir := t.TempDir()
	var port string
	snd := receiverKilledScenario(t, func(name string, extra ...string) *daemon {
		// A later flag wins: the sender waits through its own stop.
		args := append(append([]string{"--transport", "rdma"}, extra...), "--io-timeout", "30s", "--send-timeout", "45s")
		if name == "rcv2" {
			args = append(args, "--listen", "127.0.0.1:"+port)
		}
		d := startDaemon(t, dir, name, args...)
		if name == "rcv" {
			_, port, _ = net.SplitHostPort(d.listen)
		}
		return d
	}, grantWhileSenderStopped)
	line := snd.log.wait(t, time.Second, "the first attempt's warning", func(m map[string]any) bool {
		return m["level"] == "warn" && m["req_id"] == "kill-1" && m["attempt"] == 1.0
	})
	if e, _ := line["error"].(string); !strings.Contains(e, "work requests in flight") {
		t.Errorf("the first attempt failed before its RDMA WRITEs were posted: %v", line)
	}
}

// TestRDMASlotFreedWhileWriteLands: the receiver grants a write into a
// slot and frees the slot before the write lands (the sender held
// stopped between the grant and its post, the only way to keep an RDMA
// write in flight on a loopback device). slotFreedScenario checks that no
// newer slot gets that memory meanwhile and that the late write is
// discarded with a WARN line.
func TestRDMASlotFreedWhileWriteLands(t *testing.T) {
	requireRDMA(t)
	// The sender waits through its own stop.
	snd, rcv := pair(t, "--transport", "rdma", "--io-timeout", "30s", "--send-timeout", "45s")
	slotFreedScenario(t, snd, rcv, func(start func() <-chan sendResult) (<-chan sendResult, func()) {
		rcv.pause(t)
		sent := start()
		release := grantWhileSenderStopped(t, snd, rcv)
		if info, err := rcv.c.WaitInfo(ctxT(t), "old", 0); err != nil || info.WritesInFlight != 1 {
			t.Fatalf("the granted write is not in flight at the receiver: %+v %v", info, err)
		}
		return sent, release
	})
}

// grantWhileSenderStopped, with the receiver stopped and a write's header
// on its way to it, stops the sender and lets the receiver grant the
// write; the sender goes on, and posts the write, when the function it
// returns runs.
func grantWhileSenderStopped(t *testing.T, snd, rcv *daemon) func() {
	t.Helper()
	_, port, _ := net.SplitHostPort(rcv.listen)
	p, _ := strconv.ParseUint(port, 10, 16)
	waitTCPQueue(t, "the write's header queued at the stopped receiver", func(local, remote uint16, queued int) bool {
		return local == uint16(p) && queued >= peer.HeaderSize
	})
	snd.pause(t)
	rcv.signal(syscall.SIGCONT)
	waitTCPQueue(t, "the grant queued at the stopped sender", func(local, remote uint16, queued int) bool {
		return remote == uint16(p) && queued >= peer.ReplySize+16
	})
	return func() { snd.signal(syscall.SIGCONT) }
}

// waitTCPQueue waits (20 s at most) for an established loopback TCP
// connection whose local and remote ports and unread bytes match: the
// kernel's tables (/proc/net/tcp) are the only witness of bytes a
// stopped process has not read, so this polls them.
func waitTCPQueue(t *testing.T, what string, match func(local, remote uint16, queued int) bool) {
	t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	tick := time.NewTicker(2 * time.Millisecond)
	defer tick.Stop()
	for ; ; <-tick.C {
		for _, table := range []string{"/proc/net/tcp", "/proc/net/tcp6"} {
			f, err := os.Open(table)
			if err != nil {
				continue
			}
			sc := bufio.NewScanner(f)
			for sc.Scan() {
				// sl local_address rem_address st tx_queue:rx_queue ...
				fs := strings.Fields(sc.Text())
				if len(fs) < 5 || fs[3] != "01" { // ESTABLISHED
					continue
				}
				local, lok := hexPort(fs[1])
				remote, rok := hexPort(fs[2])
				_, rx, _ := strings.Cut(fs[4], ":")
				queued, err := strconv.ParseUint(rx, 16, 32)
				if lok && rok && err == nil && match(local, remote, int(queued)) {
					f.Close()
					return
				}
			}
			f.Close()
		}
		if time.Now().After(deadline) {
			t.Fatalf("no TCP connection shows %s within 20s", what)
		}
	}
}

// hexPort is the port of a /proc/net/tcp address (ADDR:PORT, in hex).
func hexPort(a string) (uint16, bool) {
	_, p, ok := strings.Cut(a, ":")
	n, err := strconv.ParseUint(p, 16, 16)
	return uint16(n), ok && err == nil
}
