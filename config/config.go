// Package config is the one home of ferryd's settings: each one's name,
// default, help and checks, read from the defaults, a TOML file, FERRY_*
// environment variables and command-line flags, each overriding the one
// before. A setting has one name in all three: the key arena_size is the
// variable FERRY_ARENA_SIZE and the flag --arena-size.
//
// The file is strict: an unknown key, a value of the wrong type, or a
// size or duration that does not parse is an error naming the key, the
// file and the line. Every value, wherever it comes from, goes through the
// same checks (Check), and the daemon takes the same Settings.
package config

import (
	"bytes"
	"errors"
	"flag"
	"fmt"
	"io"
	"maps"
	"os"
	"regexp"
	"slices"
	"strings"

	"github.com/pelletier/go-toml/v2"

	"github.com/ferry-project/ferry/api"
	"github.com/ferry-project/ferry/internal/size"
	"github.com/ferry-project/ferry/mooncake"
	"github.com/ferry-project/ferry/transport/peer"
)

// DefaultFile is read when no --config or FERRY_CONFIG names a file, and
// only if it exists: flags and defaults alone run ferryd.
const DefaultFile = "/etc/ferry/ferryd.toml"

// Transport is the data plane ferryd runs: the transport setting.
type Transport string

const (
	TransportAuto Transport = "auto" // RDMA when an active RDMA port exists, else TCP
	TransportRDMA Transport = "rdma" // RDMA or fail at start
	TransportTCP  Transport = "tcp"
)

// Settings is ferryd's configuration, as the TOML file spells it.
type Settings struct {
	Socket           string               `toml:"socket"`
	SocketGroup      string               `toml:"socket_group"`
	AllowUIDs        []uint32             `toml:"allow_uids"`
	AllowGIDs        []uint32             `toml:"allow_gids"`
	RequestTimeout   Duration             `toml:"request_timeout"`
	MaxHeaderBytes   Size                 `toml:"max_header_bytes"`
	MaxBodyBytes     Size                 `toml:"max_body_bytes"`
	Listen           string               `toml:"listen"`
	Advertise        string               `toml:"advertise"`
	Transport        Transport            `toml:"transport"`
	IOTimeout        Duration             `toml:"io_timeout"`
	TCPSendBuffer    Size                 `toml:"tcp_send_buffer"`
	TCPStripes       int                  `toml:"tcp_stripes"`
	MaxConns         int                  `toml:"max_conns"`
	MetricsListen    string               `toml:"metrics_listen"`
	PeerSecretFile   string               `toml:"peer_secret_file"`
	MooncakeListen   string               `toml:"mooncake_listen"`
	MooncakeQPs      int                  `toml:"mooncake_qps_per_endpoint"`
	MooncakeMTU      int                  `toml:"mooncake_mtu"`
	MooncakeFetch    []string             `toml:"mooncake_fetch_allow"`
	MooncakeAllow    []string             `toml:"mooncake_allow"`
	MooncakeRDMAPool Share                `toml:"mooncake_rdma_pool"`
	RDMADevice       Names                `toml:"rdma_device"`
	RDMAStripeMin    Size                 `toml:"rdma_stripe_min"`
	RDMAGIDIndex     int                  `toml:"rdma_gid_index"`
	RDMARegistration api.RegistrationMode `toml:"rdma_registration"`
	GPURegistration  api.GPURegistration  `toml:"gpu_registration"`
	Device           Device               `toml:"device"`
	ArenaSize        Sizes                `toml:"arena_size"`
	BounceSize       Size                 `toml:"bounce_size"`
	ArenaHugePages   string               `toml:"arena_huge_pages"`
	ArenaFile        string               `toml:"arena_file"`
	MaxRegionBytes   Share                `toml:"max_region_bytes"`
	SlowThreshold    Duration             `toml:"slow_threshold"`
	SendRetries      int                  `toml:"send_retries"`
	SendTimeout      Duration             `toml:"send_timeout"`
	StageTTL         Duration             `toml:"stage_ttl"`
	ReceiveTTL       Duration             `toml:"receive_ttl"`
	DrainTimeout     Duration             `toml:"drain_timeout"`
	LogLevel         string               `toml:"log_level"`
	LogFormat        string               `toml:"log_format"`
	// A table, so last: TOML puts a table after the plain keys.
	Affinity Affinity `toml:"affinity"`
}

// option is one setting: its key, its default (as text, "" for an empty
// string or list), its help text, its field in a Settings, and what its
// value must be beyond parsing (nil: any value that parses is good).
type option struct {
	key   string
	def   string
	help  string
	of    func(*Settings) value
	check func(*Settings) error
}

// ArenaAlign is the arena's allocation alignment, so also the smallest arena.
const ArenaAlign = 256

// maxSendRetries bounds send_retries: retries re-dial at once, so more of
// them recover nothing that fewer would not.
const maxSendRetries = 10

// options is every setting, in the order --print-config writes them.
var options = []option{
	{"socket", api.DefaultSocket, "control socket `path`",
		func(s *Settings) value { return (*text)(&s.Socket) }, checkSocket},
	{"socket_group", "", "`group` (name or gid) that owns the control socket (mode 0660; default: ferryd's own group); the arena is ferryd's alone (a sealed memfd): allowed callers get its descriptor over the socket",
		func(s *Settings) value { return (*text)(&s.SocketGroup) },
		func(s *Settings) error { _, err := LookupGroup(s.SocketGroup); return err }},
	{"allow_uids", "", "comma-separated `uids` that may call the API (with --allow-gids; both empty: anyone who can open the socket; root and ferryd's own uid always may)",
		func(s *Settings) value { return (*ids)(&s.AllowUIDs) }, nil},
	{"allow_gids", "", "comma-separated `gids` whose members may call the API (primary or supplementary group)",
		func(s *Settings) value { return (*ids)(&s.AllowGIDs) }, nil},
	{"request_timeout", "15m", "bound (a `duration`) on one control request, from its headers to its answer; must exceed --send-timeout",
		func(s *Settings) value { return &s.RequestTimeout },
		func(s *Settings) error {
			if s.RequestTimeout.D() <= s.SendTimeout.D() {
				return fmt.Errorf("must be longer than send_timeout (%s): a send must be able to use its whole time", s.SendTimeout)
			}
			return nil
		}},
	{"max_header_bytes", "64KiB", "bound on a control request's headers (`size`)",
		func(s *Settings) value { return &s.MaxHeaderBytes }, sizeWithin(func(s *Settings) Size { return s.MaxHeaderBytes }, 1<<10, 1<<30)},
	{"max_body_bytes", "64KiB", "bound on a JSON request body (`size`; uploads are bounded by the arena)",
		func(s *Settings) value { return &s.MaxBodyBytes }, sizeWithin(func(s *Settings) Size { return s.MaxBodyBytes }, 1<<10, 1<<40)},
	{"listen", fmt.Sprintf(":%d", api.DefaultPeerPort), "peer port `host:port` other daemons dial",
		func(s *Settings) value { return (*text)(&s.Listen) }, hostPort(func(s *Settings) string { return s.Listen }, false, "e.g. :17100 or 10.0.0.5:17100")},
	{"advertise", "", "`host:port` receive slots name as their session, where peers dial this daemon; with a peer secret, a peer that dialed another address is refused (default: the listen address, or this host's first IPv4 address when listening on all)",
		func(s *Settings) value { return (*text)(&s.Advertise) },
		func(s *Settings) error {
			if s.Advertise == "" {
				return nil
			}
			return api.CheckSession(s.Advertise)
		}},
	{"transport", string(TransportAuto), "`transport` of the data plane: auto (RDMA when an active RDMA port exists, else TCP, logged with why), rdma (fail at start without a usable port) or tcp",
		func(s *Settings) value {
			return choice[Transport]{&s.Transport, []Transport{TransportAuto, TransportRDMA, TransportTCP}}
		}, nil},
	{"rdma_device", "", "RDMA `devices` to use, comma-separated, e.g. mlx5_0 or mlx5_0,mlx5_1, or all (every device with an active port); a send below rdma_stripe_min goes out of the device nearest its source's (the first for the first arena) into the receiver's nearest the slot's, and larger sends are striped over all (empty: the one whose GID carries the advertised address)",
		func(s *Settings) value { return (*names)(&s.RDMADevice) }, nil},
	{"rdma_stripe_min", "8MiB", "`size` from which a send from the arena is striped in 1 MiB pieces over every RDMA device pair the two daemons share (rdma_device); a device failing mid-send gives its pieces to the others (0: never stripe)",
		func(s *Settings) value { return &s.RDMAStripeMin }, sizeWithin(func(s *Settings) Size { return s.RDMAStripeMin }, 0, 1<<40)},
	{"rdma_gid_index", "-1", "GID table `index` to use (-1: the RoCE v2 GID of the advertised address)",
		func(s *Settings) value { return (*number)(&s.RDMAGIDIndex) },
		func(s *Settings) error {
			if s.RDMAGIDIndex < -1 {
				return errors.New("is below -1: give a GID table index (see /sys/class/infiniband/*/ports/*/gids), or -1 to choose by the advertised address")
			}
			return nil
		}},
	{"rdma_registration", string(api.RegistrationShared), "`mode`: shared (register the arena once) or per-send (debugging: each send registers its range)",
		func(s *Settings) value {
			return choice[api.RegistrationMode]{&s.RDMARegistration, []api.RegistrationMode{api.RegistrationShared, api.RegistrationPerSend}}
		}, nil},
	{"gpu_registration", string(api.GPURegistrationAuto), "`path` by which a GPU arena is registered with the RDMA NIC once: auto (dmabuf, else peermem, else bounce; status says why each was not taken), dmabuf (ibv_reg_dmabuf_mr of the arena's dmabuf), peermem (ibv_reg_mr of the device pointer; needs nvidia-peermem) or bounce (the pinned bounce area, with a copy around each transfer); a forced path that fails stops the RDMA transport",
		func(s *Settings) value {
			return choice[api.GPURegistration]{&s.GPURegistration, append([]api.GPURegistration{api.GPURegistrationAuto}, api.GPURegistrationPaths...)}
		}, nil},
	{"io_timeout", "10s", "`deadline` on each network read and write; a stalled peer fails within it",
		func(s *Settings) value { return &s.IOTimeout }, positive(func(s *Settings) Duration { return s.IOTimeout })},
	{"tcp_send_buffer", size.Format(peer.DefaultSendBuffer), "kernel send buffer (`size`, SO_SNDBUF, which the kernel doubles) of each connection to a peer: small, so that the sender's copy and the receiver's overlap within one write; raise it for links whose bandwidth x round trip is larger (0: the kernel's autotuning)",
		func(s *Settings) value { return &s.TCPSendBuffer }, sizeWithin(func(s *Settings) Size { return s.TCPSendBuffer }, 0, 1<<30)},
	{"tcp_stripes", "4", "`connections` one send over TCP spreads its bytes across at once, in pieces of at least 1 MiB (bounded by max_conns): one connection's copies run on one core each side, which caps a single stream well below a fast NIC (1: every send on one connection)",
		func(s *Settings) value { return (*number)(&s.TCPStripes) }, intWithin(func(s *Settings) int { return s.TCPStripes }, 1, 64)},
	{"max_conns", "8", "`connections` per peer session (concurrent writes to one peer)",
		func(s *Settings) value { return (*number)(&s.MaxConns) }, intWithin(func(s *Settings) int { return s.MaxConns }, 1, 1024)},
	{"metrics_listen", "", "also serve GET /metrics on this TCP `host:port` (empty: off; the control socket always serves it)",
		func(s *Settings) value { return (*text)(&s.MetricsListen) }, hostPort(func(s *Settings) string { return s.MetricsListen }, true, "e.g. 127.0.0.1:9464 or :9464")},
	{"peer_secret_file", "", "`file` (mode 0600 or stricter) holding a secret of at least 16 bytes every peer daemon must share; peers prove it to each other on every connection (empty: off)",
		func(s *Settings) value { return (*text)(&s.PeerSecretFile) },
		func(s *Settings) error {
			if s.PeerSecretFile == "" {
				return nil
			}
			_, err := ReadPeerSecret(s.PeerSecretFile)
			return err
		}},
	{"mooncake_listen", "", "also serve as a Mooncake Transfer Engine segment: its RPC (handshake) port on this `host:port`, a TCP data port beside it; Mooncake senders write into receive slots made with \"mooncake\": true (empty: off)",
		func(s *Settings) value { return (*text)(&s.MooncakeListen) }, hostPort(func(s *Settings) string { return s.MooncakeListen }, true, "e.g. 0.0.0.0:15302: the Mooncake RPC port senders name as the segment")},
	{"mooncake_qps_per_endpoint", fmt.Sprint(mooncake.DefaultQPs), "RC `QPs` ferry offers per RDMA endpoint when it dials a Mooncake segment: the peers' MC_NUM_QP_PER_EP, which must match (1 to 16)",
		func(s *Settings) value { return (*number)(&s.MooncakeQPs) }, intWithin(func(s *Settings) int { return s.MooncakeQPs }, 1, mooncake.MaxQPs)},
	{"mooncake_mtu", fmt.Sprint(mooncake.DefaultMTU), "path MTU cap (`bytes`: 512, 1024, 2048 or 4096) of RDMA QPs to Mooncake peers: their MC_MTU; Mooncake exchanges no MTU, so each end takes the smaller of the cap and its port's, and both must agree",
		func(s *Settings) value { return (*number)(&s.MooncakeMTU) },
		func(s *Settings) error {
			if !slices.Contains([]int{512, 1024, 2048, 4096}, s.MooncakeMTU) {
				return fmt.Errorf("is not 512, 1024, 2048 or 4096: give the Mooncake peers' MC_MTU (their default is %d)", mooncake.DefaultMTU)
			}
			return nil
		}},
	{"mooncake_fetch_allow", "", "Mooncake `segments` (IP addresses or CIDR prefixes, comma-separated) whose descriptor ferryd may fetch when their engine's RDMA handshake carries no local_gid (older Mooncake releases), besides the segments it has sent to (empty: only those)",
		func(s *Settings) value { return (*prefixes)(&s.MooncakeFetch) }, nil},
	{"mooncake_allow", "", "`addresses` (IP addresses or CIDR prefixes, comma-separated) that may connect to the Mooncake RPC and data ports: Mooncake's wire carries no key, so only these may write into receive slots made with \"mooncake\": true (empty: loopback and this host's own addresses)",
		func(s *Settings) value { return (*prefixes)(&s.MooncakeAllow) }, nil},
	{"mooncake_rdma_pool", "25%", "the part of the first arena (a `size`, or a share of it) that receive slots made with \"mooncake\": true come from when ferryd's Mooncake segment speaks rdma: the only memory registered for Mooncake peers' one-sided writes, and the one buffer the segment lists (Mooncake peers cache the descriptor, so it cannot list each slot); nothing else is ever placed there. Over tcp the data port checks each write, and slots come from the whole arena",
		func(s *Settings) value { return &s.MooncakeRDMAPool }, nil},
	{"device", string(DeviceAuto), "arena `memory`, one arena per device listed: auto (a GPU when the CUDA driver and one are there, else host memory), cpu, cuda:N, several joined by commas (cuda:0,1,3 or cuda:0,cpu; in the file also a list), or cuda:all (every GPU the driver lists); receive slots and staged entries name their device, the first by default",
		func(s *Settings) value { return (*text)(&s.Device) },
		func(s *Settings) error { _, err := s.Device.List(); return err }},
	{"arena_size", "1GiB", "arena `size`, e.g. 64MiB or 8GiB: one for every device's arena, or one per device joined by commas (in the file also a list)",
		func(s *Settings) value { return &s.ArenaSize }, checkArenaSizes},
	{"bounce_size", "256MiB", "pinned host memory (`size`) that copies to and from a GPU arena are staged in",
		func(s *Settings) value { return &s.BounceSize }, nil},
	{"arena_huge_pages", "", "huge page `size` (e.g. 2MiB or 1GiB, one the kernel lists in /sys/kernel/mm/hugepages) a host-memory arena takes its pages in, from vm.nr_hugepages' pool (empty: ordinary pages)",
		func(s *Settings) value { return (*text)(&s.ArenaHugePages) }, checkHugePages},
	{"arena_file", "", "no longer used, must be empty: the host-memory arena is a sealed memfd ferryd owns, in no file system (for huge pages set arena_huge_pages)",
		func(s *Settings) value { return (*text)(&s.ArenaFile) }, checkArenaFile},
	{"max_region_bytes", "75%", "bound on the host memory all memfd regions (POST /v1/regions) hold at once: a `size`, or a share (e.g. 75%) of physical memory, or of the memory limit of ferryd's cgroup (MemoryMax=, a container's) where that is less; past it a region is refused before ferryd maps it. Over RDMA registering a region pins every page of it, untouched ones too (a sparse memfd), so this keeps one client from pinning the host's memory; 75% lets a CPU KV pool take most of the host and leaves a quarter to the kernel, the arena and the clients. CUDA regions pin no host memory and do not count (0: no bound)",
		func(s *Settings) value { return &s.MaxRegionBytes }, nil},
	{"slow_threshold", "200ms", "log transfers slower than this `duration` (0: every transfer; reloaded on SIGHUP)",
		func(s *Settings) value { return &s.SlowThreshold }, nil},
	{"send_retries", "1", "re-dial and retry a failed write this many `times` (0 to 10)",
		func(s *Settings) value { return (*number)(&s.SendRetries) }, intWithin(func(s *Settings) int { return s.SendRetries }, 0, maxSendRetries)},
	{"send_timeout", "1m", "bound (a `duration`) on one send, retries included",
		func(s *Settings) value { return &s.SendTimeout }, positive(func(s *Settings) Duration { return s.SendTimeout })},
	{"stage_ttl", "10m", "drop staged entries not sent or deleted after this `duration` (logged at WARN)",
		func(s *Settings) value { return &s.StageTTL }, positive(func(s *Settings) Duration { return s.StageTTL })},
	{"receive_ttl", "10m", "drop receive slots not freed after this `duration` (logged at WARN)",
		func(s *Settings) value { return &s.ReceiveTTL }, positive(func(s *Settings) Duration { return s.ReceiveTTL })},
	{"drain_timeout", "30s", "on SIGTERM, how `long` in-flight requests may finish before they are cancelled (0: cancel them at once)",
		func(s *Settings) value { return &s.DrainTimeout }, nil},
	{"log_level", "info", "`level`: debug, info, warn or error (reloaded on SIGHUP)",
		func(s *Settings) value {
			return choice[string]{&s.LogLevel, []string{"debug", "info", "warn", "error"}}
		}, nil},
	{"log_format", "json", "`format`: json (for journald) or console",
		func(s *Settings) value { return choice[string]{&s.LogFormat, []string{"json", "console"}} }, nil},
	{"affinity", "", "`map` of GPUs to the RDMA NICs their memory uses, over the PCIe topology's choice, e.g. cuda:0=mlx5_0+mlx5_1,cuda:1=mlx5_2; in the file a table: [affinity] then \"cuda:0\" = [\"mlx5_0\", \"mlx5_1\"] (empty: the nearest NICs by the topology; ferryctl status shows the table)",
		func(s *Settings) value { return &s.Affinity }, nil},
}

func lookup(key string) (option, bool) {
	for _, o := range options {
		if o.key == key {
			return o, true
		}
	}
	return option{}, false
}

// FlagName and EnvName spell a key as a flag and as a variable.
func FlagName(key string) string { return strings.ReplaceAll(key, "_", "-") }
func EnvName(key string) string  { return "FERRY_" + strings.ToUpper(key) }

// Defaults are the settings with nothing given.
func Defaults() Settings {
	var s Settings
	for _, o := range options {
		if err := o.of(&s).Set(o.def); err != nil {
			panic(fmt.Sprintf("config: the default of %s does not parse: %v", o.key, err))
		}
	}
	return s
}

// Loaded is what Load read: the effective settings, where each came from,
// and what the command line asked for besides.
type Loaded struct {
	Settings Settings
	File     string            // the file read, "" for none
	Source   map[string]string // key -> "file", "FERRY_X" or "--x"; absent: default
	lines    map[string]int    // key -> the file's line that set it

	CheckOnly bool // --check-config
	Print     bool // --print-config
	Version   bool // --version
}

// Load reads the command line (args, without the program name), the
// environment (through getenv) and the configuration file. A --help
// returns flag.ErrHelp after printing the usage to usage.
func Load(args []string, getenv func(string) (string, bool), usage io.Writer) (*Loaded, error) {
	l := &Loaded{Settings: Defaults(), Source: map[string]string{}, lines: map[string]int{}}

	// Flags are checked as they are parsed (into a scratch copy) and
	// applied last, so they override the file and the environment.
	fs := flag.NewFlagSet("ferryd", flag.ContinueOnError)
	fs.SetOutput(io.Discard) // a bad flag is one error line, not the whole usage
	scratch := Defaults()
	given := map[string]string{}
	for _, o := range options {
		fs.Var(recorder{o.of(&scratch), o.key, given}, FlagName(o.key), o.help)
	}
	file := fs.String("config", "", "TOML configuration `file` (default: $FERRY_CONFIG, else "+DefaultFile+" if it exists)")
	fs.BoolVar(&l.CheckOnly, "check-config", false, "check the configuration and exit: 0 when it is good")
	fs.BoolVar(&l.Print, "print-config", false, "print the effective configuration as TOML and exit")
	fs.BoolVar(&l.Version, "version", false, "print the version and exit")
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			fmt.Fprintf(usage, "Usage: ferryd [flags]\n\nEvery flag is also a key of the TOML file (--arena-size is arena_size) and an\nenvironment variable (FERRY_ARENA_SIZE). Flags beat variables, variables beat\nthe file, the file beats the defaults.\n\n")
			fs.SetOutput(usage)
			fs.PrintDefaults()
		}
		return nil, err
	}
	if fs.NArg() > 0 {
		return nil, fmt.Errorf("unexpected arguments %q: ferryd takes flags only (see ferryd -h)", fs.Args())
	}

	l.File = *file
	if l.File == "" {
		l.File, _ = getenv("FERRY_CONFIG")
	}
	explicit := l.File != ""
	if !explicit {
		if _, err := os.Stat(DefaultFile); err == nil {
			l.File = DefaultFile
		}
	}
	if l.File != "" {
		if err := l.readFile(explicit); err != nil {
			return nil, err
		}
	}

	var errs []error
	for _, o := range options {
		name := EnvName(o.key)
		if v, ok := getenv(name); ok {
			if err := o.of(&l.Settings).Set(v); err != nil {
				errs = append(errs, fmt.Errorf("%s: %v", name, err))
				continue
			}
			l.Source[o.key] = name
		}
	}
	if err := errors.Join(errs...); err != nil {
		return nil, err
	}
	for _, o := range options {
		if v, ok := given[o.key]; ok {
			_ = o.of(&l.Settings).Set(v) // checked while parsing
			l.Source[o.key] = "--" + FlagName(o.key)
		}
	}
	return l, nil
}

// recorder checks a flag's value as it is parsed and keeps its text.
type recorder struct {
	value
	key   string
	given map[string]string
}

// String is the default --help shows; the flag package also calls it on
// a zero recorder.
func (r recorder) String() string {
	if r.value == nil {
		return ""
	}
	return r.value.String()
}

func (r recorder) Set(s string) error {
	if err := r.value.Set(s); err != nil {
		return err
	}
	r.given[r.key] = s
	return nil
}

// readFile decodes the TOML file over the defaults, strictly.
func (l *Loaded) readFile(explicit bool) error {
	data, err := os.ReadFile(l.File)
	if err != nil {
		if errors.Is(err, os.ErrNotExist) && explicit {
			return fmt.Errorf("config file %s does not exist: create it (systemd/ferryd.toml is an example documenting every key) or name another with --config", l.File)
		}
		return fmt.Errorf("config file: %w", err)
	}
	dec := toml.NewDecoder(bytes.NewReader(data))
	dec.DisallowUnknownFields()
	dec.EnableUnmarshalerInterface() // device and arena_size: a string or a list
	if err := dec.Decode(&l.Settings); err != nil {
		if le := (*listError)(nil); errors.As(err, &le) {
			o, _ := lookup(le.key)
			return fmt.Errorf("%s: %s: %v; want %s", l.where(lineOf(data, le.key), 0), le.key, le.err, o.of(&Settings{}).want())
		}
		return l.explain(err)
	}
	// Decoding checked the types; the values are checked here, the same
	// way a flag's or a variable's are.
	var present map[string]any
	_ = toml.Unmarshal(data, &present) // it decoded above
	var errs []error
	// go-toml matches keys to fields ignoring case; ferryd's keys are
	// exact, and a key spelt otherwise would skip the checks below.
	for _, key := range slices.Sorted(maps.Keys(present)) {
		if _, ok := lookup(key); !ok {
			errs = append(errs, fmt.Errorf("%s: unknown key %q%s", l.where(lineOf(data, key), 0), key, suggest(key)))
		}
	}
	for _, o := range options {
		if _, ok := present[o.key]; !ok {
			continue
		}
		l.Source[o.key] = "file"
		l.lines[o.key] = lineOf(data, o.key)
		v := o.of(&l.Settings)
		if err := v.Set(v.String()); err != nil {
			errs = append(errs, fmt.Errorf("%s: %s: %v", l.where(l.lines[o.key], 0), o.key, err))
		}
	}
	return errors.Join(errs...)
}

// explain turns go-toml's errors into ones naming the file, line, column
// and key, with what a good value looks like.
func (l *Loaded) explain(err error) error {
	var strict *toml.StrictMissingError
	if errors.As(err, &strict) {
		var errs []error
		for _, e := range strict.Errors {
			row, col := e.Position()
			key := strings.Join(e.Key(), ".")
			errs = append(errs, fmt.Errorf("%s: unknown key %q%s", l.where(row, col), key, suggest(key)))
		}
		return errors.Join(errs...)
	}
	var de *toml.DecodeError
	if errors.As(err, &de) {
		row, col := de.Position()
		// go-toml names the Go field and type; the key and what it wants
		// say it better.
		msg := typeMismatch.ReplaceAllString(strings.TrimPrefix(de.Error(), "toml: "), "a TOML $1 is the wrong type")
		if len(de.Key()) == 0 {
			return fmt.Errorf("%s: not valid TOML: %s", l.where(row, col), msg)
		}
		key := strings.Join(de.Key(), ".")
		if o, ok := lookup(key); ok {
			return fmt.Errorf("%s: %s: %s; want %s", l.where(row, col), key, msg, o.of(&Settings{}).want())
		}
		return fmt.Errorf("%s: %s: %s", l.where(row, col), key, msg)
	}
	return fmt.Errorf("config file %s: %w", l.File, err)
}

var typeMismatch = regexp.MustCompile(`^cannot decode TOML (\w+) into .*`)

func (l *Loaded) where(row, col int) string {
	if col > 0 {
		return fmt.Sprintf("config file %s, line %d, column %d", l.File, row, col)
	}
	return fmt.Sprintf("config file %s, line %d", l.File, row)
}

// lineOf finds the line that sets key: the one that starts with the
// key, or the header of its table (affinity).
func lineOf(data []byte, key string) int {
	re := regexp.MustCompile(`^\s*(["']?` + regexp.QuoteMeta(key) + `["']?\s*=|\[\s*` + regexp.QuoteMeta(key) + `\s*\])`)
	for i, line := range bytes.Split(data, []byte("\n")) {
		if re.Match(line) {
			return i + 1
		}
	}
	return 0
}

// suggest names the known key closest to a misspelt one.
func suggest(key string) string {
	best, dist := "", 4
	for _, o := range options {
		if strings.EqualFold(key, o.key) {
			return fmt.Sprintf(": keys are lower case: write %q", o.key)
		}
		if d := editDistance(key, o.key); d < dist {
			best, dist = o.key, d
		}
	}
	if best != "" {
		return fmt.Sprintf(": did you mean %q?", best)
	}
	return ": remove it; ferryd --print-config lists every key"
}

func editDistance(a, b string) int {
	prev := make([]int, len(b)+1)
	for j := range prev {
		prev[j] = j
	}
	for i := 1; i <= len(a); i++ {
		cur := make([]int, len(b)+1)
		cur[0] = i
		for j := 1; j <= len(b); j++ {
			cost := 1
			if a[i-1] == b[j-1] {
				cost = 0
			}
			cur[j] = min(prev[j]+1, cur[j-1]+1, prev[j-1]+cost)
		}
		prev = cur
	}
	return prev[len(b)]
}

// Changed lists the keys whose values differ between a and b.
func Changed(a, b Settings) []string {
	var out []string
	for _, o := range options {
		if o.of(&a).String() != o.of(&b).String() {
			out = append(out, o.key)
		}
	}
	return out
}

// TOML writes the effective settings as a configuration file, each key
// followed by where its value came from.
func (l *Loaded) TOML() ([]byte, error) {
	body, err := toml.Marshal(l.Settings)
	if err != nil {
		return nil, err
	}
	var b bytes.Buffer
	b.WriteString("# ferryd's effective configuration: flags > FERRY_* variables > file > defaults\n")
	if l.File != "" {
		fmt.Fprintf(&b, "# file: %s\n", l.File)
	}
	table := ""
	for _, line := range strings.Split(strings.TrimRight(string(body), "\n"), "\n") {
		key, _, _ := strings.Cut(line, " =")
		if t, ok := strings.CutPrefix(line, "["); ok {
			table = strings.TrimSuffix(t, "]")
		}
		if table != "" {
			key = table // a table's entries came from where the table did
		}
		from := "default"
		if src, ok := l.Source[key]; ok {
			from = src
		}
		if line == "" {
			fmt.Fprintln(&b)
			continue
		}
		fmt.Fprintf(&b, "%s  # %s\n", line, from)
	}
	return b.Bytes(), nil
}
