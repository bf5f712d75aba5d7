// Package client is the Go client of ferryd's control API. The zero value
// talks to the default socket; ferryctl, ferrybench and the tests use it.
package client

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"strconv"
	"sync"
	"time"

	"github.com/ferry-project/ferry/api"
)

// Client talks to one ferryd over its Unix socket.
type Client struct {
	// Socket is the control socket path; empty means api.DefaultSocket.
	Socket string
	// Dial, when set, replaces the Unix-socket dialer (tests inject here).
	Dial func(ctx context.Context) (net.Conn, error)

	once sync.Once
	hc   *http.Client
}

// Error is a failure ferryd answered with: its status and envelope.
type Error struct {
	Status  int
	Code    string
	Message string
}

func (e *Error) Error() string { return fmt.Sprintf("ferryd: %s (%s)", e.Message, e.Code) }

// ErrUnreachable wraps every failure to reach ferryd at all.
var ErrUnreachable = errors.New("cannot reach ferryd")

// Code returns the API error code of err ("" when it is not an API error).
func Code(err error) string {
	var e *Error
	if errors.As(err, &e) {
		return e.Code
	}
	return ""
}

func (c *Client) socket() string {
	if c.Socket == "" {
		return api.DefaultSocket
	}
	return c.Socket
}

// UnixDialer dials the Unix socket at path whatever address HTTP asks for;
// it fits http.Transport.DialContext, for callers that want raw HTTP.
func UnixDialer(path string) func(ctx context.Context, network, addr string) (net.Conn, error) {
	return func(ctx context.Context, _, _ string) (net.Conn, error) {
		var d net.Dialer
		return d.DialContext(ctx, "unix", path)
	}
}

// dial opens a connection to ferryd.
func (c *Client) dial(ctx context.Context) (net.Conn, error) {
	if c.Dial != nil {
		return c.Dial(ctx)
	}
	return UnixDialer(c.socket())(ctx, "", "")
}

func (c *Client) http() *http.Client {
	c.once.Do(func() {
		dial := c.dial
		c.hc = &http.Client{Transport: &syncTransport{
			dial: dial,
			fallback: &http.Transport{
				DialContext:         func(ctx context.Context, _, _ string) (net.Conn, error) { return dial(ctx) },
				MaxIdleConnsPerHost: 64,
				IdleConnTimeout:     30 * time.Second,
			},
		}}
	})
	return c.hc
}

// CloseIdleConnections closes the connections kept open between calls.
func (c *Client) CloseIdleConnections() { c.http().CloseIdleConnections() }

// do sends one request and decodes a JSON answer into out (when non-nil),
// or turns the error envelope into *Error.
func (c *Client) do(ctx context.Context, method, path string, body io.Reader, contentLength int64, out any) (*http.Response, error) {
	req, err := http.NewRequestWithContext(ctx, method, "http://ferryd"+path, body)
	if err != nil {
		return nil, err
	}
	if contentLength >= 0 {
		req.ContentLength = contentLength
	}
	if body != nil && contentLength < 0 {
		req.Header.Set("Content-Type", "application/json")
	}
	return c.doRequest(ctx, req, out)
}

// doRequest is do for a request made by the caller (its own headers).
func (c *Client) doRequest(ctx context.Context, req *http.Request, out any) (*http.Response, error) {
	method, path := req.Method, req.URL.RequestURI()
	resp, err := c.http().Do(req)
	if err != nil {
		if ctx.Err() != nil {
			return nil, ctx.Err()
		}
		return nil, fmt.Errorf("%w at %s: %v (is ferryd running, and is that its control socket?)", ErrUnreachable, c.socket(), err)
	}
	if resp.StatusCode >= 300 {
		defer resp.Body.Close()
		return nil, errorOf(resp)
	}
	if out == nil {
		return resp, nil
	}
	defer resp.Body.Close()
	if err := json.NewDecoder(resp.Body).Decode(out); err != nil {
		return nil, fmt.Errorf("decoding ferryd's answer to %s %s: %w", method, path, err)
	}
	return resp, nil
}

// errorOf turns an answer that is not a success into *Error.
func errorOf(resp *http.Response) error {
	var env api.ErrorBody
	raw, _ := io.ReadAll(io.LimitReader(resp.Body, 1<<20))
	if json.Unmarshal(raw, &env) != nil || env.Error.Code == "" {
		return &Error{Status: resp.StatusCode, Code: "http_" + strconv.Itoa(resp.StatusCode), Message: string(bytes.TrimSpace(raw))}
	}
	return &Error{Status: resp.StatusCode, Code: env.Error.Code, Message: env.Error.Message}
}

func jsonBody(v any) io.Reader {
	b, _ := json.Marshal(v)
	return bytes.NewReader(b)
}

func call[T any](ctx context.Context, c *Client, method, path string, in any) (T, error) {
	var out T
	var body io.Reader
	if in != nil {
		body = jsonBody(in)
	}
	_, err := c.do(ctx, method, path, body, -1, &out)
	return out, err
}

func (c *Client) noContent(ctx context.Context, method, path string) error {
	resp, err := c.do(ctx, method, path, nil, -1, nil)
	if err == nil {
		resp.Body.Close()
	}
	return err
}

func esc(s string) string { return url.PathEscape(s) }

// Status returns the daemon's status.
func (c *Client) Status(ctx context.Context) (api.Status, error) {
	return call[api.Status](ctx, c, "GET", "/v1/status", nil)
}

// Stage uploads n bytes from r as req_id's embedding of shape and dtype,
// into the arena of ferryd's first device.
func (c *Client) Stage(ctx context.Context, reqID string, shape []int64, dtype string, r io.Reader, n int64) (api.Embedding, error) {
	return c.StageOn(ctx, "", reqID, shape, dtype, r, n)
}

// StageOn is Stage into the arena on device ("cuda:1", "cpu"; "": the
// first), one of ferryd's --device: the device the tensor is on.
func (c *Client) StageOn(ctx context.Context, device, reqID string, shape []int64, dtype string, r io.Reader, n int64) (api.Embedding, error) {
	q := url.Values{"shape": {api.ShapeString(shape)}, "dtype": {dtype}}
	if device != "" {
		q.Set("device", device)
	}
	var out api.Embedding
	_, err := c.do(ctx, "PUT", "/v1/embeddings/"+esc(reqID)+"?"+q.Encode(), r, n, &out)
	return out, err
}

// Slice reserves an arena slice for zero-copy staging.
func (c *Client) Slice(ctx context.Context, reqID string, req api.SliceRequest) (api.Slice, error) {
	return call[api.Slice](ctx, c, "POST", "/v1/embeddings/"+esc(reqID)+"/slice", req)
}

// Commit seals a zero-copy slice with its shape and dtype.
func (c *Client) Commit(ctx context.Context, reqID string, shape []int64, dtype string) (api.Embedding, error) {
	return call[api.Embedding](ctx, c, "POST", "/v1/embeddings/"+esc(reqID)+"/commit", api.CommitRequest{Shape: shape, DType: dtype})
}

// Embedding describes a staged entry.
func (c *Client) Embedding(ctx context.Context, reqID string) (api.Embedding, error) {
	return call[api.Embedding](ctx, c, "GET", "/v1/embeddings/"+esc(reqID), nil)
}

// Embeddings lists staged entries.
func (c *Client) Embeddings(ctx context.Context) ([]api.Embedding, error) {
	return call[[]api.Embedding](ctx, c, "GET", "/v1/embeddings", nil)
}

// Send writes req_id's staged embedding into a peer's receive slot.
func (c *Client) Send(ctx context.Context, reqID string, req api.SendRequest) (api.SendResult, error) {
	return call[api.SendResult](ctx, c, "POST", "/v1/embeddings/"+esc(reqID)+"/send", req)
}

// Write writes data into a peer's receive slot at slot.BufferAddress
// with one request (POST /v1/writes), the bytes inline: nothing is
// staged, nor kept after a failure.
func (c *Client) Write(ctx context.Context, slot api.ReceiveSlot, data []byte) (api.SendResult, error) {
	q := url.Values{"session": {slot.Session}, "buffer_address": {strconv.FormatUint(slot.BufferAddress, 10)}}
	if slot.NBytes > 0 {
		q.Set("nbytes", strconv.FormatInt(slot.NBytes, 10))
	}
	req, err := http.NewRequestWithContext(ctx, "POST", "http://ferryd/v1/writes?"+q.Encode(), bytes.NewReader(data))
	if err != nil {
		return api.SendResult{}, err
	}
	req.Header.Set("Content-Type", "application/octet-stream")
	if !slot.Key.IsZero() {
		req.Header.Set(api.KeyHeader, slot.Key.String())
	}
	var out api.SendResult
	_, err = c.doRequest(ctx, req, &out)
	return out, err
}

// Read reads req's pieces from a ferry engine's registered memory
// (POST /v1/reads): their bytes, one after another.
func (c *Client) Read(ctx context.Context, req api.ReadRequest) ([]byte, error) {
	resp, err := c.do(ctx, "POST", "/v1/reads", jsonBody(req), -1, nil)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err == nil && int64(len(b)) != resp.ContentLength {
		err = fmt.Errorf("ferryd's answer to POST /v1/reads ended after %d of %d bytes", len(b), resp.ContentLength)
	}
	return b, err
}

// ReadInto reads req's pieces into req.Region at req.RegionOffsets
// (POST /v1/reads with a region).
func (c *Client) ReadInto(ctx context.Context, req api.ReadRequest) (api.ReadResult, error) {
	return call[api.ReadResult](ctx, c, "POST", "/v1/reads", req)
}

// Delete drops a staged embedding.
func (c *Client) Delete(ctx context.Context, reqID string) error {
	return c.noContent(ctx, "DELETE", "/v1/embeddings/"+esc(reqID))
}

// Receive allocates a receive slot of nbytes for req_id, in the arena
// of ferryd's first device.
func (c *Client) Receive(ctx context.Context, reqID string, nbytes int64) (api.ReceiveSlot, error) {
	return c.ReceiveOn(ctx, "", reqID, nbytes)
}

// ReceiveOn allocates the slot in the arena on device ("cuda:3", "cpu";
// "": the first), one of ferryd's --device: where the data is wanted.
func (c *Client) ReceiveOn(ctx context.Context, device, reqID string, nbytes int64) (api.ReceiveSlot, error) {
	return c.ReceiveWith(ctx, api.ReceiveRequest{ReqID: reqID, NBytes: nbytes, Device: device})
}

// ReceiveWith allocates a receive slot as req says (a slot Mooncake
// senders may write into, say).
func (c *Client) ReceiveWith(ctx context.Context, req api.ReceiveRequest) (api.ReceiveSlot, error) {
	return call[api.ReceiveSlot](ctx, c, "POST", "/v1/receives", req)
}

// CompleteReceive tells ferryd that a slot made for Mooncake senders
// holds its data, written by one-sided RDMA WRITEs without a notify
// (Mooncake's transfer_sync_write), which ferryd cannot see.
func (c *Client) CompleteReceive(ctx context.Context, reqID string) (api.Receive, error) {
	return call[api.Receive](ctx, c, "POST", "/v1/receives/"+esc(reqID)+"/complete", nil)
}

// Receives lists receive slots.
func (c *Client) Receives(ctx context.Context) ([]api.Receive, error) {
	return call[[]api.Receive](ctx, c, "GET", "/v1/receives", nil)
}

func waitQuery(wait time.Duration) string {
	return url.Values{"wait": {wait.String()}}.Encode()
}

// Wait waits up to wait for req_id's data and returns it.
func (c *Client) Wait(ctx context.Context, reqID string, wait time.Duration) ([]byte, error) {
	resp, err := c.do(ctx, "GET", "/v1/receives/"+esc(reqID)+"?"+waitQuery(wait), nil, -1, nil)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	data, err := io.ReadAll(resp.Body)
	if err != nil {
		return nil, fmt.Errorf("reading req_id %s's data from ferryd: %w", reqID, err)
	}
	return data, nil
}

// WaitInfo waits up to wait and describes the slot (to read it in place).
func (c *Client) WaitInfo(ctx context.Context, reqID string, wait time.Duration) (api.Receive, error) {
	return call[api.Receive](ctx, c, "GET", "/v1/receives/"+esc(reqID)+"?format=json&"+waitQuery(wait), nil)
}

// FreeReceive frees a receive slot.
func (c *Client) FreeReceive(ctx context.Context, reqID string) error {
	return c.noContent(ctx, "DELETE", "/v1/receives/"+esc(reqID))
}

// Sessions lists the sessions to peer daemons.
func (c *Client) Sessions(ctx context.Context) ([]api.Session, error) {
	return call[[]api.Session](ctx, c, "GET", "/v1/sessions", nil)
}

// Teardown closes and forgets a session.
func (c *Client) Teardown(ctx context.Context, id string) error {
	return c.noContent(ctx, "DELETE", "/v1/sessions/"+esc(id))
}
