// Package loglimit rate-limits the log lines a remote party can cause.
// A port anyone may reach (the peer port, the Mooncake ports) logs each
// malformed request or refused connection: a hostile or broken peer
// reconnecting as fast as it can would otherwise flood the daemon's log.
package loglimit

import (
	"fmt"
	"sync"
	"time"
)

// A Limiter logs at most Burst lines in a Window; a line after a quiet
// window is always logged.
const (
	Burst  = 10
	Window = time.Second
)

// MaxQuoted is how much of a text a remote party chose Clip and Quote
// keep: a Mooncake notify_msg may be 16 KiB.
const MaxQuoted = 256

// Limiter passes at most max lines per window to logf. The lines past
// that are counted, and when the window ends one line, under the
// limiter's name, says how many were suppressed.
type Limiter struct {
	name   string
	logf   func(format string, args ...any)
	max    int
	window time.Duration

	mu      sync.Mutex
	start   time.Time // of the current window
	passed  int       // lines logged in it
	dropped int       // lines suppressed, not yet summarized
	count   uint64    // lines asked for, logged or not
	summary *time.Timer
	stopped bool
}

// New limits logf to Burst lines a Window; name begins the summary line
// ("mooncake: suppressed 7 more lines like the above ...").
func New(name string, logf func(format string, args ...any)) *Limiter {
	return &Limiter{name: name, logf: logf, max: Burst, window: Window}
}

// Printf logs the line unless the window's burst is spent.
func (l *Limiter) Printf(format string, args ...any) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.allow() {
		l.logf(format, args...)
	}
}

// Allow counts a line as Printf does and reports whether the caller may
// log it, in its own form (a structured line); the summary of those
// suppressed still goes to the limiter's logf.
func (l *Limiter) Allow() bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.allow()
}

// allow counts a line and reports whether it passes. l.mu is held.
func (l *Limiter) allow() bool {
	l.count++
	now := time.Now()
	if now.Sub(l.start) >= l.window {
		l.start, l.passed = now, 0
	}
	if l.passed < l.max {
		l.passed++
		return true
	}
	l.dropped++
	if l.summary == nil && !l.stopped {
		l.summary = time.AfterFunc(l.window-now.Sub(l.start), func() {
			l.mu.Lock()
			defer l.mu.Unlock()
			l.summary = nil
			l.summarize()
		})
	}
	return false
}

// Count is how many lines were asked for since New, logged or
// suppressed: each a failure a remote party caused, for /metrics.
func (l *Limiter) Count() uint64 {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.count
}

// summarize logs how many lines were suppressed since it last did.
// l.mu is held.
func (l *Limiter) summarize() {
	if l.dropped > 0 {
		l.logf("%s: suppressed %d more lines like the above (at most %d per %s are logged)", l.name, l.dropped, l.max, l.window)
		l.dropped = 0
	}
}

// Stop says what is still suppressed and ends the summary timer, so
// nothing is logged after the port's Close returns.
func (l *Limiter) Stop() {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.stopped = true
	if l.summary != nil {
		l.summary.Stop()
		l.summary = nil
	}
	l.summarize()
}

// Clip cuts a text a remote party chose (or that quotes one) to
// MaxQuoted bytes for a log line, saying how long it was.
func Clip(s string) string {
	if len(s) <= MaxQuoted {
		return s
	}
	return fmt.Sprintf("%s... (%d bytes)", s[:MaxQuoted], len(s))
}

// Quote is Clip, quoted: for a text that is all the remote party's.
func Quote(s string) string {
	if len(s) <= MaxQuoted {
		return fmt.Sprintf("%q", s)
	}
	return fmt.Sprintf("%q... (%d bytes)", s[:MaxQuoted], len(s))
}
