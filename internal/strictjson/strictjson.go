// Package strictjson checks JSON that strangers and local clients send
// for what encoding/json lets through: an object with the same key twice.
// encoding/json matches keys to fields ignoring case and keeps the last
// of duplicates, so {"nbytes":1024,"NBYTES":2048} would read as 2048
// while a proxy, a log or another parser sees 1024.
package strictjson

import (
	"encoding/json"
	"fmt"
	"slices"
	"strings"
)

// MaxDepth is how deep objects and arrays may nest: encoding/json's own
// limit.
const MaxDepth = 10000

// MaxKeys is how many keys one object may hold: far more than any object
// ferry reads has, and a bound on what the walk keeps for one.
const MaxKeys = 1024

// smallObject is how many keys an object's are compared one by one;
// past that they go into a map of its own.
const smallObject = 16

// NoDuplicateKeys reports the first object in data that holds a key twice,
// comparing keys without regard to case, at any depth. Syntax errors are
// left to the decoder that reads data next.
//
// It walks the bytes itself rather than through json.Decoder.Token, which
// allocates a token per value: a batch transfer's body is thousands of
// numbers, and this check runs before every body is decoded.
//
// It refuses JSON nested deeper than MaxDepth, which encoding/json
// refuses too: its own stack of open objects and arrays would otherwise
// grow with the input (some 1.5 GiB allocated for 16 MiB of [). It
// refuses an object of more than MaxKeys keys, and makes no map for an
// object of a few: a stranger's nested or many-keyed object costs the
// walk little more than its bytes.
func NoDuplicateKeys(data []byte) error {
	// The open objects and arrays, innermost last, each as first<<1 |
	// isObject: an open object's keys so far, lowered, are keys[first:],
	// and past smallObject of them also in seen[its depth]. A few bytes
	// an object: a stranger nesting them as deep as allowed costs little.
	var stack []int
	var keys []string
	var seen map[int]map[string]struct{}
	isObject := func(o int) bool { return o&1 == 1 }
	expectKey := false // the next string is an object's key
	for i := 0; i < len(data); i++ {
		switch data[i] {
		case '{', '[':
			if len(stack) == MaxDepth {
				return fmt.Errorf("the JSON nests more than %d objects and arrays deep (at byte %d): send a flatter one", MaxDepth, i)
			}
			o := len(keys) << 1
			if data[i] == '{' {
				o |= 1
			}
			stack = append(stack, o)
			expectKey = data[i] == '{'
		case '}', ']':
			if d := len(stack) - 1; d >= 0 {
				keys = keys[:stack[d]>>1]
				stack = stack[:d]
				delete(seen, d)
			}
			expectKey = false
		case ',':
			expectKey = len(stack) > 0 && isObject(stack[len(stack)-1])
		case ':':
			expectKey = false
		case '"':
			end, escaped := stringEnd(data, i)
			if end < 0 {
				return nil // unterminated: the decoder says so
			}
			if expectKey {
				key := string(data[i+1 : end])
				if escaped && json.Unmarshal(data[i:end+1], &key) != nil {
					return nil // a bad escape: the decoder says so
				}
				d := len(stack) - 1
				first := stack[d] >> 1
				own := keys[first:]
				if len(own) == MaxKeys {
					return fmt.Errorf("an object holds more than %d keys (at byte %d): no request takes that many; send fewer", MaxKeys, i)
				}
				k := strings.ToLower(key)
				big := seen[d]
				var dup bool
				if big != nil {
					_, dup = big[k]
				} else {
					dup = slices.Contains(own, k)
				}
				if dup {
					return fmt.Errorf("the key %q comes twice in one object (keys are matched ignoring case): send each key once", key)
				}
				keys = append(keys, k)
				switch {
				case big != nil:
					big[k] = struct{}{}
				case len(own) == smallObject:
					if seen == nil {
						seen = make(map[int]map[string]struct{})
					}
					big = make(map[string]struct{}, 2*smallObject)
					for _, o := range keys[first:] {
						big[o] = struct{}{}
					}
					seen[d] = big
				}
				expectKey = false
			}
			i = end
		}
	}
	return nil
}

// stringEnd is the index of the quote closing the string that opens at
// data[start], or -1; escaped says whether it holds a backslash.
func stringEnd(data []byte, start int) (end int, escaped bool) {
	for i := start + 1; i < len(data); i++ {
		switch data[i] {
		case '\\':
			escaped = true
			i++ // the escaped byte is never the closing quote
		case '"':
			return i, escaped
		}
	}
	return -1, escaped
}
