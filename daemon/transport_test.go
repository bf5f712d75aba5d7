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
	if c.Transport != "auto" || c.RDMARegistration != "shared" || c.RDMAGIDIndex != nil || c.MooncakeQPs != 2 || c.MooncakeMTU != 4096 {
		t.Errorf("defaults: transport %q, registration %q, gid %v, Mooncake QPs %d and MTU %d; want auto, shared, chosen, 2 and 4096 (Mooncake's own)",
			c.Transport, c.RDMARegistration, c.RDMAGIDIndex, c.MooncakeQPs, c.MooncakeMTU)
	}
	bad := -1
	c = Config{Transport: "infiniband", RDMARegistration: "lazy", RDMAGIDIndex: &bad, MooncakeQPs: 17, MooncakeMTU: 1500}
	err := c.Check()
	for _, want := range []string{`--transport "infiniband": use auto`, `--rdma-registration "lazy": use shared or per-send`, "--rdma-gid-index -1 is negative",
		"--mooncake-qps-per-endpoint 17 is outside 1..16", "--mooncake-mtu 1500: use 512, 1024, 2048 or 4096"} {
		if err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("got %v; want it to say %q", err, want)
		}
	}
}
