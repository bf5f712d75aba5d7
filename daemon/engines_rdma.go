package daemon

import (
	"context"
	"fmt"
	"net"

	"github.com/ferry-project/ferry/api"
	"github.com/ferry-project/ferry/arena"
	"github.com/ferry-project/ferry/internal/connlimit"
	"github.com/ferry-project/ferry/mooncake"
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
// write. No registration allows remote reads; Mooncake peers read
// engine memory over the TCP data port.

// registerEngineRegion registers mem, lent as l, for peers' RDMA writes
// at its Mooncake address, when the transport is rdma; l.mr holds it.
// A region that cannot be registered is refused: a peer's write into
// memory the NIC does not reach would fail.
func (d *Daemon) registerEngineRegion(name string, mem arena.Memory, l *lend) error {
	switch {
	case l.mooncakeAddr == 0 || d.dp.rdma == nil:
		return nil
	case mem.Host() == nil && d.mooncake.seg.Protocol == "rdma":
		// A buffer without keys would make the whole rdma descriptor one
		// Mooncake rejects.
		return apiErr(api.CodeBadRequest, "region %s: mooncake_addr: this ferryd's Mooncake segments speak rdma, and GPU memory is not yet registered for peers' RDMA writes at an engine's addresses: lend a memfd, or run ferryd's Mooncake segments over tcp", name)
	case mem.Host() == nil:
		return nil // GPU memory: Mooncake peers write it over TCP, through staging
	}
	er, err := d.dp.rdma.RegisterEngineRegion(mem.Host(), l.mooncakeAddr)
	if err != nil {
		return apiErr(api.CodeInternal, "region %s: mooncake_addr: Mooncake and ferry peers write it over RDMA, and %v", name, err)
	}
	l.mr = er
	return nil
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
