package config

import (
	"errors"
	"flag"
	"io"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"
	"time"
)

// env is a fake environment for Load.
func env(kv ...string) func(string) (string, bool) {
	m := map[string]string{}
	for i := 0; i+1 < len(kv); i += 2 {
		m[kv[i]] = kv[i+1]
	}
	return func(k string) (string, bool) { v, ok := m[k]; return v, ok }
}

func writeFile(t *testing.T, body string) string {
	t.Helper()
	p := filepath.Join(t.TempDir(), "ferryd.toml")
	if err := os.WriteFile(p, []byte(body), 0o644); err != nil {
		t.Fatal(err)
	}
	return p
}

func load(t *testing.T, args []string, getenv func(string) (string, bool)) (*Loaded, error) {
	t.Helper()
	return Load(args, getenv, io.Discard)
}

func TestEveryFieldHasOneOption(t *testing.T) {
	typ := reflect.TypeFor[Settings]()
	if typ.NumField() != len(options) {
		t.Fatalf("Settings has %d fields, options %d", typ.NumField(), len(options))
	}
	var s Settings
	for i := range typ.NumField() {
		key := typ.Field(i).Tag.Get("toml")
		o, ok := lookup(key)
		if !ok {
			t.Fatalf("field %s (key %q) has no option", typ.Field(i).Name, key)
		}
		// The option's value is that very field.
		v := o.of(&s)
		p := reflect.ValueOf(v)
		if f, ok := v.(fielder); ok {
			p = reflect.ValueOf(f.field())
		}
		if p.UnsafePointer() != reflect.ValueOf(&s).Elem().Field(i).Addr().UnsafePointer() {
			t.Errorf("option %q is not field %s", key, typ.Field(i).Name)
		}
	}
}

// The example shipped in systemd/ holds every key at its default, so it
// cannot drift from the code.
func TestExampleDocumentsEveryKeyAtItsDefault(t *testing.T) {
	l, err := load(t, []string{"--config", "../systemd/ferryd.toml"}, env())
	if err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(l.Settings, Defaults()) {
		t.Errorf("the example's values differ from the defaults:\n got %+v\nwant %+v", l.Settings, Defaults())
	}
	for _, o := range options {
		if l.Source[o.key] != "file" {
			t.Errorf("the example does not set %q", o.key)
		}
	}
}

func TestPrecedenceFlagsEnvFileDefaults(t *testing.T) {
	file := writeFile(t, "slow_threshold = \"1h\"\nmax_conns = 3\narena_size = \"2GiB\"\nallow_uids = [1000, 1001]\n")
	l, err := load(t, []string{"--config", file, "--slow-threshold", "5ms"},
		env("FERRY_SLOW_THRESHOLD", "2s", "FERRY_MAX_CONNS", "4", "FERRY_LOG_LEVEL", "debug"))
	if err != nil {
		t.Fatal(err)
	}
	want := Defaults()
	want.SlowThreshold, want.MaxConns, want.ArenaSize, want.LogLevel = "5ms", 4, "2GiB", "debug"
	want.AllowUIDs = []uint32{1000, 1001}
	if !reflect.DeepEqual(l.Settings, want) {
		t.Fatalf("got  %+v\nwant %+v", l.Settings, want)
	}
	wantSrc := map[string]string{
		"slow_threshold": "--slow-threshold", "max_conns": "FERRY_MAX_CONNS", "log_level": "FERRY_LOG_LEVEL",
		"arena_size": "file", "allow_uids": "file",
	}
	if !reflect.DeepEqual(l.Source, wantSrc) {
		t.Fatalf("sources %v, want %v", l.Source, wantSrc)
	}
	if s := l.Settings; s.SlowThreshold.D() != 5*time.Millisecond || s.ArenaSize.Bytes() != 2<<30 || s.SendTimeout.D() != time.Minute {
		t.Fatalf("settings %+v", s)
	}
}

func TestFileErrorsNameKeyAndLine(t *testing.T) {
	cases := []struct {
		name, body string
		want       []string
	}{
		{"unknown key", "socket = \"/x\"\nslow_treshold = \"1s\"\n", []string{"line 2, column 1", `unknown key "slow_treshold"`, `did you mean "slow_threshold"`}},
		{"far from any key", "frobnicate = 1\n", []string{"line 1", `"frobnicate"`, "--print-config lists every key"}},
		{"table", "[arena]\nsize = \"1GiB\"\n", []string{"line 1", `unknown key "arena"`}},
		// go-toml matches keys ignoring case; ferryd does not (found by FuzzConfigFile).
		{"key in mixed case", "\nLog_Level = \"verbose\"\n", []string{"line 2", `unknown key "Log_Level"`, `keys are lower case: write "log_level"`}},
		{"string for int", "max_conns = \"eight\"\n", []string{"line 1, column 13", "max_conns", "a TOML string is the wrong type", "want an integer"}},
		{"int for duration", "\n\nsend_timeout = 60\n", []string{"line 3", "send_timeout", "a TOML integer is the wrong type", `"30s"`}},
		{"int for size", "arena_size = 1073741824\n", []string{"line 1", "arena_size", `e.g. "64MiB"`}},
		{"bad size", "max_body_bytes = \"a lot\"\n", []string{"line 1", "max_body_bytes", `"a lot"`}},
		{"bad duration", "slow_threshold = \"fast\"\n", []string{"line 1", "slow_threshold", `"fast"`, "with a unit"}},
		{"negative duration", "stage_ttl = \"-1s\"\n", []string{"line 1", "stage_ttl", "negative"}},
		{"share over 100%", "max_region_bytes = \"120%\"\n", []string{"line 1", "max_region_bytes", `"120%"`, "at most 100"}},
		{"bad share", "max_region_bytes = \"most\"\n", []string{"line 1", "max_region_bytes", `"most"`, `"75%"`}},
		{"bad choice", "log_format = \"xml\"\n", []string{"line 1", "log_format", "json, console"}},
		{"negative uid", "allow_gids = [5, -1]\n", []string{"line 1", "allow_gids", "negative"}},
		{"syntax", "listen = \"unterminated\n", []string{"line 1", "not valid TOML"}},
		{"two errors", "io_timeout = \"soon\"\nreceive_ttl = \"later\"\n", []string{"line 1: io_timeout", "line 2: receive_ttl"}},
		{"affinity of a non-GPU", "log_level = \"info\"\n[affinity]\n\"gpu0\" = [\"mlx5_0\"]\n", []string{"line 2: affinity", `"gpu0" is not a GPU`}},
		{"affinity to a bad NIC name", "[affinity]\n\"cuda:1\" = [\"mlx5_0\", \"a b\"]\n", []string{"line 1: affinity", `cuda:1 maps to "a b", which is not an RDMA device name`}},
		{"affinity as a string", "affinity = \"cuda:0\"\n", []string{"line 1", "affinity", `[affinity] then "cuda:0" = ["mlx5_0"]`}},
	}
	for _, c := range cases {
		file := writeFile(t, c.body)
		_, err := load(t, []string{"--config", file}, env())
		if err == nil {
			t.Errorf("%s: no error for %q", c.name, c.body)
			continue
		}
		for _, w := range append(c.want, file) {
			if !strings.Contains(err.Error(), w) {
				t.Errorf("%s: error lacks %q: %v", c.name, w, err)
			}
		}
	}
}

func TestEnvAndFlagErrorsNameTheirSource(t *testing.T) {
	_, err := load(t, []string{"--config", os.DevNull}, env("FERRY_DRAIN_TIMEOUT", "30"))
	if err == nil || !strings.Contains(err.Error(), "FERRY_DRAIN_TIMEOUT") || !strings.Contains(err.Error(), `"30"`) {
		t.Errorf("bad variable: %v", err)
	}
	_, err = load(t, []string{"--config", os.DevNull, "--allow-uids", "1000,bob"}, env())
	if err == nil || !strings.Contains(err.Error(), "allow-uids") || !strings.Contains(err.Error(), `"bob"`) {
		t.Errorf("bad flag: %v", err)
	}
	_, err = load(t, []string{"--config", os.DevNull, "stray"}, env())
	if err == nil || !strings.Contains(err.Error(), "stray") {
		t.Errorf("stray argument: %v", err)
	}
	_, err = load(t, []string{"-h"}, env())
	if !errors.Is(err, flag.ErrHelp) {
		t.Errorf("-h: %v", err)
	}
}

func TestConfigFileChoice(t *testing.T) {
	missing := filepath.Join(t.TempDir(), "absent.toml")
	if _, err := load(t, []string{"--config", missing}, env()); err == nil || !strings.Contains(err.Error(), "does not exist") {
		t.Errorf("a named file that is missing must be an error: %v", err)
	}
	if _, err := load(t, nil, env("FERRY_CONFIG", missing)); err == nil || !strings.Contains(err.Error(), missing) {
		t.Errorf("FERRY_CONFIG naming a missing file must be an error: %v", err)
	}
	// --config beats FERRY_CONFIG.
	file := writeFile(t, "max_conns = 5\n")
	l, err := load(t, []string{"--config", file}, env("FERRY_CONFIG", missing))
	if err != nil || l.File != file || l.Settings.MaxConns != 5 {
		t.Fatalf("--config over FERRY_CONFIG: %+v %v", l, err)
	}
}

func TestPrintedConfigLoadsBackTheSame(t *testing.T) {
	file := writeFile(t, "allow_gids = [44]\nsend_retries = 0\narena_size = \"1.5GiB\"\n")
	l, err := load(t, []string{"--config", file, "--log-format", "console"}, env("FERRY_ADVERTISE", "10.0.0.5:17100"))
	if err != nil {
		t.Fatal(err)
	}
	out, err := l.TOML()
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"allow_gids = [44]  # file", "log_format = 'console'  # --log-format", "advertise = '10.0.0.5:17100'  # FERRY_ADVERTISE", "max_conns = 8  # default"} {
		if !strings.Contains(string(out), want+"\n") {
			t.Errorf("printed config lacks %q:\n%s", want, out)
		}
	}
	again, err := load(t, []string{"--config", writeFile(t, string(out))}, env())
	if err != nil {
		t.Fatalf("printed config does not load: %v\n%s", err, out)
	}
	if !reflect.DeepEqual(again.Settings, l.Settings) {
		t.Fatalf("round trip changed the settings:\n got %+v\nwant %+v", again.Settings, l.Settings)
	}
}

func TestChanged(t *testing.T) {
	a, b := Defaults(), Defaults()
	b.LogLevel, b.AllowUIDs = "debug", []uint32{7}
	if got := Changed(a, b); !reflect.DeepEqual(got, []string{"allow_uids", "log_level"}) {
		t.Fatalf("Changed = %v", got)
	}
}

// A share is a size, or a part of the host's physical memory.
func TestShareBytes(t *testing.T) {
	for in, want := range map[string]int64{"75%": 3 << 30, "100%": 4 << 30, " 12.5 % ": 512 << 20, "512MiB": 512 << 20, "0": 0} {
		var h Share
		if err := h.Set(in); err != nil {
			t.Errorf("Set(%q): %v", in, err)
			continue
		}
		if got := h.Bytes(4 << 30); got != want {
			t.Errorf("Share(%q).Bytes(4GiB) = %d, want %d", in, got, want)
		}
	}
	for _, bad := range []string{"", "%", "0%", "-5%", "101%", "NaN%", "most", "-1"} {
		var h Share
		if err := h.Set(bad); err == nil {
			t.Errorf("Set(%q) succeeded; want an error", bad)
		}
	}
}

func TestDeviceList(t *testing.T) {
	for in, want := range map[Device][]Device{
		"auto": {"auto"}, "cpu": {"cpu"}, "cuda:0": {"cuda:0"}, "cuda:7": {"cuda:7"},
		"cuda:0,1,3": {"cuda:0", "cuda:1", "cuda:3"}, "cuda:2, cuda:0": {"cuda:2", "cuda:0"},
		"cuda:all": {"cuda:all"}, "cuda:0,1,cpu": {"cuda:0", "cuda:1", "cpu"}, "cpu,cuda:all": {"cpu", "cuda:all"},
	} {
		if got, err := in.List(); err != nil || !reflect.DeepEqual(got, want) {
			t.Errorf("Device(%q).List() = %q, %v; want %q", in, got, err, want)
		}
	}
	for in, msg := range map[Device]string{
		"": "use auto", "gpu": "use auto", "cuda": "use auto", "cuda:": "use auto", "cuda:-1": "use auto", "cuda:x": "use auto",
		"CUDA:0": "use auto", "cuda:+1": "use auto", "0,1": `"0" is not a device`, "cpu,1": `"1" is not a device`, "cuda:0,": `"" is not a device`,
		"cuda:0,1,0": "cuda:0 is listed twice", "cpu,cpu": "cpu is listed twice", "cuda:all,cuda:1": "cuda:1 is listed twice",
		"auto,cpu": "auto picks the one device itself",
	} {
		if _, err := in.List(); err == nil || !strings.Contains(err.Error(), msg) {
			t.Errorf("Device(%q).List() = %v, want an error with %q", in, err, msg)
		}
	}
}

// device and arena_size take lists: joined by commas as flags and
// variables, TOML lists in the file (a plain string still works), with
// one size for every arena or one per device; printed back as they load.
func TestDeviceAndArenaSizeLists(t *testing.T) {
	for body, want := range map[string][2]string{
		"device = \"cuda:0\"\narena_size = \"64MiB\"\n":                           {"cuda:0", "64MiB"},
		"device = [\"cuda:0\", \"cuda:1\", \"cpu\"]\narena_size = \"64MiB\"\n":    {"cuda:0,cuda:1,cpu", "64MiB"},
		"device = [\"cuda:1\", \"cuda:3\"]\narena_size = [\"64MiB\", \"1GiB\"]\n": {"cuda:1,cuda:3", "64MiB,1GiB"},
		"device = \"cuda:all\"\narena_size = [\"64MiB\", \"1GiB\", \"2GiB\"]\n":   {"cuda:all", "64MiB,1GiB,2GiB"},
	} {
		l, err := load(t, []string{"--config", writeFile(t, body)}, env())
		if err == nil {
			err = l.Check()
		}
		if err != nil {
			t.Fatalf("%s: %v", body, err)
		}
		if string(l.Settings.Device) != want[0] || string(l.Settings.ArenaSize) != want[1] {
			t.Fatalf("%s: %v: device %q, arena_size %q", body, err, l.Settings.Device, l.Settings.ArenaSize)
		}
		out, err := l.TOML()
		if err != nil {
			t.Fatal(err)
		}
		again, err := load(t, []string{"--config", writeFile(t, string(out))}, env())
		if err != nil || !reflect.DeepEqual(again.Settings, l.Settings) {
			t.Fatalf("%s: round trip: %v\n%s", body, err, out)
		}
	}
	l, err := load(t, []string{"--config", os.DevNull, "--device", "cuda:0,2", "--arena-size", "1GiB,2GiB"}, env("FERRY_DEVICE", "cpu"))
	if err != nil || l.Check() != nil {
		t.Fatal(err, l.Check())
	}
	if z := l.Settings.ArenaSize; z.For(0) != "1GiB" || z.For(1) != "2GiB" || z.Bytes() != 1<<30 || z.Max() != 2<<30 {
		t.Fatalf("sizes %q: %q %q %d %d", z, z.For(0), z.For(1), z.Bytes(), z.Max())
	}
	if z := Sizes("8MiB"); z.For(0) != "8MiB" || z.For(5) != "8MiB" {
		t.Fatalf("one size is every arena's: %q %q", z.For(0), z.For(5))
	}
	for _, c := range []struct {
		args []string
		file string
		msg  string
	}{
		{[]string{"--device", "cuda:0,1", "--arena-size", "1GiB,2GiB,3GiB"}, "", `lists 3 sizes for the 2 devices of device "cuda:0,1"`},
		{[]string{"--arena-size", "1GiB,100"}, "", "100 is outside 256B..1PiB"},
		{[]string{"--device", "cuda:0,0"}, "", "--device \"cuda:0,0\": cuda:0 is listed twice"},
		{nil, "device = [\"cuda:0\", 1]\n", "line 1"},
		{nil, "device = [\"cuda:0\", \"gpu1\"]\n", `device "cuda:0,gpu1": "gpu1" is not a device`},
		{nil, "arena_size = [\"1GiB\", \"lots\"]\n", "arena_size"},
	} {
		args := c.args
		if c.file != "" {
			args = append(args, "--config", writeFile(t, c.file))
		} else {
			args = append(args, "--config", os.DevNull)
		}
		l, err := load(t, args, env())
		if err == nil {
			err = l.Check()
		}
		if err == nil || !strings.Contains(err.Error(), c.msg) {
			t.Errorf("%q %q: %v, want an error with %q", c.args, c.file, err, c.msg)
		}
	}
}

// Check names each bad setting as it was given (flag, variable, file and
// line, or the default), with its value and what a good one is.
func TestCheckNamesEachSettingWhereItCameFrom(t *testing.T) {
	file := writeFile(t, "mooncake_mtu = 1500\n\nmax_conns = 0\n")
	l, err := load(t, []string{"--config", file, "--device", "tpu:0", "--rdma-gid-index", "-2", "--send-timeout", "20m"},
		env("FERRY_STAGE_TTL", "0s", "FERRY_METRICS_LISTEN", "9464", "FERRY_MOONCAKE_QPS_PER_ENDPOINT", "17"))
	if err != nil {
		t.Fatal(err)
	}
	err = l.Check()
	for _, want := range []string{
		`--device "tpu:0": "tpu:0" is not a device: use auto`,
		`--rdma-gid-index "-2": is below -1`,
		`FERRY_STAGE_TTL "0s": must be above zero`,
		`FERRY_METRICS_LISTEN "9464": is not host:port`,
		`FERRY_MOONCAKE_QPS_PER_ENDPOINT "17": is outside 1..16`,
		file + `, line 1: mooncake_mtu "1500": is not 512, 1024, 2048 or 4096`,
		file + `, line 3: max_conns "0": is outside 1..1024`,
		`request_timeout (default) "15m": must be longer than send_timeout (20m)`,
	} {
		if err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("Check() = %v\nwant it to say %q", err, want)
		}
	}
	if err := l.Settings.Check(); err == nil || !strings.Contains(err.Error(), `stage_ttl "0s": must be above zero`) {
		t.Errorf("Settings.Check() names keys: got %v", err)
	}
}

// A zero is honoured where it means something and refused where it
// does not; the defaults pass.
func TestExplicitZeros(t *testing.T) {
	s := Defaults()
	if err := s.Check(); err != nil {
		t.Fatalf("the defaults do not pass: %v", err)
	}
	l, err := load(t, []string{"--config", os.DevNull, "--slow-threshold", "0s", "--send-retries", "0", "--drain-timeout", "0s", "--bounce-size", "0", "--max-region-bytes", "0"}, env())
	if err != nil {
		t.Fatal(err)
	}
	if err := l.Check(); err != nil {
		t.Fatalf("meaningful zeros refused: %v", err)
	}
	if l.Settings.SlowThreshold.D() != 0 || l.Source["slow_threshold"] != "--slow-threshold" {
		t.Fatalf("slow_threshold 0s became %q from %q", l.Settings.SlowThreshold, l.Source["slow_threshold"])
	}
	for _, key := range []string{"io_timeout", "send_timeout", "stage_ttl", "receive_ttl", "request_timeout", "max_conns", "arena_size", "max_body_bytes", "max_header_bytes"} {
		o, ok := lookup(key)
		if !ok {
			t.Fatalf("no option %s", key)
		}
		zero := "0"
		if _, ok := o.of(&Settings{}).(*Duration); ok {
			zero = "0s"
		}
		l, err := load(t, []string{"--config", os.DevNull, "--" + FlagName(key), zero}, env())
		if err == nil {
			err = l.Check()
		}
		if err == nil || !strings.Contains(err.Error(), "--"+FlagName(key)) {
			t.Errorf("%s = %s: got %v, want a refusal naming --%s", key, zero, err, FlagName(key))
		}
	}
}

// The affinity map: a table in the file, a list of device=NIC+NIC as a
// flag or variable, each checked, and printed back as a table.
func TestAffinityFromEachSource(t *testing.T) {
	file := writeFile(t, "max_conns = 3\n\n[affinity]\n\"cuda:0\" = [\"mlx5_0\", \"mlx5_1\"]\n\"cuda:3\" = [\"mlx5_2\"]\n")
	l, err := load(t, []string{"--config", file}, env())
	if err != nil {
		t.Fatal(err)
	}
	want := Affinity{"cuda:0": {"mlx5_0", "mlx5_1"}, "cuda:3": {"mlx5_2"}}
	if !reflect.DeepEqual(l.Settings.Affinity, want) || l.Source["affinity"] != "file" || l.Settings.MaxConns != 3 {
		t.Fatalf("file: %v from %q", l.Settings.Affinity, l.Source["affinity"])
	}
	out, err := l.TOML()
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(string(out), "[affinity]  # file\n'cuda:0' = ['mlx5_0', 'mlx5_1']  # file\n") {
		t.Errorf("printed config:\n%s", out)
	}
	again, err := load(t, []string{"--config", writeFile(t, string(out))}, env())
	if err != nil || !reflect.DeepEqual(again.Settings, l.Settings) {
		t.Fatalf("round trip: %v\n%+v", err, again)
	}
	l, err = load(t, []string{"--config", file, "--affinity", "cuda:1=mlx5_3"}, env("FERRY_AFFINITY", "cuda:2=mlx5_0+mlx5_1"))
	if err != nil || !reflect.DeepEqual(l.Settings.Affinity, Affinity{"cuda:1": {"mlx5_3"}}) {
		t.Fatalf("flag: %v %v", l.Settings.Affinity, err)
	}
	l, err = load(t, []string{"--config", os.DevNull}, env("FERRY_AFFINITY", "cuda:2=mlx5_0+mlx5_1"))
	if err != nil || !reflect.DeepEqual(l.Settings.Affinity, Affinity{"cuda:2": {"mlx5_0", "mlx5_1"}}) {
		t.Fatalf("variable: %v %v", l.Settings.Affinity, err)
	}
	for arg, msg := range map[string]string{
		"cuda:0":                      "maps a device to no NIC",
		"cuda:0=mlx5_0,cuda:0=mlx5_1": "cuda:0 is mapped twice",
		"cpu=mlx5_0":                  `"cpu" is not a GPU`,
		"cuda:0=mlx5_0+":              `cuda:0 maps to "", which is not an RDMA device name`,
	} {
		if _, err := load(t, []string{"--config", os.DevNull, "--affinity", arg}, env()); err == nil || !strings.Contains(err.Error(), msg) {
			t.Errorf("--affinity %s: %v, want %q", arg, err, msg)
		}
	}
}

// TestRDMADevices: rdma_device takes a TOML array, or a string of names
// as before (and as a flag or variable gives it); "all" stands alone,
// and no name twice.
func TestRDMADevices(t *testing.T) {
	for _, c := range []struct {
		name, file string
		args       []string
		want       string
		fail       string
	}{
		{"Array", `rdma_device = ["mlx5_0", "mlx5_1"]`, nil, "mlx5_0,mlx5_1", ""},
		{"String", `rdma_device = "mlx5_0"`, nil, "mlx5_0", ""},
		{"Flag", "", []string{"--rdma-device", "rxe0,rxe1"}, "rxe0,rxe1", ""},
		{"All", `rdma_device = "all"`, nil, "all", ""},
		{"AllAndMore", `rdma_device = ["all", "mlx5_0"]`, nil, "", `"all" takes every device`},
		{"Twice", "", []string{"--rdma-device", "rxe0,rxe0"}, "", `names "rxe0" twice`},
		{"NotAName", `rdma_device = ["mlx5_0", "m\u0083"]`, nil, "", `"m\u0083" is not an RDMA device name`},
	} {
		t.Run(c.name, func(t *testing.T) {
			args := c.args
			if c.file != "" {
				args = append(args, "--config", writeFile(t, c.file))
			}
			l, err := load(t, args, env())
			if c.fail != "" {
				if err == nil || !strings.Contains(err.Error(), c.fail) {
					t.Fatalf("got %v, want an error saying %s", err, c.fail)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if got := strings.Join(l.Settings.RDMADevice, ","); got != c.want {
				t.Fatalf("rdma_device %q, want %q", got, c.want)
			}
		})
	}
}
