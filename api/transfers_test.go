package api

import (
	"encoding/json"
	"errors"
	"reflect"
	"strings"
	"testing"

	"github.com/ferry-project/ferry/transport"
)

func TestItemsReadAsTheDecoderWould(t *testing.T) {
	for in, want := range map[string]Items{
		`[[0,0,0,0,4096],[1,4096,0,8192,4096]]`:           {{0, 0, 0, 0, 4096}, {1, 4096, 0, 8192, 4096}},
		" [ [ 0 , -1 ,2,3 ,9223372036854775807 ] ,\n[]] ": {{0, -1, 2, 3, 9223372036854775807}, {}},
		`[]`:                       {},
		`null`:                     nil,
		`[[-9223372036854775808]]`: {{-9223372036854775808}},
	} {
		var got Items
		if err := json.Unmarshal([]byte(in), &got); err != nil || !reflect.DeepEqual(got, want) {
			t.Errorf("%s: got %v, %v; want %v", in, got, err, want)
		}
		var ref [][]int64
		if err := json.Unmarshal([]byte(in), &ref); err != nil || !reflect.DeepEqual([][]int64(got), ref) && len(ref) > 0 {
			t.Errorf("%s: encoding/json reads %v (%v), Items reads %v", in, ref, err, got)
		}
	}
	for in, says := range map[string]string{
		`{"a":1}`:                 "must be an array",
		`[[1,2.5]]`:               "item 0: field 1 (source_offset) is not an integer",
		`[[1],[2,1e3]]`:           "item 1: field 1 (source_offset) is not an integer",
		`[[1],"x"]`:               "item 1 is not an array",
		`[[9223372036854775808]]`: "item 0: field 0 (source) is out of range",
		// 2^64 and 10·2^64 wrap uint64 to 0 where the digits are summed
		// unchecked; 2^64+5 to 5.
		`[[0,0,0,0,18446744073709551616]]`:  "item 0: field 4 (nbytes) is out of range",
		`[[0,184467440737095516160]]`:       "item 0: field 1 (source_offset) is out of range",
		`[[0,0,0,-18446744073709551621]]`:   "item 0: field 3 (destination_offset) is out of range",
		`[[0,0,99999999999999999999999,0]]`: "item 0: field 2 (destination) is out of range",
	} {
		var got Items
		err := json.Unmarshal([]byte(in), &got)
		if err == nil || !strings.Contains(err.Error(), says) {
			t.Errorf("%s: got %v, want an error saying %q", in, err, says)
		}
	}
}

// An item is refused at its first field past ItemFields, naming it: the
// rest of it is never read (here it is not even JSON).
func TestItemsRefuseAnExtraFieldAtOnce(t *testing.T) {
	in := `[[0,0,0,0,1],[1,2,3,4,5,6,7,8,` + strings.Repeat("x", 1<<20)
	var got Items
	err := got.UnmarshalJSON([]byte(in))
	const says = "items: item 1 has more than 5 fields: an item is [source, source_offset, destination, destination_offset, nbytes] (at byte 24 of the items)"
	if err == nil || err.Error() != says {
		t.Fatalf("got %v; want %q", err, says)
	}
	var req TransferRequest
	err = json.Unmarshal([]byte(`{"items":[[0,0,0,0,1,1]]}`), &req)
	if err == nil || !strings.Contains(err.Error(), "item 0 has more than 5 fields") {
		t.Fatalf("through TransferRequest: %v", err)
	}
}

// MaxTransferItems items are read; one more is refused as a limit.
func TestItemsAreBounded(t *testing.T) {
	item := "[0,0,0,0,1],"
	body := func(n int) []byte {
		return []byte("[" + strings.Repeat(item, n-1) + item[:len(item)-1] + "]")
	}
	var got Items
	if err := got.UnmarshalJSON(body(MaxTransferItems)); err != nil || len(got) != MaxTransferItems {
		t.Fatalf("%d items: read %d, %v", MaxTransferItems, len(got), err)
	}
	if !reflect.DeepEqual(got[MaxTransferItems-1], []int64{0, 0, 0, 0, 1}) {
		t.Fatalf("the last item reads %v", got[MaxTransferItems-1])
	}
	err := got.UnmarshalJSON(body(MaxTransferItems + 1))
	var le *LimitError
	const says = "the transfer has more than 1048576 items, the most one transfer may: split them into several transfers"
	if !errors.As(err, &le) || err.Error() != says {
		t.Fatalf("%d items: got %v; want a LimitError saying %q", MaxTransferItems+1, err, says)
	}
}

// Sources and destinations are counted as they are read: a body of
// [{},{},...] past the limit is refused as a limit, not decoded.
func TestTransferListsAreBounded(t *testing.T) {
	list := func(n int) string { return "[" + strings.Repeat("{},", n-1) + "{}]" }
	for _, c := range []struct {
		field string
		most  int
	}{{"sources", MaxTransferSources}, {"destinations", MaxTransferDestinations}} {
		var req TransferRequest
		if err := json.Unmarshal([]byte(`{"`+c.field+`":`+list(c.most)+`}`), &req); err != nil {
			t.Fatalf("%d %s: %v", c.most, c.field, err)
		}
		if n := len(req.Sources) + len(req.Destinations); n != c.most {
			t.Fatalf("%d %s read as %d", c.most, c.field, n)
		}
		err := json.Unmarshal([]byte(`{"`+c.field+`":`+list(c.most+1)+`}`), &req)
		var le *LimitError
		says := "the transfer lists more than 65536 " + c.field + ", the most one transfer may: split it into several transfers"
		if !errors.As(err, &le) || err.Error() != says {
			t.Fatalf("%d %s: got %v; want a LimitError saying %q", c.most+1, c.field, err, says)
		}
	}
}

// TransferRequest reads what the Go client writes, and refuses what
// encoding/json's strict decoding refused: unknown fields, at any level.
func TestTransferRequestReadsBack(t *testing.T) {
	key := transport.NewKey()
	want := TransferRequest{
		Sources:      []TransferSource{{ReqID: "a"}, {Region: "kv"}},
		Destinations: []ReceiveSlot{{ReqID: "r", Session: "10.0.0.2:17100", BufferAddress: 1 << 40, Key: key, NBytes: 8192}},
		Items:        Items{{0, 0, 0, 0, 4096}, {1, 8, 0, 4096, 4096}},
		KeepSources:  true,
	}
	body, err := json.Marshal(want)
	if err != nil {
		t.Fatal(err)
	}
	var got TransferRequest
	if err := json.Unmarshal(body, &got); err != nil || !reflect.DeepEqual(got, want) {
		t.Fatalf("%s read back as %+v, %v", body, got, err)
	}
	if err := json.Unmarshal([]byte(`{"Sources":[{"REQ_ID":"a"}],"ITEMS":null}`), &got); err != nil || got.Sources[0].ReqID != "a" || got.Items != nil {
		t.Fatalf("keys in another case: %+v, %v", got, err)
	}
	for in, says := range map[string]string{
		`{"sources":[],"nope":1}`:                    `unknown field "nope"`,
		`{"destinations":[{"session":"a"},{"x":1}]}`: `destination 1: json: unknown field "x"`,
		`{"sources":[{"req_id":"a","region":2}]}`:    `source 0: json: cannot unmarshal number`,
		`{"sources":{}}`:                             "sources must be an array of objects",
		`[]`:                                         "a transfer is a JSON object",
		`{"keep_sources":"yes"}`:                     "cannot unmarshal string",
	} {
		err := json.Unmarshal([]byte(in), &got)
		if err == nil || !strings.Contains(err.Error(), says) {
			t.Errorf("%s: got %v, want an error saying %q", in, err, says)
		}
	}
}

// A batch of 10,000 items: what reading it costs the daemon.
func BenchmarkTransferRequest10kItems(b *testing.B) {
	req := TransferRequest{Sources: []TransferSource{{ReqID: "src"}}, Destinations: []ReceiveSlot{{Session: "10.0.0.2:17100", BufferAddress: 140000000000}}}
	for i := range 10000 {
		req.Items = append(req.Items, []int64{0, int64(i) * 65536, 0, int64(9999-i) * 65536, 65536})
	}
	body, _ := json.Marshal(req)
	b.SetBytes(int64(len(body)))
	for b.Loop() {
		var got TransferRequest
		if err := json.Unmarshal(body, &got); err != nil {
			b.Fatal(err)
		}
	}
}
