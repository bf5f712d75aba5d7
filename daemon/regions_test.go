package daemon

import (
	"slices"
	"testing"
	"time"

	"github.com/ferry-project/ferry/api"
)

// Unregistering a region drops its registration with the NIC (which
// unpins every page: slow for a large region) and unmaps it outside the
// registry's lock, which every arriving write and API call takes; the
// region stays listed, closing, until both are done, and only then does
// gone close (DELETE /v1/regions answers 204). Whether the last use ends
// with the DELETE itself or with a write landing in it after.
func TestRegionEndsOutsideTheLock(t *testing.T) {
	for _, lastUse := range []string{"delete", "write"} {
		t.Run(lastUse, func(t *testing.T) {
			r := newTestRegistry(t, 4096)
			var g *region
			var steps []string
			// step runs inside the region's teardown: another caller
			// lists the regions meanwhile.
			step := func(what string) error {
				listed := make(chan []api.Region, 1)
				go func() { listed <- r.listRegions() }()
				select {
				case list := <-listed:
					if len(list) != 2 || list[0].Name != "big" || !list[0].Closing {
						t.Errorf("%s: the regions listed meanwhile: %+v; want big, closing, and other", what, list)
					}
				case <-time.After(5 * time.Second):
					t.Errorf("%s: listing the regions waited for it", what)
				}
				select {
				case <-g.gone:
					t.Errorf("%s: the region is gone already", what)
				default:
				}
				steps = append(steps, what)
				return nil
			}
			nic := closerFunc(func() error { return step("deregister") })
			mem := closingMemory{hostRegion(make([]byte, 8192)), func() error { return step("unmap") }}
			if _, err := r.addRegion("big", mem, nic, nil); err != nil {
				t.Fatal(err)
			}
			g = r.regions["big"]
			if _, err := r.addRegion("other", hostRegion(make([]byte, 4096)), nil, nil); err != nil {
				t.Fatal(err)
			}
			done := func(error) {}
			if lastUse == "write" {
				s, err := r.newSlotIn("in", 4096, "big", 0)
				if err != nil {
					t.Fatal(err)
				}
				if _, done, err = r.Accept(s.addr, 4096, s.key, s.key.Tag()); err != nil {
					t.Fatal(err)
				}
				if err := r.deleteSlot("in"); err != nil {
					t.Fatal(err)
				}
			}
			if _, err := r.removeRegion("big"); err != nil {
				t.Fatal(err)
			}
			if lastUse == "write" && len(steps) != 0 {
				t.Fatalf("with a write landing in it, the region went through %v", steps)
			}
			done(nil)
			if want := []string{"deregister", "unmap"}; !slices.Equal(steps, want) {
				t.Fatalf("the region went through %v; want %v", steps, want)
			}
			select {
			case <-g.gone:
			default:
				t.Fatal("the region is not gone once deregistered and unmapped")
			}
			if list := r.listRegions(); len(list) != 1 || list[0].Name != "other" {
				t.Fatalf("regions listed after: %+v", list)
			}
		})
	}
}

type closerFunc func() error

func (f closerFunc) Close() error { return f() }

// closingMemory is host memory whose Close runs close.
type closingMemory struct {
	hostRegion
	close func() error
}

func (m closingMemory) Close() error { return m.close() }
