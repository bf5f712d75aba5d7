package client

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"os"
	"time"

	"golang.org/x/sys/unix"

	"github.com/ferry-project/ferry/api"
)

// NewRegionFile makes memory to register as a region: a memfd of n bytes
// sealed against shrinking, as ferryd requires. Map it (MAP_SHARED) to
// use it; the file can be closed once registered and mapped.
func NewRegionFile(name string, n int64) (*os.File, error) {
	fd, err := unix.MemfdCreate(name, unix.MFD_CLOEXEC|unix.MFD_ALLOW_SEALING)
	if err != nil {
		return nil, fmt.Errorf("memfd_create: %w", err)
	}
	f := os.NewFile(uintptr(fd), "memfd:"+name)
	if err := f.Truncate(n); err != nil {
		f.Close()
		return nil, fmt.Errorf("sizing the memfd to %d bytes: %w", n, err)
	}
	if _, err := unix.FcntlInt(f.Fd(), unix.F_ADD_SEALS, unix.F_SEAL_SHRINK); err != nil {
		f.Close()
		return nil, fmt.Errorf("sealing the memfd against shrinking: %w", err)
	}
	return f, nil
}

// RegisterRegion lends ferryd nbytes of f (a memfd sealed against
// shrinking, from NewRegionFile) as region name: transfers may then read
// from it (a source {"region": name}) and receive slots may lie in it,
// with no copy through the arena. The descriptor travels beside the
// request (SCM_RIGHTS), on a connection of its own.
func (c *Client) RegisterRegion(ctx context.Context, name string, f *os.File, nbytes int64) (api.Region, error) {
	return c.RegisterRegionWith(ctx, api.RegionRequest{Name: name, NBytes: nbytes}, f)
}

// RegisterRegionWith is RegisterRegion with the whole request: a range
// of the memfd from FDOffset, lent for Mooncake peers' writes at
// MooncakeAddr in engine segment MooncakeSegment (docs/api.md); with f
// nil, the GPU memory r.CUDA names.
func (c *Client) RegisterRegionWith(ctx context.Context, r api.RegionRequest, f *os.File) (api.Region, error) {
	if f == nil {
		return call[api.Region](ctx, c, "POST", "/v1/regions", r)
	}
	name := r.Name
	body, _ := json.Marshal(r)
	var req bytes.Buffer
	fmt.Fprintf(&req, "POST /v1/regions HTTP/1.1\r\nHost: ferryd\r\nContent-Type: application/json\r\nContent-Length: %d\r\nConnection: close\r\n\r\n", len(body))
	req.Write(body)

	uc, done, err := c.rawConn(ctx, "registering a region")
	if err != nil {
		return api.Region{}, err
	}
	defer done()
	if _, _, err := uc.WriteMsgUnix(req.Bytes(), unix.UnixRights(int(f.Fd())), nil); err != nil {
		return api.Region{}, fmt.Errorf("passing region %s to ferryd: %w", name, err)
	}
	resp, err := http.ReadResponse(bufio.NewReader(uc), nil)
	if err != nil {
		return api.Region{}, fmt.Errorf("ferryd's answer to registering region %s: %w", name, err)
	}
	defer resp.Body.Close()
	if resp.StatusCode >= 300 {
		return api.Region{}, errorOf(resp)
	}
	var out api.Region
	if err := json.NewDecoder(resp.Body).Decode(&out); err != nil {
		return out, fmt.Errorf("decoding ferryd's answer to registering region %s: %w", name, err)
	}
	return out, nil
}

// Regions lists the registered regions.
func (c *Client) Regions(ctx context.Context) ([]api.Region, error) {
	return call[[]api.Region](ctx, c, "GET", "/v1/regions", nil)
}

// UnregisterRegion takes a region back: it returns once ferryd has ended
// every transfer and write using it and unmapped it (waiting up to wait),
// after which the memory is the caller's alone. Receive slots in it must
// be freed first. An internal error naming the NIC means the NIC kept
// the region's registration: it stays registered; call again to retry.
func (c *Client) UnregisterRegion(ctx context.Context, name string, wait time.Duration) error {
	return c.noContent(ctx, "DELETE", "/v1/regions/"+esc(name)+"?"+waitQuery(wait))
}

// RegisterCUDARegion lends ferryd nbytes of GPU memory this process owns
// as region name: the allocation ipcHandle names (cuIpcGetMemHandle), from
// offset in it, on device ("cuda:N", which must be ferryd's GPU).
func (c *Client) RegisterCUDARegion(ctx context.Context, name, device string, ipcHandle []byte, offset, nbytes int64) (api.Region, error) {
	return call[api.Region](ctx, c, "POST", "/v1/regions", api.RegionRequest{Name: name, NBytes: nbytes,
		CUDA: &api.RegionCUDA{Device: device, IPCHandle: ipcHandle, Offset: offset}})
}

// OpenEngineSegment opens a Mooncake segment of the calling process's own
// (POST /v1/mooncake/segments): its RPC port on port (0: any), listing
// the regions it lends into it; closed when the process exits.
func (c *Client) OpenEngineSegment(ctx context.Context, port int) (api.EngineSegment, error) {
	return call[api.EngineSegment](ctx, c, "POST", "/v1/mooncake/segments", api.EngineSegmentRequest{Port: port})
}

// CloseEngineSegment closes engine segment id and unregisters its regions,
// once the writes landing in them have ended.
func (c *Client) CloseEngineSegment(ctx context.Context, id string) error {
	return c.noContent(ctx, "DELETE", "/v1/mooncake/segments/"+esc(id))
}

// DrainNotifies takes the Mooncake notifies engine segment id received
// since the last drain, oldest first (its engine's get_notifies).
func (c *Client) DrainNotifies(ctx context.Context, id string) (api.Notifies, error) {
	return call[api.Notifies](ctx, c, "POST", "/v1/mooncake/segments/"+esc(id)+"/notifies/drain", nil)
}

// SendNotify sends a Mooncake notify to the RPC port of the segment
// req.Session, and returns once the receiver kept it.
func (c *Client) SendNotify(ctx context.Context, req api.NotifyRequest) error {
	resp, err := c.do(ctx, "POST", "/v1/mooncake/notifies", jsonBody(req), -1, nil)
	if err == nil {
		resp.Body.Close()
	}
	return err
}
