package e2e

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"maps"
	"math"
	"math/rand/v2"
	"os"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ferry-project/ferry/api"
	"github.com/ferry-project/ferry/client"
)

// The soak: many clients staging, sending and receiving mixed sizes across
// two daemons for a while, with deletes, freed slots and timeouts mixed
// in. make soak runs it for SOAK_DURATION; make test runs it for 10 s.
const (
	soakClients  = 64
	soakMinBytes = 1 << 10
	soakMaxBytes = 16 << 20
	// soakRSSBound is how much a daemon's anonymous memory (its Go heap
	// and stacks; the arena is a file mapping) may grow from its level
	// after the first transfers to the end.
	soakRSSBound = 64 << 20
)

// soakFloor is the fewest transfers a soak of dur must verify byte-exact:
// one per client every 8 s, about a quarter of the lowest rate measured
// on a shared 2-core machine with race-built daemons (10 s soaks verified
// 698, 407 and 315 transfers, under a load average of 4 to 8 from other
// test runs: 0.49 per client-second at the lowest), so that a slower CI
// machine passes and a soak whose sends mostly fail does not.
func soakFloor(dur time.Duration) int {
	return int(dur.Seconds() * soakClients / 8)
}

// soakDuration is FERRY_SOAK_DURATION (make soak sets it), else 10 s.
func soakDuration(t *testing.T) time.Duration {
	v := os.Getenv("FERRY_SOAK_DURATION")
	if v == "" {
		return 10 * time.Second
	}
	d, err := time.ParseDuration(v)
	if err != nil || d <= 0 {
		t.Fatalf("FERRY_SOAK_DURATION=%q is not a positive duration, e.g. 5m", v)
	}
	return d
}

// soakTally counts what became of every transfer a soak client began:
// each ends once, verified (ok) or failed with its reason (fail).
type soakTally struct {
	mu       sync.Mutex
	open     map[string]bool // begun, not yet ended
	started  int
	staged   int // stages the sender's daemon took
	verified int
	bytes    int64
	// lost counts the verified transfers no send of which completed at the
	// sender's daemon, the bytes having landed with the completion lost:
	// no daemon counts them as sent. lostBytes is their bytes.
	lost       int
	lostBytes  int64
	failed     map[string]int // by reason
	notes      map[string]int // how the timeouts and races resolved
	unexpected []string
}

func newSoakTally() *soakTally {
	return &soakTally{open: map[string]bool{}, failed: map[string]int{}, notes: map[string]int{}}
}

func (s *soakTally) begin(id string) {
	s.mu.Lock()
	s.open[id] = true
	s.started++
	s.mu.Unlock()
}

// end marks id's transfer accounted for; one accounted for twice is
// unexpected. It is called with s.mu held.
func (s *soakTally) end(id string) {
	if !s.open[id] {
		s.unexpected = append(s.unexpected, id+": accounted for twice")
	}
	delete(s.open, id)
}

func (s *soakTally) stagedOne() {
	s.mu.Lock()
	s.staged++
	s.mu.Unlock()
}

// ok accounts for a transfer whose bytes were verified at the receiver;
// completed says whether a send of it completed at the sender's daemon
// (it answered 200, or would have to a client that stopped waiting).
func (s *soakTally) ok(id string, n int, completed bool) {
	s.mu.Lock()
	s.end(id)
	s.verified++
	s.bytes += int64(n)
	if !completed {
		s.lost++
		s.lostBytes += int64(n)
	}
	s.mu.Unlock()
}

func (s *soakTally) fail(id, reason string) {
	s.mu.Lock()
	s.end(id)
	s.failed[reason]++
	s.mu.Unlock()
}

func (s *soakTally) note(what string) {
	s.mu.Lock()
	s.notes[what]++
	s.mu.Unlock()
}

// wrong records something the failure model does not allow: the soak
// fails. It does not account for the transfer; ok or fail does that, once.
func (s *soakTally) wrong(id string, format string, args ...any) {
	s.mu.Lock()
	s.unexpected = append(s.unexpected, id+": "+fmt.Sprintf(format, args...))
	s.mu.Unlock()
}

// soakPool is random bytes every transfer takes its data from, at a random
// offset and stamped with its number, so that no two transfers carry the
// same bytes and none costs a fresh random fill.
var soakPool = func() []byte {
	r := rand.New(rand.NewPCG(7, 11))
	b := make([]byte, 2*soakMaxBytes)
	for i := 0; i < len(b); i += 8 {
		binary.LittleEndian.PutUint64(b[i:], r.Uint64())
	}
	return b
}()

type soakClient struct {
	rng   *rand.Rand
	tally *soakTally
	a, b  *daemon
}

// procRSSAnon is a process's anonymous resident memory, from
// /proc/PID/status.
func procRSSAnon(t *testing.T, pid int) int64 { return procStatusBytes(t, pid, "RssAnon") }

// procStatusBytes reads a field of /proc/PID/status counted in kB, in
// bytes.
func procStatusBytes(t *testing.T, pid int, field string) int64 {
	t.Helper()
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		t.Fatal(err)
	}
	for _, line := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(line, field+":"); ok {
			kb, err := strconv.ParseInt(strings.TrimSuffix(strings.TrimSpace(v), " kB"), 10, 64)
			if err != nil {
				t.Fatalf("reading %s of pid %d: %q", field, pid, line)
			}
			return kb << 10
		}
	}
	t.Fatalf("pid %d has no %s line", pid, field)
	return 0
}

func mib(n int64) string { return fmt.Sprintf("%.1f MiB", float64(n)/(1<<20)) }

func TestSoak(t *testing.T) {
	dur := soakDuration(t)
	dir := t.TempDir()
	flags := []string{"--arena-size", "1GiB", "--log-level", "info", "--send-timeout", "30s"}
	a := startDaemon(t, dir, "a", flags...)
	b := startDaemon(t, dir, "b", flags...)
	type base struct {
		goroutines, fds int
		rss             int64
	}
	var baseA, baseB base
	baseA.goroutines, baseA.fds = a.idleResources(t)
	baseB.goroutines, baseB.fds = b.idleResources(t)

	tally := newSoakTally()
	ctx, cancel := context.WithTimeout(context.Background(), dur)
	defer cancel()
	var wg sync.WaitGroup
	var warm sync.WaitGroup // the RSS baseline waits for each client's first transfer
	warm.Add(soakClients)
	for i := range soakClients {
		c := &soakClient{rng: rand.New(rand.NewPCG(uint64(i), 99)), tally: tally, a: a, b: b}
		wg.Go(func() {
			for n := 0; ctx.Err() == nil || n == 0; n++ {
				c.transfer(fmt.Sprintf("soak-%d-%d", i, n))
				if n == 0 {
					warm.Done()
				}
			}
		})
	}
	warm.Wait()
	baseA.rss, baseB.rss = procRSSAnon(t, a.cmd.Process.Pid), procRSSAnon(t, b.cmd.Process.Pid)
	wg.Wait()

	// Sessions keep up to max_conns connections each: tear them down so
	// what is left to count is what leaked.
	for _, d := range []*daemon{a, b} {
		ss, err := d.c.Sessions(ctxT(t))
		if err != nil {
			t.Fatal(err)
		}
		for _, s := range ss {
			if err := d.c.Teardown(ctxT(t), s.ID); err != nil {
				t.Fatal(err)
			}
		}
	}
	t.Logf("soak: %s, %d clients, 2 daemons sending to each other", dur, soakClients)
	failed := 0
	for _, n := range tally.failed {
		failed += n
	}
	floor := soakFloor(dur)
	t.Logf("transfers: %d started, %d verified byte-exact (%s, %.1f MB/s; floor %d), %d failed with a reason, %d unaccounted",
		tally.started, tally.verified, mib(tally.bytes), float64(tally.bytes)/dur.Seconds()/1e6, floor, failed, len(tally.open))
	for _, kv := range sorted(tally.failed) {
		t.Logf("  failed: %-60s %6d", kv.k, kv.v)
	}
	for _, kv := range sorted(tally.notes) {
		t.Logf("  note:   %-60s %6d", kv.k, kv.v)
	}
	if tally.verified < floor {
		t.Errorf("%d transfers verified byte-exact in %s, fewer than the floor of %d", tally.verified, dur, floor)
	}
	if len(tally.open) != 0 || tally.verified+failed != tally.started {
		open := slices.Sorted(maps.Keys(tally.open))
		t.Errorf("%d transfers started, %d verified and %d failed: %d unaccounted for, e.g. %v",
			tally.started, tally.verified, failed, len(open), open[:min(len(open), 10)])
	}
	for i, u := range tally.unexpected {
		if i == 20 {
			t.Errorf("… and %d more", len(tally.unexpected)-20)
			break
		}
		t.Errorf("unexpected outcome: %s", u)
	}
	// The daemons' own counts agree with the clients': each completed
	// send is a transfer verified at the receiver, each stage taken is
	// one a client made, and no entry or slot was swept for want of one.
	var sent, sentBytes, staged, swept float64
	for _, d := range []*daemon{a, b} {
		m := d.metrics(t)
		sent += metricSum(m, "ferry_transfers_total", `outcome="ok"`)
		sentBytes += metricSum(m, "ferry_transfer_bytes_total")
		staged += metricSum(m, "ferry_staged_total")
		swept += metricSum(m, "ferry_swept_total")
	}
	t.Logf("daemons' metrics: %.0f sends completed (%s), %.0f stages, %.0f swept; clients: %d verified, %d of them with the completion lost, %d stages",
		sent, mib(int64(sentBytes)), staged, swept, tally.verified, tally.lost, tally.staged)
	if int(sent) != tally.verified-tally.lost || int64(sentBytes) != tally.bytes-tally.lostBytes {
		t.Errorf("the daemons completed %.0f sends of %.0f bytes; the clients verified %d of %d bytes whose send completed",
			sent, sentBytes, tally.verified-tally.lost, tally.bytes-tally.lostBytes)
	}
	if int(staged) != tally.staged {
		t.Errorf("the daemons counted %.0f stages; the clients made %d", staged, tally.staged)
	}
	if swept != 0 {
		t.Errorf("the daemons swept %.0f staged entries or receive slots: a client left them behind", swept)
	}
	for _, x := range []struct {
		name string
		d    *daemon
		base base
	}{{"a", a, baseA}, {"b", b, baseB}} {
		st := x.d.holdsNothing(t)
		g, f := x.d.noLeaks(t, x.base.goroutines, x.base.fds)
		rss := procRSSAnon(t, x.d.cmd.Process.Pid)
		t.Logf("daemon %s: arena used %d B, staged %d, receives %d; goroutines %d (baseline %d), open files %d (baseline %d); RssAnon %s after warm-up, %s at the end (%+.1f MiB, bound %s)",
			x.name, st.Memory.Used, st.Staged, st.Receives, g, x.base.goroutines, f, x.base.fds, mib(x.base.rss), mib(rss), float64(rss-x.base.rss)/(1<<20), mib(soakRSSBound))
		if rss-x.base.rss > soakRSSBound {
			t.Errorf("daemon %s's anonymous memory grew by %s, beyond the %s bound", x.name, mib(rss-x.base.rss), mib(soakRSSBound))
		}
		x.d.alive(t)
	}
}

type kv struct {
	k string
	v int
}

func sorted(m map[string]int) []kv {
	out := make([]kv, 0, len(m))
	for k, v := range m {
		out = append(out, kv{k, v})
	}
	sort.Slice(out, func(i, j int) bool { return out[i].k < out[j].k })
	return out
}

// transfer runs one transfer of a random size in a random direction, in
// one of the ways a client may go about it, and accounts for its outcome.
func (c *soakClient) transfer(id string) {
	c.tally.begin(id)
	src, dst := c.a, c.b
	if c.rng.IntN(2) == 0 {
		src, dst = dst, src
	}
	// Sizes spread evenly over the powers of two from 1 KiB to 16 MiB.
	n := int(math.Exp(math.Log(soakMinBytes) + c.rng.Float64()*(math.Log(soakMaxBytes)-math.Log(soakMinBytes))))
	off := c.rng.IntN(len(soakPool) - n)
	data := append([]byte(nil), soakPool[off:off+n]...)
	copy(data, id) // unique, even where two transfers share an offset

	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	if _, err := src.c.Stage(ctx, id, []int64{int64(n)}, "u8", bytes.NewReader(data), int64(n)); err != nil {
		c.tally.fail(id, "stage: "+c.reason(id, err))
		return
	}
	c.tally.stagedOne()
	slot, err := dst.c.Receive(ctx, id, int64(n))
	if err != nil {
		c.tally.fail(id, "receive slot: "+c.reason(id, err))
		c.drop(src, id)
		return
	}
	req := api.SendRequest{Session: slot.Session, BufferAddress: slot.BufferAddress, Key: slot.Key}

	switch k := c.rng.IntN(100); {
	case k < 6: // the sender deletes its entry, then sends anyway
		if err := src.c.Delete(ctx, id); err != nil {
			c.tally.wrong(id, "delete of a staged entry: %v", err)
		}
		_, err := src.c.Send(ctx, id, req)
		c.expect(id, err, api.CodeNoEmbedding, "no_embedding: deleted before the send")
		c.free(dst, id)
	case k < 12: // the receiver frees its slot before the send
		c.free(dst, id)
		_, err := src.c.Send(ctx, id, req)
		c.expect(id, err, api.CodeRefused, "refused: the slot was freed before the send")
		c.drop(src, id)
	case k < 18: // the sender deletes its entry while it is being sent
		sent := make(chan error, 1)
		go func() { _, err := src.c.Send(ctx, id, req); sent <- err }()
		derr := src.c.Delete(ctx, id)
		serr := <-sent
		switch {
		case derr == nil: // deleted before the send took it
			c.expect(id, serr, api.CodeNoEmbedding, "no_embedding: deleted before the send took it")
			c.free(dst, id)
		case client.Code(derr) == api.CodeBusy || client.Code(derr) == api.CodeNoEmbedding:
			c.tally.note("delete racing a send: " + client.Code(derr))
			c.settle(id, serr, src, dst, req, data)
		default:
			c.tally.wrong(id, "delete racing a send: %v", derr)
			c.settle(id, serr, src, dst, req, data)
		}
	case k < 30: // the client gives up on the send after a few milliseconds
		sctx, scancel := context.WithTimeout(ctx, time.Duration(1+c.rng.IntN(30))*time.Millisecond)
		_, err := src.c.Send(sctx, id, req)
		scancel()
		if err != nil && errors.Is(err, context.DeadlineExceeded) {
			c.tally.note("send abandoned by its client")
			c.afterTimeout(id, src, dst, req, data)
			return
		}
		c.settle(id, err, src, dst, req, data)
	case k < 36: // the receiver's wait times out before the send, then it waits again
		if _, err := dst.c.Wait(ctx, id, time.Millisecond); client.Code(err) != api.CodeTimeout {
			c.tally.wrong(id, "a wait before the send: %v, want a timeout", err)
		} else {
			c.tally.note("receiver wait timed out before the send")
		}
		_, err := src.c.Send(ctx, id, req)
		c.settle(id, err, src, dst, req, data)
	default:
		_, err := src.c.Send(ctx, id, req)
		c.settle(id, err, src, dst, req, data)
	}
}

// settle accounts for a send that answered: delivered and verified, or
// failed with its reason and cleaned up.
func (c *soakClient) settle(id string, err error, src, dst *daemon, req api.SendRequest, data []byte) {
	if err != nil {
		c.tally.fail(id, "send: "+c.reason(id, err))
		c.drop(src, id)
		c.free(dst, id)
		return
	}
	c.verify(id, dst, data, true)
}

// afterTimeout is what a client does when it stopped waiting for a send
// (docs/reliability.md, "a send without an answer"): once the daemon has
// finished or cancelled it, an entry gone means delivered; else it resends
// to the same slot. A resend can meet the abandoned request, which may
// start after its client left, still holding the entry (busy) or done with
// it (no_embedding): then it looks again. One refused because the slot
// already holds the data means the first write landed and only its
// completion was lost.
func (c *soakClient) afterTimeout(id string, src, dst *daemon, req api.SendRequest, data []byte) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	tick := time.NewTicker(5 * time.Millisecond) // a poll: the entry's state is the event
	defer tick.Stop()
	for ; ; <-tick.C {
		emb, err := src.c.Embedding(ctx, id)
		switch {
		case client.Code(err) == api.CodeNoEmbedding:
			c.tally.note("abandoned send: had completed")
			c.verify(id, dst, data, true)
			return
		case err != nil:
			c.tally.wrong(id, "looking up an abandoned send: %v", err)
			c.tally.fail(id, "unexpected")
			c.free(dst, id)
			return
		case emb.State != "staged":
			continue // still being sent, or cancelled
		}
		_, err = src.c.Send(ctx, id, req)
		switch {
		case client.Code(err) == api.CodeBusy, client.Code(err) == api.CodeNoEmbedding:
			// The abandoned request started after all: still going, or done.
			c.tally.note("abandoned send: resend met it " + client.Code(err) + ", looked again")
			continue
		case client.Code(err) == api.CodeRefused && strings.Contains(err.Error(), "already holds its data"):
			c.tally.note("abandoned send: completion lost after the bytes landed; resend refused, data verified")
			c.drop(src, id)
			c.verify(id, dst, data, false)
			return
		case err == nil:
			c.tally.note("abandoned send: resent")
		}
		c.settle(id, err, src, dst, req, data)
		return
	}
}

// verify reads the transfer's bytes at the receiver and frees the slot;
// completed is as for soakTally.ok.
func (c *soakClient) verify(id string, dst *daemon, data []byte, completed bool) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	got, err := dst.c.Wait(ctx, id, 30*time.Second)
	switch {
	case err != nil:
		c.tally.wrong(id, "the send completed but the receiver has no data: %v", err)
		c.tally.fail(id, "unexpected")
	case !bytes.Equal(got, data):
		c.tally.wrong(id, "the receiver holds %d bytes that differ from the %d sent", len(got), len(data))
		c.tally.fail(id, "unexpected")
	default:
		c.tally.ok(id, len(data), completed)
	}
	c.free(dst, id)
}

// expect accounts for a failure the client provoked.
func (c *soakClient) expect(id string, err error, code, reason string) {
	if client.Code(err) != code {
		c.tally.wrong(id, "%s: got %v", reason, err)
		reason = "unexpected"
	}
	c.tally.fail(id, reason)
}

// reason is the failure's error code, for failures the failure model
// allows under load; anything else is unexpected.
func (c *soakClient) reason(id string, err error) string {
	switch code := client.Code(err); code {
	case api.CodeArenaFull, api.CodeTransferFailed:
		return code
	}
	c.tally.wrong(id, "%v", err)
	return "unexpected"
}

func (c *soakClient) drop(d *daemon, id string) {
	if err := d.c.Delete(context.Background(), id); err != nil && client.Code(err) != api.CodeNoEmbedding {
		c.tally.wrong(id, "deleting the staged entry: %v", err)
	}
}

func (c *soakClient) free(d *daemon, id string) {
	if err := d.c.FreeReceive(context.Background(), id); err != nil && client.Code(err) != api.CodeNotFound {
		c.tally.wrong(id, "freeing the receive slot: %v", err)
	}
}
