package mooncaketest

import (
	"context"
	"fmt"
	"io"
	"net"
	"time"

	"github.com/ferry-project/ferry/mooncake"
)

// Pooled is one data connection of a Mooncake initiator running with
// MC_TCP_ENABLE_CONNECTION_POOL=1: it stays open between requests, for
// as long as the initiator likes, and carries one v2 WRITE after another.
type Pooled struct {
	c net.Conn
}

// DialPooled opens a pooled data connection to the data port at data,
// from the local address src ("" for any): tests play several hosts from
// 127.0.0.0/8.
func DialPooled(ctx context.Context, data, src string) (*Pooled, error) {
	d := net.Dialer{}
	if src != "" {
		d.LocalAddr = &net.TCPAddr{IP: net.ParseIP(src)}
	}
	c, err := d.DialContext(ctx, "tcp", data)
	if err != nil {
		return nil, fmt.Errorf("pooled connection to %s: %w", data, err)
	}
	return &Pooled{c: c}, nil
}

// Write WRITEs data to addr over the connection (v2) and reads the
// status word, within timeout.
func (p *Pooled) Write(addr uint64, data []byte, timeout time.Duration) error {
	p.c.SetDeadline(time.Now().Add(timeout))
	defer p.c.SetDeadline(time.Time{})
	h := mooncake.Header{Size: uint64(len(data)), Addr: addr, Op: mooncake.OpWrite, V2: true}
	var hb [mooncake.HeaderSize]byte
	h.Encode(&hb)
	if _, err := p.c.Write(append(hb[:], data...)); err != nil {
		return fmt.Errorf("sending a WRITE on a pooled connection: %w", err)
	}
	var sb [mooncake.StatusSize]byte
	if _, err := io.ReadFull(p.c, sb[:]); err != nil {
		return fmt.Errorf("failed to read WRITE ack frame on a pooled connection: %w", err)
	}
	st, err := mooncake.DecodeStatus(sb)
	if err == nil && st != mooncake.StatusOK {
		err = fmt.Errorf("the WRITE of %d bytes at %#x was %s", len(data), addr, st)
	}
	return err
}

// Close closes the connection.
func (p *Pooled) Close() error { return p.c.Close() }
