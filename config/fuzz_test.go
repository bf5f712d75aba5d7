package config

import (
	"io"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"
)

// noEnv is an environment without FERRY_* variables; FERRY_CONFIG names
// an empty file so that the host's /etc/ferry/ferryd.toml stays out.
func noEnv(k string) (string, bool) { return os.DevNull, k == "FERRY_CONFIG" }

// reload writes l's --print-config output to a file and loads that file:
// it must give the same settings back.
func reload(t *testing.T, l *Loaded, dir string) {
	t.Helper()
	out, err := l.TOML()
	if err != nil {
		t.Fatalf("printing loaded settings %+v: %v", l.Settings, err)
	}
	p := filepath.Join(dir, "printed.toml")
	if err := os.WriteFile(p, out, 0o600); err != nil {
		t.Fatal(err)
	}
	again, err := Load([]string{"--config", p}, noEnv, io.Discard)
	if err != nil {
		t.Fatalf("the printed configuration does not load: %v\n%s", err, out)
	}
	if !reflect.DeepEqual(again.Settings, l.Settings) {
		t.Fatalf("the printed configuration loads as\n%+v\nnot\n%+v\n%s", again.Settings, l.Settings, out)
	}
}

// FuzzConfigFile loads arbitrary bytes as the TOML file. An error names
// the file; what loads prints (--print-config) as a file that loads to
// the same settings. Seeds: testdata/fuzz/FuzzConfigFile.
func FuzzConfigFile(f *testing.F) {
	dir := f.TempDir()
	f.Fuzz(func(t *testing.T, data []byte) {
		p := filepath.Join(dir, "ferryd.toml")
		if err := os.WriteFile(p, data, 0o600); err != nil {
			t.Fatal(err)
		}
		l, err := Load([]string{"--config", p}, noEnv, io.Discard)
		if err != nil {
			if !strings.Contains(err.Error(), p) {
				t.Fatalf("error does not name the file %s: %v", p, err)
			}
			return
		}
		reload(t, l, dir)
	})
}

// FuzzConfigSetting gives one setting an arbitrary value, as a FERRY_*
// variable and as a flag. Both must agree: the same error (naming the
// variable or flag), or the same settings, which print and load back the
// same. Seeds: testdata/fuzz/FuzzConfigSetting (which picks the setting by
// its index in options).
func FuzzConfigSetting(f *testing.F) {
	dir := f.TempDir()
	f.Fuzz(func(t *testing.T, which uint8, value string) {
		key := options[int(which)%len(options)].key
		fromEnv, envErr := Load(nil, func(k string) (string, bool) {
			if k == EnvName(key) {
				return value, true
			}
			return noEnv(k)
		}, io.Discard)
		fromFlag, flagErr := Load([]string{"--" + FlagName(key) + "=" + value}, noEnv, io.Discard)
		if (envErr == nil) != (flagErr == nil) {
			t.Fatalf("%s=%q: as a variable %v, as a flag %v", key, value, envErr, flagErr)
		}
		if envErr != nil {
			if !strings.Contains(envErr.Error(), EnvName(key)) || !strings.Contains(flagErr.Error(), FlagName(key)) {
				t.Fatalf("%s=%q: errors do not name the variable or the flag: %v; %v", key, value, envErr, flagErr)
			}
			return
		}
		if !reflect.DeepEqual(fromEnv.Settings, fromFlag.Settings) {
			t.Fatalf("%s=%q: as a variable %+v, as a flag %+v", key, value, fromEnv.Settings, fromFlag.Settings)
		}
		reload(t, fromEnv, dir)
	})
}
