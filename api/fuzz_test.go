package api

import (
	"encoding/json"
	"errors"
	"io"
	"math/big"
	"net/url"
	"reflect"
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

// FuzzTransferRequest checks TransferRequest's own reader against
// encoding/json's strict decoding of the same fields: whatever the one
// accepts the other does, reading the same request, except that the
// items' parser is stricter: it refuses an item with more than
// ItemFields fields, and null for an item or a field.
func FuzzTransferRequest(f *testing.F) {
	for _, seed := range []string{
		`{"sources":[{"req_id":"a"},{"region":"kv"}],"destinations":[{"session":"10.0.0.2:17100","buffer_address":1,"key":"00112233445566778899aabbccddeeff00112233","nbytes":8}],"items":[[0,0,0,0,4],[1,0,0,4,4]],"keep_sources":true}`,
		`{"SOURCES":null,"items":[[1,2],[]],"destinations":[]}`,
		` {"sources" : [ {"req_id":"a\"b"} ] , "x":1} `,
		`{"items":[[1,2,3,4,5,6]]}`,
		`null`,
	} {
		f.Add([]byte(seed))
	}
	type plain struct {
		Sources      []TransferSource `json:"sources"`
		Destinations []ReceiveSlot    `json:"destinations"`
		Items        [][]int64        `json:"items"`
		KeepSources  bool             `json:"keep_sources,omitempty"`
	}
	f.Fuzz(func(t *testing.T, body []byte) {
		var got TransferRequest
		err := json.Unmarshal(body, &got)
		var want plain
		dec := json.NewDecoder(strings.NewReader(string(body)))
		dec.DisallowUnknownFields()
		werr := dec.Decode(&want)
		if _, terr := dec.Token(); werr == nil && terr != io.EOF {
			werr = errors.New("data after the object")
		}
		switch {
		case err == nil && werr != nil:
			t.Fatalf("%q: read as %+v, but encoding/json refuses it: %v", body, got, werr)
		case err != nil && werr == nil && !strings.HasPrefix(err.Error(), "items:"):
			t.Fatalf("%q: refused (%v), but encoding/json reads it as %+v", body, err, want)
		case err == nil:
			wantReq := TransferRequest{Sources: want.Sources, Destinations: want.Destinations, KeepSources: want.KeepSources}
			if want.Items != nil {
				wantReq.Items = Items(want.Items)
			}
			if !reflect.DeepEqual(got, wantReq) {
				t.Fatalf("%q: read as %+v; encoding/json reads %+v", body, got, wantReq)
			}
		}
	})
}
