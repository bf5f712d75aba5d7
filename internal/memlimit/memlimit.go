// Package memlimit reads the memory limit that this process's cgroup
// sets on it (systemd's MemoryMax=, a container's memory limit), which
// can be far below the host's physical memory.
package memlimit

import (
	"bufio"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
)

// Roots is where Read looks: the proc filesystem and the cgroup
// filesystem's mount point. Tests point it at a tree of their own.
type Roots struct {
	Proc, Cgroup string
}

// Host is this host's: cgroup v2 mounted at /sys/fs/cgroup, or cgroup
// v1's memory controller at /sys/fs/cgroup/memory (where systemd and
// container runtimes mount it; one mounted elsewhere is not looked for).
var Host = Roots{Proc: "/proc", Cgroup: "/sys/fs/cgroup"}

// Limit is the memory limit that binds this process: the least of its
// cgroup's and its ancestors', as a parent's limit binds its children.
type Limit struct {
	Bytes int64
	File  string // the file that sets it, e.g. .../system.slice/memory.max
}

// Read returns the memory limit of this process's cgroup, and false
// where none is set or none can be known (no cgroup filesystem, no
// memory controller, a cgroup not visible at its path): the host's
// memory is then all that bounds it. A limit file there but unreadable,
// or holding what is not a limit, is an error naming it.
func (r Roots) Read() (Limit, bool, error) {
	self := filepath.Join(r.Proc, "self", "cgroup")
	f, err := os.Open(self)
	if errors.Is(err, fs.ErrNotExist) {
		return Limit{}, false, nil
	}
	if err != nil {
		return Limit{}, false, err
	}
	defer f.Close()
	// A v1 memory controller takes memory from the v2 hierarchy (a hybrid
	// host shows both lines), so its line is the one that binds.
	var v1, v2 string
	s := bufio.NewScanner(f)
	for n := 1; s.Scan(); n++ {
		l := strings.SplitN(s.Text(), ":", 3)
		if len(l) != 3 || !strings.HasPrefix(l[2], "/") {
			return Limit{}, false, fmt.Errorf("%s line %d: %q is not hierarchy-ID:controllers:/path", self, n, s.Text())
		}
		switch {
		case l[0] == "0" && l[1] == "":
			v2 = l[2]
		case slices.Contains(strings.Split(l[1], ","), "memory"):
			v1 = l[2]
		}
	}
	if err := s.Err(); err != nil {
		return Limit{}, false, fmt.Errorf("%s: %w", self, err)
	}
	switch {
	case v1 != "":
		return lowest(filepath.Join(r.Cgroup, "memory"), v1, "memory.limit_in_bytes")
	case v2 != "":
		return lowest(r.Cgroup, v2, "memory.max")
	}
	return Limit{}, false, nil
}

// lowest walks from cgroup cg of the hierarchy mounted at mount up to
// its root and returns the least limit that file sets on the way. A
// level without the file sets none: the root cgroup has none, and a
// container may not see its ancestors.
func lowest(mount, cg, file string) (Limit, bool, error) {
	var low Limit
	// Cleaned as an absolute path, a cgroup outside this namespace
	// ("/../..") cannot lead the walk out of the mount.
	for dir := path.Clean(cg); ; dir = path.Dir(dir) {
		name := filepath.Join(mount, dir, file)
		b, err := os.ReadFile(name)
		switch {
		case errors.Is(err, fs.ErrNotExist):
		case err != nil:
			return Limit{}, false, err // names the file
		default:
			n, limited, err := parseLimit(strings.TrimSpace(string(b)))
			if err != nil {
				return Limit{}, false, fmt.Errorf("%s: %w", name, err)
			}
			if limited && (low.File == "" || n < low.Bytes) {
				low = Limit{Bytes: n, File: name}
			}
		}
		if dir == "/" {
			return low, low.File != "", nil
		}
	}
}

// parseLimit reads a limit file's content: bytes, or false for no
// limit, which v2 writes as "max" and v1 as the largest page count in
// bytes (9223372036854771712 with 4 KiB pages, less with larger ones;
// no host has 4 EiB, so anything from 1<<62 up is no limit).
func parseLimit(v string) (int64, bool, error) {
	if v == "max" {
		return 0, false, nil
	}
	n, err := strconv.ParseInt(v, 10, 64)
	if err != nil || n < 0 {
		return 0, false, fmt.Errorf("%q is not a memory limit (a byte count, or max)", v)
	}
	return n, n < 1<<62, nil
}

// Available is the memory the kernel estimates can be had without
// swapping: MemAvailable in meminfo.
func (r Roots) Available() (int64, error) {
	name := filepath.Join(r.Proc, "meminfo")
	b, err := os.ReadFile(name)
	if err != nil {
		return 0, err
	}
	for _, l := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(l, "MemAvailable:"); ok {
			kb, err := strconv.ParseInt(strings.TrimSpace(strings.TrimSuffix(strings.TrimSpace(v), "kB")), 10, 64)
			if err != nil {
				return 0, fmt.Errorf("%s: %q is not a count of kB", name, l)
			}
			return kb << 10, nil
		}
	}
	return 0, fmt.Errorf("%s has no MemAvailable line", name)
}
