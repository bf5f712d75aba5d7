package e2e

import (
	"bytes"
	"context"
	"fmt"
	"net"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/ferry-project/ferry/api"
	"golang.org/x/sys/unix"
)

// TestRDMARailsLinkDown: two ferryd with --rdma-device all; in the
// middle of a 128 MiB striped send, the second rail's netdev is taken
// down for real (as ip link set down does: its soft-RoCE port goes
// DOWN and stops carrying). The send succeeds in one attempt and lands
// byte-exact; the failed NIC carried nothing after the failover and the
// first NIC the rest; a send while the link stays down goes whole
// through the first NIC, and once it is back up one is striped over
// both again. It prints a RAILS linkdown line (bytes per NIC,
// the time from the link going down to the failover) and brings the
// link back up. It takes down only a virtual netdev (the soft-RoCE VM's
// dummy1), never a real NIC of the host running it.
func TestRDMARailsLinkDown(t *testing.T) {
	cs := requireRails(t)
	victim := cs[1]
	if victim.Netdev == "" || !virtualNetdev(victim.Netdev) || os.Geteuid() != 0 {
		if os.Getenv("FERRY_RDMA_REQUIRED") == "1" {
			t.Fatalf("FERRY_RDMA_REQUIRED=1 but %s's netdev %q is not a virtual one this test (uid %d) may take down", victim.Device, victim.Netdev, os.Geteuid())
		}
		t.Skipf("takes down only a virtual netdev, as root; %s's is %q", victim.Device, victim.Netdev)
	}
	snd, rcv := pair(t, "--transport", "rdma", "--rdma-device", "all", "--arena-size", "192MiB")
	// Longer than ctxT: a failover may wait out the sender's io_timeout
	// (10 s), on a VM that a busy host slows.
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	rails := func() []api.Rail {
		t.Helper()
		st, err := snd.c.Status(ctx)
		if err != nil {
			t.Fatal(err)
		}
		return st.Transport.RDMA.Rails
	}
	if r := rails(); len(r) != 2 || r[1].Device != victim.Device {
		t.Fatalf("status rails %+v: want two, %s second", r, victim.Device)
	}
	type sent struct {
		took time.Duration
		err  error
	}
	// send stages data and sends it, in the background.
	send := func(id string, data []byte) <-chan sent {
		if _, err := snd.c.Stage(ctx, id, []int64{int64(len(data))}, "u8", bytes.NewReader(data), int64(len(data))); err != nil {
			t.Fatal(err)
		}
		slot := slotFor(t, rcv, id, int64(len(data)))
		done := make(chan sent, 1)
		go func() {
			start := time.Now()
			res, err := snd.c.Send(ctx, id, slot)
			if err == nil && res.Attempts != 1 {
				err = fmt.Errorf("the send took %d attempts: the stripe should have failed over within the first", res.Attempts)
			}
			done <- sent{time.Since(start), err}
		}()
		return done
	}
	verify := func(id string, data []byte) {
		t.Helper()
		got, err := rcv.c.Wait(ctx, id, 30*time.Second)
		if err != nil || !bytes.Equal(got, data) {
			t.Fatalf("%s: %d bytes back, %v (equal %v)", id, len(got), err, bytes.Equal(got, data))
		}
	}

	// A striped send with both links up opens the lanes of both rail
	// pairs, and times an undisturbed stripe.
	warm := randomBytes(16<<20, 41)
	w := <-send("linkdown-warm", warm)
	if w.err != nil {
		t.Fatal(w.err)
	}
	verify("linkdown-warm", warm)

	const size = 128 << 20
	data := randomBytes(size, 42)
	before := rails()
	done := send("linkdown", data)
	// The link goes down once the second NIC has carried 4 MiB of this
	// send, about 1/16 of its share: mid-flight.
	deadline := time.Now().Add(30 * time.Second)
	var at []api.Rail
	for at = rails(); at[1].Bytes < before[1].Bytes+4<<20; at = rails() {
		select {
		case r := <-done:
			t.Fatalf("the send ended (%v) before %s carried 4 MiB of it", r.err, victim.Device)
		default:
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s carried under 4 MiB of the striped send in 30 s: rails %+v", victim.Device, at)
		}
		time.Sleep(2 * time.Millisecond) // a poll's pace, not a synchronisation
	}
	downAt := time.Now()
	setLink(t, victim.Netdev, false)
	t.Cleanup(func() { restoreLink(t, victim) })
	waitPortState(t, victim, "DOWN")
	portDown := time.Since(downAt)

	// ferry notices when a write on the dead rail fails: the rail stops
	// counting. Its pieces left are dealt to the others once they have
	// sent their own (a stripe goes in rounds, rails.go), with a WARN
	// line: from then on the lost rail's counters stay as they are.
	lost := func(m map[string]any) bool {
		s, _ := m["message"].(string)
		return m["level"] == "warn" && strings.Contains(s, "lost 1 rail")
	}
	var stopped, redealt time.Duration
	var why map[string]any
	for last := at[1].Bytes; why == nil; {
		if time.Since(downAt) > 45*time.Second {
			t.Fatalf("no failover logged 45 s after %s went down: rails %+v\nsender's log:\n%s", victim.Netdev, rails(), snd.log.dump())
		}
		if now := rails()[1].Bytes; now != last {
			last, stopped = now, time.Since(downAt)
		}
		for _, m := range snd.log.snapshot() {
			if m != nil && lost(m) {
				why, redealt = m, time.Since(downAt)
			}
		}
		time.Sleep(5 * time.Millisecond) // a poll's pace, not a synchronisation
	}
	failedOver := rails()
	t.Logf("the sender's log: %v", why["message"])
	r := <-done
	if r.err != nil {
		t.Fatalf("the striped send with %s down: %v\nsender's log:\n%s", victim.Netdev, r.err, snd.log.dump())
	}
	verify("linkdown", data)
	after := rails()
	moved := [2]uint64{after[0].Bytes - before[0].Bytes, after[1].Bytes - before[1].Bytes}
	switch {
	case after[1].Bytes != failedOver[1].Bytes:
		t.Fatalf("%s carried %d bytes after the failover", victim.Device, after[1].Bytes-failedOver[1].Bytes)
	case moved[0]+moved[1] != size:
		t.Fatalf("the rails counted %v bytes of a %d-byte send", moved, size)
	case moved[1] >= size/2 || moved[1] < at[1].Bytes-before[1].Bytes:
		t.Fatalf("%s carried %d bytes of the send: want at least the %d before the link went down, short of half", victim.Device, moved[1], at[1].Bytes-before[1].Bytes)
	}
	if n := snd.metric(t, "ferry_rdma_stripe_failovers_total"); n != 1 {
		t.Errorf("ferry_rdma_stripe_failovers_total %v, want 1", n)
	}
	// With the link still down, the next striped send tries the rail
	// again, loses it again and goes whole through the other NIC.
	still := randomBytes(16<<20, 43)
	d := <-send("linkdown-still", still)
	if d.err != nil {
		t.Fatalf("a striped send while %s stays down: %v", victim.Netdev, d.err)
	}
	verify("linkdown-still", still)
	if now := rails(); now[1].Bytes != after[1].Bytes || now[0].Bytes != after[0].Bytes+16<<20 {
		t.Fatalf("a 16 MiB send with %s down moved the rails from %+v to %+v: want it all out of %s", victim.Netdev, after, now, now[0].Device)
	}
	if n := snd.metric(t, "ferry_rdma_stripe_failovers_total"); n != 2 {
		t.Errorf("ferry_rdma_stripe_failovers_total %v after a striped send with %s still down, want 2", n, victim.Netdev)
	}
	for _, m := range snd.log.snapshot() {
		if m != nil && lost(m) && m["message"] != why["message"] {
			t.Logf("the sender's log, the link still down: %v", m["message"])
		}
	}
	// Back up, the next striped send uses the NIC again: its lanes
	// are opened anew.
	restoreLink(t, victim)
	back := randomBytes(16<<20, 44)
	b := <-send("linkdown-back", back)
	if b.err != nil {
		t.Fatalf("a striped send once %s is back up: %v", victim.Netdev, b.err)
	}
	verify("linkdown-back", back)
	if now := rails(); now[0].Bytes != after[0].Bytes+24<<20 || now[1].Bytes != after[1].Bytes+8<<20 {
		t.Fatalf("a 16 MiB send with %s back up moved the rails from %+v to %+v: want half out of each", victim.Netdev, after, now)
	}
	fmt.Printf("== RAILS linkdown nic=%s bytes=%d nic=%s bytes=%d (%s down after %d of them) port_down_after=%.2fs %s_last_counted_after=%.2fs redealt_after=%.2fs send=%.1fs striped_16MiB_before=%.2fs 16MiB_while_down=%.2fs 16MiB_back_up=%.2fs (a 128 MiB striped send between two ferryd --rdma-device all, %s taken down mid-send, verified byte-exact, one attempt)\n",
		after[0].Device, moved[0], after[1].Device, moved[1], victim.Netdev, at[1].Bytes-before[1].Bytes,
		portDown.Seconds(), victim.Device, stopped.Seconds(), redealt.Seconds(), r.took.Seconds(), w.took.Seconds(), d.took.Seconds(), b.took.Seconds(), victim.Netdev)
}

// virtualNetdev reports whether netdev is a software device (dummy,
// veth, bridge): no PCI function behind it.
func virtualNetdev(netdev string) bool {
	_, err := os.Stat("/sys/devices/virtual/net/" + netdev)
	return err == nil
}

// setLink sets netdev up or down (SIOCSIFFLAGS, as ip link set does,
// without starting a process: under TCG that alone takes a second).
func setLink(t *testing.T, netdev string, up bool) {
	t.Helper()
	fd, err := unix.Socket(unix.AF_INET, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(fd)
	ifr, err := unix.NewIfreq(netdev)
	if err != nil {
		t.Fatal(err)
	}
	if err := unix.IoctlIfreq(fd, unix.SIOCGIFFLAGS, ifr); err != nil {
		t.Fatalf("reading %s's flags: %v", netdev, err)
	}
	flags := ifr.Uint16() &^ unix.IFF_UP
	if up {
		flags |= unix.IFF_UP
	}
	ifr.SetUint16(flags)
	if err := unix.IoctlIfreq(fd, unix.SIOCSIFFLAGS, ifr); err != nil {
		t.Fatalf("setting %s %s: %v", netdev, map[bool]string{true: "up", false: "down"}[up], err)
	}
}

// waitPortState waits (10 s at most) until c's port says state (sysfs
// "1: DOWN", "4: ACTIVE").
func waitPortState(t *testing.T, c api.NICChoice, state string) {
	t.Helper()
	path := fmt.Sprintf("/sys/class/infiniband/%s/ports/%d/state", c.Device, c.Port)
	deadline := time.Now().Add(10 * time.Second)
	for {
		b, err := os.ReadFile(path)
		if err == nil && strings.HasSuffix(strings.TrimSpace(string(b)), state) {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s says %q (%v), not %s, 10 s on", path, strings.TrimSpace(string(b)), err, state)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// restoreLink brings c's netdev back up and waits until its port is
// ACTIVE and its GID back in the table. Setting a link up that is up
// changes nothing: the test's cleanup calls it again.
func restoreLink(t *testing.T, c api.NICChoice) {
	setLink(t, c.Netdev, true)
	waitPortState(t, c, "ACTIVE")
	path := fmt.Sprintf("/sys/class/infiniband/%s/ports/%d/gids/%d", c.Device, c.Port, c.GIDIndex)
	deadline := time.Now().Add(10 * time.Second)
	for {
		b, err := os.ReadFile(path)
		if err == nil && net.ParseIP(strings.TrimSpace(string(b))).Equal(net.ParseIP(c.GID)) {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s is %q (%v) 10 s after %s came back up, not %s", path, strings.TrimSpace(string(b)), err, c.Netdev, c.GID)
		}
		time.Sleep(10 * time.Millisecond)
	}
}
