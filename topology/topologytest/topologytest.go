// Package topologytest builds fake sysfs trees of PCIe hosts (GPUs and
// RDMA NICs under switches, NUMA nodes) for the tests of package topology
// and of ferryd, which e2e tests run with such a tree bind-mounted on /sys.
package topologytest

import (
	"fmt"
	"os"
	"path/filepath"
	"testing"
)

// Host builds a fake sysfs tree: PCI functions at their paths under
// sys/devices with the sys/bus/pci/devices links, and NICs under
// sys/class/infiniband as the kernel lays them out.
type Host struct {
	t    *testing.T
	Root string
}

// New makes an empty tree in a temporary directory.
func New(t *testing.T) *Host { return &Host{t: t, Root: t.TempDir()} }

// Write writes a file of the tree, making its directories.
func (h *Host) Write(rel, data string) {
	h.t.Helper()
	p := filepath.Join(h.Root, rel)
	if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
		h.t.Fatal(err)
	}
	if err := os.WriteFile(p, []byte(data), 0o644); err != nil {
		h.t.Fatal(err)
	}
}

func (h *Host) link(rel, target string) {
	h.t.Helper()
	p := filepath.Join(h.Root, rel)
	if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
		h.t.Fatal(err)
	}
	if err := os.Symlink(target, p); err != nil {
		h.t.Fatal(err)
	}
}

// Nodes lays out n NUMA nodes (sys/devices/system/node/nodeN); a tree
// without them is a host of one node.
func (h *Host) Nodes(n int) {
	h.t.Helper()
	for i := range n {
		h.Write(fmt.Sprintf("sys/devices/system/node/node%d/cpulist", i), fmt.Sprintf("%d-%d\n", i*16, i*16+15))
	}
}

// PCI adds the function at path (host bridge first, the function last).
func (h *Host) PCI(path string, numa int) string {
	h.t.Helper()
	h.Write("sys/devices/"+path+"/numa_node", fmt.Sprintf("%d\n", numa))
	bdf := filepath.Base(path)
	h.link("sys/bus/pci/devices/"+bdf, "../../../devices/"+path)
	return bdf
}

// NIC adds RDMA device name on the function at path, with netdev and a
// RoCE v2 GID of ipv4 at index 1 (index 0 is link-local, as on RoCE).
func (h *Host) NIC(name, path string, numa int, netdev, ipv4 string) {
	h.t.Helper()
	h.PCI(path, numa)
	dev := "sys/devices/" + path + "/infiniband/" + name
	h.link(dev+"/device", "../..")
	h.Write("sys/devices/"+path+"/net/"+netdev+"/ifindex", "3\n")
	h.Write(dev+"/ports/1/gids/0", "fe80:0000:0000:0000:0000:0000:0000:0001\n")
	h.Write(dev+"/ports/1/gid_attrs/types/0", "RoCE v2\n")
	h.Write(dev+"/ports/1/gid_attrs/ndevs/0", netdev+"\n")
	h.Write(dev+"/ports/1/gids/1", "0000:0000:0000:0000:0000:ffff:"+hexIPv4(ipv4)+"\n")
	h.Write(dev+"/ports/1/gid_attrs/types/1", "RoCE v2\n")
	h.Write(dev+"/ports/1/gid_attrs/ndevs/1", netdev+"\n")
	h.Write(dev+"/ports/1/gids/2", "0000:0000:0000:0000:0000:0000:0000:0000\n")
	h.link("sys/class/infiniband/"+name, "../../devices/"+path+"/infiniband/"+name)
}

func hexIPv4(s string) string {
	var a, b, c, d int
	fmt.Sscanf(s, "%d.%d.%d.%d", &a, &b, &c, &d)
	return fmt.Sprintf("%02x%02x:%02x%02x", a, b, c, d)
}
