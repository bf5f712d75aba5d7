package daemon

import (
	"io"
	"slices"
	"testing"
	"time"

	"github.com/rs/zerolog"

	"github.com/ferry-project/ferry/api"
	"github.com/ferry-project/ferry/arena"
	"github.com/ferry-project/ferry/rdma"
	"github.com/ferry-project/ferry/topology"
	"github.com/ferry-project/ferry/topology/topologytest"
	"github.com/ferry-project/ferry/transport"
)

// A second device's arena, as ferryd makes it (a region it owns), is
// registered with the NIC once through the transport's RegionRegistrar
// and dropped at close; its slots and entries are placed in it, its
// slots take windows as the first arena's do, a freed slot's quarantined
// memory goes back to it, not to the first arena; status counts each
// arena and a device there is none on is refused naming those there are.
func TestASecondArenaHoldsItsOwnSlotsAndEntries(t *testing.T) {
	r := newTestRegistry(t, 1<<16)
	r.device = "cuda:0"
	host, err := arena.NewSealedMemory(1<<16, 0)
	if err != nil {
		t.Fatal(err)
	}
	second := &memory{Memory: host, device: "cpu", host: host}
	t.Cleanup(func() { second.close() })
	g, err := arenaRegion(second)
	if err != nil {
		t.Fatal(err)
	}
	dropped := 0
	nic := &railsRegistrar{countingRegistrar: countingRegistrar{drop: func() error { dropped++; return nil }}}
	r.registrar = nic
	first := &memory{Memory: r.arena.Memory(), device: "cuda:0"}
	h := topologytest.New(t)
	h.NIC("mlx5_0", "pci0000:00/0000:00:01.0/0000:01:00.0", 0, "ens1", "10.1.0.1")
	h.NIC("mlx5_1", "pci0000:00/0000:00:02.0/0000:02:00.0", 0, "ens2", "10.1.0.2")
	aff, err := topology.Read(h.Root, nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	d := &Daemon{log: zerolog.Nop(), reg: r, dp: &dataPlane{}, mem: first, affinity: aff,
		arenas: []*deviceArena{{mem: first}, {mem: second, region: g}}}
	d.registerArenas()
	if nic.registered.Load() != 1 || g.nic == nil || g.nicErr != nil {
		t.Fatalf("registrations %d, nic %v (%v); want the second arena registered once", nic.registered.Load(), g.nic, g.nicErr)
	}
	if want := aff.NICsFor("cpu"); len(want) != 2 || !slices.Equal(nic.asked, want) {
		t.Fatalf("the second arena was registered on %q; want its device's NICs from the affinity table, %q", nic.asked, want)
	}
	// Without windows its slots' keys name the rail nearest it all the
	// same (the second NIC, where the fake registered it), the first
	// arena's rail 0.
	if g.rail != 1 {
		t.Fatalf("the second arena's rail is %d, want 1 (rdma.RegionRails.Home)", g.rail)
	}
	for _, c := range []struct {
		in   *region
		rail uint8
	}{{g, 1}, {nil, 0}} {
		s, err := r.newSlotOn(c.in, "s0", 100, false)
		if err != nil {
			t.Fatal(err)
		}
		if s.key.Rail() != c.rail || s.key.Window() != 0 {
			t.Fatalf("a slot in %s names rail %d, window %#x: want rail %d, no window", r.deviceOf(c.in), s.key.Rail(), s.key.Window(), c.rail)
		}
		if err := r.deleteSlot("s0"); err != nil {
			t.Fatal(err)
		}
	}

	w := &fakeWindows{open: make(map[uint32][2]uint64)}
	r.UseWindows(w)
	var fire func()
	r.quarantineFreedSlots(time.Minute)
	r.afterFunc = func(_ time.Duration, f func()) func() bool { fire = f; return func() bool { return true } }
	on, err := d.arenaOn("cpu")
	if err != nil || on.region != g {
		t.Fatalf("arenaOn(cpu) = %+v, %v", on, err)
	}
	s, err := r.newSlotOn(g, "s", 1000, false)
	if err != nil {
		t.Fatal(err)
	}
	if s.addr < host.Base() || s.addr+1000 > host.Base()+1<<16 {
		t.Fatalf("the slot at %#x lies outside the second arena [%#x, +64KiB)", s.addr, host.Base())
	}
	if got, ok := w.open[s.key.Window()]; !ok || got != [2]uint64{s.addr, 1000} {
		t.Fatalf("the slot's window: %v %v", got, ok)
	}
	if desc := r.describeSlot(s); desc.Device != "cpu" || desc.Region != "" {
		t.Fatalf("slot described as %+v; want it on cpu, in no region", desc)
	}
	e, err := r.reserveOn(g, "e", 100, []int64{100}, "u8", staged)
	if err != nil {
		t.Fatal(err)
	}
	if src := d.entrySource(e, 10, 50); src.mem != second.Memory || src.off != e.slice.Offset+10 || src.inPlace {
		t.Fatalf("the entry's source: %+v; want the second arena's memory", src)
	}
	st := d.arenasStatus()
	if len(st) != 2 || st[0].Slots != 0 || st[0].Used != 0 || st[1].Device != "cpu" || st[1].Slots != 1 || st[1].Staged != 1 ||
		st[1].Used < 1100 || st[1].NIC == nil || !st[1].NIC.Registered {
		t.Fatalf("status: %+v", st)
	}
	if n := st[1].NIC; !slices.Equal(n.NICs, []string{"mlx5_1"}) || n.NICsWhy != "mlx5_0 is away" {
		t.Fatalf("the second arena's NIC status %+v: want the NIC it went on and why not the other", n)
	}

	if err := r.deleteSlot("s"); err != nil {
		t.Fatal(err)
	}
	if err := r.deleteEntry("e"); err != nil {
		t.Fatal(err)
	}
	if used := g.alloc.Stats().Used; used != 1024 || fire == nil {
		t.Fatalf("the second arena holds %d bytes after the delete; want the slot's, quarantined", used)
	}
	fire()
	if used, first := g.alloc.Stats().Used, r.arena.Stats().Used; used != 0 || first != 0 {
		t.Fatalf("after the quarantine: %d bytes used in the second arena, %d in the first; want none", used, first)
	}

	_, err = d.arenaOn("cuda:5")
	if !isCode(err, api.CodeBadRequest) || err.Error() != `device "cuda:5": this ferryd has arenas on cuda:0, cpu only (--device): name one of them, or leave device out for cuda:0` {
		t.Fatalf("an unknown device: %v", err)
	}
	d.closeArenas()
	if dropped != 1 || g.nic != nil {
		t.Fatalf("close dropped %d registrations; want the second arena's", dropped)
	}
}

// railsRegistrar is countingRegistrar registering on named NICs too, as
// rdma with several RDMA devices does: it records the NICs asked for,
// and says it went on the last of them.
type railsRegistrar struct {
	countingRegistrar
	asked []string
}

func (c *railsRegistrar) RegisterRegionOn(_ []byte, nics []string) (io.Closer, rdma.RegionRails, error) {
	c.asked = nics
	if len(nics) == 0 {
		return c.register(), rdma.RegionRails{}, nil
	}
	return c.register(), rdma.RegionRails{NICs: nics[len(nics)-1:], Why: nics[0] + " is away", Home: len(nics) - 1}, nil
}

func (c *railsRegistrar) RegisterDeviceRegionOn(_ transport.Range, nics []string) (io.Closer, rdma.RegionRails, error) {
	return c.RegisterRegionOn(nil, nics)
}
