package config

import (
	"fmt"
	"maps"
	"net/netip"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/ferry-project/ferry/internal/size"
)

// value is one setting as flags, FERRY_* variables and the file's
// validation see it: Set checks and stores the text, String gives it back
// so that Set(String()) holds, and want says what a good value looks like.
type value interface {
	Set(string) error
	String() string
	want() string
}

// text is a string setting. It must be valid UTF-8, as a TOML file's
// strings are: otherwise --print-config would write a different value.
type text string

func (t *text) Set(s string) error {
	if !utf8.ValidString(s) {
		return fmt.Errorf("%q is not valid UTF-8: give a value a configuration file can hold", s)
	}
	*t = text(s)
	return nil
}
func (t *text) String() string { return string(*t) }
func (t *text) want() string   { return `a string in quotes` }

// choice is a setting of a string type with a fixed set of values.
type choice[T ~string] struct {
	p  *T
	of []T
}

func (c choice[T]) Set(s string) error {
	if !slices.Contains(c.of, T(s)) {
		return fmt.Errorf("%q is not one of %s", s, c.list())
	}
	*c.p = T(s)
	return nil
}
func (c choice[T]) String() string { return string(*c.p) }
func (c choice[T]) want() string   { return "one of " + c.list() + ", in quotes" }
func (c choice[T]) field() any     { return c.p }

func (c choice[T]) list() string {
	out := make([]string, len(c.of))
	for i, v := range c.of {
		out[i] = string(v)
	}
	return strings.Join(out, ", ")
}

// fielder is a value that is not itself the field it sets: the test that
// every field has one option asks it for the field.
type fielder interface{ field() any }

// number is an integer setting.
type number int

func (n *number) Set(s string) error {
	v, err := strconv.Atoi(strings.TrimSpace(s))
	if err != nil {
		return fmt.Errorf("%q is not an integer", s)
	}
	*n = number(v)
	return nil
}
func (n *number) String() string { return strconv.Itoa(int(*n)) }
func (n *number) want() string   { return "an integer" }

// Duration is a duration as written ("200ms", "30s", "10m"). The file
// holds it as a TOML string, so a bare number (no unit) is refused where
// it is written rather than read as nanoseconds.
type Duration string

func (d *Duration) Set(s string) error {
	v, err := time.ParseDuration(strings.TrimSpace(s))
	if err != nil {
		return fmt.Errorf("%q is not a duration: write a number with a unit, e.g. \"200ms\", \"30s\" or \"10m\"", s)
	}
	if v < 0 {
		return fmt.Errorf("%q is negative", s)
	}
	*d = Duration(strings.TrimSpace(s))
	return nil
}
func (d *Duration) String() string { return string(*d) }
func (d *Duration) want() string   { return `a duration in quotes, e.g. "200ms", "30s" or "10m"` }

// D is the duration; a Duration that came through Set always parses.
func (d Duration) D() time.Duration {
	v, _ := time.ParseDuration(string(d))
	return v
}

// Size is a byte count as written ("64MiB", "8GiB", "4096"), a TOML
// string for the same reason as Duration.
type Size string

func (z *Size) Set(s string) error {
	if _, err := size.Parse(s); err != nil {
		return err
	}
	*z = Size(strings.TrimSpace(s))
	return nil
}
func (z *Size) String() string { return string(*z) }
func (z *Size) want() string   { return `a size in quotes, e.g. "64MiB", "8GiB" or "4096"` }

// Bytes is the byte count; a Size that came through Set always parses.
func (z Size) Bytes() int64 {
	n, _ := size.Parse(string(z))
	return n
}

// Share is a byte count as a Size writes it, or a share ("75%") of
// what its setting says (the memory the host lets ferryd have, the
// first arena), a TOML string.
type Share string

func (h *Share) Set(s string) error {
	t := strings.TrimSpace(s)
	if pct, ok := strings.CutSuffix(t, "%"); ok {
		if v, err := strconv.ParseFloat(strings.TrimSpace(pct), 64); err != nil || !(v > 0 && v <= 100) {
			return fmt.Errorf("%q is not a share of memory: write a percentage above 0 and at most 100, e.g. \"75%%\", or a size, e.g. \"512GiB\"", s)
		}
	} else if _, err := size.Parse(t); err != nil {
		return fmt.Errorf("%q is neither a size (e.g. \"512GiB\") nor a share (e.g. \"75%%\")", s)
	}
	*h = Share(t)
	return nil
}
func (h *Share) String() string { return string(*h) }
func (h *Share) want() string {
	return `a size or a share in quotes, e.g. "512GiB" or "75%"`
}

// Bytes is the byte count where a share is of memory bytes; a Share
// that came through Set always parses.
func (h Share) Bytes(memory int64) int64 {
	if pct, ok := strings.CutSuffix(string(h), "%"); ok {
		v, _ := strconv.ParseFloat(strings.TrimSpace(pct), 64)
		return int64(float64(memory) * v / 100)
	}
	n, _ := size.Parse(string(h))
	return n
}

// ids is a list of numeric user or group ids: a TOML array, or
// comma-separated as a flag or variable.
type ids []uint32

func (l *ids) Set(s string) error {
	out := ids{}
	for _, f := range strings.FieldsFunc(s, func(r rune) bool { return r == ',' || r == ' ' }) {
		v, err := strconv.ParseUint(f, 10, 32)
		if err != nil {
			return fmt.Errorf("%q is not a numeric id", f)
		}
		out = append(out, uint32(v))
	}
	*l = out
	return nil
}

func (l *ids) String() string {
	parts := make([]string, len(*l))
	for i, v := range *l {
		parts[i] = strconv.FormatUint(uint64(v), 10)
	}
	return strings.Join(parts, ",")
}
func (l *ids) want() string { return "a list of numeric ids, e.g. [1000, 1001]" }

// prefixes is a list of IP addresses and CIDR prefixes: a TOML array of
// strings, or comma-separated as a flag or variable.
type prefixes []string

func (l *prefixes) Set(s string) error {
	out := prefixes{}
	for _, f := range strings.FieldsFunc(s, func(r rune) bool { return r == ',' || r == ' ' }) {
		if _, err := ParsePrefix(f); err != nil {
			return err
		}
		out = append(out, f)
	}
	*l = out
	return nil
}

func (l *prefixes) String() string { return strings.Join(*l, ",") }
func (l *prefixes) want() string {
	return `a list of IP addresses or CIDR prefixes, e.g. ["10.0.0.0/24", "10.0.1.7"]`
}

// ParsePrefix reads an IP address (a prefix of its full length) or a
// CIDR prefix.
func ParsePrefix(s string) (netip.Prefix, error) {
	if p, err := netip.ParsePrefix(s); err == nil {
		return p.Masked(), nil
	}
	a, err := netip.ParseAddr(s)
	if err != nil {
		return netip.Prefix{}, fmt.Errorf("%q is neither an IP address nor a CIDR prefix (e.g. 10.0.1.7 or 10.0.0.0/24)", s)
	}
	return netip.PrefixFrom(a, a.BitLen()), nil
}

// Affinity maps a GPU ("cuda:N") to the RDMA NICs its memory goes out
// through, in order, over what the PCIe topology says (package topology):
// a TOML table ([affinity] then "cuda:0" = ["mlx5_0"]), or
// "cuda:0=mlx5_0+mlx5_1,cuda:1=mlx5_2" as a flag or variable.
type Affinity map[string][]string

var (
	affinityDevice = regexp.MustCompile(`^cuda:[0-9]+$`)
	nicName        = regexp.MustCompile(`^[A-Za-z0-9_.-]+$`)
)

func (a *Affinity) Set(s string) error {
	out := Affinity{}
	for _, f := range strings.FieldsFunc(s, func(r rune) bool { return r == ',' }) {
		dev, list, ok := strings.Cut(strings.TrimSpace(f), "=")
		if !ok || list == "" {
			return fmt.Errorf("%q maps a device to no NIC: write cuda:N=NIC, several NICs joined by +, e.g. cuda:0=mlx5_0+mlx5_1", f)
		}
		if err := addAffinity(out, dev, strings.Split(list, "+")); err != nil {
			return err
		}
	}
	*a = out
	return nil
}

// add checks one mapping and puts it in out.
func addAffinity(out Affinity, dev string, nics []string) error {
	if !affinityDevice.MatchString(dev) {
		return fmt.Errorf("%q is not a GPU: affinity maps cuda:N devices to NICs", dev)
	}
	if _, dup := out[dev]; dup {
		return fmt.Errorf("%s is mapped twice", dev)
	}
	if len(nics) == 0 {
		return fmt.Errorf("%s maps to no NIC: name at least one, e.g. mlx5_0", dev)
	}
	for _, n := range nics {
		if !nicName.MatchString(n) {
			return fmt.Errorf("%s maps to %q, which is not an RDMA device name (e.g. mlx5_0)", dev, n)
		}
	}
	out[dev] = slices.Clone(nics)
	return nil
}

func (a *Affinity) String() string {
	parts := make([]string, 0, len(*a))
	for _, dev := range slices.Sorted(maps.Keys(*a)) {
		parts = append(parts, dev+"="+strings.Join((*a)[dev], "+"))
	}
	return strings.Join(parts, ",")
}
func (a *Affinity) want() string {
	return `a table of devices and NIC lists, e.g. [affinity] then "cuda:0" = ["mlx5_0"]`
}

// Names is a list of device names: a TOML array of strings, or a string
// of names separated by commas, as a flag or a variable gives it (and as
// rdma_device was written when it took one device).
type Names []string

// UnmarshalText reads the string form, for a TOML file.
func (n *Names) UnmarshalText(b []byte) error { return (*names)(n).Set(string(b)) }

// names is the value of a Names setting: "all" alone, or distinct names.
type names Names

func (l *names) Set(s string) error {
	out := names{}
	seen := map[string]bool{}
	for _, f := range strings.FieldsFunc(s, func(r rune) bool { return r == ',' || r == ' ' }) {
		if seen[f] {
			return fmt.Errorf("names %q twice: name each device once", f)
		}
		if !nicName.MatchString(f) {
			return fmt.Errorf("%q is not an RDMA device name (letters, digits, _ . -; e.g. mlx5_0): ibv_devices lists this host's", f)
		}
		seen[f] = true
		out = append(out, f)
	}
	if seen["all"] && len(out) > 1 {
		return fmt.Errorf("%q: \"all\" takes every device, so it stands alone", s)
	}
	*l = out
	return nil
}

func (l *names) String() string { return strings.Join(*l, ",") }
func (l *names) want() string {
	return `a list of device names, e.g. ["mlx5_0", "mlx5_1"], or "all"`
}
