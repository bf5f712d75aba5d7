package api

import (
	"strings"
	"testing"
)

func TestNBytes(t *testing.T) {
	for _, c := range []struct {
		shape []int64
		dtype string
		want  int64
		canon string
	}{
		{[]int64{16, 4096}, "bf16", 131072, "bf16"},
		{[]int64{16, 4096}, "bfloat16", 131072, "bf16"},
		{[]int64{3}, "float8_e4m3fn", 3, "f8e4m3"},
		{[]int64{2, 2, 2}, "f64", 64, "f64"},
		{[]int64{7}, "E5M2", 7, "f8e5m2"},
	} {
		n, canon, err := NBytes(c.shape, c.dtype)
		if err != nil || n != c.want || canon != c.canon {
			t.Errorf("NBytes(%v, %s) = %d %s %v; want %d %s", c.shape, c.dtype, n, canon, err, c.want, c.canon)
		}
	}
	for _, c := range []struct {
		shape   []int64
		dtype   string
		mention string
	}{
		{[]int64{1 << 32, 1 << 32}, "f32", "overflows"},
		{[]int64{1 << 62}, "f32", "overflows"},
		{[]int64{4, -1}, "f32", "positive"},
		{[]int64{0}, "u8", "positive"},
		{nil, "u8", "empty"},
		{[]int64{1, 1, 1, 1, 1, 1, 1, 1, 1}, "u8", "at most 8"},
		{[]int64{1}, "f128", "unknown dtype \"f128\""},
		{[]int64{1}, "", "dtype is missing"},
	} {
		_, _, err := NBytes(c.shape, c.dtype)
		if err == nil || !strings.Contains(err.Error(), c.mention) {
			t.Errorf("NBytes(%v, %q): %v; want an error mentioning %q", c.shape, c.dtype, err, c.mention)
		}
	}
}

func TestParseShape(t *testing.T) {
	s, err := ParseShape("16, 4096")
	if err != nil || len(s) != 2 || s[0] != 16 || s[1] != 4096 {
		t.Fatalf("ParseShape: %v %v", s, err)
	}
	for _, bad := range []string{"", "1,,2", "a", "1.5", "99999999999999999999"} {
		if _, err := ParseShape(bad); err == nil {
			t.Errorf("ParseShape(%q) succeeded", bad)
		}
	}
}

func TestCheckReqID(t *testing.T) {
	for _, ok := range []string{"r1", "req-42.a:b@c_d", strings.Repeat("x", MaxReqIDLen)} {
		if err := CheckReqID(ok); err != nil {
			t.Errorf("CheckReqID(%q): %v", ok, err)
		}
	}
	for _, bad := range []string{"", "..", ".hidden", "a b", "a/b", "é", strings.Repeat("x", MaxReqIDLen+1), "-x"} {
		if err := CheckReqID(bad); err == nil {
			t.Errorf("CheckReqID(%q) accepted it", bad)
		}
	}
}
