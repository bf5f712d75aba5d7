package daemon

import (
	"testing"
)

// BenchmarkStatus is a status round trip through the control socket with
// the Go client, both in this process, so -cpuprofile sees both sides.
func BenchmarkStatus(b *testing.B) {
	_, c := serveTestDaemon(b, b.TempDir(), "st", nil)
	ctx := b.Context()
	b.ReportAllocs()
	b.RunParallel(func(pb *testing.PB) {
		for pb.Next() {
			if _, err := c.Status(ctx); err != nil {
				b.Error(err)
				return
			}
		}
	})
}
