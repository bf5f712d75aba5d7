package strictjson

import (
	"encoding/json"
	"fmt"
	"runtime"
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

// An object of many keys is checked as one of a few (its keys past the
// first ones go into a map), and one of more than MaxKeys is refused;
// the keys of a closed object are not its parent's.
func TestNoDuplicateKeysManyKeys(t *testing.T) {
	object := func(n int, last string) []byte {
		var b strings.Builder
		b.WriteString(`{"in":{"k0":0,"k1":1},`)
		for i := range n - 1 {
			fmt.Fprintf(&b, `"k%d":%d,`, i, i)
		}
		fmt.Fprintf(&b, `"%s":0}`, last)
		return []byte(b.String())
	}
	for _, n := range []int{smallObject, smallObject + 1, 3 * smallObject} {
		if err := NoDuplicateKeys(object(n, "last")); err != nil {
			t.Errorf("%d keys: %v", n+1, err)
		}
		for _, dup := range []string{"K0", fmt.Sprintf("K%d", n-2)} {
			if err := NoDuplicateKeys(object(n, dup)); err == nil || !strings.Contains(err.Error(), `"`+dup+`"`) {
				t.Errorf("%d keys, %s twice: %v", n+1, dup, err)
			}
		}
	}
	if err := NoDuplicateKeys(object(MaxKeys-1, "last")); err != nil {
		t.Errorf("%d keys: %v", MaxKeys, err)
	}
	err := NoDuplicateKeys(object(MaxKeys, "last"))
	if err == nil || !strings.Contains(err.Error(), "an object holds more than 1024 keys") {
		t.Errorf("%d keys: %v, want a refusal naming the limit", MaxKeys+1, err)
	}
}

// TestNoDuplicateKeysNestingCostsLittle: objects nested as deep as
// allowed (a stranger's Mooncake notify) cost the walk a few words each,
// where each took a map of its own (some 300 bytes).
func TestNoDuplicateKeysNestingCostsLittle(t *testing.T) {
	nested := []byte(strings.Repeat(`{"a":`, MaxDepth) + "0" + strings.Repeat("}", MaxDepth))
	var before, after runtime.MemStats
	runtime.ReadMemStats(&before)
	if err := NoDuplicateKeys(nested); err != nil {
		t.Fatal(err)
	}
	runtime.ReadMemStats(&after)
	if got := (after.TotalAlloc - before.TotalAlloc) / MaxDepth; got > 160 {
		t.Errorf("%d nested objects allocated %d bytes each, want at most 160", MaxDepth, got)
	}
}
