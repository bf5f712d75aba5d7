package daemon

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"testing"
	"time"

	"github.com/ferry-project/ferry/api"
	"github.com/ferry-project/ferry/client"
)

// An upload whose client sends part of the body and then nothing is ended
// by io_timeout, and its entry freed: the req_id can be uploaded again and
// the arena's bytes are back. (The read that timed out once returned a
// negative count, bufio panicked, and the entry stayed "uploading" until
// ferryd restarted.)
func TestStalledUploadIsFreed(t *testing.T) {
	dir := t.TempDir()
	d, c := serveTestDaemon(t, dir, "stall", func(cfg *Config) { cfg.IOTimeout = "300ms" })
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()

	const n = 1 << 20
	conn, err := net.Dial("unix", d.cfg.Socket)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	fmt.Fprintf(conn, "PUT /v1/embeddings/stalled?shape=1,%d&dtype=uint8 HTTP/1.1\r\nHost: ferryd\r\nContent-Length: %d\r\n\r\n", n, n)
	conn.Write(bytes.Repeat([]byte{7}, 100))
	// ferryd answers or closes once io_timeout has passed with no byte.
	conn.SetReadDeadline(time.Now().Add(15 * time.Second))
	if _, err := io.ReadAll(conn); err != nil && !errors.Is(err, io.EOF) {
		t.Fatalf("waiting for ferryd to end the stalled upload: %v", err)
	}
	if _, err := c.Embedding(ctx, "stalled"); client.Code(err) != api.CodeNoEmbedding {
		t.Fatalf("the stalled upload's entry: %v; want it gone (not found)", err)
	}
	if used := d.arena.Stats().Used; used != 0 {
		t.Fatalf("arena holds %d bytes after the stalled upload ended; want 0", used)
	}
	if _, err := c.Stage(ctx, "stalled", []int64{1, n}, "uint8", bytes.NewReader(make([]byte, n)), n); err != nil {
		t.Fatalf("uploading the req_id again: %v", err)
	}
}
