package daemon

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"path"
	"strconv"
	"strings"
	"time"

	"golang.org/x/sys/unix"

	"github.com/ferry-project/ferry/api"
	"github.com/ferry-project/ferry/arena"
	"github.com/ferry-project/ferry/config"
	"github.com/ferry-project/ferry/internal/loglimit"
	"github.com/ferry-project/ferry/internal/strictjson"
	"github.com/ferry-project/ferry/transport"
)

// apiError is an error with its envelope code; the code decides the HTTP
// status (api.StatusOf), in one table.
type apiError struct {
	code string
	msg  string
}

func (e *apiError) Error() string { return e.msg }

func apiErr(code, format string, args ...any) error {
	return &apiError{code: code, msg: fmt.Sprintf(format, args...)}
}

// counted is n and noun, plural but for one: "1 write", "2 writes".
func counted(n int, noun string) string {
	if n == 1 {
		return "1 " + noun
	}
	return fmt.Sprintf("%d %ss", n, noun)
}

// internalCode is the code of an error no handler named: busy for one
// that passes once copies in flight end, internal otherwise.
func internalCode(err error) string {
	if errors.Is(err, arena.ErrNoStaging) {
		return api.CodeBusy
	}
	return api.CodeInternal
}

func isCode(err error, code string) bool {
	var ae *apiError
	return errors.As(err, &ae) && ae.code == code
}

var errStopping = apiErr(api.CodeUnavailable,
	"ferryd is shutting down and takes no new work: retry against the restarted daemon")

// routes is the whole control API in one table.
func (d *Daemon) routes() http.Handler {
	mux := http.NewServeMux()
	for pattern, h := range map[string]func(http.ResponseWriter, *http.Request) error{
		"GET /v1/status":                      d.handleStatus,
		"GET /v1/arena":                       d.handleArena,
		"GET /v1/embeddings":                  d.handleListEmbeddings,
		"PUT /v1/embeddings/{req_id}":         d.handleUpload,
		"GET /v1/embeddings/{req_id}":         d.handleGetEmbedding,
		"DELETE /v1/embeddings/{req_id}":      d.handleDeleteEmbedding,
		"POST /v1/embeddings/{req_id}/slice":  d.handleSlice,
		"POST /v1/embeddings/{req_id}/commit": d.handleCommit,
		"POST /v1/embeddings/{req_id}/send":   d.handleSend,
		"POST /v1/writes":                     d.handleWrite,
		"POST /v1/writes/stream":              d.handleWriteStream,
		"POST /v1/reads":                      d.handleRead,
		"POST /v1/receives":                   d.handleNewReceive,
		"GET /v1/receives":                    d.handleListReceives,
		"GET /v1/receives/{req_id}":           d.handleGetReceive,
		"DELETE /v1/receives/{req_id}":        d.handleDeleteReceive,
		"POST /v1/receives/{req_id}/complete": d.handleCompleteReceive,
		"POST /v1/transfers":                  d.handleNewTransfer,
		"GET /v1/transfers/{id}":              d.handleGetTransfer,
		"GET /v1/events":                      d.handleEvents,
		"POST /v1/regions":                    d.handleNewRegion,
		"GET /v1/regions":                     d.handleListRegions,
		"DELETE /v1/regions/{name}":           d.handleDeleteRegion,
		"GET /v1/sessions":                    d.handleListSessions,
		"DELETE /v1/sessions/{id}":            d.handleDeleteSession,
		"POST /v1/mooncake/segments":          d.handleNewEngineSegment,
		"GET /v1/mooncake/segments":           d.handleListEngineSegments,
		"DELETE /v1/mooncake/segments/{id}":   d.handleDeleteEngineSegment,

		// Mooncake notifies (notifies.go).
		"POST /v1/mooncake/segments/{id}/notifies/drain": d.handleDrainNotifies,
		"POST /v1/mooncake/notifies":                     d.handleSendNotify,
	} {
		mux.Handle(pattern, d.wrap(h))
	}
	// Through wrap, so the socket's allow-list covers /metrics too.
	prom := d.metrics.handler()
	mux.Handle("GET /metrics", d.wrap(func(w http.ResponseWriter, r *http.Request) error {
		prom.ServeHTTP(w, r)
		return nil
	}))
	mux.Handle("/", d.wrap(func(w http.ResponseWriter, r *http.Request) error {
		return noRoute(mux, r)
	}))
	// The mux would answer a path with empty, . or .. segments with a
	// redirect of its own (plain text, before any admission check, and one
	// a client follows to another route): it gets the envelope instead.
	unclean := d.wrap(func(w http.ResponseWriter, r *http.Request) error {
		return apiErr(api.CodeBadRequest,
			"path %q has empty, . or .. segments: ask for %s itself", r.URL.EscapedPath(), canonicalPath(r.URL.EscapedPath()))
	})
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if p := r.URL.EscapedPath(); r.Method != http.MethodConnect && canonicalPath(p) != p {
			unclean.ServeHTTP(w, r)
			return
		}
		mux.ServeHTTP(w, r)
	})
}

// canonicalPath is p as http.ServeMux routes it: rooted, without empty, .
// or .. segments, keeping a trailing slash.
func canonicalPath(p string) string {
	c := path.Clean("/" + p)
	if strings.HasSuffix(p, "/") && c != "/" {
		c += "/"
	}
	return c
}

// noRoute tells a wrong method (405, with Allow) from an unknown path (404).
func noRoute(mux *http.ServeMux, r *http.Request) error {
	var allow []string
	for _, m := range []string{"GET", "PUT", "POST", "DELETE"} {
		probe := r.Clone(r.Context())
		probe.Method = m
		if _, pattern := mux.Handler(probe); pattern != "/" && pattern != "" {
			allow = append(allow, m)
		}
	}
	if len(allow) > 0 {
		return apiErr(api.CodeMethod, "%s is not allowed on %s: use %s", r.Method, r.URL.Path, strings.Join(allow, ", "))
	}
	return apiErr(api.CodeNotFound, "no API route %s %s: see docs/api.md", r.Method, r.URL.Path)
}

// reqLogKey carries, in a request's context, the req_id its handler found
// (in the path or the body), so the request's log line can name it.
type reqLogKey struct{}

func noteReqID(r *http.Request, id string) {
	if p, ok := r.Context().Value(reqLogKey{}).(*string); ok {
		*p = id
	}
}

// wrap admits a request (the caller's uid against the allow-list, no new
// work while draining), bounds it by RequestTimeout, turns a handler's error
// into the one error envelope, logs failed requests at WARN with their
// req_id, and every request at DEBUG with the caller's uid and pid.
func (d *Daemon) wrap(h func(http.ResponseWriter, *http.Request) error) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		start := time.Now()
		var id string
		r = r.WithContext(context.WithValue(r.Context(), reqLogKey{}, &id))
		c := callerOf(r.Context())
		if err := d.admit(c); err != nil {
			d.refuseCaller(w, r, c, err)
			return
		}
		err := d.serveOne(w, r, h)
		ev := d.log.Debug()
		if err != nil {
			ae := &apiError{code: internalCode(err), msg: err.Error()}
			errors.As(err, &ae)
			status := api.StatusOf(ae.code)
			writeJSON(w, status, api.ErrorBody{Error: api.Error{Code: ae.code, Message: ae.msg}})
			ev = d.failWarn(&d.log).Int("status", status).Str("code", ae.code).Str("error", ae.msg)
		}
		if id == "" {
			id = r.PathValue("req_id")
		}
		if id != "" {
			ev = ev.Str("req_id", id)
		}
		ev.Str("method", r.Method).Str("path", r.URL.Path).Dur("took", time.Since(start)).
			Uint32("uid", c.uid).Int32("pid", c.pid).Msg("request")
	})
}

// refuseCaller answers a caller off the allow-lists: 403, the descriptors
// it passed closed, its connection closed after the answer (it holds
// nothing of ferryd's), and a log line rate-limited, as such a caller
// may ask as fast as it likes.
func (d *Daemon) refuseCaller(w http.ResponseWriter, r *http.Request, c *caller, err error) {
	dropPassedFDs(r.Context())
	w.Header().Set("Connection", "close")
	writeJSON(w, http.StatusForbidden, api.ErrorBody{Error: api.Error{Code: api.CodeForbidden, Message: err.Error()}})
	d.refusedLog.Printf("refused %s %s from uid %d (pid %d): %v", r.Method, loglimit.Clip(r.URL.Path), c.uid, c.pid, err)
}

func writeJSON(w http.ResponseWriter, status int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_ = json.NewEncoder(w).Encode(v)
}

// decodeJSON reads a JSON body of at most MaxBodyBytes that must hold
// exactly one object of known fields, each given once.
func (d *Daemon) decodeJSON(r *http.Request, v any) error {
	return d.decodeJSONWithin(r, v, d.cfg.MaxBodyBytes.Bytes(),
		fmt.Sprintf("request body is over %s (max_body_bytes): send less, or raise max_body_bytes", d.cfg.MaxBodyBytes))
}

// decodeJSONWithin is decodeJSON with its own bound on the body, and the
// message a longer body gets.
func (d *Daemon) decodeJSONWithin(r *http.Request, v any, most int64, tooLarge string) error {
	body, err := readJSONWithin(r, most, tooLarge)
	if err != nil {
		return err
	}
	dec := json.NewDecoder(bytes.NewReader(body))
	dec.DisallowUnknownFields()
	if err := dec.Decode(v); err != nil {
		return jsonError(err)
	}
	// Anything but the end after the object, a stray closing } or ] too
	// (which More does not report), is refused.
	if _, err := dec.Token(); err != io.EOF {
		return apiErr(api.CodeBadRequest, "request body has data after its JSON object")
	}
	return nil
}

// readJSONWithin reads a body of at most most bytes (else tooLarge) in
// which no object holds a key twice.
func readJSONWithin(r *http.Request, most int64, tooLarge string) ([]byte, error) {
	body, err := io.ReadAll(http.MaxBytesReader(nil, r.Body, most))
	if err != nil {
		var mbe *http.MaxBytesError
		if errors.As(err, &mbe) {
			return nil, apiErr(api.CodeTooLarge, "%s", tooLarge)
		}
		return nil, apiErr(api.CodeBadRequest, "reading the request body: %v", err)
	}
	if err := strictjson.NoDuplicateKeys(body); err != nil {
		return nil, apiErr(api.CodeBadRequest, "request body: %v", err)
	}
	return body, nil
}

// jsonError answers a body that did not decode: 413 past a limit the
// decoding counts (api.LimitError), else 400.
func jsonError(err error) error {
	if le := (*api.LimitError)(nil); errors.As(err, &le) {
		return apiErr(api.CodeTooLarge, "%v", le)
	}
	return apiErr(api.CodeBadRequest, "request body is not valid JSON for this call: %v", err)
}

// reqID reads and checks the {req_id} path segment.
func reqID(r *http.Request) (string, error) {
	id := r.PathValue("req_id")
	noteReqID(r, id)
	if err := api.CheckReqID(id); err != nil {
		return "", apiErr(api.CodeBadRequest, "%v", err)
	}
	return id, nil
}

// parseWait reads ?wait= as a Go duration or plain seconds.
func parseWait(r *http.Request) (time.Duration, error) {
	v := r.URL.Query().Get("wait")
	if v == "" {
		return 0, nil
	}
	d, err := time.ParseDuration(v)
	if err != nil {
		secs, serr := strconv.ParseFloat(v, 64)
		if serr != nil {
			return 0, apiErr(api.CodeBadRequest, "wait=%q is not a duration: write e.g. wait=30s or wait=500ms", v)
		}
		d = time.Duration(secs * float64(time.Second))
	}
	if d < 0 || d > maxWait {
		return 0, apiErr(api.CodeBadRequest, "wait=%s is outside 0..%s", v, maxWait)
	}
	return d, nil
}

func (d *Daemon) handleStatus(w http.ResponseWriter, r *http.Request) error {
	writeJSON(w, http.StatusOK, d.Status())
	return nil
}

// Status is what GET /v1/status answers.
func (d *Daemon) Status() api.Status {
	st := d.arena.Stats()
	staged, receives := d.reg.counts()
	var mc *api.MooncakeStatus
	if d.mooncake != nil {
		d.engines.mu.Lock()
		engines := len(d.engines.byID)
		d.engines.mu.Unlock()
		mc = &api.MooncakeStatus{Segment: d.mooncake.name, RPC: d.mooncake.hs.Addr().String(), DataPort: d.mooncake.seg.TCPDataPort, Engines: engines, RDMAPool: d.reg.poolStatus()}
	}
	return api.Status{
		Version: Version, PID: os.Getpid(), Instance: fmt.Sprintf("%016x", d.instance), StartedAt: d.started,
		Memory: api.MemoryStatus{
			Kind: d.mem.Kind(), Device: d.mem.device, Reason: d.mem.reason, ArenaFile: d.mem.Path(), ArenaBase: d.mem.Base(),
			HugePages: d.mem.HugePages(), Size: st.Size, Used: st.Used, Free: st.Free,
			LargestFree: st.LargestFree, Allocations: st.Allocations, Alignment: config.ArenaAlign, CUDA: d.mem.status(),
		},
		Registration: d.registration(),
		Transport: api.TransportStatus{
			Name: d.tr.Name(), Listen: d.tr.Addr().String(), Advertise: d.advertise,
			Reason: d.dp.reason, RDMA: d.dp.rdmaStatus(),
		},
		Arenas:   d.arenasStatus(),
		Mooncake: mc,
		Staged:   staged, Receives: receives, Regions: d.reg.regionsStatus(), Sessions: d.sessions.list(),
		Settings: api.Settings{
			SlowThreshold: d.slowThreshold().String(), SendRetries: d.cfg.SendRetries,
			SendTimeout: d.cfg.SendTimeout.String(), StageTTL: d.cfg.StageTTL.String(), ReceiveTTL: d.cfg.ReceiveTTL.String(),
		},
		Affinity: d.affinity.Table(),
	}
}

// handleArena answers with the host arena's file descriptor (SCM_RIGHTS)
// beside its description: the file is ferryd's alone, so a caller the
// allow-lists admitted maps it through this descriptor, and no one else
// can. The answer needs its own sendmsg, so the connection is taken over
// from the HTTP server and closed after it.
func (d *Daemon) handleArena(w http.ResponseWriter, r *http.Request) error {
	a, err := d.arenaOn(r.URL.Query().Get("device"))
	if err != nil {
		return err
	}
	mem := a.mem
	if mem.host == nil {
		return apiErr(api.CodeBadRequest,
			"ferryd's arena is GPU memory (%s), which has no file to map: open it with cuIpcOpenMemHandle on the ipc_handle of GET /v1/status", mem.device)
	}
	hj, ok := w.(http.Hijacker)
	if !ok {
		return fmt.Errorf("the control connection cannot carry a file descriptor")
	}
	body, err := json.Marshal(api.Arena{ArenaFile: mem.Path(), Size: mem.Size(), HugePages: mem.HugePages()})
	if err != nil {
		return err
	}
	conn, _, err := hj.Hijack()
	if err != nil {
		return fmt.Errorf("taking over the control connection to pass the arena: %w", err)
	}
	defer conn.Close()
	uc, ok := unixConn(conn)
	if !ok {
		return nil // not a Unix socket: nothing can carry the descriptor, and the close says so
	}
	head := fmt.Sprintf("HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\nConnection: close\r\n\r\n", len(body))
	uc.SetWriteDeadline(time.Now().Add(d.cfg.IOTimeout.D()))
	if _, _, err := uc.WriteMsgUnix(append([]byte(head), body...), unix.UnixRights(mem.host.Fd()), nil); err != nil {
		d.log.Debug().Err(err).Msg("passing the arena's descriptor failed")
	}
	return nil
}

func (d *Daemon) handleListEmbeddings(w http.ResponseWriter, r *http.Request) error {
	writeJSON(w, http.StatusOK, d.reg.embeddings())
	return nil
}

func (d *Daemon) handleGetEmbedding(w http.ResponseWriter, r *http.Request) error {
	id, err := reqID(r)
	if err != nil {
		return err
	}
	e, err := d.reg.embedding(id)
	if err != nil {
		return err
	}
	mem := d.memOn(e.Device)
	e.ArenaFile, e.CUDAIPC = mem.Path(), mem.ipc()
	writeJSON(w, http.StatusOK, e)
	return nil
}

// handleUpload stages by upload: PUT /v1/embeddings/{req_id}?shape=R,C&dtype=D
// with the raw bytes as the body, copied straight into the arena.
func (d *Daemon) handleUpload(w http.ResponseWriter, r *http.Request) error {
	id, err := reqID(r)
	if err != nil {
		return err
	}
	q := r.URL.Query()
	shape, err := api.ParseShape(q.Get("shape"))
	if err != nil {
		return apiErr(api.CodeBadRequest, "%s: %v", id, err)
	}
	n, dtype, err := api.NBytes(shape, q.Get("dtype"))
	if err != nil {
		return apiErr(api.CodeBadRequest, "%s: %v", id, err)
	}
	on, err := d.arenaOn(q.Get("device"))
	if err != nil {
		return err
	}
	size := d.reg.arenaOf(on.region).Stats().Size
	if r.ContentLength > size || n > size {
		return apiErr(api.CodeTooLarge,
			"%s: %d bytes is larger than the whole arena (%d bytes): raise --arena-size", id, max(n, r.ContentLength), size)
	}
	if r.ContentLength >= 0 && r.ContentLength != n {
		return apiErr(api.CodeBadRequest,
			"%s: the body is %d bytes but shape %s %s needs %d bytes (rows*cols*elem_size)", id, r.ContentLength, api.ShapeString(shape), dtype, n)
	}
	e, err := d.reg.reserveOn(on.region, id, n, shape, dtype, uploading)
	if err != nil {
		return err
	}
	// Deferred, so that the entry is staged or freed however this ends
	// (a panic in a read too): an entry left uploading holds its bytes
	// of the arena until ferryd restarts.
	finished := false
	defer func() {
		if !finished {
			d.reg.finishUpload(e, false)
		}
	}()
	setupErr, err := d.readBodyInto(w, r, d.reg.entryMemory(e), e.slice, n)
	if setupErr != nil {
		return setupErr
	}
	if pe := (*transport.PlaceError)(nil); errors.As(err, &pe) {
		// Ferryd's fault, not the body's.
		return apiErr(api.CodeInternal, "%s: copying it into GPU memory failed: %v; nothing was staged: upload it again", id, pe.Err)
	}
	if err != nil {
		return apiErr(api.CodeBadRequest, "%s: shape %s %s needs %d bytes: %v; nothing was staged", id, api.ShapeString(shape), dtype, n, err)
	}
	d.reg.finishUpload(e, true)
	finished = true
	d.metrics.staged.WithLabelValues("upload").Inc()
	e2, _ := d.reg.embedding(id)
	writeJSON(w, http.StatusCreated, e2)
	return nil
}

// readBodyInto reads a request's body, n bytes and no more, into the
// arena slice s. For a GPU arena the body lands in host staging,
// stageChunk bytes at a time, each copied in before the next is read.
// setupErr is ferryd's failing to set that up; err, the body's failing
// to arrive, or a *transport.PlaceError for a copy into GPU memory that
// failed.
func (d *Daemon) readBodyInto(w http.ResponseWriter, r *http.Request, mem arena.Memory, s arena.Slice, n int64) (setupErr, err error) {
	fill, err := arena.NewFiller(mem, s, 0, n, stageChunk)
	if err != nil {
		return err, nil
	}
	defer fill.Close()
	rc := http.NewResponseController(w)
	err = transport.ReadBody(requestBody{r.Body, rc}, uint64(n), fill.Next, d.cfg.IOTimeout.D())
	_ = rc.SetReadDeadline(time.Time{})
	var extra [1]byte
	if err == nil {
		if k, _ := r.Body.Read(extra[:]); k > 0 {
			err = errors.New("the body is longer than that")
		}
	}
	return nil, err
}

// requestBody is an upload's body as a transport.Stream: each chunk read
// under a fresh --io-timeout, so a stalled client cannot pin an
// uploading entry forever.
type requestBody struct {
	io.Reader
	rc *http.ResponseController
}

func (b requestBody) SetReadDeadline(t time.Time) error { return b.rc.SetReadDeadline(t) }

// handleSlice reserves an arena slice for zero-copy staging.
func (d *Daemon) handleSlice(w http.ResponseWriter, r *http.Request) error {
	id, err := reqID(r)
	if err != nil {
		return err
	}
	var req api.SliceRequest
	if err := d.decodeJSON(r, &req); err != nil {
		return err
	}
	n, dtype := req.NBytes, ""
	switch {
	case len(req.Shape) > 0 || req.DType != "":
		n, dtype, err = api.NBytes(req.Shape, req.DType)
		if err != nil {
			return apiErr(api.CodeBadRequest, "%s: %v", id, err)
		}
		if req.NBytes != 0 && req.NBytes != n {
			return apiErr(api.CodeBadRequest,
				"%s: nbytes %d disagrees with shape %s %s (%d bytes): give one or make them agree", id, req.NBytes, api.ShapeString(req.Shape), dtype, n)
		}
	case n <= 0:
		return apiErr(api.CodeBadRequest, "%s: give shape and dtype, or a positive nbytes", id)
	}
	on, err := d.arenaOn(req.Device)
	if err != nil {
		return err
	}
	e, err := d.reg.reserveOn(on.region, id, n, req.Shape, dtype, reserved)
	if err != nil {
		return err
	}
	writeJSON(w, http.StatusCreated, api.Slice{ReqID: id, ArenaFile: on.mem.Path(), Offset: e.slice.Offset, NBytes: n, Device: on.mem.device, CUDAIPC: on.mem.ipc()})
	return nil
}

func (d *Daemon) handleCommit(w http.ResponseWriter, r *http.Request) error {
	id, err := reqID(r)
	if err != nil {
		return err
	}
	var req api.CommitRequest
	if err := d.decodeJSON(r, &req); err != nil {
		return err
	}
	e, err := d.reg.commit(id, req.Shape, req.DType)
	if err != nil {
		return err
	}
	d.metrics.staged.WithLabelValues("zero_copy").Inc()
	writeJSON(w, http.StatusOK, d.reg.describe(e))
	return nil
}

func (d *Daemon) handleSend(w http.ResponseWriter, r *http.Request) error {
	id, err := reqID(r)
	if err != nil {
		return err
	}
	var req api.SendRequest
	if err := d.decodeJSON(r, &req); err != nil {
		return err
	}
	res, err := d.send(r.Context(), id, req)
	if err != nil {
		return err
	}
	writeJSON(w, http.StatusOK, res)
	return nil
}

func (d *Daemon) handleDeleteEmbedding(w http.ResponseWriter, r *http.Request) error {
	id, err := reqID(r)
	if err != nil {
		return err
	}
	if err := d.reg.deleteEntry(id); err != nil {
		return err
	}
	w.WriteHeader(http.StatusNoContent)
	return nil
}

func (d *Daemon) handleNewReceive(w http.ResponseWriter, r *http.Request) error {
	var req api.ReceiveRequest
	if err := d.decodeJSON(r, &req); err != nil {
		return err
	}
	noteReqID(r, req.ReqID)
	if err := api.CheckReqID(req.ReqID); err != nil {
		return apiErr(api.CodeBadRequest, "%v", err)
	}
	if req.NBytes <= 0 {
		return apiErr(api.CodeBadRequest, "%s: nbytes %d must be positive", req.ReqID, req.NBytes)
	}
	if req.Mooncake && d.mooncake == nil {
		return apiErr(api.CodeBadRequest,
			"%s: \"mooncake\": true asks for a slot Mooncake senders may write into, but this ferryd serves no Mooncake segment: start it with --mooncake-listen", req.ReqID)
	}
	on, err := d.arenaOn(req.Device)
	if err != nil {
		return err
	}
	var s *slot
	switch {
	case req.Region != "" && req.Device != "":
		return apiErr(api.CodeBadRequest, "%s: a slot goes in a region or in a device's arena: name one of region and device", req.ReqID)
	case on.region != nil && req.Mooncake:
		return apiErr(api.CodeBadRequest,
			"%s: a slot open to Mooncake senders goes in the arena of %s, the one the Mooncake segment publishes: leave device out", req.ReqID, d.mem.device)
	case req.Region != "" && req.Mooncake:
		return apiErr(api.CodeBadRequest,
			"%s: a slot in a region cannot be open to Mooncake senders (ferryd cannot see when their writes end, so it could not tell when the region's memory is free of them): use an arena slot", req.ReqID)
	case req.Region != "":
		s, err = d.reg.newSlotIn(req.ReqID, req.NBytes, req.Region, req.RegionOffset)
	case req.RegionOffset != 0:
		return apiErr(api.CodeBadRequest, "%s: region_offset without a region: name the region the slot goes in", req.ReqID)
	default:
		s, err = d.reg.newSlotOn(on.region, req.ReqID, req.NBytes, req.Mooncake)
	}
	if err != nil {
		return err
	}
	slot := api.ReceiveSlot{ReqID: req.ReqID, Session: d.advertise, BufferAddress: s.addr, Key: s.key, NBytes: s.nbytes}
	if req.Region == "" {
		slot.Device = on.mem.device
	}
	if s.mooncake {
		slot.MooncakeSession = d.mooncake.name
	}
	writeJSON(w, http.StatusCreated, slot)
	return nil
}

// handleCompleteReceive marks a Mooncake slot written in full, on its
// client's word, and answers with the slot as GET ?format=json does.
func (d *Daemon) handleCompleteReceive(w http.ResponseWriter, r *http.Request) error {
	id, err := reqID(r)
	if err != nil {
		return err
	}
	if err := d.reg.completeReceive(id); err != nil {
		return err
	}
	desc, _, _, err := d.reg.waitSlot(r.Context(), id, 0, false)
	if err != nil {
		return err
	}
	d.locate(&desc)
	writeJSON(w, http.StatusOK, desc)
	return nil
}

// locate completes a slot's description with this daemon's session and,
// for an arena slot, how to reach the arena (a region's client has its
// own mapping).
func (d *Daemon) locate(desc *api.Receive) {
	desc.Session = d.advertise
	if desc.Region == "" {
		mem := d.memOn(desc.Device)
		desc.ArenaFile, desc.CUDAIPC = mem.Path(), mem.ipc()
	}
}

func (d *Daemon) handleListReceives(w http.ResponseWriter, r *http.Request) error {
	out := d.reg.receives()
	for i := range out {
		d.locate(&out[i])
	}
	writeJSON(w, http.StatusOK, out)
	return nil
}

// handleGetReceive answers with the arrived bytes, or with the slot's
// description (?format=json) for a client that reads them in place.
func (d *Daemon) handleGetReceive(w http.ResponseWriter, r *http.Request) error {
	id, err := reqID(r)
	if err != nil {
		return err
	}
	wait, err := parseWait(r)
	if err != nil {
		return err
	}
	asJSON := r.URL.Query().Get("format") == "json"
	desc, data, release, err := d.reg.waitSlot(r.Context(), id, wait, !asJSON)
	if err != nil {
		return err
	}
	defer release()
	if asJSON {
		d.locate(&desc)
		writeJSON(w, http.StatusOK, desc)
		return nil
	}
	// The first piece is read before the answer starts, so a failed
	// copy out is answered as an error; a later one cuts the body short
	// of its Content-Length, which the client sees.
	piece, err := data.Next()
	if err != nil {
		return fmt.Errorf("req_id %s: reading its receive slot: %w", id, err)
	}
	w.Header().Set("Content-Type", "application/octet-stream")
	w.Header().Set("Content-Length", strconv.FormatInt(desc.Received, 10))
	w.Header().Set(api.HeaderNBytes, strconv.FormatInt(desc.Received, 10))
	w.Header().Set(api.HeaderTag, strconv.FormatUint(uint64(desc.Tag), 10))
	w.WriteHeader(http.StatusOK)
	for len(piece) > 0 {
		if _, err := w.Write(piece); err != nil {
			return nil // the client went away
		}
		if piece, err = data.Next(); err != nil {
			d.log.Warn().Str("req_id", id).Err(err).Msg("reading a receive slot out of GPU memory failed midway: its reader got a short body")
			return nil
		}
	}
	return nil
}

func (d *Daemon) handleDeleteReceive(w http.ResponseWriter, r *http.Request) error {
	id, err := reqID(r)
	if err != nil {
		return err
	}
	if err := d.reg.deleteSlot(id); err != nil {
		return err
	}
	w.WriteHeader(http.StatusNoContent)
	return nil
}

func (d *Daemon) handleListSessions(w http.ResponseWriter, r *http.Request) error {
	writeJSON(w, http.StatusOK, d.sessions.list())
	return nil
}

func (d *Daemon) handleDeleteSession(w http.ResponseWriter, r *http.Request) error {
	id := r.PathValue("id")
	if !d.sessions.remove(id) {
		return apiErr(api.CodeNotFound, "no session %q: GET /v1/sessions lists them", id)
	}
	d.log.Info().Str("session", id).Msg("session torn down on request")
	w.WriteHeader(http.StatusNoContent)
	return nil
}
