package daemon

import (
	"bufio"
	"bytes"
	"context"
	"encoding/binary"
	"encoding/json"
	"io"
	"math/rand/v2"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/ferry-project/ferry/api"
	"github.com/ferry-project/ferry/client"
)

// testStream is a write stream opened on a ferryd's control socket.
type testStream struct {
	t    *testing.T
	conn net.Conn
	in   *bufio.Reader
}

// openStream upgrades a fresh control connection; it is closed when the
// test ends.
func openStream(t *testing.T, socket string) *testStream {
	t.Helper()
	conn, err := net.Dial("unix", socket)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	conn.SetDeadline(time.Now().Add(30 * time.Second))
	io.WriteString(conn, "POST /v1/writes/stream HTTP/1.1\r\nHost: ferryd\r\nContent-Length: 0\r\nConnection: Upgrade\r\nUpgrade: "+api.WriteStreamProtocol+"\r\n\r\n")
	in := bufio.NewReader(conn)
	resp, err := http.ReadResponse(in, nil)
	if err != nil {
		t.Fatal(err)
	}
	if resp.StatusCode != http.StatusSwitchingProtocols || resp.Header.Get("Upgrade") != api.WriteStreamProtocol {
		body, _ := io.ReadAll(resp.Body)
		t.Fatalf("upgrade answered %s %s", resp.Status, body)
	}
	return &testStream{t: t, conn: conn, in: in}
}

// send writes raw bytes and reads the answer: its status and error code
// and message ("" when it landed); ok false when the stream closed instead.
func (s *testStream) send(raw []byte) (status int, code, msg string, ok bool) {
	s.t.Helper()
	if _, err := s.conn.Write(raw); err != nil {
		return 0, "", "", false
	}
	var head [6]byte
	if _, err := io.ReadFull(s.in, head[:]); err != nil {
		return 0, "", "", false
	}
	body := make([]byte, binary.LittleEndian.Uint32(head[2:]))
	if _, err := io.ReadFull(s.in, body); err != nil {
		s.t.Fatalf("the answer's body: %v", err)
	}
	status = int(binary.LittleEndian.Uint16(head[:]))
	if len(body) > 0 {
		var e api.ErrorBody
		if err := json.Unmarshal(body, &e); err != nil {
			s.t.Fatalf("an answer's body is not the error envelope: %q", body)
		}
		code, msg = e.Error.Code, e.Error.Message
	}
	return status, code, msg, true
}

// closed says whether ferryd closed the stream (within the deadline).
func (s *testStream) closed() bool {
	s.conn.SetReadDeadline(time.Now().Add(10 * time.Second))
	_, err := s.in.ReadByte()
	return err == io.EOF
}

// Frames on a write stream land a region's bytes in a keyed slot and in
// a Mooncake one; a frame naming no region, a range past the region or a
// missing key gets its error and the stream goes on; a malformed frame
// gets a 400 and the stream closes, ferryd serving on. An upgrade
// without its header is refused, and a drain closes the streams left.
func TestWriteStreamWritesFromRegions(t *testing.T) {
	ctx, cancel := context.WithTimeout(t.Context(), 60*time.Second)
	defer cancel()
	dir := t.TempDir()
	snd, sc := serveTestDaemon(t, dir, "snd", nil)
	_, rc := serveTestDaemon(t, dir, "rcv", func(c *Config) { c.MooncakeListen = "127.0.0.1:0" })
	const n = 64 << 10
	f := regionFile(t, "src", 2*n)
	data := make([]byte, 2*n)
	rand.NewChaCha8([32]byte{3}).Read(data)
	if _, err := f.WriteAt(data, 0); err != nil {
		t.Fatal(err)
	}
	if _, err := sc.RegisterRegion(ctx, "src", f, 2*n); err != nil {
		t.Fatal(err)
	}
	s := openStream(t, snd.cfg.Socket)

	keyed, err := rc.Receive(ctx, "keyed", n)
	if err != nil {
		t.Fatal(err)
	}
	frame := writeFrame{offset: n, length: n, bufferAddress: keyed.BufferAddress, slotBytes: n, session: keyed.Session, region: "src", key: keyed.Key.String()}
	if st, code, msg, ok := s.send(appendWriteFrame(nil, frame)); !ok || st != http.StatusOK {
		t.Fatalf("a write into a keyed slot: %d %s %s (open %v)", st, code, msg, ok)
	}
	if got, err := rc.Wait(ctx, "keyed", 0); err != nil || !bytes.Equal(got, data[n:]) {
		t.Fatalf("the keyed slot holds %d bytes (%v), want the region's second half", len(got), err)
	}
	mc, err := rc.ReceiveWith(ctx, api.ReceiveRequest{ReqID: "mc", NBytes: 2 * n, Mooncake: true})
	if err != nil {
		t.Fatal(err)
	}
	for _, at := range []uint64{n, 0} { // in two pieces, each at its own address
		fr := writeFrame{offset: at, length: n, bufferAddress: mc.BufferAddress + at, session: "mooncake://" + mc.MooncakeSession, region: "src"}
		if st, code, msg, ok := s.send(appendWriteFrame(nil, fr)); !ok || st != http.StatusOK {
			t.Fatalf("a write at %d of a Mooncake slot: %d %s %s (open %v)", at, st, code, msg, ok)
		}
	}
	if got, err := rc.Wait(ctx, "mc", 0); err != nil || !bytes.Equal(got, data) {
		t.Fatalf("the Mooncake slot holds %d bytes (%v), want the region's", len(got), err)
	}

	// Errors of a well-formed frame: answered, the stream kept.
	mc, err = rc.ReceiveWith(ctx, api.ReceiveRequest{ReqID: "mc2", NBytes: 2 * n, Mooncake: true})
	if err != nil {
		t.Fatal(err)
	}
	mcFrame := writeFrame{length: n, bufferAddress: mc.BufferAddress, session: "mooncake://" + mc.MooncakeSession, region: "src"}
	for _, c := range []struct {
		f    func(*writeFrame)
		code string
		says string
	}{
		{func(f *writeFrame) { f.region = "nope" }, api.CodeNotFound, "no region named nope"},
		{func(f *writeFrame) { f.offset = n + 1 }, api.CodeBadRequest, "passes its end"},
		{func(f *writeFrame) { f.length = 0 }, api.CodeBadRequest, "positive length"},
		{func(f *writeFrame) { f.slotBytes = 16 }, api.CodeBadRequest, "more than the 16 of the receive slot"},
		{func(f *writeFrame) { f.session = keyed.Session }, api.CodeBadRequest, "key is missing"},
		{func(f *writeFrame) { f.key = "xyz" }, api.CodeBadRequest, "the key"},
		{func(f *writeFrame) { f.bufferAddress = 0 }, api.CodeBadRequest, "buffer_address is missing"},
	} {
		fr := mcFrame
		c.f(&fr)
		st, code, msg, ok := s.send(appendWriteFrame(nil, fr))
		if !ok || code != c.code || st != api.StatusOf(c.code) || !strings.Contains(msg, c.says) {
			t.Errorf("frame %+v: %d %s %q (open %v), want %s saying %q", fr, st, code, msg, ok, c.code, c.says)
		}
	}
	if st, _, msg, ok := s.send(appendWriteFrame(nil, mcFrame)); !ok || st != http.StatusOK {
		t.Fatalf("a good frame after refused ones: %d %s (open %v)", st, msg, ok)
	}

	// Malformed frames: a 400 saying what was wrong, then the close.
	long := binary.LittleEndian.AppendUint32(nil, 1<<20)
	names := appendWriteFrame(nil, mcFrame)
	binary.LittleEndian.PutUint16(names[4+32:], 999) // a session longer than the frame
	for _, raw := range [][]byte{long, names, append(binary.LittleEndian.AppendUint32(nil, 3), "abc"...)} {
		b := openStream(t, snd.cfg.Socket)
		st, code, msg, ok := b.send(raw)
		if !ok || st != http.StatusBadRequest || code != api.CodeBadRequest || !strings.Contains(msg, "docs/api.md") && !strings.Contains(msg, "names") {
			t.Errorf("malformed frame % x...: %d %s %q (open %v)", raw[:min(len(raw), 8)], st, code, msg, ok)
		}
		if !b.closed() {
			t.Errorf("the stream stays open after a malformed frame")
		}
	}
	if st, _, msg, ok := s.send(appendWriteFrame(nil, mcFrame)); !ok || st != http.StatusOK {
		t.Fatalf("another stream after the malformed ones: %d %s (open %v)", st, msg, ok)
	}

	// An upgrade must say so.
	resp, err := (&http.Client{Transport: &http.Transport{DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
		return (&net.Dialer{}).DialContext(ctx, "unix", snd.cfg.Socket)
	}}}).Post("http://ferryd/v1/writes/stream", "", nil)
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != http.StatusBadRequest || !strings.Contains(string(body), "Upgrade: "+api.WriteStreamProtocol) {
		t.Errorf("a POST /v1/writes/stream without Upgrade: %s %s", resp.Status, body)
	}
	if _, err := sc.Status(ctx); err != nil {
		t.Fatalf("ferryd after the bad frames: %v", err)
	}
	// s stays open: serveTestDaemon's stop must close it (else Serve
	// would not return within the test's bound).
}

// At maxWriteStreams open, one more is refused busy, and /metrics
// shows both; one closed makes room.
func TestWriteStreamsAreCapped(t *testing.T) {
	dir := t.TempDir()
	snd, _ := serveTestDaemon(t, dir, "snd", nil)
	streams := make([]*testStream, maxWriteStreams)
	for i := range streams {
		streams[i] = openStream(t, snd.cfg.Socket)
	}
	refused := func() string {
		conn, err := net.Dial("unix", snd.cfg.Socket)
		if err != nil {
			t.Fatal(err)
		}
		defer conn.Close()
		conn.SetDeadline(time.Now().Add(30 * time.Second))
		io.WriteString(conn, "POST /v1/writes/stream HTTP/1.1\r\nHost: ferryd\r\nContent-Length: 0\r\nConnection: Upgrade\r\nUpgrade: "+api.WriteStreamProtocol+"\r\n\r\n")
		resp, err := http.ReadResponse(bufio.NewReader(conn), nil)
		if err != nil {
			t.Fatal(err)
		}
		body, _ := io.ReadAll(resp.Body)
		if resp.StatusCode == http.StatusSwitchingProtocols {
			return ""
		}
		return string(body)
	}
	if got := refused(); !strings.Contains(got, `"busy"`) || !strings.Contains(got, "the most ferryd keeps") {
		t.Fatalf("stream %d: %q, want busy", maxWriteStreams+1, got)
	}
	fams := scrapeSocket(t, &client.Client{Socket: snd.cfg.Socket})
	if open, n := value(fams, "ferry_write_streams"), value(fams, "ferry_write_streams_refused_total"); open != maxWriteStreams || n != 1 {
		t.Errorf("/metrics: ferry_write_streams %v, ferry_write_streams_refused_total %v: want %d open, 1 refused", open, n, maxWriteStreams)
	}
	streams[0].conn.Close()
	deadline := time.Now().Add(20 * time.Second)
	for refused() != "" {
		if time.Now().After(deadline) {
			t.Fatal("a closed stream's place is not taken back")
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// FuzzWriteFrame reads arbitrary bytes as a write stream's frame: never
// a panic or a read past the frame's own length, and a frame read
// without error is exactly the bytes it was read from.
func FuzzWriteFrame(f *testing.F) {
	f.Add(appendWriteFrame(nil, writeFrame{offset: 1, length: 65536, bufferAddress: 0x7f00, session: "mooncake://127.0.0.1:1", region: "r"}))
	f.Add(appendWriteFrame(nil, writeFrame{length: 1, bufferAddress: 1, slotBytes: 9, session: "127.0.0.1:17100", region: "r", key: strings.Repeat("a", 40)}))
	f.Add(binary.LittleEndian.AppendUint32(nil, 1<<31))
	f.Add([]byte{38, 0, 0, 0})
	f.Fuzz(func(t *testing.T, raw []byte) {
		r := bytes.NewReader(raw)
		buf := make([]byte, writeFrameFixed+writeFrameNames)
		fr, err := readWriteFrame(r, buf)
		if err != nil {
			return
		}
		used := raw[:len(raw)-r.Len()]
		if again := appendWriteFrame(nil, fr); !bytes.Equal(again, used) {
			t.Fatalf("frame %+v read from % x writes as % x", fr, used, again)
		}
	})
}
