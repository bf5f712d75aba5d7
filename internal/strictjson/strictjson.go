// Package strictjson checks JSON that strangers and local clients send
// for what encoding/json lets through: an object with the same key twice.
// encoding/json matches keys to fields ignoring case and keeps the last
// of duplicates, so {"nbytes":1024,"NBYTES":2048} would read as 2048
// while a proxy, a log or another parser sees 1024.
package strictjson

import (
	"encoding/json"
	"fmt"
	"strings"
)

// MaxDepth is how deep objects and arrays may nest: encoding/json's own
// limit.
const MaxDepth = 10000

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
// grow with the input (some 1.5 GiB allocated for 16 MiB of [).
func NoDuplicateKeys(data []byte) error {
	// Each open object's keys so far (made on its first key); an open
	// array is a nil entry with isObject false.
	type open struct {
		isObject bool
		keys     map[string]bool
	}
	var stack []open
	expectKey := false // the next string is an object's key
	for i := 0; i < len(data); i++ {
		switch data[i] {
		case '{', '[':
			if len(stack) == MaxDepth {
				return fmt.Errorf("the JSON nests more than %d objects and arrays deep (at byte %d): send a flatter one", MaxDepth, i)
			}
			stack = append(stack, open{isObject: data[i] == '{'})
			expectKey = data[i] == '{'
		case '}', ']':
			if len(stack) > 0 {
				stack = stack[:len(stack)-1]
			}
			expectKey = false
		case ',':
			expectKey = len(stack) > 0 && stack[len(stack)-1].isObject
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
				top := &stack[len(stack)-1]
				if top.keys == nil {
					top.keys = make(map[string]bool)
				}
				k := strings.ToLower(key)
				if top.keys[k] {
					return fmt.Errorf("the key %q comes twice in one object (keys are matched ignoring case): send each key once", key)
				}
				top.keys[k] = true
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
