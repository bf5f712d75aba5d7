package daemon

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"time"
	"unsafe"

	"github.com/rs/zerolog"

	"github.com/ferry-project/ferry/api"
	"github.com/ferry-project/ferry/internal/loglimit"
	"github.com/ferry-project/ferry/internal/size"
	"github.com/ferry-project/ferry/mooncake"
	"github.com/ferry-project/ferry/transport"
)

const (
	// batchWindow is how many of one batch's writes are in flight at
	// once: enough to keep a session's connections (or QPs) busy with
	// page-sized pieces, few enough that one batch cannot starve the rest.
	batchWindow = 16
	// keptTransfers is how many ended batches GET /v1/transfers/{id} can
	// still report; the oldest go first.
	keptTransfers = 4096
	// maxRunning bounds the batches running at once: each holds up to
	// batchWindow writes in flight and its sources claimed.
	maxRunning = 256
	// maxHeld bounds the bytes the running batches hold between them for
	// their writes and destinations (48 bytes each, and the destinations'
	// sessions). A batch at api's limits holds some 50 MiB; a batch of
	// 10,000 pages, some 500 KiB.
	maxHeld = 256 << 20
	// maxReading bounds the transfer bodies read and checked at once: one
	// of 16 MiB holds some 150 MiB while it is (the body, its items, their
	// writes), so a burst of them waits its turn rather than multiplying
	// that. A body of 10,000 items is read in a few milliseconds, so
	// turns come quickly.
	maxReading = 4
	// maxSessionLen bounds a session a client names: a host:port (a DNS
	// name is at most 253 bytes), or Mooncake's mooncake://host:port. A
	// session appears in a failed transfer's error, which is kept.
	maxSessionLen = 300
)

// piece is one write of a batch: items contiguous at both ends merged.
type piece struct {
	item           int // the first item it covers, for error messages
	src, dst       int
	srcOff, dstOff int64
	n              int64
}

// plan checks a batch's items against its sources' sizes and its
// destinations, and merges adjacent items into pieces.
func plan(req api.TransferRequest, srcs []batchSource) ([]piece, int64, error) {
	if len(req.Items) == 0 {
		return nil, 0, apiErr(api.CodeBadRequest, "the transfer has no items: give at least one [source, source_offset, destination, destination_offset, nbytes]")
	}
	ps := make([]piece, len(req.Items))
	var total int64
	for i, it := range req.Items {
		if len(it) != api.ItemFields {
			return nil, 0, apiErr(api.CodeBadRequest,
				"item %d has %d fields, not the %d of [source, source_offset, destination, destination_offset, nbytes]", i, len(it), api.ItemFields)
		}
		p := piece{item: i, src: int(it[api.ItemSource]), srcOff: it[api.ItemSourceOffset],
			dst: int(it[api.ItemDestination]), dstOff: it[api.ItemDestinationOffset], n: it[api.ItemNBytes]}
		switch {
		case it[api.ItemSource] < 0 || it[api.ItemSource] >= int64(len(srcs)):
			return nil, 0, apiErr(api.CodeBadRequest, "item %d names source %d, but the transfer lists %d sources (indexes from 0)", i, it[api.ItemSource], len(srcs))
		case it[api.ItemDestination] < 0 || it[api.ItemDestination] >= int64(len(req.Destinations)):
			return nil, 0, apiErr(api.CodeBadRequest, "item %d names destination %d, but the transfer lists %d destinations (indexes from 0)", i, it[api.ItemDestination], len(req.Destinations))
		case p.n <= 0:
			return nil, 0, apiErr(api.CodeBadRequest, "item %d moves %d bytes: every item moves at least one", i, p.n)
		case p.srcOff < 0 || p.srcOff > srcs[p.src].size()-p.n:
			return nil, 0, apiErr(api.CodeBadRequest, "item %d reads %d bytes at offset %d of source %d (%s), which holds %d bytes",
				i, p.n, p.srcOff, p.src, srcs[p.src].name(), srcs[p.src].size())
		case p.dstOff < 0 || (req.Destinations[p.dst].NBytes > 0 && p.dstOff > req.Destinations[p.dst].NBytes-p.n):
			return nil, 0, apiErr(api.CodeBadRequest, "item %d writes %d bytes at offset %d of destination %d, whose slot holds %d bytes",
				i, p.n, p.dstOff, p.dst, req.Destinations[p.dst].NBytes)
		}
		ps[i] = p
		total += p.n
	}
	slices.SortStableFunc(ps, func(a, b piece) int {
		return cmp.Or(cmp.Compare(a.src, b.src), cmp.Compare(a.dst, b.dst), cmp.Compare(a.srcOff, b.srcOff))
	})
	merged := ps[:1]
	for _, p := range ps[1:] {
		last := &merged[len(merged)-1]
		if p.src == last.src && p.dst == last.dst && p.srcOff == last.srcOff+last.n && p.dstOff == last.dstOff+last.n {
			last.n += p.n
			continue
		}
		merged = append(merged, p)
	}
	if len(merged) < len(ps) {
		// The batch holds its writes while it runs, and the items' array
		// is as long as the items were.
		merged = slices.Clone(merged)
	}
	return merged, total, nil
}

// sendResult checks req's slot descriptor (checkSlot, who naming the
// request) and starts the answer of a write into it: its session and the
// transport that carries it.
func (d *Daemon) sendResult(who string, req api.SendRequest) (api.SendResult, bool, error) {
	res := api.SendResult{Session: req.Session, Transport: d.tr.Name()}
	isMooncake, err := checkSlot(who, req.Session, req.BufferAddress, req.Key)
	if isMooncake {
		res.Transport = mooncake.TransportName
	}
	return res, isMooncake, err
}

// checkSlot checks a slot descriptor a client passes along (a send's, or
// a batch's destination, named by who in errors): its session, and its
// address and key as the receiver's POST /v1/receives gave them. A
// Mooncake segment's slot has no key.
func checkSlot(who, session string, addr uint64, key transport.Key) (isMooncake bool, err error) {
	if len(session) > maxSessionLen {
		return false, apiErr(api.CodeBadRequest, "%s: session %q is longer than any host:port (%d bytes at most): use the session the receiver's POST /v1/receives returned",
			who, loglimit.Clip(session), maxSessionLen)
	}
	if _, mc, err := mooncake.RPCAddr(session); mc {
		if err != nil {
			return true, apiErr(api.CodeBadRequest, "%s: %v", who, err)
		}
		isMooncake = true
	} else if err := api.CheckSession(session); err != nil {
		return false, apiErr(api.CodeBadRequest, "%s: %v", who, err)
	}
	if addr == 0 {
		return isMooncake, apiErr(api.CodeBadRequest,
			"%s: buffer_address is missing: use the buffer_address the receiver's POST /v1/receives returned", who)
	}
	if key.IsZero() && !isMooncake {
		return isMooncake, apiErr(api.CodeBadRequest,
			"%s: key is missing: use the key the receiver's POST /v1/receives returned", who)
	}
	return isMooncake, nil
}

// batchDest is where a batch writes one of its destinations: the slot's
// session, address and key (the rest of its descriptor was checked).
type batchDest struct {
	session string
	addr    uint64
	key     transport.Key
}

// batchDests keeps what a run needs of a batch's destinations, each
// session once however many slots name it, and says how many bytes that
// holds.
func batchDests(slots []api.ReceiveSlot) ([]batchDest, int64) {
	out := make([]batchDest, len(slots))
	n := int64(len(out)) * int64(unsafe.Sizeof(batchDest{}))
	sessions := make(map[string]string)
	for i, s := range slots {
		session, ok := sessions[s.Session]
		if !ok {
			session = s.Session
			sessions[session] = session
			n += int64(len(session))
		}
		out[i] = batchDest{session: session, addr: s.BufferAddress, key: s.Key}
	}
	return out, n
}

// batchSource is one source of a batch: a staged entry it claimed (as a
// send does), or a region it pins.
type batchSource struct {
	entry  *entry
	region *region
}

func (s batchSource) size() int64 {
	if s.region != nil {
		return s.region.size()
	}
	return s.entry.nbytes
}

func (s batchSource) name() string {
	if s.region != nil {
		return "region " + s.region.name
	}
	return "req_id " + s.entry.reqID
}

// claimSource takes source i of a batch for its run.
func (d *Daemon) claimSource(i int, s api.TransferSource) (batchSource, error) {
	switch {
	case (s.ReqID == "") == (s.Region == ""):
		return batchSource{}, apiErr(api.CodeBadRequest, "source %d: give a req_id or a region, one of the two", i)
	case s.Region != "":
		g, err := d.reg.pinRegion(s.Region, fmt.Sprintf("source %d", i))
		return batchSource{region: g}, err
	}
	if err := api.CheckReqID(s.ReqID); err != nil {
		return batchSource{}, apiErr(api.CodeBadRequest, "source %d: %v", i, err)
	}
	e, err := d.reg.takeForSend(context.Background(), s.ReqID, 0, nil)
	return batchSource{entry: e}, err
}

// releaseSources ends a batch's hold on its sources: staged entries are
// freed when sent, else left staged; regions are unpinned.
func (d *Daemon) releaseSources(srcs []batchSource, sent bool) {
	for _, s := range srcs {
		if s.region != nil {
			d.reg.unpinRegion(s.region)
		} else {
			d.reg.finishSend(s.entry, sent)
		}
	}
}

// sourceOf is n bytes at off of s.
func (d *Daemon) sourceOf(s batchSource, off, n int64) source {
	if g := s.region; g != nil {
		return source{mem: g.mem, off: off, n: n, inPlace: g.inPlace()}
	}
	return d.entrySource(s.entry, off, n)
}

// batch is one running or ended transfer.
type batch struct {
	done chan struct{} // closed when it ends
	held int64         // the bytes its run holds (maxHeld)

	mu sync.Mutex
	t  api.Transfer
}

func (b *batch) describe() api.Transfer {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.t
}

// transfers is the table of batches, running and recently ended.
type transfers struct {
	reading chan struct{} // a place per body being read and checked (maxReading)

	mu      sync.Mutex
	seq     uint64
	byID    map[string]*batch
	running int
	held    int64    // the bytes the running batches hold
	most    int64    // the most they may hold: maxHeld
	ended   []string // ended ids, oldest first
}

func newTransfers() *transfers {
	return &transfers{byID: make(map[string]*batch), reading: make(chan struct{}, maxReading), most: maxHeld}
}

// startReading waits for a place to read and check a transfer's body,
// for as long as ctx lets it; doneReading gives it back.
func (ts *transfers) startReading(ctx context.Context) error {
	start := time.Now()
	select {
	case ts.reading <- struct{}{}:
		return nil
	case <-ctx.Done():
		return apiErr(api.CodeTimeout, "the transfer waited %s for its turn to be read, and its request ended first: ferryd reads and checks %d transfer bodies at once, and others held every turn",
			time.Since(start).Round(time.Millisecond), maxReading)
	}
}

func (ts *transfers) doneReading() { <-ts.reading }

// add counts a batch running whose run holds held bytes (for its writes
// and dests destinations), unless that would take the running ones past
// maxRunning or maxHeld.
func (ts *transfers) add(t api.Transfer, dests int, held int64) (*batch, error) {
	ts.mu.Lock()
	defer ts.mu.Unlock()
	if ts.running >= maxRunning {
		return nil, apiErr(api.CodeBusy, "%s running, this ferryd's limit: wait for some to end (GET /v1/events), or put more items in each", counted(ts.running, "transfer"))
	}
	if ts.held+held > ts.most {
		return nil, apiErr(api.CodeBusy,
			"the transfer would hold %s while it runs (its %s and %s), and the running transfers (%d) hold %s of the %s ferryd lets them hold at once: wait for some to end (GET /v1/events), or split it into smaller transfers",
			size.Format(held), counted(t.Writes, "write"), counted(dests, "destination"), ts.running, size.Format(ts.held), size.Format(ts.most))
	}
	ts.seq++
	ts.running++
	ts.held += held
	t.ID = "t" + strconv.FormatUint(ts.seq, 10)
	b := &batch{done: make(chan struct{}), held: held, t: t}
	ts.byID[t.ID] = b
	return b, nil
}

func (ts *transfers) get(id string) (*batch, error) {
	ts.mu.Lock()
	defer ts.mu.Unlock()
	b, ok := ts.byID[id]
	if !ok {
		return nil, apiErr(api.CodeNotFound,
			"no transfer %s: its id is not one POST /v1/transfers returned, or it ended long enough ago that ferryd keeps it no more (the newest %d ended ones are kept)", id, keptTransfers)
	}
	return b, nil
}

// retire counts a batch ended, and keeps it reportable until
// keptTransfers newer ones ended.
func (ts *transfers) retire(id string) {
	ts.mu.Lock()
	defer ts.mu.Unlock()
	ts.running--
	ts.held -= ts.byID[id].held
	ts.ended = append(ts.ended, id)
	if len(ts.ended) > keptTransfers {
		delete(ts.byID, ts.ended[0])
		ts.ended = ts.ended[1:]
	}
}

// startTransfer checks a batch, claims its staged sources and starts it;
// it answers at once. The batch runs as in-flight work a drain waits for.
func (d *Daemon) startTransfer(req api.TransferRequest) (api.Transfer, error) {
	if len(req.Sources) == 0 || len(req.Destinations) == 0 {
		return api.Transfer{}, apiErr(api.CodeBadRequest, "a transfer lists its sources and its destinations: it has %d and %d", len(req.Sources), len(req.Destinations))
	}
	for i, s := range req.Destinations {
		if _, err := checkSlot(fmt.Sprintf("destination %d", i), s.Session, s.BufferAddress, s.Key); err != nil {
			return api.Transfer{}, err
		}
	}
	srcs := make([]batchSource, 0, len(req.Sources))
	started := false
	defer func() {
		if !started {
			d.releaseSources(srcs, false)
		}
	}()
	seen := make(map[api.TransferSource]int, len(req.Sources))
	for i, s := range req.Sources {
		if j, dup := seen[s]; dup {
			return api.Transfer{}, apiErr(api.CodeBadRequest, "sources %d and %d are the same: list each source once and point items at it", j, i)
		}
		seen[s] = i
		src, err := d.claimSource(i, s)
		if err != nil {
			return api.Transfer{}, err
		}
		srcs = append(srcs, src)
	}
	pieces, total, err := plan(req, srcs)
	if err != nil {
		return api.Transfer{}, err
	}
	if !d.inflight.enter() {
		return api.Transfer{}, errStopping
	}
	dsts, held := batchDests(req.Destinations)
	held += int64(len(pieces))*int64(unsafe.Sizeof(piece{})) + int64(len(srcs))*int64(unsafe.Sizeof(batchSource{}))
	b, err := d.transfers.add(api.Transfer{State: api.TransferRunning, Items: len(req.Items), Writes: len(pieces), NBytes: total, Since: time.Now()},
		len(dsts), held)
	if err != nil {
		d.inflight.leave()
		return api.Transfer{}, err
	}
	started = true
	d.metrics.batchItems.Add(float64(len(req.Items)))
	// Not the items, nor the rest of the request: the writes are what it runs.
	go d.runTransfer(b, dsts, req.KeepSources, srcs, pieces)
	return b.describe(), nil
}

// runTransfer writes a batch's pieces, batchWindow at a time, each with
// the send path's retries. The first failure stops the rest; the staged
// sources stay staged then, and are freed (unless kept) once every piece
// arrived.
func (d *Daemon) runTransfer(b *batch, dsts []batchDest, keep bool, srcs []batchSource, pieces []piece) {
	defer d.inflight.leave()
	ctx, cancel := context.WithCancel(d.reqCtx)
	defer cancel()
	id := b.t.ID // set before the batch was shared, and never again
	log := d.log.With().Str("transfer_id", id).Logger()
	start := time.Now()

	var (
		next    atomic.Int64
		done    atomic.Int64 // pieces written
		written atomic.Int64 // their bytes
		failMu  sync.Mutex
		failed  error
		failAt  int
		wg      sync.WaitGroup
	)
	fail := func(p piece, err error) {
		failMu.Lock()
		defer failMu.Unlock()
		if failed == nil {
			failed, failAt = err, p.item
			cancel()
		}
	}
	for range min(batchWindow, len(pieces)) {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for ctx.Err() == nil {
				i := int(next.Add(1)) - 1
				if i >= len(pieces) {
					return
				}
				p := pieces[i]
				if err := d.writePiece(ctx, id, dsts, srcs, p, log); err != nil {
					fail(p, err)
					return
				}
				d.metrics.batchWrites.Inc()
				b.mu.Lock()
				b.t.WritesDone++
				b.mu.Unlock()
				done.Add(1)
				written.Add(p.n)
			}
		}()
	}
	wg.Wait()
	if failed == nil && done.Load() < int64(len(pieces)) {
		// Nothing failed, yet pieces were left: the drain ran out.
		failed = apiErr(api.CodeUnavailable, "transfer %s: ferryd is shutting down and its drain timeout ran out after %d of %d writes; the staged sources are kept until it exits: start the transfer again once it is back",
			id, done.Load(), len(pieces))
		failAt = -1 // no one item failed
	}

	ok := failed == nil
	d.releaseSources(srcs, ok && !keep)
	took := time.Since(start)
	b.mu.Lock()
	b.t.Millis = float64(took.Microseconds()) / 1000
	ev := api.Event{Kind: api.EventTransferDone, TransferID: id, NBytes: b.t.NBytes}
	if ok {
		b.t.State = api.TransferDone
	} else {
		b.t.State = api.TransferFailed
		ae := &apiError{code: api.CodeInternal, msg: failed.Error()}
		errors.As(failed, &ae)
		b.t.Error = &api.Error{Code: ae.code, Message: ae.msg}
		if failAt >= 0 {
			b.t.Item = &failAt
		}
		ev.Kind, ev.Error = api.EventTransferFailed, b.t.Error
	}
	t := b.t
	b.mu.Unlock()
	// Retired first: a client that starts its next transfer as soon as
	// this one's wait answers finds its place free.
	d.transfers.retire(t.ID)
	close(b.done)
	d.events.add(ev)

	outcome := "ok"
	if !ok {
		outcome = "failed"
		d.failWarn(&log).Int("item", failAt).Str("code", t.Error.Code).Str("error", t.Error.Message).Msg("transfer failed; its staged sources are kept")
	}
	d.metrics.batches.WithLabelValues(outcome).Inc()
	d.metrics.transferBytes.WithLabelValues(d.tr.Name()).Add(float64(written.Load()))
	if took > d.slowThreshold() {
		d.metrics.slowTransfers.WithLabelValues(d.tr.Name()).Inc()
		log.Info().Int("items", t.Items).Int("writes", t.Writes).Int64("nbytes", t.NBytes).
			Float64("ms", t.Millis).Str("state", t.State).Msg("slow transfer")
	}
}

// writePiece writes one piece, with the send path's retries, bounded by
// send_timeout; its error is the API error the batch ends with.
func (d *Daemon) writePiece(ctx context.Context, id string, dsts []batchDest, srcs []batchSource, p piece, log zerolog.Logger) error {
	ctx, cancel := context.WithTimeout(ctx, d.cfg.SendTimeout.D())
	defer cancel()
	dst := dsts[p.dst]
	w := transport.Write{Remote: dst.addr + uint64(p.dstOff), Key: dst.key, Tag: dst.key.Tag()}
	dl, err := d.deliver(ctx, dst.session, w, d.sourceOf(srcs[p.src], p.srcOff, p.n), log)
	if errors.As(err, new(*copyOutError)) {
		return apiErr(internalCode(err), "transfer %s: item %d: reading %d bytes of source %d (%s) failed: %v; the staged sources are kept",
			id, p.item, p.n, p.src, srcs[p.src].name(), err)
	}
	if err != nil {
		return pieceError(id, p, dst, err, dl.attempts)
	}
	return nil
}

// pieceError phrases a piece's failure for the transfer's answer, naming
// the session, bytes and ret as a send's failure does.
func pieceError(id string, p piece, dst batchDest, err error, attempts int) error {
	if rf := (*transport.Refusal)(nil); errors.As(err, &rf) {
		return apiErr(api.CodeRefused, "transfer %s: item %d: the receiver at session %s refused the write of %d bytes to %#x: %v; the staged sources are kept",
			id, p.item, dst.session, p.n, dst.addr+uint64(p.dstOff), err)
	}
	return apiErr(api.CodeTransferFailed, "transfer %s: item %d failed (session=%s, nbytes=%d, ret=%s) after %d attempt(s): %v; the staged sources are kept: start the transfer again %s",
		id, p.item, dst.session, p.n, retCode(err), attempts, err, whenToResend(err))
}

// handleNewTransfer starts a batch: POST /v1/transfers, answered 202
// with the transfer's id while it runs.
func (d *Daemon) handleNewTransfer(w http.ResponseWriter, r *http.Request) error {
	wait, err := parseWait(r)
	if err != nil {
		return err
	}
	t, err := d.newTransfer(r)
	if err != nil {
		return err
	}
	if wait == 0 {
		writeJSON(w, http.StatusAccepted, t)
		return nil
	}
	// ?wait= makes it one round trip: the answer comes once the batch
	// ended, as GET /v1/transfers/{id}?wait= gives it.
	return d.answerTransfer(w, r, t.ID, wait)
}

// newTransfer reads a transfer's body (api.MaxTransferBody: some 400,000
// items), checks it and starts it, as one of at most maxReading at once;
// once it runs, the items are let go.
func (d *Daemon) newTransfer(r *http.Request) (api.Transfer, error) {
	if err := d.transfers.startReading(r.Context()); err != nil {
		return api.Transfer{}, err
	}
	defer d.transfers.doneReading()
	body, err := readJSONWithin(r, api.MaxTransferBody, "the transfer's body is over 16 MiB: split it into several transfers")
	if err != nil {
		return api.Transfer{}, err
	}
	// TransferRequest refuses unknown fields itself, and json.Unmarshal
	// hands it the body where it lies (a json.Decoder would copy it).
	var req api.TransferRequest
	if err := json.Unmarshal(body, &req); err != nil {
		return api.Transfer{}, jsonError(err)
	}
	return d.startTransfer(req)
}

// handleGetTransfer reports a batch: GET /v1/transfers/{id}, with ?wait=
// waiting that long for it to end (504 timeout if it has not).
func (d *Daemon) handleGetTransfer(w http.ResponseWriter, r *http.Request) error {
	wait, err := parseWait(r)
	if err != nil {
		return err
	}
	return d.answerTransfer(w, r, r.PathValue("id"), wait)
}

// answerTransfer describes transfer id once it ended, waiting up to wait
// (0: at once, ended or not).
func (d *Daemon) answerTransfer(w http.ResponseWriter, r *http.Request, id string, wait time.Duration) error {
	b, err := d.transfers.get(id)
	if err != nil {
		return err
	}
	if wait > 0 {
		start := time.Now()
		timer := time.NewTimer(wait)
		defer timer.Stop()
		select {
		case <-b.done:
		case <-timer.C:
		case <-r.Context().Done():
			// The caller left (or request_timeout or a drain ended the
			// wait, which serveOne names): a wait that ran out, as a
			// receive's wait is.
			wait = time.Since(start).Round(time.Millisecond)
		}
		if t := b.describe(); t.State == api.TransferRunning {
			return apiErr(api.CodeTimeout, "transfer %s is still running after waiting %s (%d of its %d writes done): wait again, or ask without wait for its progress",
				id, wait, t.WritesDone, t.Writes)
		}
	}
	writeJSON(w, http.StatusOK, b.describe())
	return nil
}

// handleEvents serves the event stream as a long poll: GET
// /v1/events?after=N&wait=D answers the events past seq N, waiting up
// to D for the first.
func (d *Daemon) handleEvents(w http.ResponseWriter, r *http.Request) error {
	wait, err := parseWait(r)
	if err != nil {
		return err
	}
	var after uint64
	if v := r.URL.Query().Get("after"); v != "" {
		if after, err = strconv.ParseUint(v, 10, 64); err != nil {
			return apiErr(api.CodeBadRequest, "after=%q is not a sequence number: pass the next of the previous answer, or 0", v)
		}
	}
	writeJSON(w, http.StatusOK, d.events.after(r.Context(), after, wait))
	return nil
}
