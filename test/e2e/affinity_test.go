package e2e

import (
	"bytes"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/ferry-project/ferry/api"
	"github.com/ferry-project/ferry/cuda/cudatest"
	"github.com/ferry-project/ferry/internal/fakecuda"
	"github.com/ferry-project/ferry/topology/topologytest"
)

// fakeSysfsPrefix runs a command in a user and mount namespace of its
// own with the fake tree bind-mounted on /sys, so ferryd reads the
// topology the test laid out through its ordinary paths. It skips where
// user namespaces are not allowed.
func fakeSysfsPrefix(t *testing.T, h *topologytest.Host, env ...string) []string {
	t.Helper()
	ns := []string{"unshare", "--user", "--map-root-user", "--mount"}
	if err := exec.Command(ns[0], append(ns[1:], "true")...).Run(); err != nil {
		t.Skipf("skipping: no user and mount namespace here (unshare: %v)", err)
	}
	return append(append(ns, "sh", "-c", `mount --bind "$0" /sys && exec "$@"`, filepath.Join(h.Root, "sys"), "env"), env...)
}

// ferryd on the stand-in driver with three GPUs laid out in a fake sysfs
// tree: two each under a PCIe switch with a NIC, the third on the other
// NUMA node with none. Status and ferryctl status show the table and
// warn of the third; the affinity setting overrides a row, and a map
// naming a NIC that is not there stops ferryd naming it. A send from the
// GPU arena of that ferryd arrives byte-exact.
func TestAffinityTableOfAFakeHost(t *testing.T) {
	h := topologytest.New(t)
	h.Nodes(2)
	gpus := []string{
		h.PCI("pci0000:00/0000:00:01.0/0000:01:00.0/0000:02:00.0/0000:03:00.0", 0),
		h.PCI("pci0000:00/0000:00:02.0/0000:11:00.0/0000:12:00.0/0000:13:00.0", 0),
		h.PCI("pci0000:80/0000:80:01.0/0000:81:00.0", 1),
	}
	h.NIC("mlx5_0", "pci0000:00/0000:00:01.0/0000:01:00.0/0000:02:01.0/0000:04:00.0", 0, "ens1", "10.1.0.1")
	h.NIC("mlx5_1", "pci0000:00/0000:00:02.0/0000:11:00.0/0000:12:01.0/0000:14:00.0", 0, "ens2", "10.1.0.2")
	prefix := fakeSysfsPrefix(t, h, "LD_LIBRARY_PATH="+fakecuda.Build(t, fakecuda.Working), "FAKECUDA_BUS_IDS="+strings.Join(gpus, ","))
	dir := t.TempDir()
	snd := startDaemonIn(t, prefix, dir, "snd", "--device", "cuda:1", "--bounce-size", "1MiB")
	ctx := ctxT(t)

	st, err := snd.c.Status(ctx)
	if err != nil {
		t.Fatal(err)
	}
	want := []struct{ nics, distance, why string }{
		{"mlx5_0", "pcie switch", "under the PCIe switch port 0000:01:00.0"},
		{"mlx5_1", "pcie switch", "under the PCIe switch port 0000:11:00.0"},
		{"mlx5_0,mlx5_1", "other", "numa: none near: the GPU is on NUMA node 1, the NIC on 0"},
	}
	if len(st.Affinity.Devices) != len(want) {
		t.Fatalf("affinity rows %+v", st.Affinity)
	}
	for i, r := range st.Affinity.Devices {
		var names []string
		for _, n := range r.NICs {
			names = append(names, n.Name)
		}
		if r.BusID != gpus[i] || strings.Join(names, ",") != want[i].nics || r.Distance != want[i].distance || r.Why != want[i].why {
			t.Errorf("row %d: %+v, want %+v", i, r, want[i])
		}
	}
	if n := st.Affinity.Devices[0].NICs[0]; n != (api.AffinityNIC{Name: "mlx5_0", BusID: "0000:04:00.0", NUMANode: 0, Netdev: "ens1", GID: "10.1.0.1"}) {
		t.Errorf("mlx5_0 shown as %+v", n)
	}
	if w := st.Affinity.Warnings; len(w) != 1 || !strings.HasPrefix(w[0], "cuda:2 (0000:81:00.0) has no RDMA NIC near it") {
		t.Errorf("warnings %q", w)
	}
	snd.log.wait(t, 5*time.Second, "the WARN line of cuda:2", func(m map[string]any) bool {
		s, _ := m["message"].(string)
		return m["level"] == "warn" && strings.HasPrefix(s, "cuda:2 (0000:81:00.0) has no RDMA NIC near it")
	})

	out, err := exec.CommandContext(ctx, filepath.Join(bin, "ferryctl"), "--socket", snd.socket, "status").CombinedOutput()
	if err != nil {
		t.Fatalf("ferryctl status: %v\n%s", err, out)
	}
	for _, line := range []string{
		"  GPU     BUS ID        NUMA  NIC     NETDEV  GID       DISTANCE     WHY\n",
		"  cuda:1  0000:13:00.0  0     mlx5_1  ens2    10.1.0.2  pcie switch  under the PCIe switch port 0000:11:00.0\n",
		"  cuda:2  0000:81:00.0  1     mlx5_1  ens2    10.1.0.2  other        numa: none near: the GPU is on NUMA node 1, the NIC on 0\n",
		"warning    cuda:2 (0000:81:00.0) has no RDMA NIC near it",
	} {
		if !strings.Contains(string(out), line) {
			t.Errorf("ferryctl status lacks %q:\n%s", line, out)
		}
	}

	// The namespace changes nothing else: a send from the GPU arena.
	rcv := startDaemon(t, dir, "rcv")
	data := randomBytes(embBytes, 33)
	if _, err := snd.c.Stage(ctx, "aff-1", embShape, "bf16", bytes.NewReader(data), embBytes); err != nil {
		t.Fatal(err)
	}
	if _, err := snd.c.Send(ctx, "aff-1", slotFor(t, rcv, "aff-1", embBytes)); err != nil {
		t.Fatal(err)
	}
	if got, err := rcv.c.Wait(ctx, "aff-1", 10*time.Second); err != nil || !bytes.Equal(got, data) {
		t.Fatalf("%d bytes back, %v: the bytes differ", len(got), err)
	}

	over := startDaemonIn(t, prefix, dir, "over", "--device", "cuda:0", "--affinity", "cuda:2=mlx5_1,cuda:0=mlx5_1+mlx5_0")
	st, err = over.c.Status(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if r := st.Affinity.Devices[0]; r.Distance != "configured" || len(r.NICs) != 2 || r.NICs[0].Name != "mlx5_1" || r.NICs[1].Name != "mlx5_0" {
		t.Errorf("cuda:0 mapped to mlx5_1, mlx5_0: %+v", r)
	}
	if r := st.Affinity.Devices[2]; r.Distance != "configured" || len(r.NICs) != 1 || r.NICs[0].Name != "mlx5_1" || len(st.Affinity.Warnings) != 0 {
		t.Errorf("cuda:2 mapped to mlx5_1: %+v, warnings %q", r, st.Affinity.Warnings)
	}

	bad := exec.CommandContext(ctx, prefix[0], append(prefix[1:], filepath.Join(bin, "ferryd"), "--socket", filepath.Join(dir, "bad.sock"),
		"--listen", "127.0.0.1:0", "--transport", "tcp", "--arena-size", "8MiB", "--affinity", "cuda:1=mlx5_7")...)
	bad.Env = append(os.Environ(), "FERRY_CONFIG="+os.DevNull)
	out, err = bad.CombinedOutput()
	if exitCode(err) == 0 || !strings.Contains(string(out), `cuda:1 maps to "mlx5_7", which is not an RDMA device here (there are mlx5_0, mlx5_1)`) {
		t.Errorf("a map naming a missing NIC: exit %d\n%s", exitCode(err), out)
	}
}

// make test-gpu: the table this host gives, printed for the run's log
// ("== AFFINITY" lines), each GPU the driver lists with a bus id sysfs
// shows, and each NIC of a row one sysfs lists.
func TestGPUAffinityTable(t *testing.T) {
	cudatest.Require(t)
	d := startDaemon(t, t.TempDir(), "gpu", "--device", "cuda:0", "--arena-size", "64MiB", "--bounce-size", "16MiB")
	ctx := ctxT(t)
	st, err := d.c.Status(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if len(st.Affinity.Devices) == 0 {
		t.Fatalf("no affinity rows on a GPU host: %+v", st.Affinity)
	}
	for _, r := range st.Affinity.Devices {
		if _, err := os.Stat("/sys/bus/pci/devices/" + r.BusID); err != nil {
			t.Errorf("%s: bus id %q is not in sysfs: %v", r.Device, r.BusID, err)
		}
		for _, n := range r.NICs {
			if _, err := os.Stat("/sys/class/infiniband/" + n.Name); err != nil {
				t.Errorf("%s: NIC %q is not in sysfs: %v", r.Device, n.Name, err)
			}
		}
	}
	out, err := exec.CommandContext(ctx, filepath.Join(bin, "ferryctl"), "--socket", d.socket, "status").CombinedOutput()
	if err != nil {
		t.Fatalf("ferryctl status: %v\n%s", err, out)
	}
	_, table, _ := strings.Cut(string(out), "affinity\n")
	for _, line := range strings.Split(strings.TrimRight(table, "\n"), "\n") {
		fmt.Println("== AFFINITY", line)
	}
}
