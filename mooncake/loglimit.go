package mooncake

import (
	"sync"
	"time"
)

// Both ports are unauthenticated, and each malformed request or refused
// write is a log line: a hostile or broken peer reconnecting as fast as it
// can would flood the daemon's log. A port logs at most logBurst lines
// in a logWindow; a line after a quiet window is always logged.
const (
	logBurst  = 10
	logWindow = time.Second
)

// logLimit passes at most max lines per window to logf. The lines past
// that are counted, and when the window ends one line says how many were
// suppressed.
type logLimit struct {
	logf   func(format string, args ...any)
	max    int
	window time.Duration

	mu      sync.Mutex
	start   time.Time // of the current window
	passed  int       // lines logged in it
	dropped int       // lines suppressed, not yet summarized
	summary *time.Timer
	stopped bool
}

func newLogLimit(logf func(format string, args ...any)) *logLimit {
	return &logLimit{logf: logf, max: logBurst, window: logWindow}
}

func (l *logLimit) printf(format string, args ...any) {
	l.mu.Lock()
	defer l.mu.Unlock()
	now := time.Now()
	if now.Sub(l.start) >= l.window {
		l.start, l.passed = now, 0
	}
	if l.passed < l.max {
		l.passed++
		l.logf(format, args...)
		return
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
}

// summarize logs how many lines were suppressed since it last did.
// l.mu is held.
func (l *logLimit) summarize() {
	if l.dropped > 0 {
		l.logf("mooncake: suppressed %d more lines like the above (at most %d per %s are logged)", l.dropped, l.max, l.window)
		l.dropped = 0
	}
}

// stop says what is still suppressed and ends the summary timer, so
// nothing is logged after the port's Close returns.
func (l *logLimit) stop() {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.stopped = true
	if l.summary != nil {
		l.summary.Stop()
		l.summary = nil
	}
	l.summarize()
}
