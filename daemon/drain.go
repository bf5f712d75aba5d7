package daemon

import (
	"context"
	"errors"
	"net/http"
	"sync"
	"time"

	"github.com/ferry-project/ferry/api"
)

// requestGrace is how long a cancelled request may take to write its
// answer, and how far the HTTP server's own timeouts sit above
// RequestTimeout.
const requestGrace = 5 * time.Second

// The causes a request's context is cancelled with, so its answer can say
// which limit ended it.
var (
	errDrainExpired   = errors.New("the drain timeout ran out")
	errRequestTimeout = errors.New("the request timeout ran out")
)

// inflight counts the control requests being served, so a drain knows
// when the last one has ended.
type inflight struct {
	mu     sync.Mutex
	n      int
	closed bool
	idle   chan struct{} // made by close; closed once closed && n == 0
}

// enter admits one request, unless a drain has begun.
func (f *inflight) enter() bool {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.closed {
		return false
	}
	f.n++
	return true
}

func (f *inflight) leave() {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.n--
	if f.closed && f.n == 0 {
		close(f.idle)
	}
}

// close admits nothing more; idle is closed when the last request leaves.
func (f *inflight) close() (idle <-chan struct{}, n int) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.closed = true
	f.idle = make(chan struct{})
	if f.n == 0 {
		close(f.idle)
	}
	return f.idle, f.n
}

func (f *inflight) count() int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.n
}

// serveOne runs one admitted request under RequestTimeout. When a drain
// or the timeout cancelled it, its error says so instead of what the
// cancellation looked like from inside (a broken write, an empty wait).
func (d *Daemon) serveOne(w http.ResponseWriter, r *http.Request, h func(http.ResponseWriter, *http.Request) error) error {
	if !d.inflight.enter() {
		w.Header().Set("Connection", "close")
		return errStopping
	}
	defer d.inflight.leave()
	ctx, cancel := context.WithTimeoutCause(r.Context(), d.cfg.RequestTimeout.D(), errRequestTimeout)
	defer cancel()
	err := h(w, r.WithContext(ctx))
	if err == nil {
		return nil
	}
	switch context.Cause(ctx) {
	case errDrainExpired:
		w.Header().Set("Connection", "close")
		return apiErr(api.CodeUnavailable,
			"ferryd is shutting down and its drain timeout ran out before %s %s finished, so it was cancelled; what was staged on this ferryd is dropped when it exits: stage and send again once it is back",
			r.Method, r.URL.Path)
	case errRequestTimeout:
		return apiErr(api.CodeTimeout,
			"%s %s did not finish within the control socket's request_timeout (%s) and was cancelled: ask for less at once (a shorter wait), or raise request_timeout",
			r.Method, r.URL.Path, d.cfg.RequestTimeout)
	}
	return err
}

// drain stops taking work and lets what is in flight finish for up to
// timeout, meanwhile answering new requests 503 unavailable. Requests
// still running then are cancelled; their clients get a 503 that says so.
func (d *Daemon) drain(timeout time.Duration) {
	idle, n := d.inflight.close()
	d.streams.stop()
	d.reg.stop()
	d.log.Info().Int("in_flight", n).Dur("drain_timeout", timeout).
		Msg("draining: new requests get 503, requests in flight may finish")
	expired := time.NewTimer(timeout)
	defer expired.Stop()
	select {
	case <-idle:
	case <-expired.C:
		d.log.Warn().Int("cancelled", d.inflight.count()).Dur("drain_timeout", timeout).
			Msg("drain timed out: cancelling the requests still in flight; their clients get 503 unavailable")
		d.cancelRequests(errDrainExpired)
		grace := time.NewTimer(requestGrace)
		defer grace.Stop()
		select {
		case <-idle:
		case <-grace.C:
			d.log.Error().Int("in_flight", d.inflight.count()).
				Msg("requests did not end when cancelled; closing their connections")
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	_ = d.http.Shutdown(ctx) // what is left are idle connections and 503 answers
}
