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
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// server is a real HTTP server on a Unix socket that counts the
// connections clients open to it.
type server struct {
	sock  string
	srv   *http.Server
	conns atomic.Int64
	done  chan struct{}
}

func serve(t *testing.T, sock string, h http.Handler) *server {
	t.Helper()
	ln, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	s := &server{sock: sock, done: make(chan struct{})}
	s.srv = &http.Server{Handler: h, ConnState: func(_ net.Conn, st http.ConnState) {
		if st == http.StateNew {
			s.conns.Add(1)
		}
	}}
	go func() { defer close(s.done); _ = s.srv.Serve(ln) }()
	t.Cleanup(s.close)
	return s
}

func (s *server) close() {
	_ = s.srv.Close()
	<-s.done
}

// echo answers {"method","path","body_len","body_sum"} for every request,
// and "big" with 1 MiB of bytes.
func echo() http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/big" {
			w.Write(bytes.Repeat([]byte{'x'}, 1<<20))
			return
		}
		if r.URL.Path == "/slow" {
			select {
			case <-r.Context().Done():
			case <-time.After(30 * time.Second):
			}
			return
		}
		b, _ := io.ReadAll(r.Body)
		sum := 0
		for _, c := range b {
			sum += int(c)
		}
		json.NewEncoder(w).Encode(map[string]any{"method": r.Method, "path": r.URL.Path, "body_len": len(b), "body_sum": sum})
	})
}

type echoed struct {
	Method  string `json:"method"`
	Path    string `json:"path"`
	BodyLen int    `json:"body_len"`
	BodySum int    `json:"body_sum"`
}

func ctx(t *testing.T) context.Context {
	c, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	t.Cleanup(cancel)
	return c
}

func TestSyncTransportKeepsOneConnection(t *testing.T) {
	s := serve(t, filepath.Join(t.TempDir(), "s.sock"), echo())
	c := &Client{Socket: s.sock}
	for i := range 50 {
		got, err := call[echoed](ctx(t), c, "POST", fmt.Sprintf("/p%d", i), map[string]int{"i": i})
		if err != nil {
			t.Fatal(err)
		}
		if got.Method != "POST" || got.Path != fmt.Sprintf("/p%d", i) || got.BodyLen == 0 {
			t.Fatalf("request %d: %+v", i, got)
		}
	}
	if n := s.conns.Load(); n != 1 {
		t.Fatalf("50 sequential calls opened %d connections, want 1", n)
	}
}

func TestSyncTransportLargeBodiesGoThroughNetHTTP(t *testing.T) {
	s := serve(t, filepath.Join(t.TempDir(), "s.sock"), echo())
	c := &Client{Socket: s.sock}
	body := bytes.Repeat([]byte{3}, 1<<20)
	var got echoed
	if _, err := c.do(ctx(t), "PUT", "/up", bytes.NewReader(body), int64(len(body)), &got); err != nil {
		t.Fatal(err)
	}
	if got.BodyLen != len(body) || got.BodySum != 3*len(body) {
		t.Fatalf("server saw %+v", got)
	}
	// A streamed body of unknown length works too.
	pr, pw := io.Pipe()
	go func() { pw.Write(body[:1000]); pw.Close() }()
	if _, err := c.do(ctx(t), "PUT", "/stream", pr, -1, &got); err != nil {
		t.Fatal(err)
	}
	if got.BodyLen != 1000 {
		t.Fatalf("server saw %+v", got)
	}
}

func TestSyncTransportRedialsAfterServerRestart(t *testing.T) {
	sock := filepath.Join(t.TempDir(), "s.sock")
	s := serve(t, sock, echo())
	c := &Client{Socket: sock}
	if _, err := call[echoed](ctx(t), c, "GET", "/a", nil); err != nil {
		t.Fatal(err)
	}
	s.close() // the kept-alive connection dies with the server
	serve(t, sock, echo())
	for _, method := range []string{"GET", "POST", "DELETE"} {
		if _, err := call[echoed](ctx(t), c, method, "/b", nil); err != nil {
			t.Fatalf("%s after a restart: %v", method, err)
		}
	}
}

func TestSyncTransportCancel(t *testing.T) {
	s := serve(t, filepath.Join(t.TempDir(), "s.sock"), echo())
	c := &Client{Socket: s.sock}
	cctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
	defer cancel()
	start := time.Now()
	_, err := call[echoed](cctx, c, "GET", "/slow", nil)
	if !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("want the context's error, got %v", err)
	}
	if d := time.Since(start); d > 10*time.Second {
		t.Fatalf("cancelled call took %s", d)
	}
	// The interrupted connection is not reused; the next call works.
	if _, err := call[echoed](ctx(t), c, "GET", "/after", nil); err != nil {
		t.Fatal(err)
	}
}

func TestSyncTransportUnreadBodyClosesConnection(t *testing.T) {
	s := serve(t, filepath.Join(t.TempDir(), "s.sock"), echo())
	c := &Client{Socket: s.sock}
	resp, err := c.do(ctx(t), "GET", "/big", nil, -1, nil)
	if err != nil {
		t.Fatal(err)
	}
	var b [10]byte
	if _, err := io.ReadFull(resp.Body, b[:]); err != nil {
		t.Fatal(err)
	}
	resp.Body.Close() // 1 MiB unread: the connection must not be reused
	got, err := call[echoed](ctx(t), c, "GET", "/next", nil)
	if err != nil || got.Path != "/next" {
		t.Fatalf("after an unread body: %+v %v", got, err)
	}
	if n := s.conns.Load(); n != 2 {
		t.Fatalf("%d connections, want 2 (the unread one closed, a fresh one)", n)
	}
	// A body read to its end gives its connection back.
	resp, err = c.do(ctx(t), "GET", "/big", nil, -1, nil)
	if err != nil {
		t.Fatal(err)
	}
	if n, err := io.Copy(io.Discard, resp.Body); err != nil || n != 1<<20 {
		t.Fatalf("read %d: %v", n, err)
	}
	resp.Body.Close()
	if _, err := call[echoed](ctx(t), c, "GET", "/again", nil); err != nil {
		t.Fatal(err)
	}
	if n := s.conns.Load(); n != 2 {
		t.Fatalf("%d connections, want 2", n)
	}
}

func TestSyncTransportConcurrent(t *testing.T) {
	s := serve(t, filepath.Join(t.TempDir(), "s.sock"), echo())
	c := &Client{Socket: s.sock}
	var wg sync.WaitGroup
	errs := make(chan error, 16)
	for g := range 16 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range 50 {
				path := fmt.Sprintf("/g%d/%d", g, i)
				got, err := call[echoed](ctx(t), c, "POST", path, map[string]string{"x": strings.Repeat("y", i)})
				if err == nil && got.Path != path {
					err = fmt.Errorf("asked %s, answered %s: answers crossed", path, got.Path)
				}
				if err != nil {
					errs <- err
					return
				}
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	if n := s.conns.Load(); n > maxIdleConns+16 {
		t.Fatalf("%d connections for 16 concurrent callers", n)
	}
}

func TestUnreachableNamesTheSocket(t *testing.T) {
	sock := filepath.Join(t.TempDir(), "none.sock")
	_, err := (&Client{Socket: sock}).Status(ctx(t))
	if !errors.Is(err, ErrUnreachable) || !strings.Contains(err.Error(), sock) || !strings.Contains(err.Error(), "is ferryd running") {
		t.Fatalf("got %v", err)
	}
}
