package mooncake

import (
	"encoding/json"
	"fmt"
	"slices"
)

// UnmarshalJSON reads "protocol" as a string or, from Mooncake builds with
// several transports (ENABLE_MULTI_PROTOCOL), as an array of them. From an
// array, Protocol is "rdma" when it is offered (a writer without RDMA
// falls back to "tcp" when that is offered too: see Offers), else the
// first; Offered keeps the list.
func (s *Segment) UnmarshalJSON(b []byte) error {
	type plain Segment
	v := struct {
		*plain
		Protocol json.RawMessage `json:"protocol"`
	}{plain: (*plain)(s)}
	if err := json.Unmarshal(b, &v); err != nil {
		return err
	}
	s.Protocol, s.Offered = "", nil
	switch {
	case len(v.Protocol) == 0 || string(v.Protocol) == "null":
	case v.Protocol[0] == '[':
		if err := json.Unmarshal(v.Protocol, &s.Offered); err != nil {
			return fmt.Errorf("protocol: %w", err)
		}
		switch {
		case slices.Contains(s.Offered, "rdma"):
			s.Protocol = "rdma"
		case len(s.Offered) > 0:
			s.Protocol = s.Offered[0]
		}
	default:
		if err := json.Unmarshal(v.Protocol, &s.Protocol); err != nil {
			return fmt.Errorf("protocol: %w", err)
		}
	}
	return nil
}

// Offers reports whether the segment serves protocol p.
func (s *Segment) Offers(p string) bool {
	return s.Protocol == p || slices.Contains(s.Offered, p)
}
