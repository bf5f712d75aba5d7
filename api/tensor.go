package api

import (
	"fmt"
	"math"
	"math/bits"
	"net"
	"regexp"
	"sort"
	"strconv"
	"strings"
)

// dtypeSizes maps each accepted dtype name to its element size in bytes.
// Canonical names first; torch/numpy spellings are accepted as aliases.
var dtypeSizes = map[string]int64{
	"f64": 8, "f32": 4, "f16": 2, "bf16": 2, "f8e4m3": 1, "f8e5m2": 1,
	"i64": 8, "i32": 4, "i16": 2, "i8": 1, "u8": 1, "bool": 1,
}

var dtypeAliases = map[string]string{
	"float64": "f64", "float32": "f32", "float16": "f16", "half": "f16",
	"bfloat16": "bf16", "float8_e4m3fn": "f8e4m3", "float8_e5m2": "f8e5m2",
	"e4m3": "f8e4m3", "e5m2": "f8e5m2", "fp8_e4m3": "f8e4m3", "fp8_e5m2": "f8e5m2",
	"int64": "i64", "int32": "i32", "int16": "i16", "int8": "i8", "uint8": "u8",
}

// MaxDims bounds a shape's rank.
const MaxDims = 8

// DTypeNames lists the canonical dtype names, for messages and docs.
func DTypeNames() []string {
	names := make([]string, 0, len(dtypeSizes))
	for n := range dtypeSizes {
		names = append(names, n)
	}
	sort.Strings(names)
	return names
}

// DType resolves a dtype name (canonical or alias) to its canonical name
// and element size.
func DType(name string) (string, int64, error) {
	n := strings.ToLower(strings.TrimSpace(name))
	if a, ok := dtypeAliases[n]; ok {
		n = a
	}
	size, ok := dtypeSizes[n]
	if !ok {
		if name == "" {
			return "", 0, fmt.Errorf("dtype is missing: give one of %s", strings.Join(DTypeNames(), ", "))
		}
		return "", 0, fmt.Errorf("unknown dtype %q: use one of %s", name, strings.Join(DTypeNames(), ", "))
	}
	return n, size, nil
}

// ParseShape reads "R,C" (1 to MaxDims positive integers).
func ParseShape(s string) ([]int64, error) {
	if strings.TrimSpace(s) == "" {
		return nil, fmt.Errorf("shape is missing: give it as comma-separated dimensions, e.g. shape=16,4096")
	}
	parts := strings.Split(s, ",")
	shape := make([]int64, 0, len(parts))
	for _, p := range parts {
		d, err := strconv.ParseInt(strings.TrimSpace(p), 10, 64)
		if err != nil {
			return nil, fmt.Errorf("shape %q: dimension %q is not an integer: give comma-separated positive integers, e.g. 16,4096", s, p)
		}
		shape = append(shape, d)
	}
	return shape, nil
}

// NBytes validates shape and dtype and returns the tensor's size in bytes:
// the product of the dimensions times the element size, checked for
// overflow. This is where the seed's "size mismatch" becomes a 400 at stage
// time instead of an assertion at send time.
func NBytes(shape []int64, dtype string) (int64, string, error) {
	canon, elem, err := DType(dtype)
	if err != nil {
		return 0, "", err
	}
	if len(shape) == 0 {
		return 0, "", fmt.Errorf("shape is empty: give 1 to %d positive dimensions", MaxDims)
	}
	if len(shape) > MaxDims {
		return 0, "", fmt.Errorf("shape %v has %d dimensions: at most %d are supported", shape, len(shape), MaxDims)
	}
	total := uint64(elem)
	for i, d := range shape {
		if d <= 0 {
			return 0, "", fmt.Errorf("shape %v: dimension %d is %d: every dimension must be positive", shape, i, d)
		}
		hi, lo := bits.Mul64(total, uint64(d))
		if hi != 0 || lo > math.MaxInt64 {
			return 0, "", fmt.Errorf("shape %v with dtype %s overflows a 64-bit byte count", shape, canon)
		}
		total = lo
	}
	return int64(total), canon, nil
}

// MaxReqIDLen bounds a req_id.
const MaxReqIDLen = 128

var reqIDPattern = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9._:@-]*$`)

// CheckSession validates a peer daemon's address: host:port, as the
// session of a receive slot names it.
func CheckSession(s string) error {
	host, port, err := net.SplitHostPort(s)
	if err != nil || host == "" {
		return fmt.Errorf("session %q is not host:port of a peer ferryd (e.g. 10.0.0.5:%d): use the session the receiver's POST /v1/receives returned", s, DefaultPeerPort)
	}
	if p, err := strconv.ParseUint(port, 10, 16); err != nil || p == 0 {
		return fmt.Errorf("session %q: port %q is not a port number from 1 to 65535", s, port)
	}
	return nil
}

// CheckReqID says what is wrong with a req_id, if anything. req_ids travel in
// URL paths and log lines, so they are kept to a safe alphabet.
func CheckReqID(id string) error {
	switch {
	case id == "":
		return fmt.Errorf("req_id is empty")
	case len(id) > MaxReqIDLen:
		return fmt.Errorf("req_id is %d bytes long: at most %d are allowed", len(id), MaxReqIDLen)
	case !reqIDPattern.MatchString(id):
		return fmt.Errorf("req_id %q has characters outside [A-Za-z0-9._:@-] or does not start with a letter or digit", id)
	}
	return nil
}

// ShapeString formats a shape as "R,C".
func ShapeString(shape []int64) string {
	parts := make([]string, len(shape))
	for i, d := range shape {
		parts[i] = strconv.FormatInt(d, 10)
	}
	return strings.Join(parts, ",")
}
