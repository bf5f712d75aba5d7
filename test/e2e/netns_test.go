package e2e

import (
	"bytes"
	"fmt"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"
)

// netnsHosts makes two network namespaces joined by a veth pair, with
// link-local addresses (never routed off the link), and removes them when
// the test ends. It skips, saying why, where that is not possible.
func netnsHosts(t *testing.T) (nsA, nsB, ipA, ipB string) {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("skipping: network namespaces need root (run make test as root)")
	}
	if _, err := exec.LookPath("ip"); err != nil {
		t.Skip("skipping: the ip command (iproute2) is not installed; make deps installs it")
	}
	tag := fmt.Sprintf("ferry%d", os.Getpid()%100000)
	nsA, nsB = tag+"a", tag+"b"
	ipA, ipB = "169.254.77.1", "169.254.77.2"
	run := func(args ...string) error {
		out, err := exec.Command("ip", args...).CombinedOutput()
		if err != nil {
			return fmt.Errorf("ip %s: %v: %s", strings.Join(args, " "), err, out)
		}
		return nil
	}
	if err := run("netns", "add", nsA); err != nil {
		t.Skipf("skipping: cannot create network namespaces here: %v", err)
	}
	t.Cleanup(func() { _ = run("netns", "del", nsA) })
	steps := [][]string{
		{"netns", "add", nsB},
		{"link", "add", tag + "va", "netns", nsA, "type", "veth", "peer", "name", tag + "vb", "netns", nsB},
		{"-n", nsA, "addr", "add", ipA + "/30", "dev", tag + "va"},
		{"-n", nsB, "addr", "add", ipB + "/30", "dev", tag + "vb"},
		{"-n", nsA, "link", "set", "lo", "up"},
		{"-n", nsB, "link", "set", "lo", "up"},
		{"-n", nsA, "link", "set", tag + "va", "up"},
		{"-n", nsB, "link", "set", tag + "vb", "up"},
	}
	for i, s := range steps {
		if err := run(s...); err != nil {
			t.Fatal(err)
		}
		if i == 0 {
			t.Cleanup(func() { _ = run("netns", "del", nsB) })
		}
	}
	return nsA, nsB, ipA, ipB
}

func TestPairAcrossNetworkNamespaces(t *testing.T) {
	nsA, nsB, ipA, ipB := netnsHosts(t)
	dir := t.TempDir()
	snd := startDaemonIn(t, []string{"ip", "netns", "exec", nsA}, dir, "snd", "--listen", ipA+":17100")
	rcv := startDaemonIn(t, []string{"ip", "netns", "exec", nsB}, dir, "rcv", "--listen", ipB+":17100")
	if rcv.advertise != ipB+":17100" {
		t.Fatalf("receiver advertises %q, want %s:17100", rcv.advertise, ipB)
	}
	ctx := ctxT(t)
	for i, n := range []int{embBytes, 8 << 20} {
		id := fmt.Sprintf("ns-%d", i)
		data := randomBytes(n, uint64(40+i))
		if _, err := snd.c.Stage(ctx, id, []int64{int64(n)}, "u8", bytes.NewReader(data), int64(n)); err != nil {
			t.Fatal(err)
		}
		if _, err := snd.c.Send(ctx, id, slotFor(t, rcv, id, int64(n))); err != nil {
			t.Fatal(err)
		}
		got, err := rcv.c.Wait(ctx, id, 10*time.Second)
		if err != nil || !bytes.Equal(got, data) {
			t.Fatalf("%s across namespaces: not byte-exact (%v)", id, err)
		}
	}
	ss, err := snd.c.Sessions(ctx)
	if err != nil || len(ss) != 1 || ss[0].Peer != ipB+":17100" || ss[0].State != "connected" {
		t.Fatalf("sender's sessions: %+v %v", ss, err)
	}
}
