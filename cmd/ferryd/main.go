// Command ferryd is ferry's per-host transfer daemon.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"net"
	"os"
	"os/signal"
	"syscall"
	"time"

	"github.com/coreos/go-systemd/v22/activation"
	"github.com/rs/zerolog"

	"github.com/ferry-project/ferry/config"
	"github.com/ferry-project/ferry/daemon"
)

func main() {
	// Signals are trapped before the slow set-up (arena allocation), so a
	// stop during start-up still shuts down cleanly, and a SIGHUP or
	// SIGUSR1 never kills the daemon with their default action.
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer stop()
	sigs := make(chan os.Signal, 4)
	signal.Notify(sigs, syscall.SIGHUP, syscall.SIGUSR1)
	if err := run(ctx, os.Args[1:], sigs); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return
		}
		fmt.Fprintln(os.Stderr, "ferryd:", err)
		var ce configError
		if errors.As(err, &ce) {
			os.Exit(exitConfig)
		}
		os.Exit(1)
	}
}

// exitConfig is the exit status of a configuration error (EX_CONFIG of
// sysexits.h): the unit names it in RestartPreventExitStatus=, since a
// restart cannot fix the file, and stops ferryd.socket on it, so clients
// get an error at once rather than queueing for a daemon that will not
// come. Other failures exit 1 and are restarted, a bounded number of times.
const exitConfig = 78

// configError marks an error in the configuration itself (file, flags,
// variables), as opposed to the host failing what it asks for.
type configError struct{ error }

func (e configError) Unwrap() error { return e.error }

func run(ctx context.Context, args []string, sigs <-chan os.Signal) error {
	ld, err := config.Load(args, os.LookupEnv, os.Stderr)
	if err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return err
		}
		return configError{err}
	}
	switch {
	case ld.Version:
		fmt.Println("ferryd", daemon.Version)
		return nil
	case ld.Print:
		out, err := ld.TOML()
		if err != nil {
			return err
		}
		_, err = os.Stdout.Write(out)
		return err
	}
	log, err := newLogger(ld.Settings.LogFormat)
	if err != nil {
		return configError{err}
	}
	setLevel(ld.Settings.LogLevel)
	if err := ld.Check(); err != nil {
		return configError{err}
	}
	if ld.CheckOnly {
		fmt.Printf("ferryd: configuration OK (file: %s)\n", orNone(ld.File))
		return nil
	}
	cfg := daemon.Config{Settings: ld.Settings, Log: log}
	if cfg.ControlListener, err = activatedSocket(); err != nil {
		return err
	}
	log.Info().Str("file", orNone(ld.File)).Msg("configuration loaded")
	d, err := daemon.New(cfg)
	if err != nil {
		notify(log, "STATUS=failed to start: "+err.Error())
		return err
	}
	drain := ld.Settings.DrainTimeout.D()
	served := make(chan struct{})
	defer close(served)
	go handleSignals(ctx, sigs, served, args, ld.Settings, d, log)
	notify(log, "READY=1\nSTATUS="+statusLine(d))
	go watchdog(ctx, d, log)
	go func() {
		select {
		case <-ctx.Done():
			notify(log, fmt.Sprintf("STOPPING=1\nSTATUS=draining: in-flight requests have up to %s", drain))
		case <-served:
		}
	}()
	return d.Serve(ctx, drain)
}

func orNone(file string) string {
	if file == "" {
		return "none"
	}
	return file
}

// activatedSocket is the control socket systemd passed (ferryd.socket),
// or nil when ferryd was started without one.
func activatedSocket() (net.Listener, error) {
	files := activation.Files(true)
	if len(files) == 0 {
		return nil, nil
	}
	defer func() {
		for _, f := range files {
			f.Close()
		}
	}()
	if len(files) > 1 {
		return nil, fmt.Errorf("systemd passed %d sockets (LISTEN_FDS); ferryd takes one, the control socket: give ferryd.socket a single ListenStream=", len(files))
	}
	ln, err := net.FileListener(files[0])
	if err != nil {
		return nil, fmt.Errorf("the socket systemd passed (fd 3, %s) is not a listening socket: %v", files[0].Name(), err)
	}
	if _, ok := ln.(*net.UnixListener); !ok {
		ln.Close()
		return nil, fmt.Errorf("the socket systemd passed listens on %s, not a path: ferryd.socket's ListenStream= must be the control socket's path", ln.Addr())
	}
	return ln, nil
}

// newLogger writes JSON lines (for journald) or console lines on stderr.
// The level is process-wide (setLevel), so SIGHUP can change it.
func newLogger(format string) (zerolog.Logger, error) {
	zerolog.DurationFieldUnit = time.Millisecond
	zerolog.DurationFieldInteger = false
	out := zerolog.New(os.Stderr)
	switch format {
	case "json":
	case "console":
		out = zerolog.New(zerolog.ConsoleWriter{Out: os.Stderr, TimeFormat: time.RFC3339Nano})
	default:
		return zerolog.Logger{}, fmt.Errorf("log_format %q: use json or console", format)
	}
	return out.With().Timestamp().Logger(), nil
}

// setLevel applies a log_level config.Load has checked.
func setLevel(level string) {
	lvl, _ := zerolog.ParseLevel(level)
	zerolog.SetGlobalLevel(lvl)
}
