package e2e

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

func TestConfigErrorsStopFerrydNamingTheKey(t *testing.T) {
	dir := t.TempDir()
	ctx := ctxT(t) // a ferryd that wrongly starts is killed, not waited for
	ferryd := func(args ...string) *exec.Cmd { return exec.CommandContext(ctx, filepath.Join(bin, "ferryd"), args...) }
	cases := []struct {
		name, body string
		names      []string
	}{
		{"unknown key", "listen = \"127.0.0.1:0\"\narena_sise = \"64MiB\"\n", []string{`"arena_sise"`, "line 2", `did you mean "arena_size"`}},
		{"a table", "[peer]\nlisten = \"127.0.0.1:0\"\n", []string{`"peer"`, "line 1"}},
		{"wrong type", "max_conns = \"eight\"\n", []string{"max_conns", "line 1", "integer"}},
		{"duration without unit", "\ndrain_timeout = 30\n", []string{"drain_timeout", "line 2", "duration"}},
		{"bad size", "arena_size = \"lots\"\n", []string{"arena_size", "line 1", `"lots"`}},
		{"bad duration", "slow_threshold = \"fast\"\n", []string{"slow_threshold", "line 1", `"fast"`}},
		{"bad log level", "log_level = \"loud\"\n", []string{"log_level", "loud"}},
		{"bad uid", "allow_uids = [-1]\n", []string{"allow_uids", "line 1"}},
		{"not TOML", "listen = \n", []string{"line 1", "not valid TOML"}},
	}
	for _, c := range cases {
		conf := filepath.Join(dir, strings.ReplaceAll(c.name, " ", "-")+".toml")
		if err := os.WriteFile(conf, []byte(c.body), 0o644); err != nil {
			t.Fatal(err)
		}
		sock := filepath.Join(dir, "never.sock")
		out, err := ferryd("--config", conf, "--socket", sock).CombinedOutput()
		if err == nil {
			t.Errorf("%s: ferryd started with %q", c.name, c.body)
			continue
		}
		// A status of its own, which ferryd.service names in
		// RestartPreventExitStatus=: systemd does not restart it.
		if code := exitCode(err); code != 78 {
			t.Errorf("%s: ferryd exited %d, want 78 (EX_CONFIG, a configuration error): %v", c.name, code, err)
		}
		for _, n := range append(c.names, conf) {
			if !strings.Contains(string(out), n) {
				t.Errorf("%s: the error does not name %s:\n%s", c.name, n, out)
			}
		}
		if _, err := os.Lstat(sock); err == nil {
			t.Errorf("%s: ferryd created its socket before rejecting the configuration", c.name)
		}
		// --check-config says the same, without starting anything.
		if out, err := ferryd("--config", conf, "--check-config").CombinedOutput(); exitCode(err) != 78 {
			t.Errorf("%s: --check-config: %v, want exit status 78:\n%s", c.name, err, out)
		}
	}

	// A bad value in a variable or a flag is named as such.
	cmd := ferryd("--check-config")
	cmd.Env = append(os.Environ(), "FERRY_CONFIG="+os.DevNull, "FERRY_SEND_TIMEOUT=soon")
	if out, err := cmd.CombinedOutput(); exitCode(err) != 78 || !strings.Contains(string(out), "FERRY_SEND_TIMEOUT") {
		t.Errorf("bad FERRY_SEND_TIMEOUT: err=%v\n%s", err, out)
	}
	out, err := ferryd("--config", os.DevNull, "--arena-size", "big", "--check-config").CombinedOutput()
	if exitCode(err) != 78 || !strings.Contains(string(out), "arena-size") {
		t.Errorf("bad --arena-size: err=%v\n%s", err, out)
	}
}

func TestConfigPrecedenceFlagsEnvFileDefaults(t *testing.T) {
	dir := t.TempDir()
	conf := filepath.Join(dir, "ferryd.toml")
	body := "slow_threshold = \"1h\"\nsend_retries = 2\nstage_ttl = \"7m\"\n"
	if err := os.WriteFile(conf, []byte(body), 0o644); err != nil {
		t.Fatal(err)
	}
	// The file sets three keys; a variable overrides two, a flag one.
	d := startDaemonWith(t, launch{env: []string{"FERRY_SEND_RETRIES=3", "FERRY_SLOW_THRESHOLD=2s"}}, dir, "prec",
		"--config", conf, "--slow-threshold", "5ms")
	st, err := d.c.Status(ctxT(t))
	if err != nil {
		t.Fatal(err)
	}
	s := st.Settings
	if s.SlowThreshold != "5ms" || s.SendRetries != 3 || s.StageTTL != "7m" || s.ReceiveTTL != "10m" {
		t.Fatalf("want slow_threshold 5ms (flag), send_retries 3 (env), stage_ttl 7m (file), receive_ttl 10m (default); got %+v", s)
	}

	// --print-config shows the same, with where each value came from, and
	// is itself a configuration ferryd accepts.
	cmd := exec.Command(filepath.Join(bin, "ferryd"), "--config", conf, "--slow-threshold", "5ms", "--print-config")
	cmd.Env = append(os.Environ(), "FERRY_SEND_RETRIES=3", "FERRY_SLOW_THRESHOLD=2s")
	printed, err := cmd.Output()
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{
		"slow_threshold = '5ms'  # --slow-threshold", "send_retries = 3  # FERRY_SEND_RETRIES",
		"stage_ttl = '7m'  # file", "receive_ttl = '10m'  # default",
	} {
		if !strings.Contains(string(printed), want+"\n") {
			t.Errorf("--print-config lacks %q:\n%s", want, printed)
		}
	}
	again := filepath.Join(dir, "printed.toml")
	if err := os.WriteFile(again, printed, 0o644); err != nil {
		t.Fatal(err)
	}
	if out, err := exec.Command(filepath.Join(bin, "ferryd"), "--config", again, "--check-config").CombinedOutput(); err != nil {
		t.Fatalf("--print-config output is not a valid configuration: %v\n%s", err, out)
	}
}

// --slow-threshold 0s is honoured, not taken as "unset": every send logs
// its slow-transfer line, and --print-config says the flag set it.
func TestSlowThresholdZeroLogsEverySend(t *testing.T) {
	snd, rcv := pair(t, "--slow-threshold", "0s")
	const sends = 3
	for i := range sends {
		id := fmt.Sprintf("slow0-%d", i)
		stageOn(t, snd, id, 4096, uint64(i))
		if _, err := snd.c.Send(ctxT(t), id, slotFor(t, rcv, id, 4096)); err != nil {
			t.Fatal(err)
		}
		snd.log.wait(t, 5*time.Second, "the slow-transfer line of "+id, func(m map[string]any) bool {
			return m["message"] == "slow transfer" && m["req_id"] == id
		})
	}
	n := 0
	for _, m := range snd.log.snapshot() {
		if m["message"] == "slow transfer" {
			n++
		}
	}
	if n != sends {
		t.Fatalf("%d slow-transfer lines for %d sends", n, sends)
	}
	out, err := exec.Command(filepath.Join(bin, "ferryd"), "--config", os.DevNull, "--slow-threshold", "0s", "--print-config").Output()
	if err != nil || !strings.Contains(string(out), "slow_threshold = '0s'  # --slow-threshold\n") {
		t.Fatalf("--print-config: %v\n%s", err, out)
	}
}

// --help on every binary and every command its usage lists prints that
// usage and exits 0.
func TestHelpExitsZero(t *testing.T) {
	run := func(args ...string) string {
		t.Helper()
		cmd := exec.CommandContext(ctxT(t), filepath.Join(bin, args[0]), args[1:]...)
		out, err := cmd.CombinedOutput()
		if err != nil || len(out) == 0 {
			t.Errorf("%s: exit %v, %d bytes of usage:\n%s", strings.Join(args, " "), err, len(out), out)
		}
		return string(out)
	}
	run("ferryd", "--help")
	for _, tool := range []string{"ferryctl", "ferrybench"} {
		usage := run(tool, "--help")
		_, cmds, ok := strings.Cut(usage, "Commands:\n")
		if !ok {
			t.Fatalf("%s --help lists no commands:\n%s", tool, usage)
		}
		n := 0
		for _, line := range strings.Split(cmds, "\n") {
			f := strings.Fields(line)
			if !strings.HasPrefix(line, "  ") || strings.HasPrefix(line, "   ") || len(f) == 0 {
				continue
			}
			run(tool, f[0], "--help")
			n++
		}
		if n < 2 {
			t.Errorf("%s --help: found %d commands in\n%s", tool, n, cmds)
		}
	}
}
