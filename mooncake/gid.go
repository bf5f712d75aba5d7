package mooncake

import (
	"fmt"
	"strconv"
	"strings"
)

// GIDs travel in descriptors (devices[].gid) and connection handshakes
// (local_gid) as Mooncake's RdmaContext::gid() prints them: the 16 raw
// bytes, each as two lowercase hex digits, joined by ':' (47 characters,
// e.g. 00:00:00:00:00:00:00:00:00:00:ff:ff:0a:0b:0c:01). It is not IPv6
// notation: every byte is written, none is elided.

// FormatGID writes gid in Mooncake's text form.
func FormatGID(gid [16]byte) string {
	var b strings.Builder
	b.Grow(47)
	for i, x := range gid {
		if i > 0 {
			b.WriteByte(':')
		}
		const hex = "0123456789abcdef"
		b.WriteByte(hex[x>>4])
		b.WriteByte(hex[x&15])
	}
	return b.String()
}

// ParseGID reads Mooncake's text form as its strictest reader does:
// exactly 16 ':'-separated hex bytes and nothing else. Upper-case digits
// and single-digit bytes are accepted, as Mooncake's parser accepts them.
func ParseGID(s string) ([16]byte, error) {
	var gid [16]byte
	parts := strings.Split(s, ":")
	if len(parts) != 16 {
		return gid, fmt.Errorf("GID %q has %d ':'-separated fields, want 16 hex bytes (Mooncake's form, e.g. 00:00:00:00:00:00:00:00:00:00:ff:ff:0a:0b:0c:01)", s, len(parts))
	}
	for i, p := range parts {
		v, err := strconv.ParseUint(p, 16, 8)
		if err != nil || len(p) == 0 || len(p) > 2 {
			return gid, fmt.Errorf("GID %q: field %d (%q) is not a hex byte 00..ff", s, i+1, p)
		}
		gid[i] = byte(v)
	}
	return gid, nil
}
