package daemon

import (
	"bytes"
	"fmt"
	"runtime"
	"sync"
	"testing"
	"time"

	"github.com/ferry-project/ferry/api"
	"github.com/ferry-project/ferry/arena"
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

// BenchmarkSend is one 1 MiB send between two daemons in this process,
// with its stage and receive slot, through the Go client.
func BenchmarkSend(b *testing.B) {
	dir := b.TempDir()
	_, sc := serveTestDaemon(b, dir, "snd", nil)
	_, rc := serveTestDaemon(b, dir, "rcv", nil)
	ctx := b.Context()
	data := make([]byte, 1<<20)
	b.SetBytes(int64(len(data)))
	for i := 0; b.Loop(); i++ {
		id := fmt.Sprintf("b%d", i)
		if _, err := sc.Stage(ctx, id, []int64{int64(len(data))}, "u8", bytes.NewReader(data), int64(len(data))); err != nil {
			b.Fatal(err)
		}
		slot, err := rc.Receive(ctx, id, int64(len(data)))
		if err != nil {
			b.Fatal(err)
		}
		if _, err := sc.Send(ctx, id, api.SendRequest{Session: slot.Session, BufferAddress: slot.BufferAddress, Key: slot.Key}); err != nil {
			b.Fatal(err)
		}
		if err := rc.FreeReceive(ctx, id); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkBatch is one batch transfer of 256 scattered 64 KiB items
// between two daemons in this process, with its receive slot, through
// the Go client: the per-item cost of the batch path.
func BenchmarkBatch(b *testing.B) {
	dir := b.TempDir()
	big := func(c *Config) { c.ArenaSize = "64MiB" }
	_, sc := serveTestDaemon(b, dir, "snd", big)
	_, rc := serveTestDaemon(b, dir, "rcv", big)
	ctx := b.Context()
	const n, sz = 256, 64 << 10
	data := make([]byte, n*sz)
	if _, err := sc.Stage(ctx, "src", []int64{int64(len(data))}, "u8", bytes.NewReader(data), int64(len(data))); err != nil {
		b.Fatal(err)
	}
	req := api.TransferRequest{Sources: []api.TransferSource{{ReqID: "src"}}, KeepSources: true}
	for i := range n {
		req.Items = append(req.Items, []int64{0, int64(i) * sz, 0, int64(n-1-i) * sz, sz})
	}
	b.SetBytes(int64(len(data)))
	for i := 0; b.Loop(); i++ {
		id := fmt.Sprintf("b%d", i)
		slot, err := rc.Receive(ctx, id, int64(len(data)))
		if err != nil {
			b.Fatal(err)
		}
		req.Destinations = []api.ReceiveSlot{slot}
		if t, err := sc.Transfer(ctx, req, time.Minute); err != nil || t.State != api.TransferDone {
			b.Fatal(t, err)
		}
		if err := rc.FreeReceive(ctx, id); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkMooncakeRefusedWrite is a Mooncake write that matches none of
// 100,000 live slots (a stranger guessing addresses), on every core at
// once (refused: writes/s), and a control API call on the registry while
// such writes flood in (api: ns per call).
func BenchmarkMooncakeRefusedWrite(b *testing.B) {
	const slots, size = 100_000, 256
	r := newTestRegistry(b, slots*size)
	for i := range slots {
		if _, err := r.newSlot(fmt.Sprint(i), size, true); err != nil {
			b.Fatal(err)
		}
	}
	miss := r.arena.Addr(arena.Slice{}) + slots*size // past the last slot
	refuse := func() {
		if _, _, err := r.AcceptUnkeyed(miss, 8); err == nil {
			b.Fatal("a write past every slot was accepted")
		}
	}
	b.Run("refused", func(b *testing.B) {
		b.RunParallel(func(pb *testing.PB) {
			for pb.Next() {
				refuse()
			}
		})
		b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "writes/s")
	})
	b.Run("api", func(b *testing.B) {
		stop := make(chan struct{})
		var wg sync.WaitGroup
		for range runtime.GOMAXPROCS(0) {
			wg.Go(func() {
				for {
					select {
					case <-stop:
						return
					default:
						refuse()
					}
				}
			})
		}
		for b.Loop() {
			r.embedding("none")
		}
		close(stop)
		wg.Wait()
	})
}
