package daemon

import (
	"fmt"
	"sync"
	"time"

	"github.com/rs/zerolog"

	"github.com/ferry-project/ferry/transport"
)

// Registration modes, as status and the metrics name them.
const (
	regNone    = "none"
	regShared  = "shared"
	regPerSend = "per-send"
)

// memRegs is the daemon's side of transport.Registrar: the whole arena
// registered once at start, or, when that failed, each send's source
// registered for that send only. On a transport that registers nothing
// (tcp) it does nothing.
type memRegs struct {
	r      transport.Registrar // nil when the transport registers nothing
	shared transport.Registration
	reason string
	m      *metrics

	closeOnce sync.Once
}

// newMemRegs registers [base, base+size) with tr if tr needs it. A failure
// leaves the daemon running in per-send mode, loudly.
func newMemRegs(tr transport.Transport, base uint64, size int64, m *metrics, log zerolog.Logger) *memRegs {
	r, ok := tr.(transport.Registrar)
	if !ok {
		return &memRegs{m: m, reason: fmt.Sprintf("the %s transport reads and writes the arena directly; there is nothing to register with a NIC", tr.Name())}
	}
	g := &memRegs{r: r, m: m}
	start := time.Now()
	reg, err := g.register(regShared, base, size)
	if err != nil {
		g.reason = fmt.Sprintf("registering the %d-byte arena failed (%v): every send registers its source; raise the locked-memory limit (LimitMEMLOCK=infinity) and restart", size, err)
		log.Warn().Err(err).Int64("arena_size", size).Msg("arena registration failed; running in per-send mode: raise the locked-memory limit (LimitMEMLOCK=infinity) and restart")
		return g
	}
	g.shared = reg
	g.reason = fmt.Sprintf("the whole arena is registered once (took %s)", time.Since(start).Round(time.Microsecond))
	return g
}

func (g *memRegs) mode() string {
	switch {
	case g.r == nil:
		return regNone
	case g.shared != nil:
		return regShared
	}
	return regPerSend
}

// forSend makes the n bytes at addr writable for one send. Under the
// shared registration (or none needed) there is nothing to do; otherwise
// it registers them and release deregisters.
func (g *memRegs) forSend(addr uint64, n int64) (release func() error, shared bool, err error) {
	if g.r == nil || g.shared != nil {
		return func() error { return nil }, true, nil
	}
	reg, err := g.register("per_send", addr, n)
	if err != nil {
		return nil, false, err
	}
	return reg.Deregister, false, nil
}

func (g *memRegs) register(mode string, addr uint64, n int64) (transport.Registration, error) {
	start := time.Now()
	reg, err := g.r.Register(addr, n)
	if err != nil {
		return nil, err
	}
	g.m.registrations.WithLabelValues(mode).Inc()
	g.m.registerSeconds.WithLabelValues(mode).Observe(time.Since(start).Seconds())
	return reg, nil
}

// close deregisters the shared registration (before the transport
// closes). The fields stay as they are: a send the drain timeout left
// running may still read them, and its write fails on the closing
// transport.
func (g *memRegs) close() error {
	var err error
	g.closeOnce.Do(func() {
		if g.shared != nil {
			err = g.shared.Deregister()
		}
	})
	return err
}
