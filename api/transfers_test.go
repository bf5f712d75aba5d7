package api

import (
	"encoding/json"
	"reflect"
	"strings"
	"testing"
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
		`[[1,2.5]]`:               "item 0: field 1 is not an integer",
		`[[1],[2,1e3]]`:           "item 1: field 1 is not an integer",
		`[[1],"x"]`:               "item 1 is not an array",
		`[[9223372036854775808]]`: "item 0: field 0 is not an integer",
	} {
		var got Items
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
