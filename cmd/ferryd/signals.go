package main

import (
	"bytes"
	"context"
	"os"
	"runtime/pprof"
	"slices"
	"strings"
	"syscall"

	"github.com/rs/zerolog"

	"github.com/ferry-project/ferry/config"
	"github.com/ferry-project/ferry/daemon"
)

// reloadable are the keys a SIGHUP applies; any other change needs a
// restart and is logged as such.
var reloadable = []string{"log_level", "slow_threshold"}

// handleSignals serves SIGHUP (reload) until ctx ends, and SIGUSR1
// (goroutine dump; a drain that hangs is worth one) until done.
func handleSignals(ctx context.Context, sigs <-chan os.Signal, done <-chan struct{}, args []string, running config.Settings, d *daemon.Daemon, log zerolog.Logger) {
	for {
		select {
		case <-done:
			return
		case s := <-sigs:
			switch {
			case s == syscall.SIGHUP && ctx.Err() != nil:
				log.Warn().Msg("SIGHUP ignored: shutting down")
			case s == syscall.SIGHUP:
				reloading(log)
				running = reload(args, running, d, log)
				reloaded(log, d)
			case s == syscall.SIGUSR1:
				dumpGoroutines(log)
			}
		}
	}
}

// reload reads the configuration again, from the same flags, environment
// and file, and applies what can change while running.
func reload(args []string, running config.Settings, d *daemon.Daemon, log zerolog.Logger) config.Settings {
	ld, err := config.Load(args, os.LookupEnv, os.Stderr)
	if err == nil {
		err = ld.Check()
	}
	if err != nil {
		log.Error().Err(err).Msg("reload failed: the configuration has an error; the running one stays")
		return running
	}
	next := ld.Settings
	var restart []string
	for _, key := range config.Changed(running, next) {
		if !slices.Contains(reloadable, key) {
			restart = append(restart, key)
		}
	}
	running.LogLevel, running.SlowThreshold = next.LogLevel, next.SlowThreshold
	setLevel(running.LogLevel)
	d.SetSlowThreshold(running.SlowThreshold.D())
	ev := log.Info()
	if len(restart) > 0 {
		ev = log.Warn().Strs("need_restart", restart)
	}
	ev.Str("log_level", running.LogLevel).Str("slow_threshold", string(running.SlowThreshold)).
		Msg("configuration reloaded")
	return running
}

// dumpGoroutines writes every goroutine's stack to the log, one line
// each, whatever the log level: it was asked for.
func dumpGoroutines(log zerolog.Logger) {
	var buf bytes.Buffer
	_ = pprof.Lookup("goroutine").WriteTo(&buf, 2)
	stacks := strings.Split(strings.TrimSpace(buf.String()), "\n\n")
	for _, s := range stacks {
		log.Log().Str("stack", s).Msg("goroutine")
	}
	log.Log().Int("goroutines", len(stacks)).Msg("goroutine dump")
}
