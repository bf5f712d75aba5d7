package config

import (
	"bytes"
	"errors"
	"flag"
	"os"
	"regexp"
	"strings"
	"testing"
)

// The README's flag table and ferryd --help: every flag of the table is
// one --help lists, with the same default, and every setting's flag is in
// the table. A default cell in backquotes holds the value (one per flag of
// the row, or one for them all); a cell in words stands for no default.
func TestReadmeFlagTableMatchesHelp(t *testing.T) {
	readme, err := os.ReadFile("../README.md")
	if err != nil {
		t.Fatal(err)
	}
	help := helpDefaults(t)
	row := regexp.MustCompile("(?m)^\\| ((?:`--[a-z-]+`(?:, )?)+) \\| ([^|]*) \\|")
	quoted := regexp.MustCompile("`([^`]*)`")
	seen := map[string]bool{}
	for _, m := range row.FindAllStringSubmatch(string(readme), -1) {
		var flags []string
		for _, q := range quoted.FindAllStringSubmatch(m[1], -1) {
			flags = append(flags, strings.TrimPrefix(q[1], "--"))
		}
		var defs []string
		for _, q := range quoted.FindAllStringSubmatch(m[2], -1) {
			defs = append(defs, q[1])
		}
		if len(defs) != 0 && len(defs) != 1 && len(defs) != len(flags) {
			t.Errorf("README row %q: %d defaults for %d flags", m[0], len(defs), len(flags))
			continue
		}
		for i, f := range flags {
			seen[f] = true
			def, ok := help[f]
			if !ok {
				t.Errorf("README's flag table has --%s, which ferryd --help does not list", f)
				continue
			}
			want := ""
			switch len(defs) {
			case 1:
				want = defs[0]
			case len(flags):
				want = defs[i]
			}
			if def != want {
				t.Errorf("README says --%s defaults to %q; ferryd --help says %q", f, want, def)
			}
		}
	}
	for _, o := range options {
		if !seen[FlagName(o.key)] {
			t.Errorf("--%s is missing from README's flag table", FlagName(o.key))
		}
	}
}

// helpDefaults runs ferryd's --help (config.Load's usage) and returns each
// flag with the default it shows ("" for none).
func helpDefaults(t *testing.T) map[string]string {
	var out bytes.Buffer
	if _, err := Load([]string{"--help"}, env(), &out); !errors.Is(err, flag.ErrHelp) {
		t.Fatalf("--help: %v", err)
	}
	flagLine := regexp.MustCompile(`^  -([a-z-]+)`)
	defLine := regexp.MustCompile(`\(default "?([^)"]*)"?\)$`)
	got := map[string]string{}
	var cur string
	for _, line := range strings.Split(out.String(), "\n") {
		if m := flagLine.FindStringSubmatch(line); m != nil {
			cur = m[1]
			got[cur] = ""
		}
		if m := defLine.FindStringSubmatch(line); m != nil && cur != "" {
			got[cur] = m[1]
		}
	}
	if len(got) < len(options) {
		t.Fatalf("--help lists %d flags, fewer than the %d settings:\n%s", len(got), len(options), out.String())
	}
	return got
}
