package daemon

import (
	"bufio"
	"context"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"sync"
	"time"

	"github.com/ferry-project/ferry/api"
	"github.com/ferry-project/ferry/internal/loglimit"
	"github.com/ferry-project/ferry/transport"
)

// A write stream is a control connection upgraded (POST
// /v1/writes/stream, Upgrade: ferry-writes/1) to binary frames, each a
// write of a range of a region this ferryd holds to a peer's slot, the
// answer coming once its bytes are in the receiver's memory. It is the
// fast path of one small write at a time (the Mooncake engine's
// transfer_sync_write of lent memory): no HTTP request to parse, no body
// to carry through the socket and the arena (the bytes are the region's
// already), the connection's own goroutine doing the write. docs/api.md
// has the frames.

// maxWriteStreams bounds the write streams open at once: each holds a
// goroutine and a connection the control gate no longer counts (it is
// hijacked). A client wants one per thread writing.
const maxWriteStreams = 256

// Frame sizes: a write frame's fixed part, and the most its names may add.
const (
	writeFrameFixed = 4 + 8*4 + 2*3
	writeFrameNames = maxSessionLen + 255 + 64
)

// writeFrame is one write asked on a stream.
type writeFrame struct {
	offset, length  uint64 // the range of the region
	bufferAddress   uint64
	slotBytes       uint64 // 0: not given
	session, region string
	key             string // 40 hex digits, or "" (Mooncake sessions)
}

// errFrame is a frame that could not be read as one: the stream is out of
// step and closes after its answer.
type errFrame struct{ error }

// readWriteFrame reads one frame: its length (u32, little-endian) then
// the fixed fields and the three names. io.EOF before its first byte is
// a clean end.
func readWriteFrame(r io.Reader, buf []byte) (writeFrame, error) {
	var f writeFrame
	if _, err := io.ReadFull(r, buf[:4]); err != nil {
		return f, err
	}
	n := binary.LittleEndian.Uint32(buf[:4])
	if n < writeFrameFixed-4 || n > writeFrameFixed-4+writeFrameNames {
		return f, errFrame{fmt.Errorf("a frame of %d bytes: a write frame has %d to %d after its length (docs/api.md, write streams)",
			n, writeFrameFixed-4, writeFrameFixed-4+writeFrameNames)}
	}
	b := buf[4 : 4+n]
	if _, err := io.ReadFull(r, b); err != nil {
		return f, errFrame{fmt.Errorf("read %d bytes of a frame of %d: %w", len(b), n, err)}
	}
	le := binary.LittleEndian
	f.offset, f.length, f.bufferAddress, f.slotBytes = le.Uint64(b), le.Uint64(b[8:]), le.Uint64(b[16:]), le.Uint64(b[24:])
	ls, lr, lk := int(le.Uint16(b[32:])), int(le.Uint16(b[34:])), int(le.Uint16(b[36:]))
	names := b[38:]
	if ls+lr+lk != len(names) || ls > maxSessionLen || lr > 255 || lk > 64 {
		return f, errFrame{fmt.Errorf("a frame's names: session %d, region %d and key %d bytes in %d left (at most %d, 255 and 64)",
			ls, lr, lk, len(names), maxSessionLen)}
	}
	f.session, f.region, f.key = string(names[:ls]), string(names[ls:ls+lr]), string(names[ls+lr:])
	return f, nil
}

// appendWriteFrame is a frame as a client writes it.
func appendWriteFrame(b []byte, f writeFrame) []byte {
	le := binary.LittleEndian
	b = le.AppendUint32(b, uint32(writeFrameFixed-4+len(f.session)+len(f.region)+len(f.key)))
	for _, v := range []uint64{f.offset, f.length, f.bufferAddress, f.slotBytes} {
		b = le.AppendUint64(b, v)
	}
	for _, s := range []string{f.session, f.region, f.key} {
		b = le.AppendUint16(b, uint16(len(s)))
	}
	return append(append(append(b, f.session...), f.region...), f.key...)
}

// An answer is its status (the HTTP status a request would get, u16),
// its body's length (u32) and the body: empty when the write landed,
// else the error envelope.
func appendWriteAnswer(b []byte, status int, body []byte) []byte {
	b = binary.LittleEndian.AppendUint16(b, uint16(status))
	b = binary.LittleEndian.AppendUint32(b, uint32(len(body)))
	return append(b, body...)
}

// writeStreams are the open streams, closed when ferryd drains.
type writeStreams struct {
	mu      sync.Mutex
	open    map[*writeStream]struct{}
	stopped bool
	refused uint64 // at the cap (ferry_write_streams_refused_total)
}

// stats says how many streams are open, and how many the cap refused.
func (ws *writeStreams) stats() (open int, refused uint64) {
	ws.mu.Lock()
	defer ws.mu.Unlock()
	return len(ws.open), ws.refused
}

type writeStream struct {
	conn net.Conn
	busy bool // a frame is being served: a drain lets it answer
}

// add counts a new stream in, unless ferryd is stopping or at the cap.
func (ws *writeStreams) add(s *writeStream) error {
	ws.mu.Lock()
	defer ws.mu.Unlock()
	switch {
	case ws.stopped:
		return errStopping
	case len(ws.open) >= maxWriteStreams:
		ws.refused++
		return apiErr(api.CodeBusy, "write stream: %d are open, the most ferryd keeps: close some (a client needs one per thread writing), or use POST /v1/writes", maxWriteStreams)
	}
	if ws.open == nil {
		ws.open = map[*writeStream]struct{}{}
	}
	ws.open[s] = struct{}{}
	return nil
}

// serving marks s busy with a frame; false when ferryd is stopping.
func (ws *writeStreams) serving(s *writeStream, busy bool) bool {
	ws.mu.Lock()
	defer ws.mu.Unlock()
	s.busy = busy
	return !ws.stopped
}

// attach gives s its connection; false when ferryd is stopping.
func (ws *writeStreams) attach(s *writeStream, conn net.Conn) bool {
	ws.mu.Lock()
	defer ws.mu.Unlock()
	s.conn = conn
	return !ws.stopped
}

func (ws *writeStreams) remove(s *writeStream) {
	ws.mu.Lock()
	delete(ws.open, s)
	ws.mu.Unlock()
	if s.conn != nil {
		s.conn.Close()
	}
}

// stop takes no new streams and closes those waiting for a frame; a busy
// one closes after its answer.
func (ws *writeStreams) stop() {
	ws.mu.Lock()
	defer ws.mu.Unlock()
	ws.stopped = true
	for s := range ws.open {
		if !s.busy && s.conn != nil {
			s.conn.Close()
		}
	}
}

// handleWriteStream upgrades the connection to a write stream and serves
// its frames on a goroutine of its own, after this request has ended.
func (d *Daemon) handleWriteStream(w http.ResponseWriter, r *http.Request) error {
	if r.Header.Get("Upgrade") != api.WriteStreamProtocol {
		return apiErr(api.CodeBadRequest, "write stream: want the headers Connection: Upgrade and Upgrade: %s (docs/api.md)", api.WriteStreamProtocol)
	}
	s := &writeStream{}
	if err := d.streams.add(s); err != nil {
		return err
	}
	conn, brw, err := http.NewResponseController(w).Hijack()
	if err != nil {
		d.streams.remove(s)
		return apiErr(api.CodeInternal, "write stream: taking the connection over: %v", err)
	}
	if !d.streams.attach(s, conn) {
		d.streams.remove(s)
		return nil // ferryd began to stop: the client sees the close before any 101
	}
	if brw.Reader.Buffered() > 0 {
		// Frames may follow only the 101: bytes before it are out of step.
		brw.WriteString("HTTP/1.1 400 Bad Request\r\nConnection: close\r\nContent-Length: 0\r\n\r\n")
		brw.Flush()
		d.streams.remove(s)
		return nil
	}
	conn.SetDeadline(time.Time{}) // the server's own deadlines are for one request
	fmt.Fprintf(brw, "HTTP/1.1 101 Switching Protocols\r\nConnection: Upgrade\r\nUpgrade: %s\r\n\r\n", api.WriteStreamProtocol)
	if err := brw.Flush(); err != nil {
		d.streams.remove(s)
		return nil
	}
	go d.serveWriteStream(s, conn, callerOf(r.Context()))
	return nil
}

// serveWriteStream answers frames until the client closes the stream, a
// frame is malformed (answered 400, then closed), it sits idle for the
// control socket's idle timeout, or ferryd drains.
func (d *Daemon) serveWriteStream(s *writeStream, conn net.Conn, c *caller) {
	defer d.streams.remove(s)
	// Frames are read through a buffer: the client's next frame may
	// arrive with the end of this one in one read.
	in := bufio.NewReaderSize(readsOf(conn), 4096)
	buf := make([]byte, writeFrameFixed+writeFrameNames)
	var out []byte
	for {
		conn.SetReadDeadline(time.Now().Add(controlIdleTimeout))
		f, err := readWriteFrame(in, buf)
		if err != nil {
			var bad errFrame
			if errors.As(err, &bad) {
				d.refusedLog.Printf("write stream from uid %d (pid %d): %v; closed", c.uid, c.pid, loglimit.Clip(bad.Error()))
				body, _ := json.Marshal(api.ErrorBody{Error: api.Error{Code: api.CodeBadRequest, Message: "write stream: " + bad.Error() + "; the stream is closed: open another"}})
				conn.SetWriteDeadline(time.Now().Add(d.cfg.IOTimeout.D()))
				conn.Write(appendWriteAnswer(out[:0], http.StatusBadRequest, body))
			}
			return
		}
		if !d.streams.serving(s, true) {
			return
		}
		status, body := d.streamWrite(f)
		out = appendWriteAnswer(out[:0], status, body)
		conn.SetWriteDeadline(time.Now().Add(d.cfg.IOTimeout.D()))
		_, err = conn.Write(out)
		if !d.streams.serving(s, false) || err != nil {
			return
		}
	}
}

// readsOf is the connection frames are read from: a control connection's
// own socket, past the reader that keeps passed descriptors (none come
// on a stream: the kernel drops any sent).
func readsOf(conn net.Conn) io.Reader {
	if rc, ok := conn.(*rightsConn); ok {
		return rc.UnixConn
	}
	return conn
}

// streamWrite is one frame's write, as POST /v1/writes would do it with
// the bytes at offset of region: its answer's status and body.
func (d *Daemon) streamWrite(f writeFrame) (int, []byte) {
	if !d.inflight.enter() {
		return d.streamError(errStopping)
	}
	defer d.inflight.leave()
	ctx, cancel := context.WithTimeoutCause(d.reqCtx, d.cfg.RequestTimeout.D(), errRequestTimeout)
	defer cancel()
	start := time.Now()
	err := d.streamSend(ctx, f)
	if err != nil && errors.Is(context.Cause(ctx), errDrainExpired) {
		err = apiErr(api.CodeUnavailable, "ferryd is shutting down and its drain timeout ran out before the write finished, so it was cancelled: write again once it is back")
	}
	ev := d.log.Debug()
	if err != nil {
		ev = d.log.Warn().Err(err)
	}
	ev.Str("path", "/v1/writes/stream").Str("session", f.session).Str("region", f.region).
		Uint64("nbytes", f.length).Dur("took", time.Since(start)).Msg("request")
	if err != nil {
		return d.streamError(err)
	}
	return http.StatusOK, nil
}

func (d *Daemon) streamError(err error) (int, []byte) {
	ae := &apiError{code: internalCode(err), msg: err.Error()}
	errors.As(err, &ae)
	body, _ := json.Marshal(api.ErrorBody{Error: api.Error{Code: ae.code, Message: ae.msg}})
	return api.StatusOf(ae.code), body
}

func (d *Daemon) streamSend(ctx context.Context, f writeFrame) error {
	req := api.SendRequest{Session: f.session, BufferAddress: f.bufferAddress, NBytes: int64(f.slotBytes)}
	if f.key != "" {
		var err error
		if req.Key, err = transport.ParseKey(f.key); err != nil {
			return apiErr(api.CodeBadRequest, "write: the key: %v: pass the key the receiver's POST /v1/receives returned", err)
		}
	}
	if int64(f.slotBytes) < 0 || int64(f.length) <= 0 {
		return apiErr(api.CodeBadRequest, "write: nbytes %d and the slot's %d: want a positive length, and the slot's nbytes or 0", f.length, f.slotBytes)
	}
	res, isMooncake, err := d.sendResult("write", req)
	if err != nil {
		return err
	}
	g, err := d.reg.pinRegion(f.region, "write")
	if err != nil {
		return err
	}
	defer d.reg.unpinRegion(g)
	n := int64(f.length)
	switch {
	case f.offset > uint64(g.size()) || n > g.size()-int64(f.offset):
		return apiErr(api.CodeBadRequest, "write: [%d, +%d) of region %s passes its end (%d bytes): write a range inside it", f.offset, n, f.region, g.size())
	case req.NBytes > 0 && n > req.NBytes:
		return apiErr(api.CodeBadRequest, "write: %d bytes is more than the %d of the receive slot at session %s: ask the receiver for a larger slot", n, req.NBytes, req.Session)
	}
	res.NBytes = n
	_, err = d.sendFrom(ctx, res, req, isMooncake, d.sourceOf(batchSource{region: g}, int64(f.offset), n), sendKept{
		what: "write", log: d.log, staging: "the region", stays: "nothing is kept", kept: "nothing is kept",
		resend: " (write again)",
	})
	return err
}
