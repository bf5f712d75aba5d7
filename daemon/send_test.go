package daemon

import (
	"fmt"
	"testing"

	"github.com/ferry-project/ferry/transport"
)

// TestSharedMRFromReport: shared_mr is what the transport reported of the
// write: false for a per-send registration or a bounce copy.
func TestSharedMRFromReport(t *testing.T) {
	for _, c := range []struct {
		r    transport.Report
		want bool
	}{
		{transport.Report{Messages: 2}, true}, // TCP
		{transport.Report{Registration: transport.RegisteredShared, Messages: 2}, true},
		{transport.Report{Registration: transport.RegisteredPerSend, Messages: 2}, false},
		{transport.Report{Copied: 4096, Messages: 2}, false}, // through a bounce buffer
	} {
		if got := sharedMR(c.r); got != c.want {
			t.Errorf("sharedMR(%+v) = %v, want %v", c.r, got, c.want)
		}
	}
}

// nicErr is a transport's error that names the NIC's status.
type nicErr struct{}

func (nicErr) Error() string      { return "the write completed in error" }
func (nicErr) StatusName() string { return "RETRY_EXC_ERR" }

func TestRetCodeNamesTheNICStatus(t *testing.T) {
	if got := retCode(fmt.Errorf("rdma write to x: %w", nicErr{})); got != "RETRY_EXC_ERR" {
		t.Fatalf("retCode = %q, want the status the error names", got)
	}
}
