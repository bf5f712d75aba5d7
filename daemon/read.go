package daemon

import (
	"fmt"
	"net/http"
	"strings"

	"github.com/ferry-project/ferry/api"
	"github.com/ferry-project/ferry/mooncake"
	"github.com/ferry-project/ferry/rdma"
	"github.com/ferry-project/ferry/transport"
)

// Reads: a ferry engine (ferry.mooncake.TransferEngine's
// transfer_sync_read) reads another ferry engine's registered memory
// through its own ferryd, which reads it from the peer's ferryd over
// the peer protocol (a read connection, transport/peer/read.go, or on
// rdma a control connection of RDMA READs), under the key the segment's
// descriptor publishes, as writes into it carry: with a peer secret the
// connection is authenticated. The peer serves only memory an engine
// registered, in the segment the key names (registry.ReadKeyed,
// registry.GrantRead); no key reads its arena or slots. The bytes come
// by RDMA READ on the rdma transport, from the engine region's
// registration for peers (rdma/reads.go), and over TCP where the peer
// serves no RDMA reads or the memory has no such registration.
//
// A Mooncake engine's segment (a real Mooncake engine's, or any
// Mooncake-protocol peer's) is read over Mooncake's own wire: on an rdma
// segment by plain RDMA READs from its buffers under the rkeys its
// descriptor lists, on the endpoint (QPs) ferryd's writes to that NIC
// take; on a tcp segment by READs on its data port. Every piece is
// checked against the descriptor's buffers before any is read
// (mooncake.Session.Read). Mooncake's wire has no keys: what such a
// segment serves is its engine's business.

// maxReadBytes bounds one POST /v1/reads: its bytes are held in ferryd's
// memory until the answer goes out. ferry.mooncake cuts larger batches.
const maxReadBytes = 64 << 20

// maxReadPieces bounds the pieces of one POST /v1/reads.
const maxReadPieces = 1 << 16

// handleRead: POST /v1/reads, a JSON api.ReadRequest; the answer's body
// is the pieces' bytes one after another, or, when they land in a
// region, an api.ReadResult.
func (d *Daemon) handleRead(w http.ResponseWriter, r *http.Request) error {
	var req api.ReadRequest
	if err := d.decodeJSON(r, &req); err != nil {
		return err
	}
	session := req.Session
	if !strings.HasPrefix(session, mooncake.Scheme) {
		session = mooncake.Scheme + session
	}
	if _, _, err := mooncake.RPCAddr(session); err != nil {
		return apiErr(api.CodeBadRequest, "read: %v: pass the engine's session id, \"host:rpc_port\"", err)
	}
	var total uint64
	for i, p := range req.Pieces {
		if p[1] == 0 || p[1] > maxReadBytes || p[0]+p[1] < p[0] {
			return apiErr(api.CodeBadRequest, "read from %s: piece %d [%#x, +%d) is empty, longer than %d bytes, or passes the end of the address space: give each piece an address and a length of 1 to %d bytes", req.Session, i, p[0], p[1], maxReadBytes, maxReadBytes)
		}
		total += p[1]
	}
	switch {
	case len(req.Pieces) == 0:
		return apiErr(api.CodeBadRequest, "read from %s: no pieces: give [[address, length], ...]", req.Session)
	case len(req.Pieces) > maxReadPieces:
		return apiErr(api.CodeTooLarge, "read from %s: %d pieces, more than the %d one read takes: read in several", req.Session, len(req.Pieces), maxReadPieces)
	case total > maxReadBytes:
		return apiErr(api.CodeTooLarge, "read from %s: %d bytes, more than the %d one read takes: read in several", req.Session, total, maxReadBytes)
	}
	sess, _, err := d.sessions.get(r.Context(), session)
	if err != nil {
		return apiErr(api.CodeTransferFailed, "read from %s: %v", req.Session, err)
	}
	rd, ok := sess.(transport.Reader)
	if !ok {
		return apiErr(api.CodeBadRequest, "read from %s: its %s session does not read", req.Session, sess.Transport())
	}
	reads := make([]transport.Read, len(req.Pieces))
	var buf []byte
	if req.Region != "" {
		g, err := d.reg.pinRegion(req.Region, "read")
		if err != nil {
			return err
		}
		defer d.reg.unpinRegion(g)
		if err := landInRegion(reads, req, g.mem.Host()); err != nil {
			return err
		}
	} else {
		var free func()
		buf, free = d.readBuffer(int64(total))
		defer free()
		at := uint64(0)
		for i, p := range req.Pieces {
			reads[i] = transport.Read{Addr: p[0], Dst: buf[at : at+p[1] : at+p[1]]}
			at += p[1]
		}
	}
	if err := rd.Read(r.Context(), reads); err != nil {
		if transport.IsRefusal(err) {
			// The peer's refusal, or for a Mooncake segment the
			// descriptor's: it lists no buffer holding a piece.
			return apiErr(api.CodeRefused, "read from %s refused: %v", req.Session, err)
		}
		return apiErr(api.CodeTransferFailed, "read from %s failed (ret=%s): %v; read again", req.Session, retCode(err), err)
	}
	if req.Region != "" {
		writeJSON(w, http.StatusOK, api.ReadResult{NBytes: total})
		return nil
	}
	w.Header().Set("Content-Type", "application/octet-stream")
	w.Header().Set("Content-Length", fmt.Sprint(total))
	w.WriteHeader(http.StatusOK)
	// A caller gone mid-answer gets a short body, which it sees: no
	// error envelope can follow the bytes.
	w.Write(buf)
	return nil
}

// landInRegion points each read at its piece's place in a region's host
// memory, checked to lie inside it.
func landInRegion(reads []transport.Read, req api.ReadRequest, host []byte) error {
	switch {
	case host == nil:
		return apiErr(api.CodeBadRequest, "read from %s: region %s is GPU memory, and reads land in host memory only: read into a host region, or without region (the bytes come in the answer)", req.Session, req.Region)
	case len(req.RegionOffsets) != len(req.Pieces):
		return apiErr(api.CodeBadRequest, "read from %s: %d region_offsets for %d pieces: give one offset into region %s per piece", req.Session, len(req.RegionOffsets), len(req.Pieces), req.Region)
	}
	for i, p := range req.Pieces {
		off := req.RegionOffsets[i]
		if off > uint64(len(host)) || p[1] > uint64(len(host))-off {
			return apiErr(api.CodeBadRequest, "read from %s: piece %d lands at [%d, +%d) of region %s, which has %d bytes: land it inside the region", req.Session, i, off, p[1], req.Region, len(host))
		}
		reads[i] = transport.Read{Addr: p[0], Dst: host[off : off+p[1] : off+p[1]]}
	}
	return nil
}

// readBuffer is where a read's pieces land: an arena slice when the
// arena is host memory (registered with the NIC: RDMA READs land there
// with no copy), else, or when the arena has no room now, memory of its
// own (RDMA READs then land through a bounce buffer).
func (d *Daemon) readBuffer(n int64) ([]byte, func()) {
	if host := d.arena.Memory().Host(); host != nil {
		if s, err := d.reg.scratch(n); err == nil {
			return host[s.Offset : s.Offset+n : s.Offset+n], func() { d.reg.freeScratch(s) }
		}
	}
	return make([]byte, n), func() {}
}

// ReadKeyed implements transport.Source: a ferry peer's read of the
// memory an engine registered, in the segment whose key it carries (the
// range checked as a Mooncake peer's read is: engineMemory.Read). No
// other key reads anything: a receive slot's key names memory to write,
// and the arena is no engine's.
func (r *registry) ReadKeyed(addr, n uint64, key transport.Key) ([]byte, func(), error) {
	segment, err := r.readableSegment(key)
	if err != nil {
		return nil, nil, err
	}
	return engineMemory{r, segment}.Read(addr, n)
}

// GrantRead implements rdma.ReadGranter: ReadKeyed's checks, and the
// range's place under its region's registration for peers (at the
// engine's addresses: the iova is addr itself), the region pinned until
// done. A range spanning two regions is refused (each has its own
// rkey); one in memory without that registration (GPU memory) is
// rdma.ErrNoGrant, and read over TCP.
func (r *registry) GrantRead(addr, n uint64, key transport.Key) (uint64, uint32, func(), error) {
	segment, err := r.readableSegment(key)
	if err != nil {
		return 0, 0, nil, err
	}
	r.mu.Lock()
	if r.stopping {
		r.mu.Unlock()
		return 0, 0, nil, errRefuseStopping
	}
	parts, pinned, err := r.lentRange(segment, addr, n, "read")
	r.mu.Unlock()
	switch {
	case err != nil:
		return 0, 0, nil, err
	case len(parts) > 1:
		r.unpinRegions(pinned)
		return 0, 0, nil, &transport.Refusal{Code: transport.OutOfBounds,
			Message: fmt.Sprintf("a read of %d bytes at %#x spans %d registered ranges: read each on its own", n, addr, len(parts))}
	case parts[0].g.mr == nil:
		r.unpinRegions(pinned)
		return 0, 0, nil, rdma.ErrNoGrant
	}
	return addr, parts[0].g.mr.RKey, func() { r.unpinRegions(pinned) }, nil
}

// readableSegment is the engine segment whose key a read carries.
func (r *registry) readableSegment(key transport.Key) (string, error) {
	r.mu.Lock()
	segment, ok := r.engineKeys[key]
	r.mu.Unlock()
	if !ok {
		r.refused(transport.NoSlot)
		return "", &transport.Refusal{Code: transport.NoSlot,
			Message: "no engine segment here has this key (its engine closed, or it never was one): fetch the segment's descriptor again"}
	}
	return segment, nil
}
