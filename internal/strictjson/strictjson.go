// Package strictjson checks JSON that strangers and local clients send
// for what encoding/json lets through: an object with the same key twice.
// encoding/json matches keys to fields ignoring case and keeps the last
// of duplicates, so {"nbytes":1024,"NBYTES":2048} would read as 2048
// while a proxy, a log or another parser sees 1024.
package strictjson

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"strings"
)

// NoDuplicateKeys reports the first object in data that holds a key twice,
// comparing keys without regard to case, at any depth. Syntax errors are
// left to the decoder that reads data next.
func NoDuplicateKeys(data []byte) error {
	dec := json.NewDecoder(bytes.NewReader(data))
	// Each open object's keys so far; nil marks an open array.
	var open []map[string]bool
	expectKey := func() bool { return len(open) > 0 && open[len(open)-1] != nil }
	afterKey := false // the next token is the value of a key
	for {
		tok, err := dec.Token()
		if errors.Is(err, io.EOF) {
			return nil
		}
		if err != nil {
			return nil // malformed: the decoder says so
		}
		switch t := tok.(type) {
		case json.Delim:
			afterKey = false
			switch t {
			case '{':
				open = append(open, map[string]bool{})
			case '[':
				open = append(open, nil)
			default:
				open = open[:len(open)-1]
			}
		case string:
			if expectKey() && !afterKey {
				k := strings.ToLower(t)
				if open[len(open)-1][k] {
					return fmt.Errorf("the key %q comes twice in one object (keys are matched ignoring case): send each key once", t)
				}
				open[len(open)-1][k] = true
				afterKey = true
				continue
			}
			afterKey = false
		default:
			afterKey = false
		}
	}
}
