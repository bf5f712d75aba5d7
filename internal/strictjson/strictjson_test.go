package strictjson

import (
	"encoding/json"
	"strings"
	"testing"
)

func TestNoDuplicateKeys(t *testing.T) {
	for _, ok := range []string{
		`{"nbytes":1024,"req_id":"a"}`,
		`{"a":{"a":1},"b":[{"a":1},{"a":2}]}`,
		`{"a":"a","b":"a"}`,
		`[{"x":1},{"x":1}]`,
		`{"a":[1,"a",{"a":1}],"A2":2}`,
		`not json`,
		``,
	} {
		if err := NoDuplicateKeys([]byte(ok)); err != nil {
			t.Errorf("%s: %v", ok, err)
		}
	}
	for bad, key := range map[string]string{
		`{"nbytes":1024,"NBYTES":2048}`:         "NBYTES",
		`{"a":1,"a":2}`:                         "a",
		`{"o":{"k":1,"K":2}}`:                   "K",
		`{"l":[{"z":"z","Z":1}]}`:               "Z",
		`{"a":[],"b":{},"a":0}`:                 "a",
		`{"x":{"y":{"deep":1}},"q":1,"Q":true}`: "Q",
	} {
		err := NoDuplicateKeys([]byte(bad))
		if err == nil || !strings.Contains(err.Error(), `"`+key+`"`) {
			t.Errorf("%s: got %v, want the duplicate %q named", bad, err, key)
		}
	}
}

// Keys are compared as the decoder reads them: escapes unescaped, and a
// quote or brace inside a string is not structure.
func TestNoDuplicateKeysReadsStringsAsTheDecoder(t *testing.T) {
	for bad, key := range map[string]string{
		`{"a":1,"\u0061":2}`:             "a",
		`{"s":"x\"}{,\"s\":","S":1}`:     "S",
		`{"k":{"in":"{\"k\":1}"},"K":1}`: "K",
	} {
		err := NoDuplicateKeys([]byte(bad))
		if err == nil || !strings.Contains(err.Error(), `"`+key+`"`) {
			t.Errorf("%s: got %v, want the duplicate %q named", bad, err, key)
		}
	}
	for _, ok := range []string{`{"s":"\"a\":1,\"a\":2"}`, `{"a\\":1,"a":2}`, `{"a":1` + "\n" + `,"b":2}`} {
		if err := NoDuplicateKeys([]byte(ok)); err != nil {
			t.Errorf("%s: %v", ok, err)
		}
	}
}

// Nesting is refused where encoding/json refuses it, before the walk's
// own stack grows with the input.
func TestNoDuplicateKeysBoundsDepth(t *testing.T) {
	nest := func(n int) []byte { return []byte(strings.Repeat("[", n) + strings.Repeat("]", n)) }
	var v any
	if err := NoDuplicateKeys(nest(MaxDepth)); err != nil || json.Unmarshal(nest(MaxDepth), &v) != nil {
		t.Fatalf("%d deep: %v, %v", MaxDepth, err, json.Unmarshal(nest(MaxDepth), &v))
	}
	err := NoDuplicateKeys([]byte(`{"a":` + strings.Repeat("[", 16<<20)))
	if err == nil || err.Error() != "the JSON nests more than 10000 objects and arrays deep (at byte 10004): send a flatter one" {
		t.Fatalf("16 MiB of [: %v", err)
	}
	if json.Unmarshal(nest(MaxDepth+1), &v) == nil {
		t.Fatalf("encoding/json reads %d deep: MaxDepth is not its limit", MaxDepth+1)
	}
}
