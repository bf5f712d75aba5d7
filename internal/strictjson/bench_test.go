package strictjson

import (
	"encoding/json"
	"testing"
)

func BenchmarkNoDuplicateKeys10kItems(b *testing.B) {
	items := make([][]int64, 10000)
	for i := range items {
		items[i] = []int64{0, int64(i) * 65536, 0, int64(9999-i) * 65536, 65536}
	}
	body, _ := json.Marshal(map[string]any{"sources": []map[string]string{{"req_id": "src"}}, "items": items})
	b.SetBytes(int64(len(body)))
	for b.Loop() {
		if err := NoDuplicateKeys(body); err != nil {
			b.Fatal(err)
		}
	}
}
