package rdma

import (
	"context"
	"flag"
	"fmt"
	"testing"

	"github.com/ferry-project/ferry/transport/peer"
)

// Benchmarks of the real verbs path. test/rxevm runs them in the
// soft-RoCE VM beside ib_write_bw and prints the ratios; on a fake NIC
// they would measure memcpy, so they skip there.

func benchDevice(b *testing.B) {
	b.Helper()
	if !onDevice(b) {
		b.Skip("no RDMA port: these benchmarks measure the real verbs path")
	}
}

// writers is how many writes a benchmark keeps in flight, over at most
// lanes lanes (RC QPs; by default ferryd's lanes per peer, --max-conns):
// a lane carries one write being posted and others awaiting their
// completions. test/rxevm runs ib_write_bw with as many QPs as lanes, and
// by default two writes per lane (its RXEVM_FLIGHT).
var (
	writers = flag.Int("writers", 8, "writes in flight in BenchmarkWrite and BenchmarkWriteMode")
	lanes   = flag.Int("lanes", 8, "lanes (RC QPs) the writers share in BenchmarkWrite and BenchmarkWriteMode")
)

// newRig makes a sender and a receiver over mapped memory, the way
// ferryd runs them (Memory is the arena), with a region of the
// receiver's memory per lane (sendPair); with secret they authenticate,
// and writes from the shared registration go direct (arena-rkey mode).
func newRig(b *testing.B, f *fabric, size int, perSend bool, secret []byte) *sendPair {
	b.Helper()
	p := newSendPair(mapT(b, size), mapT(b, *lanes*size), *lanes, *writers)
	tx := listenT(b, f, Config{Peer: peer.Config{MaxConnsPerPeer: *lanes, Secret: secret}, Memory: p.src, PerSend: perSend})
	rx := listenT(b, f, Config{Peer: peer.Config{Sink: p.sink, Secret: secret}, Memory: p.sink.mem, PerSend: perSend})
	s, err := tx.Dial(context.Background(), rx.Addr().String())
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { s.Close() })
	p.sess = s
	return p
}

// runBench writes b.N times, timed, after one untimed round of a write
// per writer: the session dials its lanes then, as ferryd's are dialed
// before the sends that reuse them, and as ib_write_bw connects its QPs
// before it starts its clock (a dial under TCG can take longer than a
// whole timed run).
func runBench(b *testing.B, p *sendPair) {
	b.SetBytes(int64(len(p.src)))
	p.sink.expect(int64(*writers + b.N))
	ctx := context.Background()
	if err := p.send(ctx, *writers); err != nil {
		b.Fatal(err)
	}
	b.ResetTimer()
	if err := p.send(ctx, b.N); err != nil {
		b.Fatal(err)
	}
	b.StopTimer()
	if err := p.landed(ctx); err != nil {
		b.Fatal(err)
	}
}

// BenchmarkWrite measures writes between authenticated peers: from the
// shared registration they go direct, with no message per write.
func BenchmarkWrite(b *testing.B) {
	benchDevice(b)
	for _, size := range []int{64 << 10, 1 << 20, 4 << 20} {
		b.Run(sizeName(size), func(b *testing.B) {
			runBench(b, newRig(b, nil, size, false, testSecret))
		})
	}
}

// BenchmarkWriteMode compares 1 MiB writes from the shared registration
// with writes that register their source (and the receiver its
// destination) for each write, both asking for a grant (no peer secret),
// so that only the registration differs.
func BenchmarkWriteMode(b *testing.B) {
	benchDevice(b)
	for _, mode := range []string{"shared", "per-send"} {
		b.Run(mode+"-1MiB", func(b *testing.B) {
			runBench(b, newRig(b, nil, 1<<20, mode == "per-send", nil))
		})
	}
}

// BenchmarkRegister times registering and deregistering: an arena-sized
// region (reported per GiB) and per-send sizes.
func BenchmarkRegister(b *testing.B) {
	benchDevice(b)
	n := testNIC(b, nil, 0)
	b.Cleanup(func() { n.Close() })
	for _, size := range []int{256 << 20, 64 << 10, 1 << 20, 16 << 20} {
		b.Run(sizeName(size), func(b *testing.B) {
			mem := mapT(b, size)
			for i := 0; i < len(mem); i += 4096 {
				mem[i] = 1 // fault the pages in, as a used arena has them
			}
			b.ResetTimer()
			for range b.N {
				reg, err := n.Register(mem, localUse)
				if err != nil {
					b.Fatal(err)
				}
				if err := reg.Close(); err != nil {
					b.Fatal(err)
				}
			}
			perOp := float64(b.Elapsed().Nanoseconds()) / float64(b.N)
			b.ReportMetric(perOp/1e6*float64(1<<30)/float64(size), "ms/GiB")
		})
	}
}

func sizeName(n int) string {
	switch {
	case n >= 1<<20:
		return fmt.Sprintf("%dMiB", n>>20)
	case n >= 1<<10:
		return fmt.Sprintf("%dKiB", n>>10)
	}
	return fmt.Sprintf("%dB", n)
}

// mapT maps n bytes of NIC-safe memory until tb ends.
func mapT(tb testing.TB, n int) []byte {
	tb.Helper()
	b, err := mapAnon(n)
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { unmap(b) })
	return b
}

// BenchmarkSendCPU is SendCPU (ferrybench rdma-cpu) as a benchmark: 64
// KiB sends, 16 in flight over 8 lanes, on the simulated NIC, direct
// (peer secret) and granted, b.N sends each. It runs on the simulated
// NIC on any host, a device or not.
func BenchmarkSendCPU(b *testing.B) {
	for _, direct := range []bool{true, false} {
		name := map[bool]string{true: "direct", false: "granted"}[direct]
		b.Run(name, func(b *testing.B) {
			r, err := SendCPU(b.Context(), CPUConfig{Size: 64 << 10, Sends: b.N, InFlight: 16, Lanes: 8, Direct: direct, TCP: overTCP})
			if err != nil {
				b.Fatal(err)
			}
			b.ReportMetric(r.CPU, "cpu_us_per_send")
			b.ReportMetric(r.NIC, "nic_us_left_out")
			b.ReportMetric(r.Control, "control_per_send")
		})
	}
}
