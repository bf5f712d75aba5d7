package daemon

import (
	"fmt"
	"net"
	"strconv"
	"time"

	"github.com/rs/zerolog"

	"github.com/ferry-project/ferry/mooncake"
)

// mooncakeSegment is ferryd serving as a Mooncake segment
// (--mooncake-listen): the handshake on the RPC port, advertising the
// arena as the segment's one buffer, and a TCP data port whose writes
// land in live receive slots only.
type mooncakeSegment struct {
	name string // "ip:rpcport", the session_id Mooncake senders use
	seg  mooncake.Segment
	hs   *mooncake.Server
	data *mooncake.DataServer
}

// openMooncake listens on cfg.MooncakeListen and a data port on the same
// host. base and size are the arena's addresses, as receive slots name
// them; advertiseHost stands in for a wildcard listen host.
func openMooncake(cfg Config, reg *registry, base uint64, size int64, advertiseHost string, log zerolog.Logger) (*mooncakeSegment, error) {
	logf := func(format string, args ...any) {
		log.Warn().Str("component", "mooncake").Msg(fmt.Sprintf(format, args...))
	}
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
	m := &mooncakeSegment{name: name, seg: mooncake.Segment{
		Name: name, Protocol: "tcp", TCPDataPort: dl.Addr().(*net.TCPAddr).Port, TCPProtoVersion: 2,
		Timestamp: time.Now().UTC().Format("2006-01-02 15:04:05.000000"),
		Buffers:   []mooncake.Buffer{{Name: name, Addr: base, Length: uint64(size)}},
	}}
	m.data = mooncake.ServeData(dl, mooncakeMemory{reg}, mooncake.DataConfig{
		IOTimeout: cfg.IOTimeout, MaxSize: uint64(size), MaxConns: 4 * cfg.MaxConns, Logf: logf,
	})
	m.hs = mooncake.Serve(rpc, mooncake.Handlers{
		Segment: func() *mooncake.Segment { return &m.seg },
		Notify: func(n mooncake.NotifyDesc) {
			log.Debug().Str("component", "mooncake").Str("from", n.Name).Str("notify_msg", n.NotifyMsg).Msg("mooncake notify received")
		},
		// Connect stays nil until ferry speaks Mooncake's RDMA QP
		// exchange: connection requests are refused with a reply_msg.
	}, mooncake.ServerConfig{Logf: logf})
	log.Info().Str("segment", name).Str("rpc", rpc.Addr().String()).Str("data", dl.Addr().String()).
		Uint64("buffer_addr", base).Int64("buffer_length", size).Msg("serving as a Mooncake segment")
	return m, nil
}

func (m *mooncakeSegment) close() {
	m.hs.Close()
	m.data.Close()
}

// mooncakeMemory lets Mooncake WRITEs into live receive slots only; READs
// are refused (ferry's slots are write targets).
type mooncakeMemory struct{ reg *registry }

func (mm mooncakeMemory) Write(addr, n uint64) ([]byte, func(error), error) {
	return mm.reg.AcceptUnkeyed(addr, n)
}

func (mm mooncakeMemory) Read(addr, n uint64) ([]byte, func(), error) {
	return nil, nil, fmt.Errorf("READ is not served: ferry's receive slots take writes only")
}
