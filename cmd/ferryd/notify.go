package main

import (
	"context"
	"fmt"
	"time"

	sd "github.com/coreos/go-systemd/v22/daemon"
	"github.com/rs/zerolog"
	"golang.org/x/sys/unix"

	"github.com/ferry-project/ferry/daemon"
	"github.com/ferry-project/ferry/internal/size"
)

// notify tells systemd about ferryd's state (sd_notify); without
// NOTIFY_SOCKET it does nothing.
func notify(log zerolog.Logger, state string) {
	if _, err := sd.SdNotify(false, state); err != nil {
		log.Warn().Err(err).Str("state", state).Msg("sd_notify failed")
	}
}

// statusLine is the one-line summary systemctl status shows.
func statusLine(d *daemon.Daemon) string {
	st := d.Status()
	return fmt.Sprintf("serving: arena %s of %s memory (%s), transport %s on %s, registration %s",
		size.Format(st.Memory.Size), st.Memory.Kind, st.Memory.Device,
		st.Transport.Name, st.Transport.Advertise, st.Registration.Mode)
}

// reloading and reloaded bracket a SIGHUP reload for systemd.
func reloading(log zerolog.Logger) {
	var ts unix.Timespec
	_ = unix.ClockGettime(unix.CLOCK_MONOTONIC, &ts)
	notify(log, fmt.Sprintf("RELOADING=1\nMONOTONIC_USEC=%d", ts.Nano()/1000))
}

func reloaded(log zerolog.Logger, d *daemon.Daemon) {
	notify(log, "READY=1\nSTATUS="+statusLine(d))
}

// watchdog pings systemd at half of WatchdogSec= for as long as the daemon
// is healthy, until ctx ends (systemd stops watching at STOPPING=1, and
// TimeoutStopSec= bounds the drain). Healthy means a status snapshot, which
// takes the arena's, the registry's and the sessions' locks, completes
// within that half interval: a wedged daemon stops pinging and systemd
// restarts it.
func watchdog(ctx context.Context, d *daemon.Daemon, log zerolog.Logger) {
	interval, err := sd.SdWatchdogEnabled(false)
	if err != nil {
		log.Warn().Err(err).Msg("systemd watchdog settings unreadable; not pinging")
		return
	}
	if interval == 0 {
		return
	}
	every := interval / 2
	log.Info().Dur("watchdog", interval).Dur("ping_every", every).Msg("systemd watchdog on")
	t := time.NewTicker(every)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		snap := make(chan struct{})
		go func() { d.Status(); close(snap) }()
		select {
		case <-snap:
			notify(log, "WATCHDOG=1")
		case <-t.C:
			log.Error().Dur("waited", every).Msg("status snapshot did not complete: daemon wedged, withholding the watchdog ping (systemd restarts ferryd when WatchdogSec= passes)")
		case <-ctx.Done():
			return
		}
	}
}
