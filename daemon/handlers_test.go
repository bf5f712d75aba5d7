package daemon

import (
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/ferry-project/ferry/api"
)

// A body is one JSON object and nothing after it but space: a second
// value, or a stray closing brace or bracket, is refused.
func TestJSONBodyIsOneObject(t *testing.T) {
	d := &Daemon{}
	for body, ok := range map[string]bool{
		`{"req_id":"a"}`: true, "{\"req_id\":\"a\"}\n ": true,
		`{"req_id":"a"}}`: false, `{"req_id":"a"}]`: false, `{"req_id":"a"}{}`: false, `{"req_id":"a"} 1`: false,
	} {
		var v struct {
			ReqID string `json:"req_id"`
		}
		r := httptest.NewRequest("POST", "/v1/receives", strings.NewReader(body))
		err := d.decodeJSONWithin(r, &v, 1<<10, "too large")
		if ok && err != nil || !ok && !isCode(err, api.CodeBadRequest) {
			t.Errorf("body %q: %v", body, err)
		}
	}
}
