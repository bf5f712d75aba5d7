package rdma

import (
	"errors"
	"fmt"
	"net"
	"strings"
)

// Want is what the operator asked for: a device (--rdma-device), a GID
// index (--rdma-gid-index), and the address this daemon advertises to
// its peers, which picks the GID when neither is given.
type Want struct {
	Device   string // "" for any
	GIDIndex int    // < 0 to choose
	Addr     net.IP // nil or unspecified when unknown
}

// ErrNoPort is Choose's answer when no device has an active port that
// fits: the daemon's auto transport falls back to TCP on it.
var ErrNoPort = errors.New("no usable RDMA port")

// Choose picks the port and GID to use among the NICs discovery saw.
//
// With no GID index given, on RoCE it prefers the RoCE v2 IPv4-mapped GID
// of the advertised address (that is the address peers route to), then
// any RoCE v2 IPv4-mapped GID, then any RoCE v2 GID, then RoCE v1; on
// InfiniBand, GID 0. Only ACTIVE ports count. Ties go to the first
// device, port and index in discovery order.
func Choose(inv Inventory, w Want) (Choice, error) {
	if len(inv.NICs) == 0 {
		why := inv.Why
		if why == "" {
			why = "no RDMA devices"
		}
		return Choice{}, fmt.Errorf("%w: %s", ErrNoPort, why)
	}
	nics := inv.NICs
	if w.Device != "" {
		nics = nil
		for _, n := range inv.NICs {
			if n.Name == w.Device {
				nics = append(nics, n)
			}
		}
		if nics == nil {
			return Choice{}, fmt.Errorf("%w: device %s is not among the RDMA devices seen (%s)", ErrNoPort, w.Device, names(inv.NICs))
		}
	}

	var active int
	var down []string
	best, bestScore := Choice{}, 0
	for _, n := range nics {
		for _, p := range n.Ports {
			if !p.Active {
				down = append(down, fmt.Sprintf("%s port %d is %s", n.Name, p.Num, p.State))
				continue
			}
			active++
			for _, g := range p.GIDs {
				if w.GIDIndex >= 0 && g.Index != w.GIDIndex {
					continue
				}
				score, why := rank(p, g, w)
				if score > bestScore {
					best, bestScore = choiceOf(n, p, g, why), score
				}
			}
		}
	}
	switch {
	case active == 0:
		return Choice{}, fmt.Errorf("%w: no ACTIVE port (%s); check the link and the NIC's netdev (ip link)", ErrNoPort, strings.Join(down, ", "))
	case bestScore == 0 && w.GIDIndex >= 0:
		return Choice{}, fmt.Errorf("%w: no active port has a GID at index %d; see the GID tables under /sys/class/infiniband/*/ports/*/gids", ErrNoPort, w.GIDIndex)
	case bestScore == 0:
		return Choice{}, fmt.Errorf("%w: the active ports have no usable GID (a RoCE port needs an IP address on its netdev)", ErrNoPort)
	}
	return best, nil
}

// rank scores g on port p for w; 0 means unusable.
func rank(p Port, g GID, w Want) (int, string) {
	if w.GIDIndex >= 0 {
		return 1, fmt.Sprintf("GID index %d, as asked", w.GIDIndex)
	}
	if p.LinkLayer == "InfiniBand" {
		if g.Index == 0 {
			return 4, "InfiniBand port: GID 0"
		}
		return 0, ""
	}
	v4 := ipv4Of(g)
	advertised := w.Addr != nil && !w.Addr.IsUnspecified()
	switch {
	case g.Type == "RoCE v2" && v4 != nil && advertised && v4.Equal(w.Addr):
		return 5, fmt.Sprintf("the RoCE v2 GID of %s, which carries the advertised address %s", g.Netdev, w.Addr)
	case g.Type == "RoCE v2" && v4 != nil:
		if advertised {
			return 4, fmt.Sprintf("the advertised address %s is on no RDMA netdev; using the first RoCE v2 IPv4 GID (%s on %s)", w.Addr, v4, g.Netdev)
		}
		return 4, fmt.Sprintf("the first RoCE v2 IPv4 GID (%s on %s)", v4, g.Netdev)
	case g.Type == "RoCE v2":
		return 3, fmt.Sprintf("no RoCE v2 IPv4 GID; using the RoCE v2 GID %s on %s", g.GID, g.Netdev)
	case g.Type == "RoCE v1":
		return 2, fmt.Sprintf("no RoCE v2 GID; using the RoCE v1 GID %s on %s", g.GID, g.Netdev)
	}
	return 0, ""
}

func choiceOf(n NIC, p Port, g GID, why string) Choice {
	return Choice{
		Device: n.Name, Port: p.Num, GIDIndex: g.Index, GID: g.GID, GIDType: g.Type,
		Netdev: g.Netdev, LinkLayer: p.LinkLayer, MTU: p.MTU, Why: why,
	}
}

func names(nics []NIC) string {
	var s []string
	for _, n := range nics {
		s = append(s, n.Name)
	}
	return strings.Join(s, ", ")
}

// AllDevices, as the only device asked for, takes every device with a
// usable port.
const AllDevices = "all"

// ChooseRails picks the port and GID of each device asked for (rails.go),
// in the order given: with none, the one device Choose picks; with
// AllDevices, that one first, then every other device with a usable
// port in discovery order (a device without one is skipped, and said so
// in skipped). Any named device that has no usable port fails.
func ChooseRails(inv Inventory, devices []string, w Want) (rails []Choice, skipped []string, err error) {
	if len(devices) != 1 || devices[0] != AllDevices {
		if len(devices) == 0 {
			devices = []string{""}
		}
		for _, d := range devices {
			w.Device = d
			c, err := Choose(inv, w)
			if err != nil {
				return nil, nil, err
			}
			rails = append(rails, c)
		}
		return rails, nil, nil
	}
	first, err := Choose(inv, w)
	if err != nil {
		return nil, nil, err
	}
	rails = append(rails, first)
	for _, n := range inv.NICs {
		if n.Name == first.Device {
			continue
		}
		w.Device = n.Name
		c, err := Choose(inv, w)
		if err != nil {
			skipped = append(skipped, fmt.Sprintf("%s: %v", n.Name, err))
			continue
		}
		rails = append(rails, c)
	}
	return rails, skipped, nil
}
