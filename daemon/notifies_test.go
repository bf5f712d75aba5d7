package daemon

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/ferry-project/ferry/api"
	"github.com/ferry-project/ferry/client"
	"github.com/ferry-project/ferry/mooncake"
)

// An engine segment keeps at most maxEngineNotifies unread notifies and
// maxEngineNotifyBytes of them; past either a notify is refused (and
// counted), the ones held kept; a drain empties it, in arrival order.
func TestNotifyQueueIsBounded(t *testing.T) {
	var q notifyQueue
	for i := range maxEngineNotifies {
		if err := q.add(mooncake.NotifyDesc{Name: "n", NotifyMsg: string(rune('a' + i%26))}); err != nil {
			t.Fatalf("notify %d: %v", i, err)
		}
	}
	err := q.add(mooncake.NotifyDesc{Name: "n", NotifyMsg: "one more"})
	if !errors.Is(err, mooncake.ErrNotifyRefused) || !strings.Contains(err.Error(), "keeps at most 1024") {
		t.Fatalf("a notify past the count: %v", err)
	}
	if held, refused := q.stats(); held != maxEngineNotifies || refused != 1 {
		t.Fatalf("held %d, refused %d", held, refused)
	}
	got := q.drain()
	if len(got) != maxEngineNotifies || got[0].NotifyMsg != "a" || got[27].NotifyMsg != "b" {
		t.Fatalf("drained %d, first %+v", len(got), got[0])
	}
	if held, _ := q.stats(); held != 0 || len(q.drain()) != 0 {
		t.Fatal("a drained queue holds notifies")
	}
	// The bytes bound: notifies of 16 KiB fill it long before the count.
	big := strings.Repeat("x", 16<<10-100)
	n := 0
	for ; q.add(mooncake.NotifyDesc{Name: "n", NotifyMsg: big}) == nil; n++ {
	}
	if n != maxEngineNotifyBytes/notifyCost(mooncake.NotifyDesc{Name: "n", NotifyMsg: big}) {
		t.Fatalf("%d notifies of %d bytes kept, bound %d bytes", n, len(big), maxEngineNotifyBytes)
	}
	q.drain()
	if err := q.add(mooncake.NotifyDesc{Name: "n", NotifyMsg: big}); err != nil {
		t.Fatalf("after a drain: %v", err)
	}
}

// Notifies between a ferryd's engine segments: sent through the control
// API to an engine segment's RPC port (here the same ferryd's), kept for
// the engine, drained by its process only, counted; a full segment
// refuses a notify and its sender hears why; an oversize or garbage
// notify on the wire keeps nothing and leaves the port serving.
func TestEngineSegmentsKeepNotifiesForTheirEngine(t *testing.T) {
	ctx, cancel := context.WithTimeout(t.Context(), 60*time.Second)
	defer cancel()
	d, c := serveTestDaemon(t, t.TempDir(), "n", func(c *Config) { c.MooncakeListen = "127.0.0.1:0" })
	seg, err := c.OpenEngineSegment(ctx, 0)
	if err != nil {
		t.Fatal(err)
	}
	for _, msg := range []string{"first", "second"} {
		if err := c.SendNotify(ctx, api.NotifyRequest{Session: seg.Session, Name: "peer", NotifyMsg: msg}); err != nil {
			t.Fatalf("notify %s: %v", msg, err)
		}
	}
	got, err := c.DrainNotifies(ctx, seg.ID)
	if err != nil || len(got.Notifies) != 2 || got.Notifies[0] != (api.Notify{Name: "peer", NotifyMsg: "first"}) || got.Notifies[1].NotifyMsg != "second" {
		t.Fatalf("drained %+v, %v", got, err)
	}
	if got, err := c.DrainNotifies(ctx, seg.ID); err != nil || len(got.Notifies) != 0 {
		t.Fatalf("a second drain: %+v, %v; want none", got, err)
	}

	// Hostile notifies on the wire: too long (refused unread), not JSON,
	// a key twice. Each connection is closed without a reply.
	body := []byte(`{"name":"x","notify_msg":"` + strings.Repeat("a", mooncake.MaxSmallMessage) + `"}`)
	for _, raw := range [][]byte{
		mooncake.AppendFrame(nil, mooncake.Notify, body),
		mooncake.AppendFrame(nil, mooncake.Notify, []byte("\x00\xffgarbage")),
		mooncake.AppendFrame(nil, mooncake.Notify, []byte(`{"name":"x","notify_msg":"1","notify_msg":"2"}`)),
		binary.LittleEndian.AppendUint64(nil, 1<<40),
	} {
		if reply := sendRawTo(t, seg.Session, raw); len(reply) != 0 {
			t.Fatalf("a hostile notify answered %q", reply)
		}
	}

	// A full segment refuses; the sender's call says so, and the count
	// shows in the segment's listing and in the metrics.
	es := d.engines.get(seg.ID)
	if held, _ := es.notifies.stats(); held != 0 {
		t.Fatalf("hostile notifies left %d held", held)
	}
	for es.notifies.add(mooncake.NotifyDesc{Name: "filler"}) == nil {
	}
	err = c.SendNotify(ctx, api.NotifyRequest{Session: seg.Session, Name: "peer", NotifyMsg: "late"})
	var ce *client.Error
	if !errors.As(err, &ce) || ce.Code != api.CodeRefused || !strings.Contains(ce.Message, "get_notifies()") {
		t.Fatalf("a notify to a full segment: %v", err)
	}
	if desc := d.describeEngine(es); desc.Notifies != maxEngineNotifies || desc.NotifiesRefused != 2 {
		t.Fatalf("the segment's listing: %+v", desc)
	}
	got, err = c.DrainNotifies(ctx, seg.ID)
	if err != nil || len(got.Notifies) != maxEngineNotifies || got.Refused != 2 {
		t.Fatalf("drained %d, refused %d, %v", len(got.Notifies), got.Refused, err)
	}
	fams := scrapeSocket(t, c)
	for _, m := range []struct {
		name, outcome string
		want          float64
	}{
		{"ferry_mooncake_notifies_received_total", "kept", 2},
		{"ferry_mooncake_notifies_received_total", "refused", 1},
		{"ferry_mooncake_notifies_sent_total", "ok", 2},
		{"ferry_mooncake_notifies_sent_total", "failed", 1},
	} {
		if v := value(fams, m.name, "outcome", m.outcome); v != m.want {
			t.Errorf("%s{outcome=%q} = %v, want %v", m.name, m.outcome, v, m.want)
		}
	}

	// Only the process that opened a segment takes its notifies.
	theirs, err := d.openEngineSegment(int32(os.Getppid()), 0)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := c.DrainNotifies(ctx, theirs.id); !errors.As(err, &ce) || ce.Code != api.CodeForbidden || !strings.Contains(ce.Message, "its own notifies") {
		t.Fatalf("another process's drain: %v", err)
	}
	if _, err := c.DrainNotifies(ctx, "e99"); !errors.As(err, &ce) || ce.Code != api.CodeNotFound {
		t.Fatalf("an unknown segment's drain: %v", err)
	}
	// Nor may another close it (an engine that outlived a restart of
	// ferryd holds an id of the old one's, never one this one gave).
	if err := c.CloseEngineSegment(ctx, theirs.id); !errors.As(err, &ce) || ce.Code != api.CodeForbidden || !strings.Contains(ce.Message, "closes only its own segment") {
		t.Fatalf("another process's close: %v", err)
	}
	if d.engines.get(theirs.id) != theirs {
		t.Fatal("another process closed the segment")
	}
	if !strings.HasSuffix(seg.ID, fmt.Sprintf("-%08x", uint32(d.instance))) {
		t.Fatalf("segment id %s does not carry this ferryd's instance", seg.ID)
	}
	// A caller whose pid ferryd cannot see (another PID namespace) could
	// never have its segment dropped when it exits: refused, saying so.
	if _, err := d.openEngineSegment(0, 0); !isCode(err, api.CodeForbidden) || !strings.Contains(err.Error(), "PID namespace") {
		t.Fatalf("a segment for pid 0: %v", err)
	}

	// Bad requests say what was wrong; an unreachable target fails.
	for _, bad := range []struct {
		req  api.NotifyRequest
		code string
		says string
	}{
		{api.NotifyRequest{Session: "nohost", NotifyMsg: "m"}, api.CodeBadRequest, `"host:rpc_port"`},
		{api.NotifyRequest{Session: seg.Session, NotifyMsg: strings.Repeat("m", mooncake.MaxSmallMessage)}, api.CodeTooLarge, "a notify may have"},
		{api.NotifyRequest{Session: closedPort(t), NotifyMsg: "m"}, api.CodeTransferFailed, "not delivered"},
	} {
		if err := c.SendNotify(ctx, bad.req); !errors.As(err, &ce) || ce.Code != bad.code || !strings.Contains(ce.Message, bad.says) {
			t.Errorf("%+v: %v, want %s saying %s", bad.req, err, bad.code, bad.says)
		}
	}
}

// A notify from an address not on mooncake_allow is refused at accept,
// as a write from there is: nothing kept, the sender fails.
func TestNotifiesFromAddressesNotAllowedAreRefused(t *testing.T) {
	ctx, cancel := context.WithTimeout(t.Context(), 60*time.Second)
	defer cancel()
	d, c := serveTestDaemon(t, t.TempDir(), "n", func(c *Config) {
		c.MooncakeListen = "127.0.0.1:0"
		c.MooncakeAllow = []string{"192.0.2.0/24"}
	})
	seg, err := c.OpenEngineSegment(ctx, 0)
	if err != nil {
		t.Fatal(err)
	}
	var ce *client.Error
	if err := c.SendNotify(ctx, api.NotifyRequest{Session: seg.Session, NotifyMsg: "m"}); !errors.As(err, &ce) || ce.Code != api.CodeTransferFailed {
		t.Fatalf("a notify from loopback, not allowed: %v", err)
	}
	if got, err := c.DrainNotifies(ctx, seg.ID); err != nil || len(got.Notifies) != 0 {
		t.Fatalf("drained %+v, %v; want none", got, err)
	}
	if n := d.engines.get(seg.ID).hs.Stats().RefusedNotAllowed; n != 1 {
		t.Errorf("connections the segment's RPC port refused: %d, want 1", n)
	}
}

// sendRawTo writes raw to addr as one request and reads whatever comes
// back until the server closes (a reset reads as nothing).
func sendRawTo(t *testing.T, addr string, raw []byte) []byte {
	t.Helper()
	conn, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	conn.Write(raw)
	conn.(*net.TCPConn).CloseWrite()
	conn.SetReadDeadline(time.Now().Add(10 * time.Second))
	got, _ := io.ReadAll(conn)
	return got
}
