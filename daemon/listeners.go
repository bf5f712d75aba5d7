package daemon

import (
	"fmt"
	"log"
	"net"
	"strings"
	"sync/atomic"
	"time"

	"github.com/rs/zerolog"

	"github.com/ferry-project/ferry/internal/connlimit"
	"github.com/ferry-project/ferry/internal/loglimit"
)

// The caps on ferryd's two HTTP listeners. Every connection costs ferryd
// a descriptor, a goroutine and its buffers (a request's headers up to
// max_header_bytes on the control socket, metricsHeaderBytes on the
// metrics listener), so these bound what any local user can make it
// hold. At the cap a newcomer takes the place of an idle connection (a
// refused caller's first, then one from the source holding the most,
// then the least recently used) or is refused (docs/security.md).
var (
	// controlLimits: per uid. An admitted client holds one connection
	// per request in flight (long waits included), plus its idle ones.
	controlLimits = connlimit.Limits{Total: 1024, PerSource: 512}
	// metricsLimits: per address. A scraper needs one or two.
	metricsLimits = connlimit.Limits{Total: 64, PerSource: 16}
)

// Deadlines and bounds of the metrics listener, which any local user
// reaches: a scrape is one small GET.
const (
	metricsHeaderTimeout = 5 * time.Second
	metricsReadTimeout   = 10 * time.Second
	metricsWriteTimeout  = 30 * time.Second
	metricsIdleTimeout   = 30 * time.Second
	metricsHeaderBytes   = 8 << 10
)

// Deadlines of the control socket beyond request_timeout: the headers of
// a request, and an idle kept-alive connection.
const (
	controlHeaderTimeout = 10 * time.Second
	controlIdleTimeout   = 5 * time.Minute
)

// controlSource is a control connection's source for the gate: its
// caller's uid, proven when the allow-lists admit it.
func controlSource(c net.Conn) (string, bool) {
	rc, ok := c.(*rightsConn)
	if !ok || rc.caller.err != nil {
		return "unknown caller", false
	}
	return fmt.Sprintf("uid %d", rc.caller.uid), !rc.refused
}

// metricsSource is a metrics connection's source: its address (an IPv6
// /64), none proven.
func metricsSource(c net.Conn) (string, bool) { return connlimit.Source(c.RemoteAddr()), false }

// httpLog is net/http's ErrorLog for ferryd's HTTP servers. What it
// hears a local user can cause at will (a malformed request, a refused
// connection), so its lines are rate-limited. A panic the server
// recovered from is counted (ferry_panics_total); its stack is logged
// the first time only, as a flood of them would otherwise write a stack
// per connection.
type httpLog struct {
	log    zerolog.Logger
	lim    *loglimit.Limiter
	panics atomic.Uint64
}

func newHTTPLog(l zerolog.Logger) *httpLog {
	h := &httpLog{log: l.With().Str("component", "http").Logger()}
	h.lim = loglimit.New("http", func(format string, args ...any) { h.log.Warn().Msg(fmt.Sprintf(format, args...)) })
	return h
}

// logger is h as a *log.Logger, for http.Server.ErrorLog.
func (h *httpLog) logger() *log.Logger { return log.New(h, "", 0) }

// Write takes one line (with a panic's stack after it) from net/http.
func (h *httpLog) Write(p []byte) (int, error) {
	line, stack, _ := strings.Cut(strings.TrimSpace(string(p)), "\n")
	if strings.HasPrefix(line, "http: panic serving") {
		if h.panics.Add(1) == 1 {
			h.log.Error().Str("stack", stack).Msg(line + " (a bug: its stack is logged this once; ferry_panics_total counts every one)")
		} else if h.lim.Allow() {
			h.log.Error().Msg(line)
		}
		return len(p), nil
	}
	if h.lim.Allow() {
		h.log.Warn().Msg(loglimit.Clip(line))
	}
	return len(p), nil
}

// warnf is a gate's refusal log: rate-limited with net/http's own.
func (h *httpLog) warnf(format string, args ...any) { h.lim.Printf(format, args...) }
