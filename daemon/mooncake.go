package daemon

import (
	"context"
	"fmt"
	"net"
	"net/netip"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/rs/zerolog"

	"github.com/ferry-project/ferry/config"
	"github.com/ferry-project/ferry/internal/connlimit"
	"github.com/ferry-project/ferry/internal/loglimit"
	"github.com/ferry-project/ferry/mooncake"
	"github.com/ferry-project/ferry/transport"
)

// mooncakeSegment is ferryd serving as a Mooncake segment
// (--mooncake-listen): the handshake on the RPC port, advertising the
// arena and the regions open to Mooncake writers as the segment's
// buffers, and a TCP data port whose writes land in live receive slots
// made for them and in those regions only. With an RDMA data plane whose shared
// registration covers the arena, the segment speaks protocol rdma
// instead: its descriptor lists the NIC and the Mooncake pool (never the
// arena) with the pool's own keys (mooncakepool.go), connection
// handshakes set up QPs (the passive side), and Mooncake's one-sided
// WRITEs land with no event here: a notify naming a receive slot
// (notify_msg = its buffer_address) completes it.
type mooncakeSegment struct {
	name string // "ip:rpcport", the session_id Mooncake senders use
	seg  mooncake.Segment
	hs   *mooncake.Server
	data *mooncake.DataServer
	// debug limits the DEBUG lines anyone reaching the ports can cause
	// (a notify received, a connection closed to make room); warnf logs
	// the ports' WARNs (the mooncake package rate-limits them). Engine
	// segments log through both.
	debug *loglimit.Limiter
	warnf func(format string, args ...any)
	// engines limits the WARN and INFO lines of every engine segment's
	// ports and endpoint table, all together: each port limits its own,
	// and 256 segments' limits apiece would let a stranger flooding
	// them all have ferryd log 512 times as much.
	engines *loglimit.Limiter
	// enginePorts caps the connections of every engine segment's ports
	// together (each port is capped too): 256 segments' two ports could
	// otherwise hold some 330,000, past ferryd's descriptors.
	enginePorts *connlimit.Table[*connlimit.Conn]
}

// openMooncake listens on cfg.MooncakeListen and a data port on the same
// host; over dp's Mooncake endpoints, when it has them, it speaks RDMA.
// base and size are the arena's addresses, as receive slots name them;
// advertiseHost stands in for a wildcard listen host. sentTo says
// whether this daemon has sent to a Mooncake segment: only such a
// segment is dialed back for an RDMA initiator's descriptor.
func openMooncake(cfg Config, reg *registry, dp *dataPlane, base uint64, size int64, advertiseHost string, sentTo func(segment string) bool, log zerolog.Logger) (*mooncakeSegment, error) {
	// Anyone may reach these ports: the packages rate-limit their WARNs,
	// and debug the DEBUG lines.
	logf := func(format string, args ...any) {
		log.Warn().Str("component", "mooncake").Msg(fmt.Sprintf(format, args...))
	}
	debug := loglimit.New("mooncake", func(format string, args ...any) {
		log.Debug().Str("component", "mooncake").Msg(fmt.Sprintf(format, args...))
	})
	rpc, err := net.Listen("tcp", cfg.MooncakeListen)
	if err != nil {
		return nil, fmt.Errorf("--mooncake-listen %s: %w", cfg.MooncakeListen, err)
	}
	host, _, _ := net.SplitHostPort(cfg.MooncakeListen)
	dl, err := net.Listen("tcp", net.JoinHostPort(host, "0"))
	if err != nil {
		rpc.Close()
		return nil, fmt.Errorf("--mooncake-listen: the data port on %s: %w", host, err)
	}
	ra := rpc.Addr().(*net.TCPAddr)
	name := ra.String()
	if ra.IP.IsUnspecified() {
		name = net.JoinHostPort(advertiseHost, strconv.Itoa(ra.Port))
	}
	m := &mooncakeSegment{name: name, debug: debug, warnf: logf, engines: loglimit.New("mooncake engine segments", logf), seg: mooncake.Segment{
		Name: name, Protocol: "tcp", TCPDataPort: dl.Addr().(*net.TCPAddr).Port, TCPProtoVersion: 2,
		Timestamp: time.Now().UTC().Format("2006-01-02 15:04:05.000000"),
		Buffers:   []mooncake.Buffer{{Name: name, Addr: base, Length: uint64(size)}},
	}}
	m.enginePorts = connlimit.NewShared(enginePortLimits)
	allow, err := mooncakeAllow(cfg.MooncakeAllow)
	if err != nil {
		rpc.Close()
		dl.Close()
		return nil, err
	}
	m.data = mooncake.ServeData(dl, mooncakeMemory{reg}, mooncake.DataConfig{
		IOTimeout: cfg.IOTimeout.D(), MaxSize: uint64(size), Logf: logf, Debugf: debug.Printf, Allow: allow,
	})
	h := mooncake.Handlers{
		// The arena, then the regions open to Mooncake writers now
		// (ferry.mooncake's registered memory): a sender fetches the
		// descriptor again for an address outside the one it holds.
		Segment: func() *mooncake.Segment {
			seg := m.seg
			seg.Buffers = append(slices.Clip(m.seg.Buffers), reg.mooncakeBuffers("", m.seg.Buffers[0].Name)...)
			return &seg
		},
		Notify: func(from net.Addr, n mooncake.NotifyDesc) error {
			if debug.Allow() {
				log.Debug().Str("component", "mooncake").Stringer("addr", from).Str("from", loglimit.Clip(n.Name)).Str("notify_msg", loglimit.Clip(n.NotifyMsg)).Msg("mooncake notify received")
			}
			return nil
		},
	}
	if dp.mooncake != nil {
		pool, err := poolBytes(cfg.MooncakeRDMAPool, size)
		if err != nil {
			rpc.Close()
			dl.Close()
			return nil, err
		}
		if err := m.serveRDMA(dp, pool, reg, &h, sentTo, log); err != nil {
			log.Warn().Str("component", "mooncake").Err(err).Msg("the Mooncake segment speaks TCP only")
		}
	}
	m.hs = mooncake.Serve(rpc, h, mooncake.ServerConfig{Logf: logf, Debugf: debug.Printf, Allow: allow})
	log.Info().Str("segment", name).Str("protocol", m.seg.Protocol).Str("rpc", rpc.Addr().String()).Str("data", dl.Addr().String()).
		Uint64("buffer_addr", m.seg.Buffers[0].Addr).Uint64("buffer_length", m.seg.Buffers[0].Length).Stringer("allow", prefixList(allow.Prefixes)).Msg("serving as a Mooncake segment")
	return m, nil
}

// mooncakeAllow is who may connect to the Mooncake ports: the
// mooncake_allow setting, or when it is empty loopback and this host's
// own addresses (Mooncake engines beside ferryd), so that no other host
// writes into a receive slot unless the operator says so.
func mooncakeAllow(setting []string) (mooncake.Allow, error) {
	a := mooncake.Allow{Setting: "mooncake_allow", Prefixes: []netip.Prefix{}}
	for _, s := range setting {
		p, _ := config.ParsePrefix(s) // checked when the setting was read
		a.Prefixes = append(a.Prefixes, p)
	}
	if len(setting) > 0 {
		return a, nil
	}
	a.Setting = "mooncake_allow (empty: loopback and this host's own addresses)"
	a.Prefixes = append(a.Prefixes, netip.MustParsePrefix("127.0.0.0/8"), netip.MustParsePrefix("::1/128"))
	addrs, err := net.InterfaceAddrs()
	if err != nil {
		return a, fmt.Errorf("--mooncake-listen: listing this host's addresses for the default mooncake_allow: %w; set mooncake_allow", err)
	}
	for _, ad := range addrs {
		if ipn, ok := ad.(*net.IPNet); ok {
			if ip, ok := netip.AddrFromSlice(ipn.IP); ok {
				ip = ip.Unmap()
				a.Prefixes = append(a.Prefixes, netip.PrefixFrom(ip, ip.BitLen()))
			}
		}
	}
	return a, nil
}

// prefixList prints as the prefixes, comma-separated.
type prefixList []netip.Prefix

func (l prefixList) String() string {
	out := make([]string, len(l))
	for i, p := range l {
		out[i] = p.String()
	}
	return strings.Join(out, ",")
}

// mooncakeLocation is the arena's memory location in the descriptor,
// the key of its priority matrix.
const mooncakeLocation = "cpu:0"

// serveRDMA makes the segment an rdma one over dp's Mooncake
// endpoints, its one buffer the Mooncake pool (mooncakepool.go): pool
// bytes of the first arena, registered with the NIC on their own.
func (m *mooncakeSegment) serveRDMA(dp *dataPlane, pool int64, reg *registry, h *mooncake.Handlers, sentTo func(string) bool, log zerolog.Logger) error {
	eps := dp.mooncake
	dev, err := eps.Device()
	if err != nil {
		return err
	}
	sl, err := reg.reservePool(pool)
	if err != nil {
		return err
	}
	addr, rkey, lkey, err := dp.rdma.MooncakePool(uint64(sl.Offset), uint64(sl.Len))
	if err == nil {
		err = reg.usePool(sl)
	}
	if err != nil {
		reg.dropPool(sl)
		return err
	}
	m.seg.Protocol = "rdma"
	m.seg.Devices = []mooncake.Device{dev}
	m.seg.PriorityMatrix = mooncake.Priority{mooncakeLocation: {{dev.Name}, {}}}
	m.seg.Buffers[0] = mooncake.Buffer{Name: mooncakeLocation, Addr: addr, Length: uint64(sl.Len), RKey: []uint32{rkey}, LKey: []uint32{lkey}}
	h.Connect = func(ctx context.Context, from net.Addr, req mooncake.HandshakeDesc) (mooncake.HandshakeDesc, func()) {
		return eps.Accept(ctx, mooncake.Handshake{Self: m.name, From: from, MayFetch: sentTo}, req)
	}
	h.Notify = func(from net.Addr, n mooncake.NotifyDesc) error {
		reqID, nbytes, err := reg.deliverNotified(n.NotifyMsg)
		if err != nil {
			// The server logs it, rate-limited, the message cut short.
			return fmt.Errorf("completed no receive slot: %w", err)
		}
		// Only a sender that knows a live slot's address gets here: its
		// address's endpoints stay before strangers' in a full table.
		eps.Proven(from)
		log.Debug().Str("component", "mooncake").Stringer("addr", from).Str("from", loglimit.Clip(n.Name)).Str("req_id", reqID).Int64("nbytes", nbytes).
			Msg("a Mooncake notify completed a receive slot")
		return nil
	}
	reg.quarantineFreedSlots(mooncakeQuarantine)
	return nil
}

// deliverNotified completes the receive slot a notify names: notify_msg
// is the slot's buffer_address (decimal or 0x-hex). Over RDMA, Mooncake's
// WRITEs into the slot raise no event here; the sender's notify, sent
// once its batch completed, says they are all in.
func (r *registry) deliverNotified(msg string) (reqID string, nbytes int64, err error) {
	addr, err := strconv.ParseUint(strings.TrimSpace(msg), 0, 64)
	if err != nil {
		return "", 0, fmt.Errorf("notify_msg is not a receive slot's buffer_address (decimal or 0x-hex): ferry completes the slot a notify names")
	}
	r.mu.Lock()
	s := r.unkeyed.at(addr) // Mooncake slots only
	if r.closedTo(s) {
		r.mu.Unlock()
		return "", 0, errRefuseStopping
	}
	if s == nil || s.addr != addr {
		r.mu.Unlock()
		return "", 0, fmt.Errorf("no live receive slot open to Mooncake writers starts at %#x: it was freed, timed out, made without \"mooncake\": true, or never existed; whatever was written there is not delivered", addr)
	}
	reqID, nbytes = s.reqID, int64(s.nbytes)
	return reqID, nbytes, r.completeWhole(s)
}

// self is the descriptor ferry sends with its own metadata requests:
// name, protocol and devices, and no buffers. The receiver has no use for
// it, and the arena's address, length and rkey are nobody else's business
// (a Mooncake that needs the initiator's GID fetches the descriptor from
// the handshake port, or takes local_gid from the handshake).
func (m *mooncakeSegment) self() *mooncake.Segment {
	return &mooncake.Segment{Name: m.seg.Name, Protocol: m.seg.Protocol, Devices: m.seg.Devices, Buffers: []mooncake.Buffer{}}
}

func (m *mooncakeSegment) close() {
	m.hs.Close()
	m.data.Close()
	m.debug.Stop()
	m.engines.Stop()
}

// mooncakeMemory lets Mooncake WRITEs into live receive slots only; READs
// are refused (ferry's slots are write targets).
type mooncakeMemory struct{ reg *registry }

func (mm mooncakeMemory) Write(addr, n uint64) (transport.Body, func(error), error) {
	return mm.reg.AcceptUnkeyed(addr, n)
}

func (mm mooncakeMemory) Read(addr, n uint64) ([]byte, func(), error) {
	return nil, nil, fmt.Errorf("READ is not served: ferry's receive slots take writes only")
}
