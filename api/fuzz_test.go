package api

import (
	"math/big"
	"net/url"
	"slices"
	"strings"
	"testing"
	"unicode"
)

// FuzzTensorSpec feeds a shape as a query string carries it and a dtype
// name to the stage-time checks. Whatever they accept must be a tensor
// whose byte count is exact, and must read back the same when written out.
// Seeds: testdata/fuzz/FuzzTensorSpec.
func FuzzTensorSpec(f *testing.F) {
	f.Fuzz(func(t *testing.T, shapeText, dtype string) {
		canon, elem, derr := DType(dtype)
		if derr == nil {
			if !slices.Contains(DTypeNames(), canon) || !slices.Contains([]int64{1, 2, 4, 8}, elem) {
				t.Fatalf("DType(%q) = %q, %d: not a canonical name and element size", dtype, canon, elem)
			}
			if c2, e2, err := DType(canon); err != nil || c2 != canon || e2 != elem {
				t.Fatalf("DType(%q) = %q, %d, %v; its canonical name %q does not resolve to itself", dtype, c2, e2, err, canon)
			}
		} else if derr.Error() == "" {
			t.Fatal("DType error without a message")
		}

		shape, err := ParseShape(shapeText)
		if err != nil {
			if !strings.Contains(err.Error(), "shape") {
				t.Fatalf("ParseShape(%q) error does not say it is about the shape: %v", shapeText, err)
			}
			return
		}
		again, err := ParseShape(ShapeString(shape))
		if err != nil || !slices.Equal(again, shape) {
			t.Fatalf("shape %v written as %q reads back as %v, %v", shape, ShapeString(shape), again, err)
		}

		n, c, err := NBytes(shape, dtype)
		want, ok := exactBytes(shape, elem, derr == nil)
		if err != nil {
			if ok {
				t.Fatalf("NBytes(%v, %q) refused a valid tensor of %s bytes: %v", shape, dtype, want, err)
			}
			return
		}
		if !ok || want.Cmp(big.NewInt(n)) != 0 || c != canon {
			t.Fatalf("NBytes(%v, %q) = %d %q; want %s %q (valid=%v)", shape, dtype, n, c, want, canon, ok)
		}
	})
}

// exactBytes is a tensor's byte count in arbitrary precision, and whether
// it is a tensor the API must accept: known dtype, 1..MaxDims positive
// dimensions, and a count that fits an int64.
func exactBytes(shape []int64, elem int64, dtypeOK bool) (*big.Int, bool) {
	total := big.NewInt(elem)
	if len(shape) < 1 || len(shape) > MaxDims {
		return total, false // no product needed: thousands of dimensions make it slow
	}
	ok := dtypeOK
	for _, d := range shape {
		ok = ok && d > 0
		total.Mul(total, big.NewInt(d))
	}
	return total, ok && total.IsInt64()
}

// FuzzReqID checks that every req_id CheckReqID accepts is safe where
// req_ids go: as one URL path segment, unescaped, and in a log line.
func FuzzReqID(f *testing.F) {
	f.Fuzz(func(t *testing.T, id string) {
		if err := CheckReqID(id); err != nil {
			if err.Error() == "" {
				t.Fatal("CheckReqID error without a message")
			}
			return
		}
		if id == "" || len(id) > MaxReqIDLen {
			t.Fatalf("CheckReqID accepted a req_id of %d bytes", len(id))
		}
		if url.PathEscape(id) != id {
			t.Fatalf("accepted req_id %q needs escaping in a URL path (%q)", id, url.PathEscape(id))
		}
		if id == "." || id == ".." || strings.ContainsFunc(id, func(r rune) bool { return r > unicode.MaxASCII || !unicode.IsPrint(r) || unicode.IsSpace(r) }) {
			t.Fatalf("accepted req_id %q is not safe in a path or a log line", id)
		}
	})
}
