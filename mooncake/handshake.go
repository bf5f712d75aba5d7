package mooncake

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"time"

	"github.com/ferry-project/ferry/internal/loglimit"
)

// HandshakeTimeout bounds one handshake exchange when the caller's
// context sets no earlier deadline; the server's receive timeout is the
// same 5 s.
const HandshakeTimeout = 5 * time.Second

// Exchange sends one handshake request of type t to the RPC port at addr
// and decodes the reply (of the same type) into reply. One request per
// connection, as Mooncake's server expects.
func Exchange(ctx context.Context, addr string, t MsgType, req, reply any) error {
	_, err := exchange(ctx, addr, t, req, reply)
	return err
}

// exchange is Exchange, which also says the address it reached (addr
// may name a host).
func exchange(ctx context.Context, addr string, t MsgType, req, reply any) (reached net.Addr, _ error) {
	body, err := json.Marshal(req)
	if err != nil {
		return nil, fmt.Errorf("mooncake %s handshake with %s: encoding the request: %w", t, addr, err)
	}
	parent := ctx
	ctx, cancel := context.WithTimeout(ctx, HandshakeTimeout)
	defer cancel()
	var d net.Dialer
	c, err := d.DialContext(ctx, "tcp", addr)
	if err != nil {
		return nil, fmt.Errorf("mooncake %s handshake with %s: %w", t, addr, err)
	}
	defer c.Close()
	stop := context.AfterFunc(ctx, func() { c.Close() })
	defer stop()
	deadline, _ := ctx.Deadline()
	c.SetDeadline(deadline)
	if err := WriteFrame(c, t, append(body, '\n')); err != nil {
		return nil, fmt.Errorf("mooncake %s handshake with %s: sending: %w", t, addr, err)
	}
	rt, rb, err := ReadFrame(c)
	if err == io.EOF {
		err = errors.New("the peer closed the connection without a reply (it refused the request or is not a Mooncake RPC port)")
	}
	if err != nil {
		switch {
		case parent.Err() != nil:
			err = fmt.Errorf("the caller gave up waiting for the reply (%v): %w", parent.Err(), err)
		case ctx.Err() != nil:
			err = fmt.Errorf("no reply within %s: %w", HandshakeTimeout, err)
		case errors.Is(err, ErrFrame):
			err = fmt.Errorf("%w in the reply: is %s a Mooncake RPC port (not a ferry peer port)?", err, addr)
		}
		return nil, fmt.Errorf("mooncake %s handshake with %s: %w", t, addr, err)
	}
	if rt != t {
		return nil, fmt.Errorf("mooncake %s handshake with %s: the reply is a %s message", t, addr, rt)
	}
	if err := json.Unmarshal(rb, reply); err != nil {
		return nil, fmt.Errorf("mooncake %s handshake with %s: the reply is not the JSON expected: %w", t, addr, err)
	}
	return c.RemoteAddr(), nil
}

// FetchSegment runs the metadata handshake: it sends self (which the
// server ignores but Mooncake's client always sends) and returns the
// server's descriptor.
func FetchSegment(ctx context.Context, addr string, self *Segment) (*Segment, error) {
	var raw json.RawMessage
	if err := Exchange(ctx, addr, Metadata, self, &raw); err != nil {
		return nil, err
	}
	s, err := DecodeSegment(raw)
	if err != nil {
		return nil, fmt.Errorf("mooncake metadata from %s: %w", addr, err)
	}
	return s, nil
}

// ProbeSegment checks that a Mooncake RPC port answers.
func ProbeSegment(ctx context.Context, addr string) error {
	var r ProbeReply
	if err := Exchange(ctx, addr, Probe, struct{}{}, &r); err != nil {
		return err
	}
	if r.Status != "success" {
		return fmt.Errorf("mooncake probe of %s: status %q, want \"success\"", addr, r.Status)
	}
	return nil
}

// SendNotify delivers a notify message. A receiver's refusal is an
// error wrapping ErrNotifyRefused, with its reason when it gave one
// (a ferry segment does; Mooncake's keeps every notify).
func SendNotify(ctx context.Context, addr string, n NotifyDesc) error {
	if err := CheckNotify(n); err != nil {
		return fmt.Errorf("mooncake notify to %s: %w", addr, err)
	}
	var r NotifyReply
	if err := Exchange(ctx, addr, Notify, n, &r); err != nil {
		return err
	}
	switch {
	case r.NotifyMsg == "success":
		return nil
	case r.Error != "":
		return fmt.Errorf("mooncake notify to %s: %w: %s", addr, ErrNotifyRefused, loglimit.Clip(r.Error))
	}
	return fmt.Errorf("mooncake notify to %s: %w: reply notify_msg %s, want \"success\"", addr, ErrNotifyRefused, loglimit.Quote(r.NotifyMsg))
}

// CheckNotify says whether n fits in one notify message (MaxSmallMessage
// bytes, type byte and JSON encoding included), which is what a ferry
// segment takes; Mooncake's takes up to MaxMessage.
func CheckNotify(n NotifyDesc) error {
	body, err := json.Marshal(n)
	if err != nil {
		return err
	}
	if len(body)+2 > MaxSmallMessage {
		return fmt.Errorf("name and notify_msg take %d bytes as a notify message, past the %d a notify may have: send a shorter notify_msg", len(body)+2, MaxSmallMessage)
	}
	return nil
}
