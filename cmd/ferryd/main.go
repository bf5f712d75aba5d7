// Command ferryd is ferry's per-host transfer daemon.
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/rs/zerolog"

	"github.com/ferry-project/ferry/api"
	"github.com/ferry-project/ferry/daemon"
	"github.com/ferry-project/ferry/internal/size"
)

// sizeFlag is a byte count flag that reads "64MiB".
type sizeFlag struct{ n *int64 }

func (s sizeFlag) String() string {
	if s.n == nil {
		return ""
	}
	return size.Format(*s.n)
}
func (s sizeFlag) Set(v string) error {
	n, err := size.Parse(v)
	if err == nil {
		*s.n = n
	}
	return err
}

func main() {
	// Signals are trapped before the slow set-up (arena allocation), so a
	// stop during start-up still shuts down cleanly.
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer stop()
	if err := run(ctx, os.Args[1:]); err != nil {
		fmt.Fprintln(os.Stderr, "ferryd:", err)
		os.Exit(1)
	}
}

func run(ctx context.Context, args []string) error {
	fs := flag.NewFlagSet("ferryd", flag.ContinueOnError)
	cfg := daemon.Config{ArenaSize: daemon.DefaultArenaSize}
	fs.StringVar(&cfg.Socket, "socket", api.DefaultSocket, "control socket `path`")
	fs.StringVar(&cfg.Listen, "listen", fmt.Sprintf(":%d", api.DefaultPeerPort), "peer port `host:port` other daemons dial")
	fs.StringVar(&cfg.Advertise, "advertise", "", "`host:port` receive slots name as their session (default: the listen address, or this host's first IPv4 address when listening on all)")
	fs.StringVar(&cfg.Device, "device", "cpu", "arena memory: cpu (host memory)")
	fs.StringVar(&cfg.Transport, "transport", "auto", "data plane: auto (RDMA when an active RDMA port exists, else TCP), rdma or tcp")
	fs.StringVar(&cfg.RDMADevice, "rdma-device", "", "RDMA `device` to use, e.g. mlx5_0 (default: the one whose GID carries the advertised address)")
	fs.Func("rdma-gid-index", "GID table `index` to use (default: the RoCE v2 GID of the advertised address)", func(v string) error {
		n, err := strconv.Atoi(v)
		if err != nil {
			return fmt.Errorf("%q is not a GID table index", v)
		}
		cfg.RDMAGIDIndex = &n
		return nil
	})
	fs.StringVar(&cfg.RDMARegistration, "rdma-registration", "shared", "shared (register the arena once) or per-send (debugging: each send registers its range)")
	fs.Var(sizeFlag{&cfg.ArenaSize}, "arena-size", "arena `size`, e.g. 64MiB or 8GiB")
	fs.StringVar(&cfg.ArenaFile, "arena-file", "", "arena backing `file` that local clients map for zero-copy (default: the socket path + \".arena\"; a path on hugetlbfs gives huge pages)")
	fs.DurationVar(&cfg.SlowThreshold, "slow-threshold", daemon.DefaultSlowThreshold, "log transfers slower than this")
	fs.IntVar(&cfg.SendRetries, "send-retries", 1, "re-dial and retry a failed write this many times")
	fs.DurationVar(&cfg.SendTimeout, "send-timeout", daemon.DefaultSendTimeout, "bound on one send, retries included")
	fs.DurationVar(&cfg.StageTTL, "stage-ttl", daemon.DefaultTTL, "drop staged entries not sent or deleted after this long (logged at WARN)")
	fs.DurationVar(&cfg.ReceiveTTL, "receive-ttl", daemon.DefaultTTL, "drop receive slots not freed after this long (logged at WARN)")
	fs.DurationVar(&cfg.IOTimeout, "io-timeout", daemon.DefaultIOTimeout, "deadline on each network read and write; a stalled peer fails within it")
	fs.IntVar(&cfg.MaxConns, "max-conns", daemon.DefaultMaxConns, "connections per peer session (concurrent writes to one peer)")
	drain := fs.Duration("drain-timeout", 30*time.Second, "on SIGTERM, how long in-flight requests may finish")
	level := fs.String("log-level", "info", "debug, info, warn or error")
	format := fs.String("log-format", "json", "json (for journald) or console")
	version := fs.Bool("version", false, "print the version and exit")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if *version {
		fmt.Println("ferryd", daemon.Version)
		return nil
	}
	if fs.NArg() > 0 {
		return fmt.Errorf("unexpected arguments %q: ferryd takes flags only (see ferryd -h)", fs.Args())
	}
	log, err := newLogger(*level, *format)
	if err != nil {
		return err
	}
	cfg.Log = log
	d, err := daemon.New(cfg)
	if err != nil {
		return err
	}
	return d.Serve(ctx, *drain)
}

func newLogger(level, format string) (zerolog.Logger, error) {
	lvl, err := zerolog.ParseLevel(strings.ToLower(level))
	if err != nil || level == "" {
		return zerolog.Logger{}, fmt.Errorf("--log-level %q: use debug, info, warn or error", level)
	}
	zerolog.DurationFieldUnit = time.Millisecond
	zerolog.DurationFieldInteger = false
	var out = zerolog.New(os.Stderr)
	switch format {
	case "json":
	case "console":
		out = zerolog.New(zerolog.ConsoleWriter{Out: os.Stderr, TimeFormat: time.RFC3339Nano})
	default:
		return zerolog.Logger{}, fmt.Errorf("--log-format %q: use json or console", format)
	}
	return out.Level(lvl).With().Timestamp().Logger(), nil
}
