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

// hosts is two network namespaces joined by a veth pair: host A (ns, ip
// and dev end with A) and host B.
type hosts struct {
	nsA, nsB   string
	ipA, ipB   string
	devA, devB string // the veth's two ends
}

// netnsHosts makes two network namespaces joined by a veth pair, with
// link-local addresses (never routed off the link), and removes them when
// the test ends. It skips, saying why, where that is not possible.
func netnsHosts(t *testing.T) *hosts {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("skipping: network namespaces need root (run make test as root)")
	}
	if _, err := exec.LookPath("ip"); err != nil {
		t.Skip("skipping: the ip command (iproute2) is not installed; make deps installs it")
	}
	tag := fmt.Sprintf("ferry%d", os.Getpid()%100000)
	h := &hosts{nsA: tag + "a", nsB: tag + "b", ipA: "169.254.77.1", ipB: "169.254.77.2", devA: tag + "va", devB: tag + "vb"}
	if err := run("ip", "netns", "add", h.nsA); err != nil {
		t.Skipf("skipping: cannot create network namespaces here: %v", err)
	}
	t.Cleanup(func() { _ = run("ip", "netns", "del", h.nsA) })
	steps := [][]string{
		{"netns", "add", h.nsB},
		{"link", "add", h.devA, "netns", h.nsA, "type", "veth", "peer", "name", h.devB, "netns", h.nsB},
		{"-n", h.nsA, "addr", "add", h.ipA + "/30", "dev", h.devA},
		{"-n", h.nsB, "addr", "add", h.ipB + "/30", "dev", h.devB},
		{"-n", h.nsA, "link", "set", "lo", "up"},
		{"-n", h.nsB, "link", "set", "lo", "up"},
		{"-n", h.nsA, "link", "set", h.devA, "up"},
		{"-n", h.nsB, "link", "set", h.devB, "up"},
	}
	for i, s := range steps {
		if err := run("ip", s...); err != nil {
			t.Fatal(err)
		}
		if i == 0 {
			t.Cleanup(func() { _ = run("ip", "netns", "del", h.nsB) })
		}
	}
	return h
}

// run runs a command, returning its output in the error when it fails.
func run(name string, args ...string) error {
	out, err := exec.Command(name, args...).CombinedOutput()
	if err != nil {
		return fmt.Errorf("%s %s: %v: %s", name, strings.Join(args, " "), err, bytes.TrimSpace(out))
	}
	return nil
}

// netnsExec is the command prefix that runs a program in namespace ns.
func netnsExec(ns string) []string { return []string{"ip", "netns", "exec", ns} }

func TestPairAcrossNetworkNamespaces(t *testing.T) {
	h := netnsHosts(t)
	dir := t.TempDir()
	snd := startDaemonIn(t, netnsExec(h.nsA), dir, "snd", "--listen", h.ipA+":17100")
	rcv := startDaemonIn(t, netnsExec(h.nsB), dir, "rcv", "--listen", h.ipB+":17100")
	if rcv.advertise != h.ipB+":17100" {
		t.Fatalf("receiver advertises %q, want %s:17100", rcv.advertise, h.ipB)
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
	if err != nil || len(ss) != 1 || ss[0].Peer != h.ipB+":17100" || ss[0].State != "connected" {
		t.Fatalf("sender's sessions: %+v %v", ss, err)
	}
}
