package loglimit

import (
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"
)

// lines records what a Limiter passes on, and says when one holds a word.
type lines struct {
	mu  sync.Mutex
	got []string
	ch  chan string
}

func (r *lines) logf(format string, args ...any) {
	r.mu.Lock()
	defer r.mu.Unlock()
	line := fmt.Sprintf(format, args...)
	r.got = append(r.got, line)
	if r.ch != nil {
		r.ch <- line
	}
}

func (r *lines) all() []string {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]string(nil), r.got...)
}

// TestLogLimitCounts: within a window the first max lines pass, the rest
// are counted, and Stop says how many, under the limiter's name.
func TestLogLimitCounts(t *testing.T) {
	var r lines
	l := &Limiter{name: "test", logf: r.logf, max: 3, window: time.Hour}
	for i := range 10 {
		l.Printf("malformed request %d", i)
	}
	if got := r.all(); len(got) != 3 || got[0] != "malformed request 0" || got[2] != "malformed request 2" {
		t.Fatalf("within one window: %q, want the first 3 lines", got)
	}
	if n := l.Count(); n != 10 {
		t.Fatalf("Count() = %d after 10 lines asked for, 3 of them logged; want 10", n)
	}
	l.Stop()
	got := r.all()
	if len(got) != 4 || !strings.HasPrefix(got[3], "test: suppressed 7 more lines") || !strings.Contains(got[3], "at most 3 per 1h0m0s") {
		t.Fatalf("after stop: %q, want a 4th line saying 7 were suppressed and what the limit is", got)
	}
}

// TestLogLimitAllow: Allow passes the lines Printf would, counted with
// them, for a caller that logs them in its own form; the suppressed ones
// are summarized all the same.
func TestLogLimitAllow(t *testing.T) {
	var r lines
	l := &Limiter{name: "test", logf: r.logf, max: 2, window: time.Hour}
	l.Printf("by Printf")
	passed := 0
	for range 5 {
		if l.Allow() {
			passed++
		}
	}
	if passed != 1 || l.Count() != 6 {
		t.Fatalf("after 1 Printf and 5 Allows under a burst of 2: %d allowed, %d counted; want 1 and 6", passed, l.Count())
	}
	l.Stop()
	if got := r.all(); len(got) != 2 || !strings.HasPrefix(got[1], "test: suppressed 4 more lines") {
		t.Fatalf("lines %q: want the Printf line and a summary of 4 suppressed", got)
	}
}

// TestLogLimitSummaryAtWindowEnd: the count of suppressed lines is logged
// when their window ends, without waiting for another line, and the next
// line after that always passes.
func TestLogLimitSummaryAtWindowEnd(t *testing.T) {
	r := lines{ch: make(chan string, 100)}
	l := &Limiter{name: "test", logf: r.logf, max: 1, window: 20 * time.Millisecond}
	defer l.Stop()
	deadline := time.After(10 * time.Second)
	// Log until one line is suppressed (a stalled machine may start a new
	// window between two lines).
	for dropped := 0; dropped == 0; {
		l.Printf("refused a write")
		l.mu.Lock()
		dropped = l.dropped
		l.mu.Unlock()
		select {
		case <-deadline:
			t.Fatal("no line was suppressed")
		default:
		}
	}
	for {
		select {
		case line := <-r.ch:
			if !strings.Contains(line, "suppressed 1 more lines") {
				continue
			}
		case <-deadline:
			t.Fatalf("no summary line at the window's end: %q", r.all())
		}
		break
	}
	l.Printf("after a quiet window")
	if got := r.all(); got[len(got)-1] != "after a quiet window" {
		t.Fatalf("the first line after the summary was not logged: %q", got)
	}
}

// TestQuoteCuts: a remote party's text is kept (quoted) whole up to
// MaxQuoted bytes, and past that cut with its length.
func TestQuoteCuts(t *testing.T) {
	if got := Clip(strings.Repeat("b", 300)); got != strings.Repeat("b", 256)+"... (300 bytes)" {
		t.Errorf("Clip of 300 bytes: %q", got)
	}
	if got := Quote("0x7f00"); got != `"0x7f00"` {
		t.Errorf("Quote of a short text: %s", got)
	}
	got := Quote(strings.Repeat("a", 1<<20))
	if len(got) > MaxQuoted+32 || !strings.HasSuffix(got, "... (1048576 bytes)") {
		t.Errorf("Quote of 1 MiB: %d bytes ending %q, want at most %d bytes naming the length", len(got), got[len(got)-24:], MaxQuoted+32)
	}
}
