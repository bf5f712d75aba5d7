// Package topology pairs each GPU with the RDMA NICs nearest to it on the
// PCIe fabric, read from sysfs: the chain of bridges above each device
// (its /sys/bus/pci/devices link resolved), its numa_node, and each NIC's
// netdev and GID under /sys/class/infiniband. A GPU's traffic through a
// NIC under the same PCIe switch never crosses the root complex; through
// one on the other socket it crosses the socket interconnect, which on
// rail-optimized hosts halves what the NIC can carry. The sysfs root is a
// parameter, so tests build fake trees of the common layouts.
package topology

import (
	"cmp"
	"fmt"
	"maps"
	"net"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"sort"
	"strconv"
	"strings"

	"github.com/ferry-project/ferry/api"
)

// Level is how near a NIC is to a GPU, nearest first.
type Level int

const (
	Switch     Level = iota + 1 // a PCIe switch above both
	RootPort                    // the same root port, no switch shared
	HostBridge                  // the same PCI root complex, different root ports
	NUMANode                    // the same NUMA node, different root complexes
	Other                       // nothing nearer than across the host (the other socket)
)

func (l Level) String() string {
	switch l {
	case Switch:
		return "pcie switch"
	case RootPort:
		return "root port"
	case HostBridge:
		return "host bridge"
	case NUMANode:
		return "numa node"
	}
	return "other"
}

// Configured is the distance a row shows when the configuration's
// affinity map chose its NICs.
const Configured = "configured"

// GPU is one device as the CUDA driver names it.
type GPU struct {
	Device string // "cuda:N"
	BusID  string // sysfs's spelling, 0000:3b:00.0
}

// Affinity is the table: per GPU its NICs, nearest first.
type Affinity struct {
	table api.Affinity
	nics  []string // every NIC, by name
}

// Table is the affinity table as status shows it.
func (a *Affinity) Table() api.Affinity { return a.table }

// NICsFor names the local NICs a transport should use for memory on
// device, in order: the row's for a GPU, every NIC for host memory
// ("cpu") or a device the table does not know.
func (a *Affinity) NICsFor(device string) []string {
	for _, r := range a.table.Devices {
		if r.Device == device {
			out := make([]string, len(r.NICs))
			for i, n := range r.NICs {
				out[i] = n.Name
			}
			return out
		}
	}
	return slices.Clone(a.nics)
}

// pciNode is a device's place on the PCIe fabric.
type pciNode struct {
	// chain is the host bridge (pciDDDD:BB) then each bridge above the
	// device, the nearest last; nil when sysfs does not show the device.
	chain []string
	numa  int
	why   string // why chain is nil
}

// nic is one RDMA device with its place and what the table shows of it.
type nic struct {
	api.AffinityNIC
	pci pciNode
}

// Read builds the table for gpus from the sysfs tree under root ("/" on a
// host). override maps a device ("cuda:N") to NIC names, in order, and
// beats the topology for that device; naming a device or NIC that is not
// here is an error. A host without RDMA NICs is no error (each row says
// so), nor is a sysfs that cannot be read (a warning says so).
func Read(root string, gpus []GPU, override map[string][]string) (*Affinity, error) {
	a := &Affinity{table: api.Affinity{Devices: []api.DeviceAffinity{}}}
	nics, err := readNICs(root)
	if err != nil {
		// The table informs; a sysfs ferryd may not read costs it the NICs,
		// not its start.
		a.table.Warnings = append(a.table.Warnings, err.Error()+": the table lists no NICs")
	}
	byName := map[string]nic{}
	for _, n := range nics {
		a.nics = append(a.nics, n.Name)
		byName[n.Name] = n
	}
	if err := checkOverride(override, gpus, byName); err != nil {
		return nil, err
	}
	oneNode := numaNodes(root) <= 1
	for _, g := range gpus {
		node := readPCI(root, g.BusID)
		row := api.DeviceAffinity{Device: g.Device, BusID: g.BusID, NUMANode: node.numa, NICs: []api.AffinityNIC{}}
		chosen, level, why := nearest(node, nics, oneNode)
		row.Distance, row.Why = level.String(), why
		if names, ok := override[g.Device]; ok {
			chosen = nil
			for _, name := range names {
				chosen = append(chosen, byName[name])
			}
			row.Distance, row.Why = Configured, fmt.Sprintf("the configuration's affinity map (the topology's choice: %s, %s)", level, why)
		} else if len(nics) > 0 && level == Other {
			a.table.Warnings = append(a.table.Warnings, fmt.Sprintf(
				"%s (%s) has no RDMA NIC near it (%s): its transfers may cross the host's socket interconnect; map it to a NIC with [affinity] in the configuration if another is better",
				g.Device, g.BusID, why))
		}
		for _, n := range chosen {
			row.NICs = append(row.NICs, n.AffinityNIC)
		}
		a.table.Devices = append(a.table.Devices, row)
	}
	return a, nil
}

func checkOverride(override map[string][]string, gpus []GPU, nics map[string]nic) error {
	for _, dev := range slices.Sorted(maps.Keys(override)) {
		if !slices.ContainsFunc(gpus, func(g GPU) bool { return g.Device == dev }) {
			return fmt.Errorf("affinity: %q is not a GPU ferryd uses here (%s): map only the cuda:N devices of this host", dev, gpuList(gpus))
		}
		if len(override[dev]) == 0 {
			return fmt.Errorf("affinity: %s maps to no NIC: name at least one, or leave it out to take the topology's choice", dev)
		}
		for _, name := range override[dev] {
			if _, ok := nics[name]; !ok {
				return fmt.Errorf("affinity: %s maps to %q, which is not an RDMA device here (%s): name one of /sys/class/infiniband", dev, name, nicList(nics))
			}
		}
	}
	return nil
}

func gpuList(gpus []GPU) string {
	if len(gpus) == 0 {
		return "none"
	}
	names := make([]string, len(gpus))
	for i, g := range gpus {
		names[i] = g.Device
	}
	return strings.Join(names, ", ")
}

func nicList(nics map[string]nic) string {
	if len(nics) == 0 {
		return "there are none"
	}
	return "there are " + strings.Join(slices.Sorted(maps.Keys(nics)), ", ")
}

// nearest picks the NICs nearest gpu: those of the best level, and at
// the switch level those under the deepest shared bridge. On a host of
// one NUMA node every device is on it, whatever numa_node says (-1 or 0).
func nearest(gpu pciNode, nics []nic, oneNode bool) ([]nic, Level, string) {
	if len(nics) == 0 {
		return nil, Other, "no RDMA NIC on this host"
	}
	type ranked struct {
		n      nic
		level  Level
		shared int
		why    string
	}
	rs := make([]ranked, len(nics))
	for i, n := range nics {
		l, shared, why := distance(gpu, n.pci, oneNode)
		rs[i] = ranked{n, l, shared, why}
	}
	sort.SliceStable(rs, func(i, j int) bool {
		return cmp.Or(cmp.Compare(rs[i].level, rs[j].level), cmp.Compare(rs[j].shared, rs[i].shared)) < 0
	})
	var out []nic
	for _, r := range rs {
		if r.level == rs[0].level && r.shared == rs[0].shared {
			out = append(out, r.n)
		}
	}
	why := rs[0].why
	if rs[0].level == Other {
		why = "numa: none near: " + why
	}
	return out, rs[0].level, why
}

// distance says how near n is to gpu, how many bridges they share, and why.
func distance(gpu, n pciNode, oneNode bool) (Level, int, string) {
	if gpu.chain == nil {
		return Other, 0, gpu.why
	}
	shared := 0
	for shared < min(len(gpu.chain), len(n.chain)) && gpu.chain[shared] == n.chain[shared] {
		shared++
	}
	switch {
	case shared >= 3:
		return Switch, shared, "under the PCIe switch port " + gpu.chain[shared-1]
	case shared == 2:
		return RootPort, shared, "under the root port " + gpu.chain[1]
	case shared == 1:
		return HostBridge, shared, "on the root complex " + gpu.chain[0]
	case n.chain == nil:
		return Other, 0, n.why
	case oneNode:
		return NUMANode, 0, "the host has one NUMA node"
	case gpu.numa >= 0 && gpu.numa == n.numa:
		return NUMANode, 0, fmt.Sprintf("on NUMA node %d", gpu.numa)
	case gpu.numa < 0 && n.numa < 0:
		return NUMANode, 0, "the kernel gives neither a NUMA node"
	}
	return Other, 0, fmt.Sprintf("the GPU is on NUMA node %d, the NIC on %d", gpu.numa, n.numa)
}

var (
	pciAddr    = regexp.MustCompile(`^[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]$`)
	hostBridge = regexp.MustCompile(`^pci[0-9a-f]{4}:[0-9a-f]{2}$`)
)

// readPCI places the PCI function busID: the link under
// sys/bus/pci/devices resolves to its path under sys/devices, whose
// components from the host bridge on are the bridges above it.
func readPCI(root, busID string) pciNode {
	path, err := filepath.EvalSymlinks(filepath.Join(root, "sys/bus/pci/devices", busID))
	if err != nil {
		return pciNode{numa: -1, why: fmt.Sprintf("%s is not in %s", busID, filepath.Join(root, "sys/bus/pci/devices"))}
	}
	return placeAt(path)
}

// placeAt reads the place of the PCI function at path (resolved): the
// last PCI address in it, so a NIC's auxiliary device (mlx5 SFs) is
// placed at the function it lives on.
func placeAt(path string) pciNode {
	parts := strings.Split(filepath.ToSlash(path), "/")
	start := slices.IndexFunc(parts, hostBridge.MatchString)
	last := -1
	for i, p := range parts {
		if pciAddr.MatchString(p) {
			last = i
		}
	}
	if start < 0 || last <= start {
		return pciNode{numa: -1, why: path + " is not a PCI device under a host bridge"}
	}
	fn := strings.Join(parts[:last+1], "/")
	return pciNode{chain: slices.Clone(parts[start:last]), numa: readInt(filepath.Join(fn, "numa_node"), -1)}
}

// numaNodes counts sys/devices/system/node/nodeN.
func numaNodes(root string) int {
	nodes, _ := filepath.Glob(filepath.Join(root, "sys/devices/system/node/node[0-9]*"))
	return len(nodes)
}

func readInt(path string, def int) int {
	b, err := os.ReadFile(path)
	if err != nil {
		return def
	}
	v, err := strconv.Atoi(strings.TrimSpace(string(b)))
	if err != nil {
		return def
	}
	return v
}

// readNICs lists sys/class/infiniband: each NIC's PCI function, NUMA
// node, netdev and GID. A host without the directory has no NICs; one
// whose directory cannot be read is an error.
func readNICs(root string) ([]nic, error) {
	class := filepath.Join(root, "sys/class/infiniband")
	entries, err := os.ReadDir(class)
	if os.IsNotExist(err) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("listing the RDMA devices: %w", err)
	}
	var out []nic
	for _, e := range entries {
		dir := filepath.Join(class, e.Name())
		n := nic{AffinityNIC: api.AffinityNIC{Name: e.Name(), NUMANode: -1}}
		if path, err := filepath.EvalSymlinks(filepath.Join(dir, "device")); err == nil {
			n.pci = placeAt(path)
			n.NUMANode = n.pci.numa
			if n.pci.chain != nil {
				n.BusID = lastPCI(path)
			}
		} else {
			n.pci = pciNode{numa: -1, why: e.Name() + " has no PCI device (a virtual NIC, e.g. soft-RoCE)"}
		}
		n.GID, n.Netdev = portGID(dir)
		if n.Netdev == "" {
			n.Netdev = firstEntry(filepath.Join(dir, "device/net"))
		}
		out = append(out, n)
	}
	return out, nil
}

func lastPCI(path string) string {
	parts := strings.Split(filepath.ToSlash(path), "/")
	for i := len(parts) - 1; i >= 0; i-- {
		if pciAddr.MatchString(parts[i]) {
			return parts[i]
		}
	}
	return ""
}

func firstEntry(dir string) string {
	entries, err := os.ReadDir(dir)
	if err != nil || len(entries) == 0 {
		return ""
	}
	return entries[0].Name()
}

// portGID picks port 1's GID the RDMA transport would use by default: the
// first RoCE v2 GID holding an IPv4 address, else GID 0 (InfiniBand's);
// with the netdev it belongs to.
func portGID(dir string) (gid, netdev string) {
	port := filepath.Join(dir, "ports/1")
	entries, err := os.ReadDir(filepath.Join(port, "gids"))
	if err != nil {
		return "", ""
	}
	idx := make([]int, 0, len(entries))
	for _, e := range entries {
		if i, err := strconv.Atoi(e.Name()); err == nil {
			idx = append(idx, i)
		}
	}
	slices.Sort(idx)
	read := func(sub string, i int) string {
		b, _ := os.ReadFile(filepath.Join(port, sub, strconv.Itoa(i))) // unused entries read as errors
		return strings.TrimSpace(string(b))
	}
	first := ""
	for _, i := range idx {
		ip := net.ParseIP(read("gids", i))
		if ip == nil || ip.IsUnspecified() {
			continue
		}
		if i == 0 {
			first = ip.String()
		}
		if ip.To4() != nil && read("gid_attrs/types", i) == "RoCE v2" {
			return ip.String(), read("gid_attrs/ndevs", i)
		}
	}
	return first, read("gid_attrs/ndevs", 0)
}
