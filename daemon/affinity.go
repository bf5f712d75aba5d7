package daemon

import (
	"fmt"
	"strings"

	"github.com/rs/zerolog"

	"github.com/ferry-project/ferry/topology"
)

// readAffinity pairs each GPU the CUDA driver sees (none when the arena
// is in host memory: the driver is then not loaded) with its nearest RDMA
// NICs, or the ones the affinity setting names; each row is logged, and
// each GPU with no NIC near it is a WARN line. It is read once, at start.
// A transport asks it which NICs serve a device's memory (NICsFor).
func readAffinity(cfg Config, mem *memory, log zerolog.Logger) (*topology.Affinity, error) {
	var gpus []topology.GPU
	if mem.drv == nil && len(cfg.Affinity) > 0 {
		return nil, fmt.Errorf("affinity %q maps GPUs to NICs, but the arena is in host memory (%s): remove the map, or put the arena on a GPU with --device", cfg.Affinity.String(), mem.reason)
	}
	if mem.drv != nil {
		n, err := mem.drv.DeviceCount()
		if err != nil {
			return nil, err
		}
		for i := range n {
			in, err := mem.drv.Describe(i)
			if err != nil {
				return nil, err
			}
			gpus = append(gpus, topology.GPU{Device: fmt.Sprintf("cuda:%d", i), BusID: in.PCIBusID})
		}
	}
	a, err := topology.Read("/", gpus, cfg.Affinity)
	if err != nil {
		return nil, err
	}
	tab := a.Table()
	for _, r := range tab.Devices {
		nics := make([]string, len(r.NICs))
		for i, n := range r.NICs {
			nics[i] = n.Name
		}
		log.Info().Str("component", "affinity").Str("device", r.Device).Str("pci_bus_id", r.BusID).Int("numa_node", r.NUMANode).
			Str("nics", strings.Join(nics, ",")).Str("distance", r.Distance).Str("why", r.Why).Msg("GPU and its nearest RDMA NICs")
	}
	for _, w := range tab.Warnings {
		log.Warn().Str("component", "affinity").Msg(w)
	}
	return a, nil
}
