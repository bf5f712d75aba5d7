package mooncake

import (
	"strings"
	"testing"
)

func TestGIDText(t *testing.T) {
	gid := [16]byte{10: 0xff, 11: 0xff, 12: 10, 13: 11, 14: 12, 15: 1}
	const want = "00:00:00:00:00:00:00:00:00:00:ff:ff:0a:0b:0c:01"
	if got := FormatGID(gid); got != want {
		t.Fatalf("FormatGID = %q, want %q", got, want)
	}
	back, err := ParseGID(want)
	if err != nil || back != gid {
		t.Fatalf("ParseGID(%q) = %x, %v; want %x", want, back, err, gid)
	}
	full := [16]byte{0xfe, 0x80, 15: 0xAB}
	if back, err := ParseGID(strings.ToUpper(FormatGID(full))); err != nil || back != full {
		t.Fatalf("upper-case round trip: %x, %v", back, err)
	}
	if back, err := ParseGID("0:0:0:0:0:0:0:0:0:0:ff:ff:a:b:c:1"); err != nil || back != gid {
		t.Fatalf("single-digit bytes: %x, %v", back, err)
	}
}

func TestGIDTextRejects(t *testing.T) {
	for _, s := range []string{
		"",
		"fe80::1", // IPv6 notation
		"00:00:00:00:00:00:00:00:00:00:ff:ff:0a:0b:0c",     // 15 bytes
		"00:00:00:00:00:00:00:00:00:00:ff:ff:0a:0b:0c:01:", // trailing
		"00:00:00:00:00:00:00:00:00:00:ff:ff:0a:0b:0c:100", // > 0xff
		"00:00:00:00:00:00:00:00:00:00:ff:ff:0a:0b:0c:zz",
		"00:00:00:00:00:00:00:00:00:00:ff:ff:0a:0b::01",
		"00:00:00:00:00:00:00:00:00:00:ff:ff:0a:0b:0c:+1",
	} {
		if _, err := ParseGID(s); err == nil {
			t.Errorf("ParseGID(%q) accepted it", s)
		} else if !strings.Contains(err.Error(), "GID") {
			t.Errorf("ParseGID(%q): error %q does not say what was wrong", s, err)
		}
	}
}

// FuzzParseGID: whatever ParseGID accepts formats back to the same bytes,
// and FormatGID's output always parses.
func FuzzParseGID(f *testing.F) {
	f.Add("00:00:00:00:00:00:00:00:00:00:ff:ff:0a:0b:0c:01")
	f.Add("FE:80:0:0:0:0:0:0:0:0:0:0:0:0:0:1")
	f.Add("fe80::1")
	f.Fuzz(func(t *testing.T, s string) {
		gid, err := ParseGID(s)
		if err != nil {
			return
		}
		again, err := ParseGID(FormatGID(gid))
		if err != nil || again != gid {
			t.Fatalf("%q → %x → %q → %x, %v", s, gid, FormatGID(gid), again, err)
		}
	})
}
