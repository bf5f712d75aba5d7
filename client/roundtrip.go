package client

import (
	"bufio"
	"context"
	"errors"
	"io"
	"net"
	"net/http"
	"sync"
	"time"
)

// syncTransport is the Client's http.RoundTripper: it writes a request and
// reads its answer on the calling goroutine, over kept-alive connections
// to the one socket. net/http's Transport passes every exchange between
// three goroutines (caller, writer, reader); on a loaded or virtualised
// host each pass is a thread wake-up, and together they were a third of a
// status round trip (bench/README.md). A request whose body is large or
// of unknown length goes to fallback (net/http's Transport), which also
// reads an early answer while the body is still being written.
type syncTransport struct {
	dial     func(ctx context.Context) (net.Conn, error)
	fallback http.RoundTripper

	mu   sync.Mutex
	idle []*syncConn
}

// syncBodyMax is the largest request body sent synchronously: it fits in
// a Unix socket's buffer, so writing it never waits for a server that
// answered early and stopped reading.
const syncBodyMax = 64 << 10

// maxIdleConns bounds the connections kept open between requests.
const maxIdleConns = 64

type syncConn struct {
	nc net.Conn
	br *bufio.Reader
	bw *bufio.Writer
}

func (t *syncTransport) RoundTrip(req *http.Request) (*http.Response, error) {
	if req.Body != nil && req.Body != http.NoBody && (req.ContentLength < 0 || req.ContentLength > syncBodyMax) {
		return t.fallback.RoundTrip(req)
	}
	for retried := false; ; retried = true {
		c, reused, err := t.conn(req.Context())
		if err != nil {
			closeBody(req)
			return nil, err
		}
		resp, err := t.exchange(c, req)
		if err == nil {
			return resp, nil
		}
		c.nc.Close()
		// A kept-alive connection the server closed between requests
		// fails before any answer: once, on a fresh connection, for a
		// request that may safely be sent again.
		if retried || !reused || req.Context().Err() != nil || !replayable(req, err) {
			closeBody(req)
			return nil, err
		}
		if req.GetBody != nil {
			body, gerr := req.GetBody()
			if gerr != nil {
				return nil, err
			}
			req = req.Clone(req.Context())
			req.Body = body
		}
	}
}

// errNotSent marks a request whose bytes never reached the server.
var errNotSent = errors.New("ferryd closed the connection before the request was sent")

// replayable says whether req may be sent again after err on a reused
// connection: when it never reached the server, or when it is a read.
func replayable(req *http.Request, err error) bool {
	if req.Body != nil && req.Body != http.NoBody && req.GetBody == nil {
		return false
	}
	return errors.Is(err, errNotSent) || req.Method == http.MethodGet || req.Method == http.MethodHead
}

func closeBody(req *http.Request) {
	if req.Body != nil {
		req.Body.Close()
	}
}

// conn takes an idle connection, or dials one.
func (t *syncTransport) conn(ctx context.Context) (*syncConn, bool, error) {
	t.mu.Lock()
	if n := len(t.idle); n > 0 {
		c := t.idle[n-1]
		t.idle = t.idle[:n-1]
		t.mu.Unlock()
		return c, true, nil
	}
	t.mu.Unlock()
	nc, err := t.dial(ctx)
	if err != nil {
		return nil, false, err
	}
	return &syncConn{nc: nc, br: bufio.NewReader(nc), bw: bufio.NewWriter(nc)}, false, nil
}

// CloseIdleConnections closes the kept-alive connections, its own and
// the fallback's (http.Client.CloseIdleConnections calls it).
func (t *syncTransport) CloseIdleConnections() {
	t.mu.Lock()
	idle := t.idle
	t.idle = nil
	t.mu.Unlock()
	for _, c := range idle {
		c.nc.Close()
	}
	if f, ok := t.fallback.(interface{ CloseIdleConnections() }); ok {
		f.CloseIdleConnections()
	}
}

func (t *syncTransport) put(c *syncConn) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if len(t.idle) >= maxIdleConns {
		c.nc.Close()
		return
	}
	t.idle = append(t.idle, c)
}

// exchange sends req on c and reads the answer's header; the body is read
// by the caller, and c goes back to the pool once it has been read to its
// end and closed.
func (t *syncTransport) exchange(c *syncConn, req *http.Request) (*http.Response, error) {
	ctx := req.Context()
	// Cancellation interrupts the connection's I/O; the connection is
	// then not reused.
	stop := context.AfterFunc(ctx, func() { c.nc.SetDeadline(time.Unix(1, 0)) })
	if err := req.Write(c.bw); err != nil {
		stop()
		return nil, errNotSent
	}
	if err := c.bw.Flush(); err != nil {
		stop()
		return nil, errNotSent
	}
	resp, err := http.ReadResponse(c.br, req)
	if err != nil {
		stop()
		if ctx.Err() != nil {
			return nil, ctx.Err()
		}
		return nil, err
	}
	resp.Body = &syncBody{body: resp.Body, t: t, c: c, stop: stop, reuse: !resp.Close}
	return resp, nil
}

// syncBody returns its connection to the pool when it was read to its end.
type syncBody struct {
	body   io.ReadCloser
	t      *syncTransport
	c      *syncConn
	stop   func() bool
	reuse  bool
	eof    bool
	closed bool
}

func (b *syncBody) Read(p []byte) (int, error) {
	n, err := b.body.Read(p)
	if err == io.EOF {
		b.eof = true
	}
	return n, err
}

// drainMax is how much of an unread answer Close reads to keep its
// connection: a JSON decoder may stop before the final newline.
const drainMax = 4 << 10

func (b *syncBody) Close() error {
	if b.closed {
		return nil
	}
	b.closed = true
	if !b.eof {
		if _, err := io.CopyN(io.Discard, b.body, drainMax); err == io.EOF {
			b.eof = true
		}
	}
	if b.stop() && b.eof && b.reuse {
		b.t.put(b.c)
	} else {
		b.c.nc.Close()
	}
	return nil
}
