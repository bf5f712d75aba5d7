package daemon

import (
	"errors"
	"fmt"
	"net"
	"net/http"
	"sync"

	"github.com/ferry-project/ferry/api"
	"github.com/ferry-project/ferry/internal/loglimit"
	"github.com/ferry-project/ferry/mooncake"
)

// Mooncake notifies. A Mooncake engine sends one ({"name","notify_msg"},
// type 2 on the target's RPC port) once a transfer made with a notify
// has completed, and the target engine's get_notifies() takes the ones
// it received since the last call. An engine segment keeps what its RPC
// port receives (from addresses on mooncake_allow, as writes into it)
// until its engine drains them (POST /v1/mooncake/segments/{id}/notifies/drain);
// a ferry engine's own notifies go out through its ferryd
// (POST /v1/mooncake/notifies), to a Mooncake engine's RPC port or to
// another ferry engine segment's alike.

// An engine segment keeps at most maxEngineNotifies unread notifies, of
// at most maxEngineNotifyBytes of names and messages together: a peer
// sending to an engine that never drains them meets the bound, not
// ferryd's memory (256 segments at most: 64 MiB). A notify past either
// is refused, not an older one dropped: its sender hears so (ferry's
// sender fails the call, Mooncake's logs "Notify rejected"), where a
// drop would lose a notify no one learns of. One notify is at most
// mooncake.MaxSmallMessage bytes on the wire.
const (
	maxEngineNotifies    = 1024
	maxEngineNotifyBytes = 256 << 10
	notifyOverhead       = 64 // a held notify's own bytes, counted with its strings
)

// notifyQueue is an engine segment's unread notifies.
type notifyQueue struct {
	mu      sync.Mutex
	held    []mooncake.NotifyDesc
	bytes   int
	refused uint64 // notifies refused for want of room, ever
}

func notifyCost(n mooncake.NotifyDesc) int {
	return notifyOverhead + len(n.Name) + len(n.NotifyMsg)
}

// add keeps n, or refuses it (an error wrapping
// mooncake.ErrNotifyRefused) when the queue is full.
func (q *notifyQueue) add(n mooncake.NotifyDesc) error {
	q.mu.Lock()
	defer q.mu.Unlock()
	cost := notifyCost(n)
	if len(q.held) >= maxEngineNotifies || q.bytes+cost > maxEngineNotifyBytes {
		q.refused++
		return fmt.Errorf("%w: this engine holds %d unread notifies (%d bytes), and keeps at most %d (%d bytes) until it takes them with get_notifies()",
			mooncake.ErrNotifyRefused, len(q.held), q.bytes, maxEngineNotifies, maxEngineNotifyBytes)
	}
	q.held = append(q.held, n)
	q.bytes += cost
	return nil
}

// drain takes every notify held, in the order they came.
func (q *notifyQueue) drain() []mooncake.NotifyDesc {
	q.mu.Lock()
	defer q.mu.Unlock()
	out := q.held
	q.held, q.bytes = nil, 0
	return out
}

// stats is how many notifies are held now and how many were refused.
func (q *notifyQueue) stats() (held int, refused uint64) {
	q.mu.Lock()
	defer q.mu.Unlock()
	return len(q.held), q.refused
}

// engineNotify is an engine segment's handshake handler for notifies:
// it keeps them for the engine, counted by outcome. A refusal is logged
// by the handshake server, rate-limited, and answered as one.
func (d *Daemon) engineNotify(es *engineSegment) func(net.Addr, mooncake.NotifyDesc) error {
	return func(from net.Addr, n mooncake.NotifyDesc) error {
		if err := es.notifies.add(n); err != nil {
			d.metrics.notifiesReceived.WithLabelValues("refused").Inc()
			return err
		}
		d.metrics.notifiesReceived.WithLabelValues("kept").Inc()
		if d.mooncake.debug.Allow() {
			d.log.Debug().Str("component", "mooncake").Str("engine_segment", es.id).Stringer("addr", from).
				Str("from", loglimit.Clip(n.Name)).Str("notify_msg", loglimit.Clip(n.NotifyMsg)).Msg("mooncake notify kept for its engine")
		}
		return nil
	}
}

// handleDrainNotifies: POST /v1/mooncake/segments/{id}/notifies/drain,
// the notifies the segment received since the last drain, oldest first;
// only the process that opened the segment may take them.
func (d *Daemon) handleDrainNotifies(w http.ResponseWriter, r *http.Request) error {
	id := r.PathValue("id")
	es := d.engines.get(id)
	if es == nil {
		return apiErr(api.CodeNotFound, "no engine segment %s (GET /v1/mooncake/segments lists them)", id)
	}
	if pid := callerOf(r.Context()).pid; pid != es.owner {
		return apiErr(api.CodeForbidden, "engine segment %s belongs to process %d, not to this caller (pid %d): an engine takes only its own notifies", id, es.owner, pid)
	}
	held := es.notifies.drain()
	_, refused := es.notifies.stats()
	out := api.Notifies{Notifies: make([]api.Notify, len(held)), Refused: refused}
	for i, n := range held {
		out.Notifies[i] = api.Notify{Name: n.Name, NotifyMsg: n.NotifyMsg}
	}
	writeJSON(w, http.StatusOK, out)
	return nil
}

// handleSendNotify: POST /v1/mooncake/notifies sends a notify to the RPC
// port of a Mooncake segment (a Mooncake engine's, or a ferry engine
// segment's), 204 once it said it kept it.
func (d *Daemon) handleSendNotify(w http.ResponseWriter, r *http.Request) error {
	var req api.NotifyRequest
	if err := d.decodeJSON(r, &req); err != nil {
		return err
	}
	n := mooncake.NotifyDesc{Name: req.Name, NotifyMsg: req.NotifyMsg}
	if _, _, err := net.SplitHostPort(req.Session); err != nil {
		return apiErr(api.CodeBadRequest, "session %q: want the target engine's session id \"host:rpc_port\" (%v)", req.Session, err)
	}
	if err := mooncake.CheckNotify(n); err != nil {
		return apiErr(api.CodeTooLarge, "%v", err)
	}
	if err := mooncake.SendNotify(r.Context(), req.Session, n); err != nil {
		d.metrics.notifiesSent.WithLabelValues("failed").Inc()
		if errors.Is(err, mooncake.ErrNotifyRefused) {
			return apiErr(api.CodeRefused, "%v", err)
		}
		return apiErr(api.CodeTransferFailed, "%v: the notify was not delivered", err)
	}
	d.metrics.notifiesSent.WithLabelValues("ok").Inc()
	w.WriteHeader(http.StatusNoContent)
	return nil
}
