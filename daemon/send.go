package daemon

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"strconv"
	"sync"
	"syscall"
	"time"

	"github.com/rs/zerolog"
	"golang.org/x/sys/unix"

	"github.com/ferry-project/ferry/api"
	"github.com/ferry-project/ferry/arena"
	"github.com/ferry-project/ferry/config"
	"github.com/ferry-project/ferry/mooncake"
	"github.com/ferry-project/ferry/transport"
	peerport "github.com/ferry-project/ferry/transport/peer"
)

// maxWait bounds wait_ms and ?wait=: a client that wants longer asks again.
const maxWait = 10 * time.Minute

// send carries out DESIGN.md data flow 4 for one req_id: take the staged
// entry (waiting wait_ms for a racing stage), write it to the peer's slot,
// and on a broken path tear the session down, re-dial and retry
// SendRetries times. The entry is freed only after a completed write; on
// any failure it stays staged for the client to retry or delete.
func (d *Daemon) send(ctx context.Context, reqID string, req api.SendRequest) (api.SendResult, error) {
	res, isMooncake, err := d.sendResult(reqID, req)
	res.ReqID = reqID
	if err != nil {
		return res, err
	}
	wait := time.Duration(req.WaitMS) * time.Millisecond
	if req.NBytes < 0 {
		return res, apiErr(api.CodeBadRequest, "%s: nbytes %d is negative: pass the slot's nbytes, or leave it out", reqID, req.NBytes)
	}
	if req.WaitMS < 0 || wait > maxWait {
		return res, apiErr(api.CodeBadRequest, "%s: wait_ms %d is outside 0..%d", reqID, req.WaitMS, maxWait.Milliseconds())
	}

	e, err := d.reg.takeForSend(ctx, reqID, wait, func() {
		d.log.Debug().Str("req_id", reqID).Dur("wait", wait).Msg("send waiting for its req_id to be staged")
	})
	if err != nil {
		if isCode(err, api.CodeNoEmbedding) {
			d.metrics.transfers.WithLabelValues(d.tr.Name(), "no_embedding").Inc()
			d.metrics.transferFailed("no_embedding")
		}
		return res, err
	}
	res.NBytes = e.nbytes
	sent := false
	defer func() { d.reg.finishSend(e, sent) }()
	if req.NBytes > 0 && e.nbytes > req.NBytes {
		return res, apiErr(api.CodeBadRequest,
			"%s: the staged embedding has %d bytes, more than the %d of the receive slot at session %s: ask the receiver for a slot of %d bytes; the staged embedding is kept",
			reqID, e.nbytes, req.NBytes, req.Session, e.nbytes)
	}

	res, err = d.sendFrom(ctx, res, req, isMooncake, d.entrySource(e, 0, e.nbytes), sendKept{
		what: reqID, log: d.log.With().Str("req_id", reqID).Logger(),
		staging: "the staged embedding out of the arena", stays: "it stays staged",
		kept: "the staged embedding is kept", resend: ", or DELETE /v1/embeddings/" + reqID,
	})
	sent = err == nil
	return res, err
}

// sendKept is how a send's messages name what it sends, what stays
// after a failure, and what else the client may do.
type sendKept struct {
	what    string // the req_id, or "write" for POST /v1/writes
	log     zerolog.Logger
	staging string // "reading <staging> failed"
	stays   string // what stays after that
	kept    string // what stays after a failed write
	resend  string // after "resend when ...": the client's other way out
}

// sendFrom writes src (res.NBytes bytes) to req's slot, striped over TCP
// as tcp_stripes says, and phrases the outcome: a send's, or an inline
// write's (POST /v1/writes).
func (d *Daemon) sendFrom(ctx context.Context, res api.SendResult, req api.SendRequest, isMooncake bool, src source, k sendKept) (api.SendResult, error) {
	n := src.n
	ctx, cancel := context.WithTimeout(ctx, d.cfg.SendTimeout.D())
	defer cancel()
	// Whole (a direct write's condition) only when the sender knows the
	// slot is exactly this size: a longer direct write would run past the
	// slot before the receiver could see it.
	w := transport.Write{Remote: req.BufferAddress, Key: req.Key, Tag: req.Key.Tag(), Whole: req.NBytes == n}
	start := time.Now()
	stripes := 1
	if !isMooncake && d.tr.Name() == string(config.TransportTCP) {
		stripes = d.cfg.TCPStripes
	}
	dl, lastErr := d.deliverSend(ctx, req.Session, w, src, stripes, k.log)
	res.Attempts, res.Writes = dl.attempts, dl.writes
	if dl.transport != "" {
		res.Transport = dl.transport
	}
	res.SharedMR = sharedMR(dl.report)
	if errors.As(lastErr, new(*copyOutError)) {
		d.failed("staging", "failed", time.Since(start))
		return res, apiErr(internalCode(lastErr),
			"%s: reading %s failed: %v; %s", k.what, k.staging, lastErr, k.stays)
	}
	var rf *transport.Refusal
	if errors.As(lastErr, &rf) {
		d.failed(rf.Code.Label(), "refused", time.Since(start))
		return res, apiErr(api.CodeRefused,
			"%s: the receiver at session %s refused the write of %d bytes to %#x: %v; %s%s",
			k.what, req.Session, n, req.BufferAddress, lastErr, k.kept, lostCompletion(lastErr, dl.attempts))
	}
	elapsed := time.Since(start)
	res.Millis = float64(elapsed.Microseconds()) / 1000
	if lastErr != nil {
		d.failed(retCode(lastErr), "failed", elapsed)
		return res, apiErr(api.CodeTransferFailed,
			"transfer of %s failed (session=%s, nbytes=%d, ret=%s) after %d attempt(s) in %.1f ms: %v; %s: resend %s%s",
			k.what, req.Session, n, retCode(lastErr), res.Attempts, res.Millis, lastErr, k.kept, whenToResend(lastErr), k.resend)
	}
	if elapsed > 0 {
		res.GBps = float64(n) / elapsed.Seconds() / 1e9
	}
	d.metrics.transfers.WithLabelValues(d.tr.Name(), "ok").Inc()
	d.metrics.transferBytes.WithLabelValues(d.tr.Name()).Add(float64(n))
	d.metrics.transferSeconds.WithLabelValues(d.tr.Name(), "ok").Observe(elapsed.Seconds())
	slow := elapsed > d.slowThreshold()
	if slow {
		d.metrics.slowTransfers.WithLabelValues(d.tr.Name()).Inc()
	}
	// The seeds' line: slow transfers and per-send registrations, at INFO.
	if slow || !res.SharedMR {
		what := "slow transfer"
		if !slow {
			what = "transfer with a per-send registration"
		}
		k.log.Info().Str("session", req.Session).Int64("nbytes", n).
			Float64("ms", res.Millis).Str("transport", res.Transport).Bool("shared_mr", res.SharedMR).
			Int("attempts", res.Attempts).Msg(what)
	}
	return res, nil
}

// delivery is what writing one piece to a peer took.
type delivery struct {
	transport string // the data plane the last attempt ran on; "" if none was dialed
	attempts  int
	writes    int // pieces written at once (tcp_stripes), else 1
	report    transport.Report
}

// source is where a write's bytes lie: n bytes at offset off of mem
// (the arena's memory, a region's). inPlace says the RDMA NIC reads mem
// itself: GPU memory it registered.
type source struct {
	mem     arena.Memory
	off, n  int64
	inPlace bool
}

// part is the bytes [from, to) of s.
func (s source) part(from, to int64) source {
	s.off, s.n = s.off+from, to-from
	return s
}

// entrySource is n bytes at off of the staged entry e.
func (d *Daemon) entrySource(e *entry, off, n int64) source {
	inPlace := d.dp.inPlace()
	if e.region != nil { // another device's arena
		inPlace = e.region.inPlace()
	}
	return source{mem: d.reg.entryMemory(e), off: e.slice.Offset + off, n: n, inPlace: inPlace}
}

// stageChunk bounds the host memory one write or request over a stream
// (TCP, Mooncake's data port, the control API) stages for GPU memory at
// once. A write's GPU source is copied out this many bytes at a time:
// larger writes go as consecutive writes of this many bytes, each
// copied out, written and its staging released before the next is
// copied, so a 10 GiB region takes 16 MiB of host memory, not 10 GiB.
// A write landing in GPU memory, an upload and a read of a slot back
// take one loan of it, each chunk copied before the next is read (the
// RDMA bounce path, whose NIC needs a write's memory whole, does not).
// At 16 MiB a write's header and reply (some 50 µs on loopback) are
// about 1% of the 5 ms its bytes take at 3 GB/s, and a full batch
// window (batchWindow writes of a chunk) fits the default 256 MiB
// pinned bounce area. Consecutive chunks of a write touch, so the
// receiver tracks them as one range (maxPieces).
const stageChunk = 16 << 20

// copyOutError is a write stopped copying its source out of GPU memory
// into host staging: this host's failure (no staging memory now, a CUDA
// error), not the session's, which no teardown or re-dial mends.
type copyOutError struct{ err error }

func (e *copyOutError) Error() string { return e.err.Error() }
func (e *copyOutError) Unwrap() error { return e.err }

// deliver writes src to w's slot on session: on a broken path it tears
// the session down, re-dials and tries again, SendRetries times. A
// refusal, ctx's end, a peer no re-dial can fix (secrets or versions
// differ, or its daemon stalled), or a failed copy out of GPU memory ends
// it at once. The error
// is the last attempt's.
func (d *Daemon) deliver(ctx context.Context, session string, w transport.Write, src source, log zerolog.Logger) (delivery, error) {
	var dl delivery
	var err error
	for attempt := 1; attempt <= d.cfg.SendRetries+1; attempt++ {
		dl.attempts = attempt
		if attempt > 1 {
			d.metrics.retries.Inc()
		}
		log.Debug().Str("session", session).Int64("nbytes", src.n).Int("attempt", attempt).Msg("write attempt")
		var sess transport.Session
		var p *peer
		sess, p, err = d.sessions.get(ctx, session)
		if err == nil {
			dl.transport = sess.Transport()
			dl.report, err = d.write(ctx, sess, w, src)
			if errors.As(err, new(*copyOutError)) {
				// Whatever reached the session, it is not to blame.
				return dl, err
			}
			if ctx.Err() == nil { // a write its own deadline or client ended says nothing of the session
				p.outcome(err)
			}
		}
		if err == nil || transport.IsRefusal(err) {
			return dl, err
		}
		if ctx.Err() != nil {
			// This write's own deadline, or its client gone: the session
			// is not to blame, and tearing it down would break every
			// other write on it.
			return dl, err
		}
		if errors.Is(err, transport.ErrAuth) || errors.Is(err, transport.ErrIncompatible) {
			return dl, err // the peers' secrets or versions differ: no re-dial can change that
		}
		if errors.Is(err, transport.ErrStalled) {
			// The path is sound and the peer's daemon took nothing for
			// io_timeout: a re-dial would reach the same stopped process,
			// and a teardown would fail the writes queued behind this one
			// for no reason of their own.
			return dl, err
		}
		d.metrics.sessionFailed(session)
		p.teardown(sess)
		if attempt <= d.cfg.SendRetries {
			d.failWarn(&log).Str("session", session).Int("attempt", attempt).
				Str("ret", retCode(err)).Err(err).Msg("write failed; session torn down, re-dialing and retrying")
		}
	}
	return dl, err
}

// write is sess.Write of src to w's slot. Host memory goes as it lies,
// and GPU memory the NIC reads in place as a device range on the RDMA
// transport's sessions; for any other session (TCP, a Mooncake peer, or
// RDMA where the NIC does not reach that GPU memory) GPU memory is
// copied out to host staging, stageChunk bytes at a time. The report
// sums its writes'.
func (d *Daemon) write(ctx context.Context, sess transport.Session, w transport.Write, src source) (transport.Report, error) {
	if src.inPlace && sess.Transport() == d.dp.rdma.Name() {
		w.Device = transport.Range{Addr: src.mem.Base() + uint64(src.off), Len: uint64(src.n)}
		return sess.Write(ctx, w)
	}
	chunk := src.n
	if src.mem.Host() == nil {
		chunk = stageChunk
	}
	if src.n > chunk {
		w.Whole = false // each chunk is a piece of the slot, its range counted by the receiver
	}
	var rep transport.Report
	for at := int64(0); ; {
		n := min(chunk, src.n-at)
		buf, release, err := arena.Readable(src.mem, arena.Slice{Offset: src.off + at, Len: n}, 0, n)
		if err != nil {
			return rep, &copyOutError{fmt.Errorf("copying %d bytes of %s memory out to host memory for a %s session: %w", n, src.mem.Kind(), sess.Transport(), err)}
		}
		piece := w
		piece.Src, piece.Remote = buf, w.Remote+uint64(at)
		r, err := sess.Write(ctx, piece)
		release()
		rep = addReport(rep, r)
		at += n
		if err != nil || at >= src.n {
			return rep, err
		}
	}
}

// addReport is what two writes of one piece took between them: their
// messages and copies summed, and the costlier registration.
func addReport(a, b transport.Report) transport.Report {
	return transport.Report{Registration: max(a.Registration, b.Registration), Copied: a.Copied + b.Copied, Messages: a.Messages + b.Messages}
}

// stripeMin is the smallest piece a striped send puts on a connection:
// below it a piece's header, reply and wake-ups cost more than the
// parallel copies save.
const stripeMin = 1 << 20

// deliverSend is deliver for a send's whole embedding. Over TCP a large
// one goes as up to tcp_stripes pieces at once, each on a connection of
// its own with deliver's retries: a single connection's copies run on
// one core at each end, which caps a stream well below a fast NIC. The
// receiver counts the pieces' ranges, so the slot arrives once, whole;
// a failed piece fails the send (the embedding stays staged), and a
// resend writes every piece again. stripes is 1 for RDMA (a direct
// write must be the slot's whole content) and Mooncake's segments.
func (d *Daemon) deliverSend(ctx context.Context, session string, w transport.Write, src source, stripes int, log zerolog.Logger) (delivery, error) {
	n := src.n
	k := min(stripes, d.cfg.MaxConns, int(n/stripeMin))
	if k < 2 {
		dl, err := d.deliver(ctx, session, w, src, log)
		dl.writes = 1
		return dl, err
	}
	per := (n + int64(k) - 1) / int64(k)
	type result struct {
		dl  delivery
		err error
	}
	results := make([]result, k)
	var wg sync.WaitGroup
	for i := range int64(k) {
		piece := w
		piece.Whole = false
		piece.Remote = w.Remote + uint64(i*per)
		wg.Add(1)
		go func() {
			defer wg.Done()
			dl, err := d.deliver(ctx, session, piece, src.part(i*per, min((i+1)*per, n)), log)
			results[i] = result{dl, err}
		}()
	}
	wg.Wait()
	out := delivery{writes: k}
	var err error
	for _, r := range results {
		out.transport = cmp.Or(out.transport, r.dl.transport)
		out.attempts = max(out.attempts, r.dl.attempts)
		out.report = addReport(out.report, r.dl.report)
		// A refusal says most about why (no slot, a slot too small):
		// report it before a broken path's error.
		if r.err != nil && (err == nil || transport.IsRefusal(r.err) && !transport.IsRefusal(err)) {
			err = r.err
		}
	}
	return out, err
}

// whenToResend says when sending again after err can work.
func whenToResend(err error) string {
	switch {
	case errors.Is(err, peerport.ErrMisdirected):
		return "once the session is the receiving daemon's --advertise and leads to it with no relay in between"
	case errors.Is(err, transport.ErrAuth):
		return "once both daemons hold the same peer secret (--peer-secret-file)"
	case errors.Is(err, transport.ErrIncompatible):
		return "once both daemons run the same ferry release"
	}
	return "when the peer is back"
}

// sharedMR says a write took no memory of its own for the NIC: it went
// from where its source lay, inside the shared registration or with
// nothing to register (TCP). A per-send registration or a copy through a
// bounce buffer is what the seeds' log line is for.
func sharedMR(r transport.Report) bool {
	return r.Registration != transport.RegisteredPerSend && r.Copied == 0
}

// failed counts a send that did not deliver; took is zero when no write
// was attempted.
func (d *Daemon) failed(reason, outcome string, took time.Duration) {
	d.metrics.transfers.WithLabelValues(d.tr.Name(), outcome).Inc()
	d.metrics.transferFailed(reason)
	if took > 0 {
		d.metrics.transferSeconds.WithLabelValues(d.tr.Name(), outcome).Observe(took.Seconds())
	}
}

// lostCompletion explains a retry refused because the slot is full: the
// attempt before it broke after its bytes may all have landed, only the
// completion being lost on the way back.
func lostCompletion(err error, attempt int) string {
	var rf *transport.Refusal
	if attempt == 1 || !errors.As(err, &rf) || rf.Code != transport.SlotBusy {
		return ""
	}
	return fmt.Sprintf(". Attempt %d broke, yet the slot now holds data: most likely that attempt's bytes all landed and only its completion was lost on the way back; "+
		"unless another sender was given this slot, the data was delivered (the receiver's wait returns it): then DELETE the staged embedding", attempt-1)
}

// retCode names the failure the way an operator greps for it: the verbs
// completion status (RETRY_EXC_ERR, REM_ACCESS_ERR), the errno
// (ECONNREFUSED, ECONNRESET, EPIPE), a Mooncake peer's "rejected",
// "timeout", "eof" or "error".
func retCode(err error) string {
	var errno syscall.Errno
	var nerr net.Error
	switch {
	case err == nil:
		return "0"
	case transport.StatusName(err) != "":
		return transport.StatusName(err)
	case mooncake.IsRejected(err):
		return "rejected"
	case errors.As(err, &errno):
		if name := unix.ErrnoName(errno); name != "" {
			return name
		}
		return "errno " + strconv.Itoa(int(errno))
	case errors.Is(err, context.DeadlineExceeded), errors.Is(err, os.ErrDeadlineExceeded),
		errors.As(err, &nerr) && nerr.Timeout():
		return "timeout"
	case errors.Is(err, io.EOF), errors.Is(err, io.ErrUnexpectedEOF):
		return "eof"
	case errors.Is(err, transport.ErrClosed):
		return "closed"
	case errors.Is(err, transport.ErrAuth):
		return "auth"
	case errors.Is(err, transport.ErrIncompatible):
		return "incompatible"
	}
	return "error"
}
