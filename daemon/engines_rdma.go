package daemon

import (
	"context"
	"fmt"
	"net"
	"strings"

	"github.com/ferry-project/ferry/api"
	"github.com/ferry-project/ferry/arena"
	"github.com/ferry-project/ferry/internal/connlimit"
	"github.com/ferry-project/ferry/mooncake"
	"github.com/ferry-project/ferry/rdma"
	"github.com/ferry-project/ferry/transport"
)

// Engine memory over RDMA. On the rdma transport, a region lent with a
// mooncake_addr is registered with the NIC once more, beside its own
// registration: under an I/O virtual address equal to mooncake_addr, for
// remote writes, covering exactly the region (rdma/engines.go). Its
// segment (ferryd's own, or the engine's) speaks protocol rdma and lists
// the region as a buffer at mooncake_addr with that registration's keys,
// each region a buffer of its own (neighbours have different rkeys).
// So a Mooncake peer, once its connection handshake on the segment's RPC
// port set up queue pairs, writes into the region one-sidedly at the
// engine's addresses, and a write past the region fails at its NIC
// (REM_ACCESS_ERR): it never gets the arena's rkey for engine memory. A
// ferry peer writes over ferry's peer protocol with the segment's key
// (engines.go), and its write is granted at the engine's address under
// the same registration: in place, with no registration or copy per
// write. The same registration serves peers' RDMA READs: a Mooncake
// peer's over its endpoint's queue pairs, a ferry peer's granted per
// piece on a read connection (rdma/reads.go). GPU memory is registered so too
// where the NIC reaches GPU memory itself, by its dmabuf or its device
// pointer as the GPU arena may be, a ferry peer's write into it placed
// by the NIC through AcceptEngine; on the bounce path nothing is, and
// its writes go through staging (registerEngineRegion).

// registerEngineRegion registers mem, lent as l, for peers' RDMA writes
// at its Mooncake address, when the transport is rdma; l.mr holds it,
// l.engineNIC says how it went. A region that cannot be registered is
// refused: a peer's write into memory the NIC does not reach would
// fail. GPU memory is registered where the NIC reaches GPU memory
// itself, by its dmabuf or its device pointer as the GPU arena may be
// (rdma/engines.go), the path logged and counted; where the NIC reaches
// none (the bounce path), or its registration fails, it is refused when
// ferryd's Mooncake segments speak rdma (Mooncake peers' one-sided
// writes could land nowhere), and over tcp segments every write into it
// goes through host staging, as over TCP, the reason logged. It returns
// how GPU memory met the NIC, for engineGPUTaken once the region is in.
func (d *Daemon) registerEngineRegion(name string, mem arena.Memory, l *lend) (*rdma.GPURegistration, error) {
	if l.mooncakeAddr == 0 || d.dp.rdma == nil {
		return nil, nil
	}
	var er *rdma.EngineRegion
	var gpu *rdma.GPURegistration
	var err error
	if host := mem.Host(); host != nil {
		er, err = d.dp.rdma.RegisterEngineRegion(host, l.mooncakeAddr)
	} else {
		dev := rdma.EngineDevice{Range: transport.Range{Addr: mem.Base(), Len: uint64(mem.Size())}}
		if x, ok := mem.(dmabufExporter); ok {
			dev.DMABuf = x.ExportDMABuf
		}
		er, gpu, err = d.dp.rdma.RegisterEngineDevice(dev, l.mooncakeAddr)
		d.countEngineGPUFailures(gpu)
	}
	l.mr, l.engineNIC = er, &api.RegionEngineNIC{Registered: er != nil, GPU: gpuStatus(gpu)}
	switch {
	case err == nil:
	case mem.Host() == nil && d.mooncake.seg.Protocol != "rdma":
		l.engineNIC.Error = err.Error()
		d.regionLog.Printf("region %s: mooncake_addr: ferry peers' writes into this GPU memory go through host staging: %v", name, err)
	case mem.Host() == nil:
		return gpu, apiErr(api.CodeBadRequest, "region %s: mooncake_addr: this ferryd's Mooncake segments speak rdma, so Mooncake peers write the region one-sidedly, and %v: lend a memfd, or run ferryd's Mooncake segments over tcp (writes into GPU memory then go through host staging)", name, err)
	default:
		return gpu, apiErr(api.CodeInternal, "region %s: mooncake_addr: Mooncake and ferry peers write it over RDMA, and %v", name, err)
	}
	return gpu, nil
}

// dmabufExporter is GPU memory that exports itself as a dmabuf for the
// NIC: a CUDA region (cuda.Region).
type dmabufExporter interface {
	ExportDMABuf() (fd int, offset uint64, err error)
}

// countEngineGPUFailures counts each path that failed to register GPU
// memory an engine registered, whether or not a later one was taken.
func (d *Daemon) countEngineGPUFailures(g *rdma.GPURegistration) {
	if g == nil {
		return
	}
	for _, n := range g.NotTaken {
		if n.Err != nil {
			d.metrics.engineGPURegistrations.WithLabelValues(string(n.Path), "failed").Inc()
		}
	}
}

// engineGPUTaken counts and logs (rate-limited) the path by which GPU
// memory an engine registered, region name, met the NIC, once the region
// is in (a request refused after all leaves no registration behind), and
// each path that failed first.
func (d *Daemon) engineGPUTaken(name string, g *rdma.GPURegistration) {
	if g == nil || g.Path == "" {
		return // host memory; or refused, or staged with the reason logged
	}
	var failed []string
	for _, n := range g.NotTaken {
		if n.Err != nil {
			failed = append(failed, fmt.Sprintf("%s failed: %v", n.Path, n.Err))
		}
	}
	d.metrics.engineGPURegistrations.WithLabelValues(string(g.Path), "taken").Inc()
	if len(failed) > 0 {
		d.regionLog.Printf("region %s: mooncake_addr: GPU memory registered for peers' writes by %s, as %s", name, g.Path, strings.Join(failed, "; "))
	}
}

var _ transport.EngineSink = (*registry)(nil)

// AcceptEngine implements transport.EngineSink: a ferry peer's write
// carrying an engine segment's key, wholly inside one of its GPU regions
// registered for peers' RDMA writes, lands in place, the region pinned
// until done. Any other goes through Accept (acceptKeyed), which stages
// or refuses it.
func (r *registry) AcceptEngine(addr, n uint64, key transport.Key, tag uint32) (uint64, func(error), bool, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	segment, ok := r.engineKeys[key]
	if !ok || r.byKey[key] != nil {
		return 0, nil, false, nil
	}
	g := r.mooncakeRegionAt(segment, addr)
	if g == nil || g.mr == nil || g.mem.Host() != nil || n == 0 || n > uint64(g.size())-(addr-g.mooncakeAddr) {
		return 0, nil, false, nil
	}
	if r.closedTo(nil) {
		return 0, nil, true, errRefuseStopping
	}
	g.uses++
	return g.addr() + (addr - g.mooncakeAddr), func(error) { r.unpinRegions([]*region{g}) }, true, nil
}

// closeNIC drops l's registration for peers' RDMA writes, if any.
func (l *lend) closeNIC() error {
	if l.mr == nil {
		return nil
	}
	return l.mr.Close()
}

// engineBuffer is g, lent as a buffer named name, with its keys over
// RDMA.
func engineBuffer(g *region, name string) mooncake.Buffer {
	b := mooncake.Buffer{Name: name, Addr: g.mooncakeAddr, Length: uint64(g.size())}
	if g.mr != nil {
		b.RKey, b.LKey = []uint32{g.mr.RKey}, []uint32{g.mr.LKey}
	}
	return b
}

// serveEngineRDMA makes an engine segment an rdma one, as ferryd's own
// is: the same NIC, its buffers under mooncakeLocation, and a table of
// endpoints of its own, closed with it. A Mooncake initiator keeps one
// endpoint per target NIC path, and so QPs of its own to each segment
// from the same NIC path of its own; in one table, keyed by that path,
// its handshake with a second segment (two ranks' engines on one host)
// would replace, and close, the QPs it still writes to the first over.
func (d *Daemon) serveEngineRDMA(es *engineSegment, h *mooncake.Handlers) {
	own := d.mooncake.seg
	if own.Protocol != "rdma" {
		return
	}
	es.seg.Protocol, es.seg.Devices, es.seg.PriorityMatrix = own.Protocol, own.Devices, own.PriorityMatrix
	es.eps = mooncake.NewEndpoints(d.dp.rdma, mooncake.EndpointConfig{MTU: d.cfg.MooncakeMTU, Infof: func(format string, args ...any) {
		if d.mooncake.engines.Allow() { // every engine segment's lines together
			d.log.Info().Str("component", "mooncake").Str("engine_segment", es.id).Msg(fmt.Sprintf(format, args...))
		}
	}})
	eps, mayFetch := es.eps, d.mayFetchMooncake()
	h.Connect = func(ctx context.Context, from net.Addr, req mooncake.HandshakeDesc) (mooncake.HandshakeDesc, func()) {
		return eps.Accept(ctx, mooncake.Handshake{Self: es.seg.Name, From: from, MayFetch: mayFetch}, req)
	}
}

// retire counts what closed segment es's endpoint table did into the
// totals, so that the endpoint counters only grow.
func (e *engines) retire(es *engineSegment) {
	if es.eps == nil {
		return
	}
	st := es.eps.Stats()
	e.mu.Lock()
	defer e.mu.Unlock()
	e.retired.Evicted += st.Evicted
	e.retired.RefusedPerSource += st.RefusedPerSource
}

// mooncakeEndpointStats is what every Mooncake endpoint table holds and
// did: ferryd's own segment's, each open engine segment's, and those of
// engine segments closed.
func (d *Daemon) mooncakeEndpointStats() connlimit.Stats {
	st := d.dp.mooncake.Stats()
	d.engines.mu.Lock()
	defer d.engines.mu.Unlock()
	st.Evicted += d.engines.retired.Evicted
	st.RefusedPerSource += d.engines.retired.RefusedPerSource
	for _, es := range d.engines.byID {
		if es.eps != nil {
			e := es.eps.Stats()
			st.Open += e.Open
			st.Evicted += e.Evicted
			st.RefusedPerSource += e.RefusedPerSource
		}
	}
	return st
}
