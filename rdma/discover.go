package rdma

import (
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strings"

	"github.com/Mellanox/rdmamap"

	"github.com/ferry-project/ferry/api"
)

// The inventory's types are the control API's (GET /v1/status shows
// them as they are).
type (
	NIC    = api.NIC
	Port   = api.NICPort
	GID    = api.GID
	Choice = api.NICChoice
)

// ipv4Of is the address of an IPv4-mapped GID (::ffff:a.b.c.d), else nil.
func ipv4Of(g GID) net.IP {
	// net.IP prints an IPv4-mapped address dotted, and nothing else so.
	if !strings.Contains(g.GID, ".") {
		return nil
	}
	return net.ParseIP(g.GID).To4()
}

// Inventory is what Discover saw.
type Inventory struct {
	NICs []NIC `json:"nics"`
	// Why says why NICs is empty, in a sentence.
	Why string `json:"why,omitempty"`
}

// portCounterNames are the sysfs port counters shown in the inventory: traffic
// in both directions, on IB/RoCE NICs (counters/) and on rxe (hw_counters/).
var portCounterNames = []string{"port_xmit_data", "port_rcv_data", "sent_pkts", "rcvd_pkts", "rcvd_seq_err", "retry_exceeded_err"}

// Discover lists the RDMA devices with their ports and GID tables (verbs
// queries) and their network interfaces and PCI addresses (rdmamap). A
// host without RDMA is not an error: the inventory is empty and says why.
func Discover() (Inventory, error) {
	names, err := deviceNames()
	if errors.Is(err, errNoKernelRDMA) {
		return Inventory{Why: err.Error()}, nil
	}
	if err != nil {
		return Inventory{}, err
	}
	if len(names) == 0 {
		return Inventory{Why: "libibverbs lists no RDMA devices: no NIC with an RDMA driver, and no soft-RoCE device (rdma link add NAME type rxe netdev IFACE)"}, nil
	}
	netdevs := netdevsByDevice()
	var inv Inventory
	for _, name := range names {
		nic, err := describe(name)
		if err != nil {
			return Inventory{}, err
		}
		nic.Netdevs = netdevs[name]
		nic.PCI = pciAddress(name)
		inv.NICs = append(inv.NICs, nic)
	}
	return inv, nil
}

// describe queries one device's ports and GID tables.
func describe(name string) (NIC, error) {
	nic := NIC{Name: name}
	dev, err := openDevice(name)
	if err != nil {
		return nic, err
	}
	defer dev.Close()
	attr, err := dev.query()
	if err != nil {
		return nic, err
	}
	nic.FW = attr.fw
	stats, _ := rdmamap.GetRdmaSysfsAllPortsStats(name) // counters are optional
	for p := 1; p <= attr.ports; p++ {
		pa, err := dev.queryPort(p)
		if err != nil {
			return nic, err
		}
		port := Port{Num: p, State: portStateName(pa.state), Active: pa.state == portActive, MTU: pa.activeMTU.Bytes(), LID: pa.lid}
		port.LinkLayer = "InfiniBand"
		if pa.linkLayer == linkLayerEthernet {
			port.LinkLayer, port.LID = "Ethernet", 0
		}
		for i := range pa.gidTable {
			g, ok, err := dev.queryGID(p, i)
			if err != nil {
				return nic, err
			}
			if ok {
				port.GIDs = append(port.GIDs, gidOf(i, g))
			}
		}
		port.Counters = portCounters(stats, p)
		nic.Ports = append(nic.Ports, port)
	}
	return nic, nil
}

func gidOf(index int, e gidEntry) GID {
	g := GID{Index: index, GID: net.IP(e.raw[:]).String()}
	switch e.typ {
	case gidTypeIB:
		g.Type = "IB"
	case gidTypeRoCEv1:
		g.Type = "RoCE v1"
	case gidTypeRoCEv2:
		g.Type = "RoCE v2"
	default:
		g.Type = fmt.Sprintf("type %d", e.typ)
	}
	if e.ifindex > 0 {
		if ifi, err := net.InterfaceByIndex(e.ifindex); err == nil {
			g.Netdev = ifi.Name
		}
	}
	return g
}

// WithCounters returns a copy of nics with their ports' counters read
// afresh (the inventory is taken once, at start).
func WithCounters(nics []NIC) []NIC {
	out := make([]NIC, len(nics))
	for i, n := range nics {
		stats, _ := rdmamap.GetRdmaSysfsAllPortsStats(n.Name)
		n.Ports = append([]Port(nil), n.Ports...)
		for j := range n.Ports {
			n.Ports[j].Counters = portCounters(stats, n.Ports[j].Num)
		}
		out[i] = n
	}
	return out
}

func portCounters(stats rdmamap.RdmaStats, port int) map[string]uint64 {
	out := make(map[string]uint64)
	for _, ps := range stats.PortStats {
		if ps.Port != port {
			continue
		}
		for _, e := range append(ps.Stats, ps.HwStats...) {
			if slices.Contains(portCounterNames, e.Name) {
				out[e.Name] = e.Value
			}
		}
	}
	if len(out) == 0 {
		return nil
	}
	return out
}

// netdevsByDevice maps each RDMA device to its network interfaces.
func netdevsByDevice() map[string][]string {
	out := make(map[string][]string)
	ifs, err := net.Interfaces()
	if err != nil {
		return out
	}
	for _, ifi := range ifs {
		if dev, err := rdmamap.GetRdmaDeviceForNetdevice(ifi.Name); err == nil && dev != "" {
			out[dev] = append(out[dev], ifi.Name)
		}
	}
	return out
}

// pciAddress is the PCI function behind device name, confirmed by
// rdmamap's reverse lookup; "" for a virtual device.
func pciAddress(name string) string {
	target, err := os.Readlink(filepath.Join(rdmamap.RdmaClassDir, name, "device"))
	if err != nil {
		return ""
	}
	pci := filepath.Base(target)
	if slices.Contains(rdmamap.GetRdmaDevicesForPcidev(pci), name) {
		return pci
	}
	return ""
}
