package rdma

import (
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"slices"

	"github.com/Mellanox/rdmamap"
)

// NIC is an RDMA device as discovery found it.
type NIC struct {
	Name    string   `json:"name"`
	Netdevs []string `json:"netdevs,omitempty"` // network interfaces of the device (rdmamap)
	PCI     string   `json:"pci,omitempty"`     // PCI address; empty for a virtual device (rxe)
	FW      string   `json:"fw,omitempty"`
	Ports   []Port   `json:"ports"`
}

// Port is one port of a NIC.
type Port struct {
	Num       int               `json:"num"`
	State     string            `json:"state"` // "ACTIVE", "DOWN", ...
	Active    bool              `json:"active"`
	LinkLayer string            `json:"link_layer"` // "Ethernet" (RoCE) or "InfiniBand"
	MTU       int               `json:"active_mtu"` // bytes
	LID       uint16            `json:"lid,omitempty"`
	GIDs      []GID             `json:"gids"`
	Counters  map[string]uint64 `json:"counters,omitempty"` // sysfs port counters (rdmamap)
}

// GID is one used entry of a port's GID table.
type GID struct {
	Index  int    `json:"index"`
	GID    net.IP `json:"gid"`
	Type   string `json:"type"`             // "IB", "RoCE v1" or "RoCE v2"
	Netdev string `json:"netdev,omitempty"` // the interface a RoCE GID belongs to
}

// IPv4 is the address of an IPv4-mapped GID (::ffff:a.b.c.d), else nil.
func (g GID) IPv4() net.IP {
	if len(g.GID) == net.IPv6len && g.GID.To4() != nil {
		return g.GID.To4()
	}
	return nil
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
	g := GID{Index: index, GID: net.IP(slices.Clone(e.raw[:]))}
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
