package daemon

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/rs/zerolog"

	"github.com/ferry-project/ferry/api"
	"github.com/ferry-project/ferry/arena"
	"github.com/ferry-project/ferry/client"
	"github.com/ferry-project/ferry/config"
	"github.com/ferry-project/ferry/internal/memlimit"
	"github.com/ferry-project/ferry/mooncake"
	"github.com/ferry-project/ferry/rdma"
	"github.com/ferry-project/ferry/transport"
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
				case <-g.end.done:
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
			end, err := r.removeRegion("big")
			if err != nil {
				t.Fatal(err)
			}
			if lastUse == "write" {
				select {
				case <-end.done:
					t.Fatalf("with a write landing in it, the region went through %v", steps)
				default:
				}
			}
			done(nil)
			waitEnd(t, end)
			if want := []string{"deregister", "unmap"}; !slices.Equal(steps, want) {
				t.Fatalf("the region went through %v; want %v", steps, want)
			}
			if list := r.listRegions(); len(list) != 1 || list[0].Name != "other" {
				t.Fatalf("regions listed after: %+v", list)
			}
		})
	}
}

// The write or transfer that drops a closing region's last use (a
// lane's or a receiver's goroutine) does not wait for its teardown:
// dropping the registration unpins every page, which for a large region
// takes long. Meanwhile the region is listed, closing, its name taken,
// and its DELETE waits; it ends once the NIC has dropped it.
func TestRegionEndsOffTheGoroutineDroppingItsLastUse(t *testing.T) {
	for _, lastUse := range []string{"write", "transfer"} {
		t.Run(lastUse, func(t *testing.T) {
			r := newTestRegistry(t, 4096)
			entered, release := make(chan struct{}), make(chan struct{})
			nic := closerFunc(func() error {
				close(entered)
				<-release
				return nil
			})
			if _, err := r.addRegion("big", hostRegion(make([]byte, 8192)), nic, nil); err != nil {
				t.Fatal(err)
			}
			var drop func()
			if lastUse == "write" {
				s, err := r.newSlotIn("in", 4096, "big", 0)
				if err != nil {
					t.Fatal(err)
				}
				_, done, err := r.Accept(s.addr, 4096, s.key, s.key.Tag())
				if err != nil {
					t.Fatal(err)
				}
				if err := r.deleteSlot("in"); err != nil {
					t.Fatal(err)
				}
				drop = func() { done(nil) }
			} else {
				g, err := r.pinRegion("big", "test")
				if err != nil {
					t.Fatal(err)
				}
				drop = func() { r.unpinRegion(g) }
			}
			end, err := r.removeRegion("big")
			if err != nil {
				t.Fatal(err)
			}
			dropped := make(chan struct{})
			go func() {
				drop()
				close(dropped)
			}()
			select {
			case <-entered:
			case <-time.After(5 * time.Second):
				t.Fatal("the registration was not dropped once the last use ended")
			}
			select {
			case <-dropped:
			case <-time.After(5 * time.Second):
				close(release)
				t.Fatalf("the %s that dropped the region's last use waited for the NIC to drop its registration", lastUse)
			}
			if list := r.listRegions(); len(list) != 1 || list[0].Name != "big" || !list[0].Closing {
				t.Errorf("the regions listed while it is deregistered: %+v; want big, closing", list)
			}
			if _, err := r.addRegion("big", hostRegion(make([]byte, 4096)), nil, nil); !isCode(err, api.CodeExists) {
				t.Errorf("a region of its name while it is deregistered: %v; want exists", err)
			}
			select {
			case <-end.done:
				t.Fatal("its DELETE was answered before the NIC dropped it")
			default:
			}
			close(release)
			waitEnd(t, end)
			if list := r.listRegions(); len(list) != 0 {
				t.Fatalf("regions listed after: %+v", list)
			}
		})
	}
}

// A stopping ferryd waits for the region teardowns running before it
// closes the NIC and returns: one whose DELETE gave up waiting (504)
// still holds Serve until the NIC has dropped the region.
func TestStopWaitsForRegionTeardowns(t *testing.T) {
	d, err := New(testConfig(t.TempDir(), "d"))
	if err != nil {
		t.Fatal(err)
	}
	entered, release, dropped := make(chan struct{}), make(chan struct{}), make(chan struct{})
	d.reg.mu.Lock()
	d.reg.registrar = &countingRegistrar{drop: func() error {
		close(entered)
		<-release
		close(dropped)
		return nil
	}}
	d.reg.mu.Unlock()
	ctx, stop := context.WithCancel(context.Background())
	defer stop()
	served := make(chan error, 1)
	go func() { served <- d.Serve(ctx, 5*time.Second) }()
	c := &client.Client{Socket: d.cfg.Socket}
	calls, cancel := context.WithTimeout(t.Context(), 10*time.Second)
	defer cancel()
	f, err := client.NewRegionFile("kv", 4096)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if _, err := c.RegisterRegion(calls, "kv", f, 4096); err != nil {
		close(release)
		t.Fatal(err)
	}
	var e *client.Error
	if err := c.UnregisterRegion(calls, "kv", time.Millisecond); !errors.As(err, &e) || e.Code != api.CodeTimeout {
		close(release)
		t.Fatalf("a DELETE that gave up waiting: %v; want timeout", err)
	}
	select {
	case <-entered:
	case <-time.After(5 * time.Second):
		t.Fatal("the NIC was not asked to drop the region's registration")
	}
	stop()
	// Serve must not return while the NIC is dropping the region: give
	// it the time it would take to, then let the NIC finish.
	select {
	case err := <-served:
		close(release)
		t.Fatalf("Serve returned (%v) while the NIC was still dropping a region", err)
	case <-time.After(200 * time.Millisecond):
	}
	close(release)
	select {
	case err := <-served:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("ferryd did not stop once the region's teardown ended")
	}
	select {
	case <-dropped:
	default:
		t.Fatal("Serve returned before the region's registration was dropped")
	}
}

// waitEnd waits for a region's teardown to end it, as its DELETE does.
func waitEnd(t *testing.T, end *regionEnd) {
	t.Helper()
	select {
	case <-end.done:
		if end.err != nil {
			t.Fatalf("region %s did not end: %v", end.g.name, end.err)
		}
	case <-time.After(5 * time.Second):
		t.Fatalf("region %s did not end", end.g.name)
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

// Memfd regions together hold at most max_region_bytes of host memory,
// counted by their size whether or not a page was touched: a sparse memfd
// (sized to 1 TiB, never written) is refused before ferryd maps it or the
// NIC pins a page of it. A region that fits is taken, one that does not
// fit beside it is refused, and unregistering gives its bytes back.
func TestRegionsHoldAtMostMaxRegionBytes(t *testing.T) {
	d, c := serveTestDaemon(t, t.TempDir(), "d", func(cfg *Config) { cfg.MaxRegionBytes = "1MiB" })
	ctx := t.Context()
	nic := &countingRegistrar{}
	d.reg.mu.Lock()
	d.reg.registrar = nic
	d.reg.mu.Unlock()
	memfd := func(name string, n int64) *os.File { return regionFile(t, name, n) }
	wantRefused := func(err error, status int, code string, says ...string) {
		t.Helper()
		wantAPIError(t, err, status, code, says...)
	}
	held := func(want int64) {
		t.Helper()
		wantRegionsHold(t, c, want, 1<<20)
	}

	_, err := c.RegisterRegion(ctx, "sparse", memfd("sparse", 1<<40), 1<<40)
	wantRefused(err, 413, api.CodeTooLarge, "region sparse", "1TiB", "1099511627776 bytes", "max_region_bytes is 1MiB", "--max-region-bytes")
	if n := nic.registered.Load(); n != 0 {
		t.Fatalf("the NIC was asked to register %d region(s) refused", n)
	}
	if maps, err := os.ReadFile("/proc/self/maps"); err != nil || strings.Contains(string(maps), "memfd:sparse") {
		t.Fatalf("the refused memfd is mapped (%v):\n%s", err, maps)
	}
	held(0)
	// A request refused after its check gives its bytes back.
	_, err = c.RegisterRegion(ctx, "short", memfd("short", 4096), 8192)
	wantRefused(err, 400, api.CodeBadRequest, "4096 bytes")
	held(0)

	if _, err := c.RegisterRegion(ctx, "kv", memfd("kv", 768<<10), 768<<10); err != nil {
		t.Fatalf("a region within the bound: %v", err)
	}
	held(768 << 10)
	more := memfd("more", 512<<10)
	_, err = c.RegisterRegion(ctx, "more", more, 512<<10)
	wantRefused(err, 409, api.CodeBusy, "region more", "512KiB", "to 1.25MiB", "max_region_bytes 1MiB", "unregister regions")
	if n := nic.registered.Load(); n != 1 {
		t.Fatalf("the NIC was asked to register %d regions; want the one taken", n)
	}
	if err := c.UnregisterRegion(ctx, "kv", 10*time.Second); err != nil {
		t.Fatal(err)
	}
	held(0)
	if _, err := c.RegisterRegion(ctx, "more", more, 512<<10); err != nil {
		t.Fatalf("once the first was unregistered: %v", err)
	}
	held(512 << 10)
}

// A registration the NIC will not drop (ibv_dereg_mr failing) keeps its
// region: the DELETE that waited gets 500 internal naming the region,
// the NIC's error, the bytes still pinned and counted, and what to do;
// the region stays listed (closing, the error in its nic), mapped, its
// name taken and its bytes counted against max_region_bytes. A second
// DELETE tries again and, the NIC dropping it now, answers 204 and
// frees the bytes.
func TestRegionTheNICKeepsStaysCounted(t *testing.T) {
	d, c := serveTestDaemon(t, t.TempDir(), "d", func(cfg *Config) { cfg.MaxRegionBytes = "1MiB" })
	ctx := t.Context()
	var drops atomic.Int64
	nic := &countingRegistrar{drop: func() error {
		if drops.Add(1) == 1 {
			return errors.New("ibv_dereg_mr: Device or resource busy")
		}
		return nil
	}}
	d.reg.mu.Lock()
	d.reg.registrar = nic
	d.reg.mu.Unlock()
	mapped := func() bool {
		maps, err := os.ReadFile("/proc/self/maps")
		if err != nil {
			t.Fatal(err)
		}
		return strings.Contains(string(maps), "memfd:kept")
	}

	if _, err := c.RegisterRegion(ctx, "kept", regionFile(t, "kept", 768<<10), 768<<10); err != nil {
		t.Fatal(err)
	}
	err := c.UnregisterRegion(ctx, "kept", 10*time.Second)
	wantAPIError(t, err, 500, api.CodeInternal, "region kept", "ibv_dereg_mr: Device or resource busy",
		"786432 bytes stay pinned and count against max_region_bytes", "DELETE /v1/regions/kept again", "restart ferryd")
	list, err := c.Regions(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if len(list) != 1 || list[0].Name != "kept" || !list[0].Closing || list[0].NIC == nil || !list[0].NIC.Registered ||
		!strings.Contains(list[0].NIC.Error, "ibv_dereg_mr") {
		t.Fatalf("regions listed once the NIC kept it: %+v; want kept, closing, registered, with the NIC's error", list)
	}
	if !mapped() {
		t.Error("the region was unmapped though the NIC keeps its pages")
	}
	wantRegionsHold(t, c, 768<<10, 1<<20)
	more := regionFile(t, "more", 512<<10)
	_, err = c.RegisterRegion(ctx, "more", more, 512<<10)
	wantAPIError(t, err, 409, api.CodeBusy, "region more", "max_region_bytes")
	_, err = c.RegisterRegion(ctx, "kept", regionFile(t, "again", 4096), 4096)
	wantAPIError(t, err, 409, api.CodeExists, "kept is still closing", "ibv_dereg_mr")
	if got := value(scrapeSocket(t, c), "ferry_region_deregistration_failures_total"); got != 1 {
		t.Errorf("ferry_region_deregistration_failures_total = %v, want 1", got)
	}

	if err := c.UnregisterRegion(ctx, "kept", 10*time.Second); err != nil {
		t.Fatalf("a second DELETE, the NIC dropping it now: %v", err)
	}
	if mapped() {
		t.Error("the region is still mapped once the NIC dropped it")
	}
	wantRegionsHold(t, c, 0, 1<<20)
	if _, err := c.RegisterRegion(ctx, "more", more, 512<<10); err != nil {
		t.Fatalf("once the first was unregistered: %v", err)
	}
}

// regionFile is a memfd of n bytes, sealed as a region's must be.
func regionFile(t *testing.T, name string, n int64) *os.File {
	f, err := client.NewRegionFile(name, n)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { f.Close() })
	return f
}

// wantAPIError checks err is the API's answer status, code, its
// message saying each of says.
func wantAPIError(t *testing.T, err error, status int, code string, says ...string) {
	t.Helper()
	var e *client.Error
	if !errors.As(err, &e) || e.Status != status || e.Code != code {
		t.Fatalf("got %v; want %d %s", err, status, code)
	}
	for _, s := range says {
		if !strings.Contains(e.Message, s) {
			t.Errorf("the answer does not say %q: %s", s, e.Message)
		}
	}
}

// wantRegionsHold checks the host bytes regions hold, and the bound, as
// GET /v1/status and the metrics show them.
func wantRegionsHold(t *testing.T, c *client.Client, want, limit int64) {
	t.Helper()
	st, err := c.Status(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	if st.Regions.HostBytes != want || st.Regions.HostLimit != limit {
		t.Errorf("status says regions hold %d of %d bytes; want %d of %d", st.Regions.HostBytes, st.Regions.HostLimit, want, limit)
	}
	fams := scrapeSocket(t, c)
	if got := value(fams, "ferry_region_host_bytes"); got != float64(want) {
		t.Errorf("ferry_region_host_bytes = %v, want %d", got, want)
	}
	if got := value(fams, "ferry_region_host_limit_bytes"); got != float64(limit) {
		t.Errorf("ferry_region_host_limit_bytes = %v, want %d", got, limit)
	}
}

// A region being mapped and registered holds its bytes from its first
// check, so requests arriving together cannot between them pass the
// bound; one given up gives them back.
func TestRegionClaimsHoldTheirBytes(t *testing.T) {
	r := newTestRegistry(t, 4096)
	r.hostLimit = hostLimit{setting: "8KiB", bytes: 8192}
	a, err := r.claimRegion("a", 6144)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := r.claimRegion("b", 4096); !isCode(err, api.CodeBusy) {
		t.Fatalf("a claim past the bound beside another: %v", err)
	}
	if _, err := r.claimRegion("a", 1024); !isCode(err, api.CodeExists) {
		t.Fatalf("a second claim of a name: %v", err)
	}
	if _, err := r.claimRegion("gpu", 1<<40); !isCode(err, api.CodeTooLarge) {
		t.Fatalf("a region past the whole bound: %v", err)
	}
	if _, err := r.claimRegion("gpu", 0); err != nil {
		t.Fatalf("a region of no host memory (CUDA): %v", err)
	}
	r.unclaim(a)
	if _, err := r.claimRegion("b", 4096); err != nil {
		t.Fatalf("once the other gave up: %v", err)
	}
	if _, err := r.addRegion("b", hostRegion(make([]byte, 4096)), nil, nil); err != nil {
		t.Fatal(err)
	}
	if st := r.regionsStatus(); st.Count != 1 || st.HostBytes != 4096 {
		t.Fatalf("after b was added: %+v; want 1 region of 4096 bytes, the claim taken", st)
	}
}

// A share of max_region_bytes is of the host's physical memory, or of
// ferryd's cgroup limit where that is less (region pages are charged to
// the cgroup), and a refusal says which it was taken of.
func TestRegionLimitIsAShareOfTheLesserMemory(t *testing.T) {
	const physical = 64 << 30
	cg := memlimit.Limit{Bytes: 8 << 30, File: "/sys/fs/cgroup/system.slice/memory.max"}
	for _, c := range []struct {
		name    string
		share   config.Share
		cg      memlimit.Limit
		limited bool
		bytes   int64
		says    string
	}{
		{"no cgroup limit", "75%", memlimit.Limit{}, false, 48 << 30,
			"max_region_bytes is 75% of physical memory (64GiB), 48GiB (51539607552 bytes):"},
		{"a cgroup limit below physical memory", "75%", cg, true, 6 << 30,
			"max_region_bytes is 75% of ferryd's cgroup memory limit (8GiB, /sys/fs/cgroup/system.slice/memory.max), 6GiB (6442450944 bytes):"},
		{"a cgroup limit above physical memory", "50%", memlimit.Limit{Bytes: 128 << 30, File: "/sys/fs/cgroup/memory.max"}, true, 32 << 30,
			"max_region_bytes is 50% of physical memory (64GiB), 32GiB (34359738368 bytes):"},
		{"a share of next to nothing still bounds", "10%", memlimit.Limit{Bytes: 4, File: "/sys/fs/cgroup/memory.max"}, true, 1,
			"max_region_bytes is 10% of ferryd's cgroup memory limit (4B, /sys/fs/cgroup/memory.max), 1B (1 bytes):"},
	} {
		t.Run(c.name, func(t *testing.T) {
			r := newTestRegistry(t, 4096)
			r.hostLimit = shareOf(c.share, physical, c.cg, c.limited)
			if r.hostLimit.bytes != c.bytes {
				t.Errorf("%s of %d bytes of memory, cgroup %+v (%v): %d bytes; want %d", c.share, int64(physical), c.cg, c.limited, r.hostLimit.bytes, c.bytes)
			}
			_, err := r.claimRegion("kv", 1<<40)
			if !isCode(err, api.CodeTooLarge) || !strings.Contains(err.Error(), c.says) {
				t.Errorf("a region past the bound: %v; want %s saying %q", err, api.CodeTooLarge, c.says)
			}
		})
	}
}

// countingRegistrar stands in for rdma's region registrations, counting
// them; drop, if set, is what dropping one returns.
type countingRegistrar struct {
	registered atomic.Int64
	drop       func() error
}

func (c *countingRegistrar) RegisterRegion([]byte) (io.Closer, error) { return c.register(), nil }

func (c *countingRegistrar) RegisterDeviceRegion(transport.Range) (io.Closer, error) {
	return c.register(), nil
}

func (c *countingRegistrar) register() io.Closer {
	c.registered.Add(1)
	return closerFunc(func() error {
		if c.drop == nil {
			return nil
		}
		return c.drop()
	})
}

// Memory a Mooncake engine registered (a region with mooncake_addr):
// peers' writes without a key land in it at its owner's addresses, a
// write may span regions that follow one another (tensors sharing a
// page are lent as adjacent regions), the segment lists those as one
// buffer, ranges overlapping the arena or each other are refused, and a
// closing region takes no write and waits for those landing.
func TestMooncakeRegionsTakeUnkeyedWritesAtTheirOwnersAddresses(t *testing.T) {
	r := newTestRegistry(t, 1<<16)
	const at = 0x7f0000000000
	a, b := hostRegion(make([]byte, 8192)), hostRegion(make([]byte, 4096))
	if _, err := r.addRegionAt("a", a, nil, nil, lend{mooncakeAddr: at}); err != nil {
		t.Fatal(err)
	}
	if _, err := r.addRegionAt("b", b, nil, nil, lend{mooncakeAddr: at + 8192}); err != nil {
		t.Fatal(err)
	}
	if _, err := r.addRegionAt("over-a", hostRegion(make([]byte, 4096)), nil, nil, lend{mooncakeAddr: at + 4096}); !isCode(err, api.CodeExists) || !strings.Contains(err.Error(), "overlaps region a") {
		t.Fatalf("a range over region a's: %v", err)
	}
	base := r.arena.Addr(arena.Slice{})
	if _, err := r.addRegionAt("over-arena", hostRegion(make([]byte, 4096)), nil, nil, lend{mooncakeAddr: base + 100}); !isCode(err, api.CodeBadRequest) || !strings.Contains(err.Error(), "arena") {
		t.Fatalf("a range over the arena's: %v", err)
	}
	if got, want := fmt.Sprint(r.mooncakeBuffers("", "seg")), fmt.Sprint([]mooncake.Buffer{{Name: "seg", Addr: at, Length: 12288}}); got != want {
		t.Errorf("the segment's buffers: %s, want %s", got, want)
	}
	// A write spanning a's end and b's start lands in both.
	want := []byte("across two regions")
	body, done, err := r.AcceptUnkeyed(at+8192-5, uint64(len(want)))
	if err != nil {
		t.Fatal(err)
	}
	off := 0
	eachPiece(t, body, func(piece []byte) { off += copy(piece, want[off:]) })
	if off != len(want) {
		t.Fatalf("the body lent %d bytes, want %d", off, len(want))
	}
	// Closing while the write lands: no new write, the end waits.
	end, err := r.removeRegion("b")
	if err != nil {
		t.Fatal(err)
	}
	if _, _, err := r.AcceptUnkeyed(at+8192, 1); refusalCode(t, err) != transport.NoSlot {
		t.Fatalf("a write into a closing region: %v", err)
	}
	select {
	case <-end.done:
		t.Fatal("region b ended while a write still lands in it")
	default:
	}
	done(nil)
	<-end.done
	if string(a[8192-5:])+string(b[:len(want)-5]) != string(want) {
		t.Errorf("the bytes landed %q %q, want %q", a[8192-5:], b[:len(want)-5], want)
	}
	// Past a's end, now that b is gone; an empty write.
	if _, _, err := r.AcceptUnkeyed(at+8190, 4); refusalCode(t, err) != transport.OutOfBounds {
		t.Fatalf("a write running past the registered memory: %v", err)
	}
	if _, _, err := r.AcceptUnkeyed(at, 0); refusalCode(t, err) != transport.OutOfBounds {
		t.Fatalf("an empty write: %v", err)
	}
	if _, err := r.removeRegion("a"); err != nil {
		t.Fatal(err)
	}
	if _, _, err := r.AcceptUnkeyed(at, 1); refusalCode(t, err) != transport.NoSlot || r.mooncakeRegions.Load() != 0 {
		t.Fatalf("a write once no region is open to Mooncake peers: %v (%d open)", err, r.mooncakeRegions.Load())
	}
}

// A region asked to take Mooncake peers' writes needs a Mooncake
// segment (tcp or rdma; a memfd, or GPU memory over tcp), and an engine segment, if named, that
// exists and is the caller's; each refusal says what to do.
func TestMooncakeRegionRequestsRefusedSayWhy(t *testing.T) {
	tcp := &mooncakeSegment{seg: mooncake.Segment{Protocol: "tcp"}}
	rdma := &mooncakeSegment{seg: mooncake.Segment{Protocol: "rdma"}}
	theirs := &engineSegment{id: "e1", owner: 1}
	bad, missing, forbidden := api.CodeBadRequest, api.CodeNotFound, api.CodeForbidden
	for _, c := range []struct {
		seg  *mooncakeSegment
		req  api.RegionRequest
		code string
		want string // "" accepted
	}{
		{nil, api.RegionRequest{Name: "r", NBytes: 4096}, "", ""},
		{nil, api.RegionRequest{Name: "r", NBytes: 4096, MooncakeAddr: 0x1000}, bad, "--mooncake-listen"},
		{rdma, api.RegionRequest{Name: "r", NBytes: 4096, MooncakeAddr: 0x1000}, "", ""},
		{tcp, api.RegionRequest{Name: "r", NBytes: 4096, MooncakeAddr: 0x1000, CUDA: &api.RegionCUDA{}}, "", ""},
		{tcp, api.RegionRequest{Name: "r", NBytes: 4096, MooncakeAddr: ^uint64(0) - 100}, bad, "end of the address space"},
		{tcp, api.RegionRequest{Name: "r", NBytes: 4096, MooncakeSegment: "e1"}, bad, "without mooncake_addr"},
		{tcp, api.RegionRequest{Name: "r", NBytes: 4096, MooncakeAddr: 0x1000, MooncakeSegment: "e9"}, missing, "POST /v1/mooncake/segments"},
		{tcp, api.RegionRequest{Name: "r", NBytes: 4096, MooncakeAddr: 0x1000, MooncakeSegment: "e1"}, forbidden, "belongs to process 1"},
		{tcp, api.RegionRequest{Name: "r", NBytes: 4096, MooncakeAddr: 0x1000}, "", ""},
	} {
		d := &Daemon{mooncake: c.seg, engines: engines{byID: map[string]*engineSegment{"e1": theirs}}}
		_, err := d.lendFor(context.Background(), c.req)
		if c.want == "" && err != nil || c.want != "" && (!isCode(err, c.code) || !strings.Contains(err.Error(), c.want)) {
			t.Errorf("%+v: %v, want %s %q", c.req, err, c.code, c.want)
		}
	}
}

// A region at an offset of a memfd (ferry's allocator lends one memfd per
// process, each registered tensor a region of it): only the pages holding
// it are mapped, its memory is exactly its bytes, and a range past the
// file is refused saying so.
func TestMapRegionAtAnOffsetMapsItsBytesOnly(t *testing.T) {
	f := regionFile(t, "window", 4*4096)
	want := make([]byte, 4*4096)
	for i := range want {
		want[i] = byte(i * 7)
	}
	if _, err := f.WriteAt(want, 0); err != nil {
		t.Fatal(err)
	}
	mem, err := mapRegion(int(f.Fd()), "t", 5000, 6000)
	if err != nil {
		t.Fatal(err)
	}
	if mem.Size() != 6000 || !slices.Equal(mem.Host(), want[5000:11000]) {
		t.Fatalf("the region holds %d bytes, want bytes 5000..11000 of the memfd", mem.Size())
	}
	copy(mem.Host(), "landed")
	got := make([]byte, 6)
	if _, err := f.ReadAt(got, 5000); err != nil || string(got) != "landed" {
		t.Fatalf("a write into the region reads back from the memfd as %q (%v)", got, err)
	}
	if err := mem.Close(); err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct{ off, n int64 }{{-1, 10}, {4 * 4096, 1}, {3 * 4096, 4097}} {
		if _, err := mapRegion(int(f.Fd()), "t", c.off, c.n); !isCode(err, api.CodeBadRequest) || !strings.Contains(err.Error(), "fd_offset") {
			t.Errorf("fd_offset %d, nbytes %d: %v", c.off, c.n, err)
		}
	}
}

// An engine segment lists and lands writes in its own regions only
// (another segment's addresses are out of bounds there, the same
// addresses may be lent in two segments), serves reads from one region,
// and closing it waits for the writes landing in it.
func TestEngineSegmentsKeepTheirMemoryApart(t *testing.T) {
	r := newTestRegistry(t, 1<<16)
	const at = 0x7f0000000000
	a, b := hostRegion(make([]byte, 8192)), hostRegion(make([]byte, 8192))
	if _, err := r.addRegionAt("a", a, nil, nil, lend{mooncakeAddr: at, segment: "e1"}); err != nil {
		t.Fatal(err)
	}
	if _, err := r.addRegionAt("b", b, nil, nil, lend{mooncakeAddr: at, segment: "e2"}); err != nil {
		t.Fatalf("the same addresses in another engine's segment: %v", err)
	}
	if got := fmt.Sprint(r.mooncakeBuffers("e1", "s")); got != fmt.Sprint([]mooncake.Buffer{{Name: "s", Addr: at, Length: 8192}}) {
		t.Errorf("e1's buffers: %s", got)
	}
	if got := r.mooncakeBuffers("", "s"); len(got) != 0 || r.mooncakeRegions.Load() != 0 {
		t.Errorf("ferryd's own segment lists engine memory: %v", got)
	}
	if _, _, err := (engineMemory{r, "e3"}).Write(at, 1); refusalCode(t, err) != transport.OutOfBounds {
		t.Fatalf("a write into a segment with no memory: %v", err)
	}
	body, done, err := (engineMemory{r, "e2"}).Write(at+100, 5)
	if err != nil {
		t.Fatal(err)
	}
	piece, _ := body()
	copy(piece, "hello")
	src, release, err := (engineMemory{r, "e1"}).Read(at, 8192)
	if err != nil || &src[0] != &a[0] {
		t.Fatalf("a read of e1's region: %v", err)
	}
	release()
	d := &Daemon{reg: r, log: zerolog.Nop()}
	es := &engineSegment{id: "e2"}
	ln := func() net.Listener {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		return l
	}
	es.hs = mooncake.Serve(ln(), mooncake.Handlers{Segment: func() *mooncake.Segment { return &es.seg }}, mooncake.ServerConfig{})
	es.data = mooncake.ServeData(ln(), engineMemory{r, "e2"}, mooncake.DataConfig{})
	d.engines.byID = map[string]*engineSegment{"e2": es}
	dropped := make(chan error, 1)
	go func() { dropped <- d.dropEngineSegment(es, 10*time.Second, "test") }()
	poll := time.Now().Add(10 * time.Second)
	for len(r.lentIn("e2")) > 0 && time.Now().Before(poll) {
		time.Sleep(time.Millisecond) // the drop marks the region closing first
	}
	select {
	case err := <-dropped:
		t.Fatalf("the segment closed while a write still lands in it: %v", err)
	default:
	}
	done(nil)
	if err := <-dropped; err != nil {
		t.Fatal(err)
	}
	if string(b[100:105]) != "hello" || d.engines.get("e2") != nil {
		t.Fatalf("after the drop: %q, segment listed %v", b[100:105], d.engines.get("e2") != nil)
	}
}

// A ferry peer's write carrying an engine segment's key lands in that
// segment's regions at their Mooncake addresses (across adjacent ones);
// outside them it is out of bounds, and a key no segment has is no slot.
func TestEngineKeysLandFerryPeersWritesInEngineMemory(t *testing.T) {
	r := newTestRegistry(t, 1<<16)
	const at = 0x7f0000000000
	a, b := hostRegion(make([]byte, 4096)), hostRegion(make([]byte, 4096))
	for i, g := range []hostRegion{a, b} {
		if _, err := r.addRegionAt(fmt.Sprint("r", i), g, nil, nil, lend{mooncakeAddr: at + uint64(i)*4096, segment: "e1"}); err != nil {
			t.Fatal(err)
		}
	}
	key := transport.NewKey()
	r.engineKeys = map[transport.Key]string{key: "e1"}
	want := []byte("spans two tensors")
	body, done, err := r.AcceptChunks(at+4090, uint64(len(want)), key, 0)
	if err != nil {
		t.Fatal(err)
	}
	off := 0
	eachPiece(t, body, func(piece []byte) { off += copy(piece, want[off:]) })
	done(nil)
	if got := string(a[4090:]) + string(b[:len(want)-6]); got != string(want) {
		t.Fatalf("landed %q, want %q", got, want)
	}
	if _, _, err := r.AcceptChunks(at+8000, 200, key, 0); refusalCode(t, err) != transport.OutOfBounds {
		t.Fatalf("past the engine's memory: %v", err)
	}
	if _, _, err := r.AcceptChunks(at, 1, transport.NewKey(), 0); refusalCode(t, err) != transport.NoSlot {
		t.Fatalf("a key no segment has: %v", err)
	}
}

// GPU memory an engine registered, as two regions (two tensors of one
// caching-allocator segment, lent by the same allocation's IPC handle):
// a ferry peer's write spanning both lands through host staging a chunk
// at a time, a transport taking one piece gets it copied in by done,
// reads are copied out, a ferryd out of staging refuses the write, and
// a failed copy fails the write (the sender hears it).
func TestEngineGPUMemoryTakesWritesThroughStaging(t *testing.T) {
	r := newTestRegistry(t, 1<<16)
	const at = 0x7f0000000000
	k, v := &deviceMemory{mem: make([]byte, 3*stageChunk/2)}, &deviceMemory{mem: make([]byte, 4096)}
	if _, err := r.addRegionAt("k", k, nil, nil, lend{mooncakeAddr: at, segment: "e1"}); err != nil {
		t.Fatal(err)
	}
	if _, err := r.addRegionAt("v", v, nil, nil, lend{mooncakeAddr: at + uint64(k.Size()), segment: "e1"}); err != nil {
		t.Fatal(err)
	}
	key := transport.NewKey()
	r.engineKeys = map[transport.Key]string{key: "e1"}
	want := bytes.Repeat([]byte("0123456789abcdef"), (stageChunk+1024)/16)
	from := uint64(k.Size()) - uint64(len(want)) + 1000 // 1000 bytes into v
	body, done, err := r.AcceptChunks(at+from, uint64(len(want)), key, 0)
	if err != nil {
		t.Fatal(err)
	}
	off := 0
	eachPiece(t, body, func(piece []byte) {
		if len(piece) > stageChunk {
			t.Fatalf("a piece of %d bytes: more than one chunk of staging", len(piece))
		}
		off += copy(piece, want[off:])
	})
	done(nil)
	if got := append(slices.Clone(k.mem[from:]), v.mem[:1000]...); !bytes.Equal(got, want) || k.lent != 0 || v.lent != 0 {
		t.Fatalf("landed %d bytes unlike those sent, or staging still lent (%d, %d)", len(got), k.lent, v.lent)
	}
	// One piece (Accept, rdma's bounce path): copied in by done.
	dst, done, err := r.Accept(at+uint64(k.Size())+100, 5, key, 0)
	if err != nil {
		t.Fatal(err)
	}
	copy(dst, "hello")
	if string(v.mem[100:105]) == "hello" {
		t.Fatal("the bytes reached GPU memory before done")
	}
	done(nil)
	if string(v.mem[100:105]) != "hello" || v.lent != 0 {
		t.Fatalf("after done: %q, %d bytes of staging lent", v.mem[100:105], v.lent)
	}
	src, release, err := (engineMemory{r, "e1"}).Read(at+uint64(k.Size())+100, 5)
	if err != nil || string(src) != "hello" {
		t.Fatalf("a read of GPU memory: %q, %v", src, err)
	}
	release()
	v.noStaging = true
	if _, _, err := r.AcceptChunks(at+uint64(k.Size()), 10, key, 0); refusalCode(t, err) != transport.Internal || !strings.Contains(err.Error(), "--bounce-size") {
		t.Fatalf("a write with no staging to lend: %v", err)
	}
	if _, _, err := (engineMemory{r, "e1"}).Read(at+uint64(k.Size()), 10); err == nil || !strings.Contains(err.Error(), "--bounce-size") {
		t.Fatalf("a read with no staging to lend: %v", err)
	}
	v.noStaging, v.failFrom = false, 1
	body, done, err = r.AcceptChunks(at+uint64(k.Size()), 10, key, 0)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := body(); err != nil {
		t.Fatal(err)
	}
	if _, err := body(); err == nil || !strings.Contains(err.Error(), "CUDA_ERROR_ILLEGAL_ADDRESS") {
		t.Fatalf("a write whose copy in failed: %v", err)
	}
	done(err)
	end, err := r.removeRegion("v")
	if err != nil {
		t.Fatal(err)
	}
	waitEnd(t, end) // no write or read still pins it
}

// Engine segments are bounded: past maxEngineSegments open, a new one is
// refused (busy) before it listens.
func TestEngineSegmentsAreBounded(t *testing.T) {
	d := &Daemon{mooncake: &mooncakeSegment{seg: mooncake.Segment{Protocol: "tcp"}}}
	d.engines.byID = make(map[string]*engineSegment)
	for i := range maxEngineSegments {
		d.engines.byID[fmt.Sprint("e", i)] = &engineSegment{}
	}
	if _, err := d.openEngineSegment(1, 0); !isCode(err, api.CodeBusy) || !strings.Contains(err.Error(), "close engines no longer used") {
		t.Fatalf("an engine segment past the bound: %v", err)
	}
	// One process meets its own bound first.
	d.engines.byID = make(map[string]*engineSegment)
	for i := range maxEngineSegmentsPerProcess {
		d.engines.byID[fmt.Sprint("e", i)] = &engineSegment{owner: 7}
	}
	if _, err := d.openEngineSegment(7, 0); !isCode(err, api.CodeBusy) || !strings.Contains(err.Error(), "process 7 holds 16 engine segments") {
		t.Fatalf("a process's engine segment past its bound: %v", err)
	}
}

// Over RDMA each region an engine lent is a buffer of its own with its
// registration's keys, even where regions follow one another: their
// rkeys differ, and a Mooncake peer writes under one per buffer.
func TestMooncakeRegionsOverRDMAAreBuffersOfTheirOwn(t *testing.T) {
	r := newTestRegistry(t, 1<<16)
	const at = 0x7f0000000000
	for i, name := range []string{"a", "b"} {
		mr := &rdma.EngineRegion{RKey: uint32(10 + i), LKey: uint32(20 + i)}
		if _, err := r.addRegionAt(name, hostRegion(make([]byte, 4096)), nil, nil, lend{mooncakeAddr: at + uint64(i)*4096, mr: mr}); err != nil {
			t.Fatal(err)
		}
	}
	want := []mooncake.Buffer{
		{Name: "cpu:0", Addr: at, Length: 4096, RKey: []uint32{10}, LKey: []uint32{20}},
		{Name: "cpu:0", Addr: at + 4096, Length: 4096, RKey: []uint32{11}, LKey: []uint32{21}},
	}
	if got := r.mooncakeBuffers("", "cpu:0"); fmt.Sprint(got) != fmt.Sprint(want) {
		t.Errorf("the segment's buffers: %v, want %v", got, want)
	}
}
