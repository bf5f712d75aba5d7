package daemon

import (
	"strings"
	"testing"
)

func TestTransportConfig(t *testing.T) {
	var c Config
	if err := c.Check(); err != nil {
		t.Fatalf("zero config: %v", err)
	}
	if c.Transport != "auto" || c.RDMARegistration != "shared" || c.RDMAGIDIndex != nil {
		t.Errorf("defaults: transport %q, registration %q, gid %v; want auto, shared, chosen", c.Transport, c.RDMARegistration, c.RDMAGIDIndex)
	}
	bad := -1
	c = Config{Transport: "infiniband", RDMARegistration: "lazy", RDMAGIDIndex: &bad}
	err := c.Check()
	for _, want := range []string{`--transport "infiniband": use auto`, `--rdma-registration "lazy": use shared or per-send`, "--rdma-gid-index -1 is negative"} {
		if err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("got %v; want it to say %q", err, want)
		}
	}
}
