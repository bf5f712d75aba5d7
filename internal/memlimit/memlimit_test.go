package memlimit

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// tree writes files (path: content; a path ending in / is a directory)
// under a new directory and returns roots within it: proc/ and cg/.
func tree(t *testing.T, files map[string]string) (Roots, string) {
	t.Helper()
	dir := t.TempDir()
	for name, content := range files {
		p := filepath.Join(dir, name)
		if strings.HasSuffix(name, "/") {
			if err := os.MkdirAll(p, 0o755); err != nil {
				t.Fatal(err)
			}
			continue
		}
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(p, []byte(content), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	return Roots{Proc: filepath.Join(dir, "proc"), Cgroup: filepath.Join(dir, "cg")}, dir
}

const (
	v2Service = "0::/system.slice/ferryd.service\n"
	v1Hybrid  = "9:name=systemd:/system.slice/ferryd.service\n4:memory:/system.slice/ferryd.service\n1:cpu,cpuacct:/\n0::/system.slice/ferryd.service\n"
	v1NoLimit = "9223372036854771712\n"
)

func TestRead(t *testing.T) {
	for _, c := range []struct {
		name  string
		files map[string]string
		bytes int64
		file  string // under the tree; "" for no limit
	}{
		{"v2 parent smaller", map[string]string{
			"proc/self/cgroup":                          v2Service,
			"cg/system.slice/ferryd.service/memory.max": "8589934592\n",
			"cg/system.slice/memory.max":                "4294967296\n",
		}, 4 << 30, "cg/system.slice/memory.max"},
		{"v2 own smaller", map[string]string{
			"proc/self/cgroup":                          v2Service,
			"cg/system.slice/ferryd.service/memory.max": "1073741824\n",
			"cg/system.slice/memory.max":                "4294967296\n",
		}, 1 << 30, "cg/system.slice/ferryd.service/memory.max"},
		{"v2 parent limits, own max", map[string]string{
			"proc/self/cgroup":                          v2Service,
			"cg/system.slice/ferryd.service/memory.max": "max\n",
			"cg/system.slice/memory.max":                "4294967296\n",
		}, 4 << 30, "cg/system.slice/memory.max"},
		{"v2 max everywhere", map[string]string{
			"proc/self/cgroup":                          v2Service,
			"cg/system.slice/ferryd.service/memory.max": "max\n",
			"cg/system.slice/memory.max":                "max\n",
		}, 0, ""},
		// In a container the cgroup fs is its own cgroup, mounted at the
		// root, while /proc/self/cgroup may still name the host's path.
		{"v2 container sees only its root", map[string]string{
			"proc/self/cgroup": "0::/docker/abc\n",
			"cg/memory.max":    "2147483648\n",
		}, 2 << 30, "cg/memory.max"},
		{"v2 path outside the namespace stays in the mount", map[string]string{
			"proc/self/cgroup": "0::/../x\n",
			"x/memory.max":     "1073741824\n",
			"cg/":              "",
		}, 0, ""},
		{"no /proc/self/cgroup", map[string]string{
			"cg/memory.max": "1073741824\n",
		}, 0, ""},
		{"no cgroup fs", map[string]string{
			"proc/self/cgroup": v2Service,
		}, 0, ""},
		{"no memory controller", map[string]string{
			"proc/self/cgroup":     "1:cpu:/\n9:name=systemd:/\n",
			"cg/memory/memory.max": "1073741824\n",
			"cg/memory.max":        "1073741824\n",
		}, 0, ""},
		{"v1 hybrid: the memory controller's hierarchy binds", map[string]string{
			"proc/self/cgroup": v1Hybrid,
			"cg/memory/system.slice/ferryd.service/memory.limit_in_bytes": "2147483648\n",
			"cg/memory/system.slice/memory.limit_in_bytes":                v1NoLimit,
			"cg/memory/memory.limit_in_bytes":                             v1NoLimit,
			"cg/system.slice/ferryd.service/memory.max":                   "1073741824\n",
		}, 2 << 30, "cg/memory/system.slice/ferryd.service/memory.limit_in_bytes"},
		{"v1 parent smaller", map[string]string{
			"proc/self/cgroup": v1Hybrid,
			"cg/memory/system.slice/ferryd.service/memory.limit_in_bytes": "2147483648\n",
			"cg/memory/system.slice/memory.limit_in_bytes":                "1073741824\n",
		}, 1 << 30, "cg/memory/system.slice/memory.limit_in_bytes"},
		{"v1 no limit (64 KiB pages)", map[string]string{
			"proc/self/cgroup":                  "4:memory:/a\n",
			"cg/memory/a/memory.limit_in_bytes": "9223372036854710272\n",
			"cg/memory/memory.limit_in_bytes":   v1NoLimit,
		}, 0, ""},
	} {
		t.Run(c.name, func(t *testing.T) {
			roots, dir := tree(t, c.files)
			l, ok, err := roots.Read()
			if err != nil {
				t.Fatal(err)
			}
			want := Limit{}
			if c.file != "" {
				want = Limit{Bytes: c.bytes, File: filepath.Join(dir, c.file)}
			}
			if ok != (c.file != "") || l != want {
				t.Fatalf("Read() = %+v, %v; want %+v, %v", l, ok, want, c.file != "")
			}
		})
	}
}

// What is there but not a limit is an error naming the file and what
// it holds, not a limit guessed.
func TestReadErrors(t *testing.T) {
	for _, c := range []struct {
		name  string
		files map[string]string
		want  []string
	}{
		{"garbage in memory.max", map[string]string{
			"proc/self/cgroup":           v2Service,
			"cg/system.slice/memory.max": "lots\n",
		}, []string{"cg/system.slice/memory.max", `"lots"`}},
		{"negative limit", map[string]string{
			"proc/self/cgroup":                "4:memory:/\n",
			"cg/memory/memory.limit_in_bytes": "-1\n",
		}, []string{"cg/memory/memory.limit_in_bytes", `"-1"`}},
		{"unreadable memory.max", map[string]string{
			"proc/self/cgroup":                           v2Service,
			"cg/system.slice/ferryd.service/memory.max/": "",
		}, []string{"cg/system.slice/ferryd.service/memory.max"}},
		{"garbage in /proc/self/cgroup", map[string]string{
			"proc/self/cgroup": v2Service + "memory\n",
		}, []string{"proc/self/cgroup line 2", `"memory"`}},
	} {
		t.Run(c.name, func(t *testing.T) {
			roots, _ := tree(t, c.files)
			l, ok, err := roots.Read()
			if err == nil {
				t.Fatalf("Read() = %+v, %v; want an error", l, ok)
			}
			for _, w := range c.want {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("error %q does not say %q", err, w)
				}
			}
		})
	}
}

// This host's, whatever it is, reads without error.
func TestReadHost(t *testing.T) {
	l, ok, err := Host.Read()
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("this host: %+v, limited: %v", l, ok)
}
