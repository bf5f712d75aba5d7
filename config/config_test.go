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

	"github.com/rs/zerolog"
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
		if c, ok := v.(choice); ok {
			p = reflect.ValueOf(c.p)
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
	cfg := l.Settings.Daemon(zerolog.Nop())
	if cfg.SlowThreshold != 5*time.Millisecond || cfg.ArenaSize != 2<<30 || cfg.MaxConns != 4 || cfg.SendTimeout != time.Minute {
		t.Fatalf("daemon config %+v", cfg)
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
		{"bad choice", "log_format = \"xml\"\n", []string{"line 1", "log_format", "json, console"}},
		{"negative uid", "allow_gids = [5, -1]\n", []string{"line 1", "allow_gids", "negative"}},
		{"syntax", "listen = \"unterminated\n", []string{"line 1", "not valid TOML"}},
		{"two errors", "io_timeout = \"soon\"\nreceive_ttl = \"later\"\n", []string{"line 1: io_timeout", "line 2: receive_ttl"}},
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
