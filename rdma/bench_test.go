package rdma

import (
	"bytes"
	"context"
	"flag"
	"fmt"
	"golang.org/x/sys/unix"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ferry-project/ferry/transport"
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

// rig is a sender and a receiver over mapped memory, the way ferryd runs
// them (Memory is the arena), with a region of the receiver's memory per
// lane, as ib_write_bw has a buffer per QP: every write carries the same
// source bytes, so writers sharing a region leave it as they found it,
// and the memory the VM touches does not grow with the writes in flight.
type rig struct {
	src  []byte
	sink *benchSink
	sess transport.Session
}

// benchSink takes every write into its memory at the address it names
// and counts the deliveries, as a receiver that checks nothing would:
// the benchmark measures the data path, and the writers rewrite their
// regions without waiting for the receiver's bookkeeping. Its addresses
// are its memory's own, so authenticated writers write directly.
type benchSink struct {
	mem       []byte
	base      uint64 // the address of mem[0]
	want      int64  // deliveries to wait for; set before the writes
	delivered atomic.Int64
	all       chan struct{} // closed at the want-th delivery
}

func (s *benchSink) Accept(addr, n uint64, key transport.Key, tag uint32) ([]byte, func(error), error) {
	addr -= s.base
	return s.mem[addr : addr+n], func(err error) {
		if err == nil {
			s.deliver()
		}
	}, nil
}

// Arrived takes a direct write as delivered.
func (s *benchSink) Arrived(tag uint32, n uint64) error {
	s.deliver()
	return nil
}

func (s *benchSink) deliver() {
	if s.delivered.Add(1) == s.want {
		close(s.all)
	}
}

// newRig makes the sender and receiver; with secret they authenticate,
// and writes from the shared registration go direct (arena-rkey mode).
func newRig(b *testing.B, f *fabric, size int, perSend bool, secret []byte) *rig {
	b.Helper()
	src := mapT(b, size)
	for i := range src {
		src[i] = byte(i * 7)
	}
	sink := &benchSink{mem: mapT(b, *lanes*size)}
	sink.base = addrOf(sink.mem)
	tx := listenT(b, f, Config{Peer: peer.Config{MaxConnsPerPeer: *lanes, Secret: secret}, Memory: src, PerSend: perSend})
	rx := listenT(b, f, Config{Peer: peer.Config{Sink: sink, Secret: secret}, Memory: sink.mem, PerSend: perSend})
	s, err := tx.Dial(context.Background(), rx.Addr().String())
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { s.Close() })
	return &rig{src: src, sink: sink, sess: s}
}

// run writes b.N times from writers goroutines, timed, after one untimed
// round of a write per writer: the session dials its lanes then, as
// ferryd's are dialed before the sends that reuse them, and as
// ib_write_bw connects its QPs before it starts its clock (a dial under
// TCG can take longer than a whole timed run).
func (r *rig) run(b *testing.B, size int) {
	b.SetBytes(int64(size))
	r.sink.want, r.sink.all = int64(*writers+b.N), make(chan struct{})
	r.sink.delivered.Store(0)
	wrote := make([]bool, *writers)
	r.writeN(b, size, *writers, wrote)
	b.ResetTimer()
	r.writeN(b, size, b.N, wrote)
	b.StopTimer()
	// Every write was delivered: the receiver's completion of the last
	// one on each lane may trail the sender's by a moment.
	select {
	case <-r.sink.all:
	case <-time.After(time.Minute):
		b.Fatalf("%d of %d writes delivered", r.sink.delivered.Load(), *writers+b.N)
	}
	for i, w := range wrote {
		if w && !bytes.Equal(r.sink.mem[i%*lanes*size:][:size], r.src) {
			b.Fatalf("writer %d's bytes differ from the source", i)
		}
	}
}

// writeN writes total times from writers goroutines, marking in wrote
// the writers that wrote.
func (r *rig) writeN(b *testing.B, size, total int, wrote []bool) {
	var next sync.Mutex
	n := 0
	var wg sync.WaitGroup
	errs := make(chan error, *writers)
	for i := range *writers {
		wg.Go(func() {
			for {
				next.Lock()
				mine := n < total
				n++
				next.Unlock()
				if !mine {
					return
				}
				// A key whose tag names the writer's region.
				key := transport.Key{0: byte(i), 1: byte(i >> 8), 15: 1}
				w := transport.Write{Src: r.src, Remote: r.sink.base + uint64(i%*lanes*size), Key: key, Tag: key.Tag(), Whole: true}
				if _, err := r.sess.Write(context.Background(), w); err != nil {
					errs <- err
					return
				}
				wrote[i] = true
			}
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		b.Fatal(err)
	}
}

// BenchmarkWrite measures writes between authenticated peers: from the
// shared registration they go direct, with no message per write.
func BenchmarkWrite(b *testing.B) {
	benchDevice(b)
	for _, size := range []int{64 << 10, 1 << 20, 4 << 20} {
		b.Run(sizeName(size), func(b *testing.B) {
			newRig(b, nil, size, false, testSecret).run(b, size)
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
			newRig(b, nil, 1<<20, mode == "per-send", nil).run(b, 1<<20)
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
				reg, err := n.Register(mem)
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

// BenchmarkSendCPU is ferry's own CPU per send, on the fake NIC (it skips
// on a device, whose work would count): 64 KiB writes, 16 in flight over
// 8 lanes, sender and receiver both in this process, so both sides'
// work counts, direct (peer secret) and granted. cpu_us_per_send is the
// process's user+system time (getrusage) per send, less the copy of
// 64 KiB timed the same way in the same run: the fake NIC's copy, which
// a real NIC does without the CPU. The fake's own bookkeeping
// (goroutines, channels, key lookups) still counts, so the figure is an
// upper bound of ferry's.
func BenchmarkSendCPU(b *testing.B) {
	if onDevice(b) {
		b.Skip("measures ferry's CPU over the fake NIC; on a device the NIC's work would count too")
	}
	const size = 64 << 10
	defer func(w, l int) { *writers, *lanes = w, l }(*writers, *lanes)
	*writers, *lanes = 16, 8
	copyUS := cpuPer(func() {
		src, dst := make([]byte, size), make([]byte, size)
		for range 20000 {
			copy(dst, src)
		}
	}, 20000)
	for _, mode := range []struct {
		name   string
		secret []byte
	}{{"direct", testSecret}, {"granted", nil}} {
		b.Run(mode.name, func(b *testing.B) {
			r := newRig(b, newFabric(), size, false, mode.secret)
			us := cpuPer(func() { r.run(b, size) }, b.N+*writers) - copyUS
			b.ReportMetric(us, "cpu_us_per_send")
			b.ReportMetric(copyUS, "copy_us_left_out")
		})
	}
}

// cpuPer is this process's user+system CPU time in µs that f took, per
// one of its n operations.
func cpuPer(f func(), n int) float64 {
	var a, z unix.Rusage
	unix.Getrusage(unix.RUSAGE_SELF, &a)
	f()
	unix.Getrusage(unix.RUSAGE_SELF, &z)
	us := func(r unix.Rusage) float64 {
		return float64(r.Utime.Sec+r.Stime.Sec)*1e6 + float64(r.Utime.Usec+r.Stime.Usec)
	}
	return (us(z) - us(a)) / float64(n)
}
