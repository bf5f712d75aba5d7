package daemon

import (
	"errors"
	"net/http"
	"strconv"

	"github.com/ferry-project/ferry/api"
	"github.com/ferry-project/ferry/transport"
)

// handleWrite is one write with its bytes inline: POST
// /v1/writes?session=S&buffer_address=N[&nbytes=N], the slot's key (if it
// has one) in the Ferry-Key header, the bytes as the body. It answers
// once they are in the receiver's slot, as a send does: one round trip
// where staging and sending take two (the Mooncake engine's
// transfer_sync_write of host memory), and nothing is kept after it,
// which failed or not. The body goes through an arena slice of its own,
// freed before the answer.
func (d *Daemon) handleWrite(w http.ResponseWriter, r *http.Request) error {
	q := r.URL.Query()
	req := api.SendRequest{Session: q.Get("session")}
	var err error
	if v := q.Get("buffer_address"); v != "" {
		if req.BufferAddress, err = strconv.ParseUint(v, 0, 64); err != nil {
			return apiErr(api.CodeBadRequest, "write: buffer_address=%q is not a number: use the buffer_address the receiver's POST /v1/receives returned", v)
		}
	}
	if v := q.Get("nbytes"); v != "" {
		if req.NBytes, err = strconv.ParseInt(v, 10, 64); err != nil || req.NBytes < 0 {
			return apiErr(api.CodeBadRequest, "write: nbytes=%q is not a slot size: pass the slot's nbytes, or leave it out", v)
		}
	}
	if v := r.Header.Get(api.KeyHeader); v != "" {
		if req.Key, err = transport.ParseKey(v); err != nil {
			return apiErr(api.CodeBadRequest, "write: the %s header: %v: pass the key the receiver's POST /v1/receives returned", api.KeyHeader, err)
		}
	}
	res, isMooncake, err := d.sendResult("write", req)
	if err != nil {
		return err
	}
	n := r.ContentLength
	switch size := d.arena.Stats().Size; {
	case n <= 0:
		return apiErr(api.CodeBadRequest, "write: the body has no Content-Length, or is empty: send the bytes with their length")
	case n > size:
		return apiErr(api.CodeTooLarge, "write: %d bytes is larger than the whole arena (%d bytes) the body passes through: stage and send it in pieces, or raise --arena-size", n, size)
	case req.NBytes > 0 && n > req.NBytes:
		return apiErr(api.CodeBadRequest, "write: %d bytes is more than the %d of the receive slot at session %s: ask the receiver for a larger slot", n, req.NBytes, req.Session)
	}
	s, err := d.reg.scratch(n)
	if err != nil {
		return err
	}
	defer d.reg.freeScratch(s)
	setupErr, err := d.readBodyInto(w, r, d.arena.Memory(), s, n)
	if setupErr != nil {
		return setupErr
	}
	if pe := (*transport.PlaceError)(nil); errors.As(err, &pe) {
		return apiErr(api.CodeInternal, "write: copying the body into GPU memory failed: %v; nothing was written: write again", pe.Err)
	}
	if err != nil {
		return apiErr(api.CodeBadRequest, "write: the body of %d bytes: %v; nothing was written", n, err)
	}
	res.NBytes = n
	src := source{mem: d.arena.Memory(), off: s.Offset, n: n, inPlace: d.dp.inPlace()}
	res, err = d.sendFrom(r.Context(), res, req, isMooncake, src, sendKept{
		what: "write", log: d.log, staging: "the body out of the arena", stays: "nothing is kept", kept: "nothing is kept",
		resend: " (POST /v1/writes again)",
	})
	if err != nil {
		return err
	}
	writeJSON(w, http.StatusOK, res)
	return nil
}
