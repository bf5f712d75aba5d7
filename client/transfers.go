package client

import (
	"context"
	"net/url"
	"strconv"
	"time"

	"github.com/ferry-project/ferry/api"
)

// StartTransfer starts a batch transfer and returns at once with its id.
func (c *Client) StartTransfer(ctx context.Context, req api.TransferRequest) (api.Transfer, error) {
	return call[api.Transfer](ctx, c, "POST", "/v1/transfers", req)
}

// Transfer runs a batch transfer and waits up to wait for its end, in one
// round trip: it describes the ended transfer (a failed one is described,
// not an error; its Error says why), or errs with a timeout.
func (c *Client) Transfer(ctx context.Context, req api.TransferRequest, wait time.Duration) (api.Transfer, error) {
	return call[api.Transfer](ctx, c, "POST", "/v1/transfers?"+waitQuery(wait), req)
}

// WaitTransfer waits up to wait for a batch transfer to end and describes
// it; a transfer that ended in failure is described, not an error (its
// Error says why). With wait 0 it reports the transfer's progress.
func (c *Client) WaitTransfer(ctx context.Context, id string, wait time.Duration) (api.Transfer, error) {
	path := "/v1/transfers/" + esc(id)
	if wait > 0 {
		path += "?" + waitQuery(wait)
	}
	return call[api.Transfer](ctx, c, "GET", path, nil)
}

// Events returns the events past seq after, waiting up to wait for the
// first: pass the answer's Next as the next call's after.
func (c *Client) Events(ctx context.Context, after uint64, wait time.Duration) (api.Events, error) {
	q := url.Values{"after": {strconv.FormatUint(after, 10)}, "wait": {wait.String()}}
	return call[api.Events](ctx, c, "GET", "/v1/events?"+q.Encode(), nil)
}
