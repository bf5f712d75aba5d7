package size

import "testing"

func TestParse(t *testing.T) {
	for in, want := range map[string]int64{
		"4096": 4096, "64MiB": 64 << 20, "8GiB": 8 << 30, "1.5GB": 1.5e9,
		"16M": 16 << 20, "512 KiB": 512 << 10, "0": 0, "10B": 10,
	} {
		got, err := Parse(in)
		if err != nil || got != want {
			t.Errorf("Parse(%q) = %d, %v; want %d", in, got, err, want)
		}
	}
	for _, bad := range []string{"", "MiB", "-1", "12XB", "1e30GiB", "NaN"} {
		if _, err := Parse(bad); err == nil {
			t.Errorf("Parse(%q) succeeded; want an error", bad)
		}
	}
}

func TestFormat(t *testing.T) {
	for n, want := range map[int64]string{
		100: "100B", 131072: "128KiB", 1610612736: "1.5GiB", 64 << 20: "64MiB", 1000: "1000B",
	} {
		if got := Format(n); got != want {
			t.Errorf("Format(%d) = %q; want %q", n, got, want)
		}
	}
}
