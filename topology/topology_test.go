package topology

import (
	"fmt"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/ferry-project/ferry/topology/topologytest"
)

// switchAt is the path of a PCIe switch's downstream port under root
// port rp of host bridge hb: hb/rp/up/down.
func switchAt(hb string, bus int, port int) string {
	dom := hb[3:7]
	return fmt.Sprintf("%s/%s:%02x:%02x.0/%s:%02x:00.0/%s:%02x:%02x.0",
		hb, dom, bus-2, 1, dom, bus-1, dom, bus, port)
}

// fnUnder names the function of bus dev under a downstream port.
func fnUnder(down string, bus int) string {
	dom := filepath.Base(down)[:4]
	return fmt.Sprintf("%s/%s:%02x:00.0", down, dom, bus)
}

// railHost is 8 GPUs and nics NICs over two sockets: four PCIe switches
// per socket; GPU i under switch i, NIC j under switch j*8/nics (one per
// switch with 8, one per two switches' GPU pair with 4: those switches
// hold two GPUs).
func railHost(t *testing.T, nics int) (*topologytest.Host, []GPU) {
	h := topologytest.New(t)
	h.Nodes(2)
	var gpus []GPU
	for i := range 8 {
		node := i / 4
		hb := []string{"pci0000:00", "pci0000:80"}[node]
		sw := i
		if nics == 4 {
			sw = i / 2 // two GPUs per switch
		}
		base := 0x10 + sw*0x10
		down := switchAt(hb, base, i%2)
		gpus = append(gpus, GPU{Device: fmt.Sprintf("cuda:%d", i), BusID: h.PCI(fnUnder(down, base+1+i%2*4), node)})
	}
	for j := range nics {
		gpuOf := j * 8 / nics
		node := gpuOf / 4
		hb := []string{"pci0000:00", "pci0000:80"}[node]
		base := 0x10 + j*0x10 // switch j
		down := switchAt(hb, base, 2)
		h.NIC(fmt.Sprintf("mlx5_%d", j), fnUnder(down, base+8), node, fmt.Sprintf("ens%d", j), fmt.Sprintf("10.0.%d.1", j))
	}
	return h, gpus
}

func nicNames(a *Affinity, dev string) string { return strings.Join(a.NICsFor(dev), ",") }

func TestRailOptimizedPairsEachGPUWithTheNICOnItsSwitch(t *testing.T) {
	h, gpus := railHost(t, 8)
	a, err := Read(h.Root, gpus, nil)
	if err != nil {
		t.Fatal(err)
	}
	tab := a.Table()
	if len(tab.Devices) != 8 || len(tab.Warnings) != 0 {
		t.Fatalf("want 8 rows and no warnings, got %+v", tab)
	}
	for i, r := range tab.Devices {
		want := fmt.Sprintf("mlx5_%d", i)
		if nicNames(a, r.Device) != want || r.Distance != "pcie switch" || !strings.Contains(r.Why, "PCIe switch") {
			t.Errorf("%s: got %s (%s: %s), want %s under its switch", r.Device, nicNames(a, r.Device), r.Distance, r.Why, want)
		}
		n := r.NICs[0]
		if n.Netdev != fmt.Sprintf("ens%d", i) || n.GID != fmt.Sprintf("10.0.%d.1", i) || n.NUMANode != i/4 || n.BusID == "" {
			t.Errorf("%s: NIC shown as %+v", r.Device, n)
		}
		if r.NUMANode != i/4 || r.BusID != gpus[i].BusID {
			t.Errorf("%s: row %+v", r.Device, r)
		}
	}
}

func TestTwoGPUsPerSwitchShareItsNIC(t *testing.T) {
	h, gpus := railHost(t, 4)
	a, err := Read(h.Root, gpus, nil)
	if err != nil {
		t.Fatal(err)
	}
	for i, r := range a.Table().Devices {
		if want := fmt.Sprintf("mlx5_%d", i/2); nicNames(a, r.Device) != want || r.Distance != "pcie switch" {
			t.Errorf("%s: got %s (%s: %s), want %s", r.Device, nicNames(a, r.Device), r.Distance, r.Why, want)
		}
	}
}

// NICs on socket 0 only: the GPUs sharing their switch get them, the
// other GPUs of socket 0 get both by NUMA node, and socket 1's GPUs get
// every NIC, "none near", with a warning each.
func TestNICsOnOneNodeOnly(t *testing.T) {
	h := topologytest.New(t)
	h.Nodes(2)
	var gpus []GPU
	for i := range 8 {
		node := i / 4
		hb := []string{"pci0000:00", "pci0000:80"}[node]
		base := 0x10 + i*0x10
		down := switchAt(hb, base, 0)
		gpus = append(gpus, GPU{Device: fmt.Sprintf("cuda:%d", i), BusID: h.PCI(fnUnder(down, base+1), node)})
		if i < 2 {
			nicDown := switchAt(hb, base, 1)
			h.NIC(fmt.Sprintf("mlx5_%d", i), fnUnder(nicDown, base+8), node, fmt.Sprintf("ens%d", i), fmt.Sprintf("10.0.%d.1", i))
		}
	}
	// A third root complex on node 0 makes GPU 2 and 3's NICs "numa node",
	// not "host bridge": move GPU 3 there.
	gpus[3].BusID = h.PCI("pci0000:c0/0000:c0:01.0/0000:c1:00.0", 0)
	a, err := Read(h.Root, gpus, nil)
	if err != nil {
		t.Fatal(err)
	}
	tab := a.Table()
	want := []struct{ nics, dist string }{
		{"mlx5_0", "pcie switch"}, {"mlx5_1", "pcie switch"},
		{"mlx5_0,mlx5_1", "host bridge"}, {"mlx5_0,mlx5_1", "numa node"},
		{"mlx5_0,mlx5_1", "other"}, {"mlx5_0,mlx5_1", "other"}, {"mlx5_0,mlx5_1", "other"}, {"mlx5_0,mlx5_1", "other"},
	}
	for i, r := range tab.Devices {
		if nicNames(a, r.Device) != want[i].nics || r.Distance != want[i].dist {
			t.Errorf("%s: got %s (%s: %s), want %s (%s)", r.Device, nicNames(a, r.Device), r.Distance, r.Why, want[i].nics, want[i].dist)
		}
		if far := i >= 4; far != strings.HasPrefix(r.Why, "numa: none near") {
			t.Errorf("%s: why %q", r.Device, r.Why)
		}
	}
	if len(tab.Warnings) != 4 {
		t.Fatalf("want a warning for each of the 4 far GPUs, got %q", tab.Warnings)
	}
	for i, w := range tab.Warnings {
		if !strings.HasPrefix(w, fmt.Sprintf("cuda:%d ", 4+i)) || !strings.Contains(w, "NUMA node 1, the NIC on 0") || !strings.Contains(w, "[affinity]") {
			t.Errorf("warning %d: %q", i, w)
		}
	}
}

// A GPU and a NIC sharing a root port but no switch (functions of one
// slot) are "root port".
func TestSharedRootPort(t *testing.T) {
	h := topologytest.New(t)
	gpus := []GPU{{Device: "cuda:0", BusID: h.PCI("pci0000:00/0000:00:02.0/0000:05:00.0", 0)}}
	h.NIC("mlx5_0", "pci0000:00/0000:00:02.0/0000:05:00.1", 0, "ens5", "10.0.0.5")
	h.NIC("mlx5_1", "pci0000:00/0000:00:03.0/0000:06:00.0", 0, "ens6", "10.0.0.6")
	a, err := Read(h.Root, gpus, nil)
	if err != nil {
		t.Fatal(err)
	}
	if r := a.Table().Devices[0]; nicNames(a, "cuda:0") != "mlx5_0" || r.Distance != "root port" || r.Why != "under the root port 0000:00:02.0" {
		t.Fatalf("got %s: %+v", nicNames(a, "cuda:0"), r)
	}
}

func TestOverrideBeatsTheTopology(t *testing.T) {
	h, gpus := railHost(t, 8)
	a, err := Read(h.Root, gpus, map[string][]string{"cuda:0": {"mlx5_7", "mlx5_1"}})
	if err != nil {
		t.Fatal(err)
	}
	r := a.Table().Devices[0]
	if nicNames(a, "cuda:0") != "mlx5_7,mlx5_1" || r.Distance != Configured || !strings.Contains(r.Why, "pcie switch") {
		t.Fatalf("override not taken: %s %+v", nicNames(a, "cuda:0"), r)
	}
	if nicNames(a, "cuda:1") != "mlx5_1" {
		t.Errorf("an unmapped GPU lost its own choice: %s", nicNames(a, "cuda:1"))
	}
	if got := nicNames(a, "cpu"); got != "mlx5_0,mlx5_1,mlx5_2,mlx5_3,mlx5_4,mlx5_5,mlx5_6,mlx5_7" {
		t.Errorf("host memory should use every NIC, got %s", got)
	}
}

func TestOverrideNamingWhatIsNotHereIsRefused(t *testing.T) {
	h, gpus := railHost(t, 4)
	for _, c := range []struct {
		m    map[string][]string
		want string
	}{
		{map[string][]string{"cuda:9": {"mlx5_0"}}, `"cuda:9" is not a GPU ferryd uses here (cuda:0, cuda:1`},
		{map[string][]string{"cuda:1": {"mlx5_9"}}, `"mlx5_9", which is not an RDMA device here (there are mlx5_0, mlx5_1, mlx5_2, mlx5_3)`},
		{map[string][]string{"cuda:1": {}}, `cuda:1 maps to no NIC`},
	} {
		if _, err := Read(h.Root, gpus, c.m); err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%v: got %v, want %q", c.m, err, c.want)
		}
	}
}

// No NICs, a GPU sysfs does not show, and a virtual NIC without a PCI
// device: rows still say why.
func TestHostsWithoutPCIFacts(t *testing.T) {
	h := topologytest.New(t)
	a, err := Read(h.Root, []GPU{{Device: "cuda:0", BusID: "0000:3b:00.0"}}, nil)
	if err != nil {
		t.Fatal(err)
	}
	if r := a.Table().Devices[0]; r.Why != "no RDMA NIC on this host" || len(r.NICs) != 0 || len(a.Table().Warnings) != 0 || r.NUMANode != -1 {
		t.Errorf("no NICs: %+v %q", r, a.Table().Warnings)
	}
	// soft-RoCE: a class entry without a device link; its netdev from the GID.
	h.Write("sys/class/infiniband/rxe0/ports/1/gids/1", "0000:0000:0000:0000:0000:ffff:0a00:0002\n")
	h.Write("sys/class/infiniband/rxe0/ports/1/gid_attrs/types/1", "RoCE v2\n")
	h.Write("sys/class/infiniband/rxe0/ports/1/gid_attrs/ndevs/1", "eth0\n")
	a, err = Read(h.Root, []GPU{{Device: "cuda:0", BusID: "0000:3b:00.0"}}, nil)
	if err != nil {
		t.Fatal(err)
	}
	r := a.Table().Devices[0]
	if len(r.NICs) != 1 || r.NICs[0].Netdev != "eth0" || r.NICs[0].GID != "10.0.0.2" || r.NICs[0].BusID != "" || r.Distance != "other" ||
		!strings.Contains(r.Why, "0000:3b:00.0 is not in") {
		t.Errorf("virtual NIC, GPU not in sysfs: %+v", r)
	}
	if len(a.Table().Warnings) != 1 {
		t.Errorf("want one warning, got %q", a.Table().Warnings)
	}
	if !slices.Equal(a.NICsFor("cuda:0"), []string{"rxe0"}) {
		t.Errorf("NICsFor: %q", a.NICsFor("cuda:0"))
	}
}

// On a host of one NUMA node the kernel may give a GPU -1 and a NIC 0:
// they are on the one node, no warning; the same devices on a host of
// two nodes are "other".
func TestOneNodeHost(t *testing.T) {
	h := topologytest.New(t)
	gpus := []GPU{{Device: "cuda:0", BusID: h.PCI("pci0000:00/0000:00:02.0/0000:05:00.0", -1)}}
	h.NIC("mlx5_0", "pci0000:40/0000:40:03.0/0000:41:00.0", 0, "ens5", "10.0.0.5")
	a, err := Read(h.Root, gpus, nil)
	if err != nil {
		t.Fatal(err)
	}
	if r := a.Table().Devices[0]; r.Distance != "numa node" || r.Why != "the host has one NUMA node" || len(a.Table().Warnings) != 0 {
		t.Errorf("one node: %+v, warnings %q", r, a.Table().Warnings)
	}
	h.Nodes(2)
	if a, err = Read(h.Root, gpus, nil); err != nil {
		t.Fatal(err)
	}
	if r := a.Table().Devices[0]; r.Distance != "other" || len(a.Table().Warnings) != 1 {
		t.Errorf("two nodes: %+v, warnings %q", r, a.Table().Warnings)
	}
}

// A class directory ferryd may not read costs the table its NICs, with a
// warning, and not ferryd its start.
func TestUnreadableNICsAreAWarning(t *testing.T) {
	h := topologytest.New(t)
	h.Write("sys/class/infiniband", "not a directory\n")
	a, err := Read(h.Root, []GPU{{Device: "cuda:0", BusID: "0000:3b:00.0"}}, nil)
	if err != nil {
		t.Fatal(err)
	}
	if w := a.Table().Warnings; len(w) != 1 || !strings.HasPrefix(w[0], "listing the RDMA devices: ") || !strings.HasSuffix(w[0], ": the table lists no NICs") {
		t.Errorf("warnings %q", w)
	}
}
