package daemon

import (
	"fmt"
	"strings"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/ferry-project/ferry/api"
	"github.com/ferry-project/ferry/arena"
	"github.com/ferry-project/ferry/config"
	"github.com/ferry-project/ferry/rdma"
)

// A ferryd with several devices (--device cuda:0,1 or cuda:all) keeps an
// arena on each. The first device's is the registry's own arena, which
// the transport registered with the NIC as it opened, as a single arena
// always was. Each other device's is a region ferryd owns, with an
// allocator of its own (region.alloc), registered with the NIC as a
// client's region is, and never listed, lent or unregistered as one.
// Slots and staged entries in it record it (slot.region, entry.region):
// writes find slots by key and address, and reach its slots as they
// reach a region's; sends read entries from the memory they lie in.

// deviceArena is one device's arena.
type deviceArena struct {
	mem    *memory
	region *region // nil for the first device's, the registry's own
	// rails are the NICs sends from it go through, for an arena after
	// the first over RDMA (registerArenas).
	rails rdma.RegionRails
}

// arenaRegion makes m, a device's memory other than the first's, an
// arena ferryd owns.
func arenaRegion(m *memory) (*region, error) {
	a, err := arena.New(m.Memory, config.ArenaAlign)
	if err != nil {
		return nil, fmt.Errorf("the arena on %s: %w", m.device, err)
	}
	return &region{name: "arena on " + m.device, mem: m.Memory, alloc: a, device: m.device, since: time.Now()}, nil
}

// registerArenas registers each arena after the first with the RDMA NIC,
// as the transport exposes it (transport.RegionRegistrar); a failure
// fails nothing: the arena's slots and entries then go through staging
// and bounce buffers, as an unregistered region's do, and status says
// why. It runs before the control API serves.
//
// This is the one place an arena other than the first meets the NIC:
// a transport with several NICs registers it also with those
// d.affinity.NICsFor(device) names that it drives, and its sends go out
// through them (rdma.RegisterRegionOn).
func (d *Daemon) registerArenas() {
	for _, a := range d.arenas[1:] { // New made at least one
		g := a.region
		g.nic, a.rails, g.nicErr = d.registerRegionNIC(a.mem.Memory, d.affinity.NICsFor(g.device))
		g.rail = uint8(a.rails.Home)
		switch {
		case g.nicErr != nil:
			d.log.Warn().Str("device", g.device).Err(g.nicErr).Msg("the arena could not be registered with the NIC: its transfers are copied through staging buffers")
		case g.nic != nil:
			d.log.Info().Str("device", g.device).Int64("bytes", g.size()).Strs("nics", a.rails.NICs).Str("why", a.rails.Why).Msg("arena registered with the NIC")
		}
	}
}

// closeArenas drops the NIC registrations of the arenas after the
// first: once no write is in flight, before the transport closes.
func (d *Daemon) closeArenas() {
	for _, a := range d.arenas { // none when New failed before they were made
		if g := a.region; g != nil && g.nic != nil {
			if err := g.nic.Close(); err != nil {
				d.log.Warn().Str("device", g.device).Err(err).Msg("dropping the arena's registration with the NIC failed")
			}
			g.nic = nil
		}
	}
}

// arenaOn is the arena on device, one of --device's ("": the first), or
// a refusal naming the devices this ferryd has.
func (d *Daemon) arenaOn(device string) (*deviceArena, error) {
	if device == "" {
		return d.arenas[0], nil
	}
	for _, a := range d.arenas {
		if a.mem.device == device {
			return a, nil
		}
	}
	return nil, apiErr(api.CodeBadRequest, "device %q: this ferryd has arenas on %s only (--device): name one of them, or leave device out for %s",
		device, strings.Join(d.devices(), ", "), d.mem.device)
}

// devices names the devices ferryd has arenas on, in --device's order.
func (d *Daemon) devices() []string {
	out := make([]string, len(d.arenas))
	for i, a := range d.arenas {
		out[i] = a.mem.device
	}
	return out
}

// memOn is the memory of the arena on device, a name ferryd gave ("":
// the first).
func (d *Daemon) memOn(device string) *memory {
	if a, err := d.arenaOn(device); err == nil {
		return a.mem
	}
	return d.mem
}

// arenaOf is g's allocator: the first arena's for nil.
func (r *registry) arenaOf(g *region) *arena.Arena {
	if g == nil {
		return r.arena
	}
	return g.alloc
}

// deviceOf names g's device: the first arena's for nil.
func (r *registry) deviceOf(g *region) string {
	if g == nil {
		return r.device
	}
	return g.device
}

// entryMemory is the memory e's bytes lie in.
func (r *registry) entryMemory(e *entry) arena.Memory {
	if e.region != nil {
		return e.region.mem
	}
	return r.arena.Memory()
}

// arenaCounts counts the staged entries and receive slots in g's arena
// (nil: the first).
func (r *registry) arenaCounts(g *region) (entries, slots int) {
	r.mu.Lock()
	defer r.mu.Unlock()
	for _, e := range r.entries {
		if e.region == g {
			entries++
		}
	}
	for _, s := range r.slots {
		if s.region == g {
			slots++
		}
	}
	return entries, slots
}

// arenasStatus is each arena's size and use, in --device's order.
func (d *Daemon) arenasStatus() []api.ArenaStatus {
	out := make([]api.ArenaStatus, len(d.arenas))
	for i, a := range d.arenas {
		st := d.reg.arenaOf(a.region).Stats()
		entries, slots := d.reg.arenaCounts(a.region)
		out[i] = api.ArenaStatus{Device: a.mem.device, Kind: a.mem.Kind(), Size: st.Size, Used: st.Used, Free: st.Free, Staged: entries, Slots: slots}
		if d.reg.registrar != nil {
			registered, why := d.dp.registration().Mode == api.RegistrationShared, ""
			nics := d.firstArenaNICs()
			if g := a.region; g != nil {
				registered, nics = g.nic != nil, a.rails.NICs
				if g.nicErr != nil {
					why = g.nicErr.Error()
				}
			}
			out[i].NIC = &api.RegionNIC{Registered: registered, Error: why, NICs: nics, NICsWhy: a.rails.Why}
		}
	}
	return out
}

// firstArenaNICs are the NICs sends from the first arena go through:
// over RDMA, rail 0, and for a host arena every rail (striped sends).
func (d *Daemon) firstArenaNICs() []string {
	if d.dp.rdma == nil {
		return nil
	}
	names := d.dp.rdma.RailNames()
	if d.mem.Host() == nil {
		return names[:1]
	}
	return names
}

// arenaCollectors are each device's arena figures, labelled by device:
// as many label values as --device lists.
func (d *Daemon) arenaCollectors() []prometheus.Collector {
	var out []prometheus.Collector
	for _, a := range d.arenas {
		dev := a.mem.device
		stats := func() arena.Stats { return d.reg.arenaOf(a.region).Stats() }
		for state, read := range map[string]func(arena.Stats) int64{
			"total": func(st arena.Stats) int64 { return st.Size },
			"used":  func(st arena.Stats) int64 { return st.Used },
			"free":  func(st arena.Stats) int64 { return st.Free },
		} {
			out = append(out, prometheus.NewGaugeFunc(prometheus.GaugeOpts{
				Name: "ferry_device_arena_bytes", ConstLabels: prometheus.Labels{"device": dev, "state": state},
				Help: "Each device's arena bytes by state: total, used (staged entries, receive slots, freed slots in quarantine), free.",
			}, func() float64 { return float64(read(stats())) }))
		}
		out = append(out,
			prometheus.NewGaugeFunc(prometheus.GaugeOpts{
				Name: "ferry_device_arena_slots", ConstLabels: prometheus.Labels{"device": dev},
				Help: "Live receive slots in each device's arena.",
			}, func() float64 { _, n := d.reg.arenaCounts(a.region); return float64(n) }),
			prometheus.NewGaugeFunc(prometheus.GaugeOpts{
				Name: "ferry_device_arena_staged", ConstLabels: prometheus.Labels{"device": dev},
				Help: "Entries staged or reserved in each device's arena.",
			}, func() float64 { n, _ := d.reg.arenaCounts(a.region); return float64(n) }))
	}
	return out
}
