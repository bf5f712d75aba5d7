package daemon

import (
	"fmt"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/ferry-project/ferry/internal/connlimit"
	"github.com/ferry-project/ferry/rdma"
)

// limitsCollector reports what the caps on the ports anyone may reach
// did (the peer port, the Mooncake RPC and data ports, and for local
// users the control socket and the metrics listener), the Mooncake
// endpoint table's, and the caps on queue pairs (Mooncake's, read
// connections'), read at scrape time. Labels are the port and the
// reason: never an address. The endpoint tables' series read 0 on a
// daemon without a Mooncake RDMA segment, so one dashboard fits every host.
type limitsCollector struct {
	ports     map[string]func() connlimit.Stats // by port label
	endpoints func() connlimit.Stats            // every table's together; nil: no Mooncake RDMA segment
	qps       func() rdma.QPStats               // nil: no Mooncake RDMA segment
	readQPs   func() rdma.QPStats               // nil: no rdma transport
}

// reasonNotAllowed labels connections refused by an allow-list.
const reasonNotAllowed = "not_allowed"

var (
	portConnsDesc = prometheus.NewDesc("ferry_port_connections",
		"Connections a port anyone may reach holds now: peer (the peer port: data connections and RDMA lanes), mooncake_rpc, mooncake_data, mooncake_engines (every engine segment's two ports together), control (the control socket), metrics (--metrics-listen).",
		[]string{"port"}, nil)
	portRefusedDesc = prometheus.NewDesc("ferry_port_refused_connections_total",
		"Connections a port closed at once, by reason: per_source (its address, or on the control socket its uid, held the most one may, each proven or in use), total (every place held by a connection in use), not_allowed (a Mooncake port: its address is not on mooncake_allow).",
		[]string{"port", "reason"}, nil)
	portClosedDesc = prometheus.NewDesc("ferry_port_closed_connections_total",
		"Connections a port closed itself, by reason: evicted (to make room for a newcomer: one that carried no traffic first, then the least recently used; past its address's cap, a newcomer takes only its own address's unproven places), idle (no write for the idle timeout; not on the Mooncake ports), handshake (it did not say what it wanted in time).",
		[]string{"port", "reason"}, nil)
	portFailuresDesc = prometheus.NewDesc("ferry_port_failures_total",
		"Failures a remote party caused on a port anyone may reach (a failed or refused handshake, a malformed request, a refused write on a Mooncake port): each a WARN line, at most 10 a second logged.",
		[]string{"port"}, nil)
	endpointsDesc = prometheus.NewDesc("ferry_mooncake_endpoints",
		"Mooncake RDMA endpoints (QPs to one peer NIC) this daemon holds, in ferryd's own segment's table and every engine segment's.", nil, nil)
	endpointsEvictedDesc = prometheus.NewDesc("ferry_mooncake_endpoints_evicted_total",
		"Mooncake RDMA endpoints closed to make room for a new one in a full table.", nil, nil)
	endpointsRefusedDesc = prometheus.NewDesc("ferry_mooncake_endpoints_refused_total",
		"Mooncake connection handshakes refused because their address held the most endpoints one address may in that segment's table.", nil, nil)
	mooncakeQPsDesc = prometheus.NewDesc("ferry_mooncake_qps",
		"Mooncake queue pairs open, across every Mooncake segment's endpoints (at most 16384).", nil, nil)
	mooncakeQPsRefusedDesc = prometheus.NewDesc("ferry_mooncake_qps_refused_total",
		"Mooncake queue pairs refused because the daemon held the most it keeps across all its Mooncake segments (16384): each a handshake refused, or a write to a Mooncake segment failed.", nil, nil)
	readQPsDesc = prometheus.NewDesc("ferry_rdma_read_qps",
		fmt.Sprintf("Queue pairs of RDMA read connections open, those this daemon serves and its own reads' (at most %d; 0 without rdma).", rdma.DefaultReadQPs), nil, nil)
	readQPsRefusedDesc = prometheus.NewDesc("ferry_rdma_read_qps_refused_total",
		fmt.Sprintf("Queue pairs of RDMA read connections refused because the daemon held %d: each a read connection refused (served) or a read failed (its own).", rdma.DefaultReadQPs), nil, nil)
)

func (c *limitsCollector) Describe(ch chan<- *prometheus.Desc) {
	ch <- portConnsDesc
	ch <- portRefusedDesc
	ch <- portClosedDesc
	ch <- portFailuresDesc
	ch <- endpointsDesc
	ch <- endpointsEvictedDesc
	ch <- endpointsRefusedDesc
	ch <- mooncakeQPsDesc
	ch <- mooncakeQPsRefusedDesc
	ch <- readQPsDesc
	ch <- readQPsRefusedDesc
}

func (c *limitsCollector) Collect(ch chan<- prometheus.Metric) {
	counter := func(d *prometheus.Desc, v uint64, labels ...string) {
		ch <- prometheus.MustNewConstMetric(d, prometheus.CounterValue, float64(v), labels...)
	}
	for port, read := range c.ports {
		st := read()
		ch <- prometheus.MustNewConstMetric(portConnsDesc, prometheus.GaugeValue, float64(st.Open), port)
		counter(portRefusedDesc, st.RefusedPerSource, port, connlimit.ReasonPerSource)
		counter(portRefusedDesc, st.RefusedTotal, port, connlimit.ReasonTotal)
		counter(portRefusedDesc, st.RefusedNotAllowed, port, reasonNotAllowed)
		counter(portClosedDesc, st.Evicted, port, connlimit.ReasonEvicted)
		counter(portClosedDesc, st.Idle, port, connlimit.ReasonIdle)
		counter(portClosedDesc, st.Timeout, port, connlimit.ReasonTimeout)
		counter(portFailuresDesc, st.Failures, port)
	}
	var st connlimit.Stats
	if c.endpoints != nil {
		st = c.endpoints()
	}
	ch <- prometheus.MustNewConstMetric(endpointsDesc, prometheus.GaugeValue, float64(st.Open))
	counter(endpointsEvictedDesc, st.Evicted)
	counter(endpointsRefusedDesc, st.RefusedPerSource)
	qps := func(read func() rdma.QPStats, open, refused *prometheus.Desc) {
		var qs rdma.QPStats
		if read != nil {
			qs = read()
		}
		ch <- prometheus.MustNewConstMetric(open, prometheus.GaugeValue, float64(qs.Open))
		counter(refused, qs.Refused)
	}
	qps(c.qps, mooncakeQPsDesc, mooncakeQPsRefusedDesc)
	qps(c.readQPs, readQPsDesc, readQPsRefusedDesc)
}

// limits is the collector over this daemon's ports.
func (d *Daemon) limits() *limitsCollector {
	// Both transports, tcp and rdma, serve the peer port.
	peer := d.dp.tr.(interface{ PortStats() connlimit.Stats })
	c := &limitsCollector{ports: map[string]func() connlimit.Stats{"peer": peer.PortStats, "control": d.controlGate.Stats}}
	if d.cfg.MetricsListen != "" {
		c.ports["metrics"] = func() connlimit.Stats { return d.metricsGate.Stats() } // opened after this
	}
	if d.dp.rdma != nil {
		c.readQPs = d.dp.rdma.ReadQPStats
	}
	if m := d.mooncake; m != nil {
		c.ports["mooncake_rpc"] = m.hs.Stats
		c.ports["mooncake_data"] = m.data.Stats
		c.ports["mooncake_engines"] = m.enginePorts.Stats
		if m.seg.Protocol == "rdma" {
			c.endpoints, c.qps = d.mooncakeEndpointStats, d.dp.rdma.MooncakeQPStats
		}
	}
	return c
}
