package config

import (
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"

	"github.com/pelletier/go-toml/v2"
)

// Device is the device setting: the memory ferryd keeps an arena in, one
// arena per device listed. Its text is one device or several joined by
// commas, a GPU list sharing its prefix: auto, cpu, cuda:0, cuda:0,1,3,
// cuda:all, cuda:0,cpu. In the file it may also be a TOML list
// (["cuda:0", "cuda:1"]).
type Device string

const (
	DeviceAuto Device = "auto" // cuda:0 when the CUDA driver and a GPU are there, else cpu
	DeviceCPU  Device = "cpu"
	// DeviceAllGPUs is every GPU the CUDA driver lists, cuda:0 onwards.
	DeviceAllGPUs Device = "cuda:all"
)

const deviceChoices = "use auto (a GPU when there is one, else host memory), cpu, cuda:N (e.g. cuda:0), several joined by commas (cuda:0,1,3 or cuda:0,cpu), or cuda:all"

// List reads the setting into its devices, in order, each one of auto,
// cpu, cuda:all or cuda:N; a device listed twice, or auto beside others,
// is an error.
func (d Device) List() ([]Device, error) {
	var out []Device
	gpus := false // a bare ordinal continues a cuda: list
	for _, f := range strings.Split(string(d), ",") {
		item := Device(strings.TrimSpace(f))
		if _, err := strconv.Atoi(string(item)); err == nil && gpus {
			item = "cuda:" + item
		}
		if _, err := item.Ordinal(); err != nil && item != DeviceAllGPUs {
			return nil, fmt.Errorf("%q is not a device: %s", item, deviceChoices)
		}
		gpus = strings.HasPrefix(string(item), "cuda:")
		if slices.Contains(out, item) || item == DeviceAllGPUs && slices.ContainsFunc(out, isGPU) || isGPU(item) && slices.Contains(out, DeviceAllGPUs) {
			return nil, fmt.Errorf("%s is listed twice: name each device once", item)
		}
		out = append(out, item)
	}
	if len(out) > 1 && slices.Contains(out, DeviceAuto) {
		return nil, errors.New("auto picks the one device itself: list the devices instead (e.g. cuda:0,1 or cuda:all)")
	}
	return out, nil
}

func isGPU(d Device) bool { return strings.HasPrefix(string(d), "cuda:") }

// Ordinal reads one device: -1 for cpu and auto, N for cuda:N.
func (d Device) Ordinal() (int, error) {
	switch d {
	case DeviceAuto, DeviceCPU:
		return -1, nil
	}
	if n, ok := strings.CutPrefix(string(d), "cuda:"); ok && n != "" && strings.Trim(n, "0123456789") == "" {
		if i, err := strconv.Atoi(n); err == nil {
			return i, nil
		}
	}
	return -1, errors.New("is not a device: " + deviceChoices)
}

// UnmarshalTOML takes a device or a TOML list of them.
func (d *Device) UnmarshalTOML(data []byte) error {
	s, err := stringOrList("device", data)
	*d = Device(s)
	return err
}

// Sizes is arena_size: one size for every device's arena, or one per
// device in --device's order, joined by commas (a TOML list in the file).
type Sizes string

func (z *Sizes) Set(s string) error {
	parts := strings.Split(s, ",")
	for i, p := range parts {
		var one Size
		if err := one.Set(p); err != nil {
			return err
		}
		parts[i] = string(one)
	}
	*z = Sizes(strings.Join(parts, ","))
	return nil
}
func (z *Sizes) String() string { return string(*z) }
func (z *Sizes) want() string {
	return `a size in quotes, e.g. "64MiB" or "8GiB", or a list of them, one per device, e.g. ["8GiB", "4GiB"]`
}

// UnmarshalTOML takes a size or a TOML list of them.
func (z *Sizes) UnmarshalTOML(data []byte) error {
	s, err := stringOrList("arena_size", data)
	*z = Sizes(s)
	return err
}

// List is each size given; a Sizes that came through Set always parses.
func (z Sizes) List() []Size {
	var out []Size
	for _, p := range strings.Split(string(z), ",") {
		out = append(out, Size(strings.TrimSpace(p)))
	}
	return out
}

// For is the size of the arena of the i-th device: the one size given,
// or the i-th of the list.
func (z Sizes) For(i int) Size {
	l := z.List()
	if len(l) == 1 {
		return l[0]
	}
	return l[i]
}

// Bytes is the first device's arena size: a single arena's.
func (z Sizes) Bytes() int64 { return z.For(0).Bytes() }

// Max is the largest arena's size, the largest write one can take.
func (z Sizes) Max() int64 {
	var n int64
	for _, s := range z.List() {
		n = max(n, s.Bytes())
	}
	return n
}

// checkArenaSizes checks each size, and that there is one size for all
// or one per device (cuda:all's devices are counted at start).
func checkArenaSizes(s *Settings) error {
	for _, z := range s.ArenaSize.List() {
		if v := z.Bytes(); v < ArenaAlign || v > 1<<50 {
			return fmt.Errorf("%s is outside 256B..1PiB", z)
		}
	}
	devs, err := s.Device.List()
	if n := len(s.ArenaSize.List()); err == nil && n > 1 && n != len(devs) && !slices.Contains(devs, DeviceAllGPUs) {
		return fmt.Errorf("lists %d sizes for the %d devices of device %q: give one size for every arena, or one per device", n, len(devs), s.Device)
	}
	return nil
}

// listError is a value of key that is neither a string nor a list of
// strings; the file's reader names its line.
type listError struct {
	key string
	err error
}

func (e *listError) Error() string { return e.key + ": " + e.err.Error() }

// stringOrList reads key's value: a TOML string, or a list of strings
// joined by commas; their values are checked as a flag's are, by Set.
func stringOrList(key string, data []byte) (string, error) {
	s, err := readStringOrList(data)
	if err != nil {
		return "", &listError{key, err}
	}
	return s, nil
}

func readStringOrList(data []byte) (string, error) {
	var v struct{ V any }
	if err := toml.Unmarshal(append([]byte("V = "), data...), &v); err != nil {
		return "", err
	}
	switch x := v.V.(type) {
	case string:
		return x, nil
	case []any:
		parts := make([]string, len(x))
		for i, e := range x {
			s, ok := e.(string)
			if !ok {
				return "", fmt.Errorf("the list holds %v, which is not a string in quotes", e)
			}
			parts[i] = s
		}
		return strings.Join(parts, ","), nil
	}
	return "", fmt.Errorf("%v is neither a string in quotes nor a list of them", v.V)
}
