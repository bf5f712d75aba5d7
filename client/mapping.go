package client

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"time"

	"golang.org/x/sys/unix"

	"github.com/ferry-project/ferry/api"
)

// Mapping is a client's own view of ferryd's host-memory arena, for
// zero-copy staging (write a reserved slice in place, then commit) and for
// reading arrived data in place.
type Mapping struct {
	mem []byte
}

// maxArenaAnswer bounds the answer to GET /v1/arena: a short JSON object.
const maxArenaAnswer = 64 << 10

// MapArena maps ferryd's host-memory arena into this process, read-write.
// The arena is ferryd's alone (a sealed memfd): ferryd passes its descriptor over the
// control socket (GET /v1/arena, SCM_RIGHTS) to callers it admits, so a
// caller its allow-lists refuse gets a forbidden error here and no memory.
func (c *Client) MapArena(ctx context.Context) (*Mapping, error) {
	uc, done, err := c.rawConn(ctx, "mapping ferryd's arena")
	if err != nil {
		return nil, err
	}
	defer done()
	if _, err := io.WriteString(uc, "GET /v1/arena HTTP/1.1\r\nHost: ferryd\r\nConnection: close\r\n\r\n"); err != nil {
		return nil, fmt.Errorf("asking ferryd for its arena: %w", err)
	}
	raw, fds, err := readWithRights(uc)
	closeAll := func() {
		for _, fd := range fds {
			unix.Close(fd)
		}
	}
	if err != nil {
		closeAll()
		return nil, fmt.Errorf("reading ferryd's answer to GET /v1/arena: %w", err)
	}
	resp, err := http.ReadResponse(bufio.NewReader(bytes.NewReader(raw)), nil)
	if err != nil {
		closeAll()
		return nil, fmt.Errorf("ferryd's answer to GET /v1/arena: %w", err)
	}
	defer resp.Body.Close()
	if resp.StatusCode >= 300 {
		closeAll()
		return nil, errorOf(resp)
	}
	var info api.Arena
	if err := json.NewDecoder(resp.Body).Decode(&info); err != nil {
		closeAll()
		return nil, fmt.Errorf("decoding ferryd's answer to GET /v1/arena: %w", err)
	}
	if len(fds) != 1 {
		closeAll()
		return nil, fmt.Errorf("ferryd's answer to GET /v1/arena carried %d file descriptors, not the arena's one", len(fds))
	}
	defer unix.Close(fds[0])
	mem, err := unix.Mmap(fds[0], 0, int(info.Size), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		return nil, fmt.Errorf("mapping ferryd's arena (%s, %d bytes): %w", info.ArenaFile, info.Size, err)
	}
	return &Mapping{mem: mem}, nil
}

// rawConn dials a connection of its own for an exchange that passes a
// descriptor (what, in errors), bounded by ctx (else a minute); done
// closes it.
func (c *Client) rawConn(ctx context.Context, what string) (*net.UnixConn, func(), error) {
	conn, err := c.dial(ctx)
	if err != nil {
		return nil, nil, fmt.Errorf("%w at %s: %v (is ferryd running, and is that its control socket?)", ErrUnreachable, c.socket(), err)
	}
	uc, ok := conn.(*net.UnixConn)
	if !ok {
		conn.Close()
		return nil, nil, fmt.Errorf("%s takes a Unix socket connection, which carries a descriptor; this client dials a %T", what, conn)
	}
	if d, ok := ctx.Deadline(); ok {
		uc.SetDeadline(d)
	} else {
		uc.SetDeadline(time.Now().Add(time.Minute))
	}
	stop := context.AfterFunc(ctx, func() { uc.SetDeadline(time.Now()) })
	return uc, func() { stop(); uc.Close() }, nil
}

// readWithRights reads c to its end, keeping the descriptors that came
// with the bytes.
func readWithRights(c *net.UnixConn) ([]byte, []int, error) {
	var out []byte
	var fds []int
	buf := make([]byte, 4096)
	oob := make([]byte, unix.CmsgSpace(4*4))
	for len(out) <= maxArenaAnswer {
		n, oobn, _, _, err := c.ReadMsgUnix(buf, oob)
		out = append(out, buf[:n]...)
		if oobn > 0 {
			msgs, perr := unix.ParseSocketControlMessage(oob[:oobn])
			for _, m := range msgs {
				if rights, err := unix.ParseUnixRights(&m); err == nil {
					fds = append(fds, rights...)
				}
			}
			if perr != nil {
				return out, fds, perr
			}
		}
		if errors.Is(err, io.EOF) || (err == nil && n == 0) {
			return out, fds, nil
		}
		if err != nil {
			return out, fds, err
		}
	}
	return out, fds, fmt.Errorf("the answer is over %d bytes", maxArenaAnswer)
}

// Bytes returns the n bytes at offset, as ferryd's Slice or Receive named.
func (m *Mapping) Bytes(offset, n int64) ([]byte, error) {
	if offset < 0 || n < 0 || offset+n > int64(len(m.mem)) || offset+n < offset {
		return nil, fmt.Errorf("range [%d, +%d) is outside ferryd's arena (%d bytes)", offset, n, len(m.mem))
	}
	return m.mem[offset : offset+n : offset+n], nil
}

// Slice returns the bytes of a reserved slice.
func (m *Mapping) Slice(s api.Slice) ([]byte, error) { return m.Bytes(s.Offset, s.NBytes) }

// Close unmaps the arena; slices taken from it must not be used after.
func (m *Mapping) Close() error {
	if m.mem == nil {
		return nil
	}
	err := unix.Munmap(m.mem)
	m.mem = nil
	return err
}

// StageInPlace is zero-copy staging: it reserves a slice of shape and
// dtype for reqID, lets fill write the tensor's bytes straight into it
// through m, and commits it. On any failure the reservation is deleted, so
// nothing is left half-written under reqID.
func (c *Client) StageInPlace(ctx context.Context, m *Mapping, reqID string, shape []int64, dtype string, fill func(dst []byte) error) (api.Embedding, error) {
	sl, err := c.Slice(ctx, reqID, api.SliceRequest{Shape: shape, DType: dtype})
	if err != nil {
		return api.Embedding{}, err
	}
	emb, err := func() (api.Embedding, error) {
		dst, err := m.Slice(sl)
		if err != nil {
			return api.Embedding{}, err
		}
		if err := fill(dst); err != nil {
			return api.Embedding{}, err
		}
		return c.Commit(ctx, reqID, shape, dtype)
	}()
	if err != nil {
		// The failure is what the caller needs; a failed delete leaves a
		// reservation the stage TTL sweeps. It runs even when ctx ended.
		dctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
		_ = c.Delete(dctx, reqID)
		cancel()
	}
	return emb, err
}
