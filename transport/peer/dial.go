package peer

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"time"

	"github.com/ferry-project/ferry/transport"
)

// ErrNoRDMA is Dial's answer, for a connection of kind rdma, from a peer
// that serves no RDMA (it runs the tcp transport, or found no usable
// NIC): use data connections.
var ErrNoRDMA = errors.New("the peer serves no RDMA")

// ErrUnknownKind is wrapped by Dial's error when the peer does not serve
// connections of the kind asked for (status 4).
var ErrUnknownKind = errors.New("unknown connection kind")

// ErrMisdirected is wrapped, with transport.ErrAuth, by Dial's error
// when the daemon that answered proved the secret but does not take the
// address dialed as its own: something in between (a relay, NAT or port
// forwarding) led the connection to it.
var ErrMisdirected = errors.New("the peer does not take the address dialed as its own")

// Dial opens one connection of the given kind to the peer port at addr
// and runs the client side of the handshake, as this daemon: it returns
// the connection, ready for the kind's own exchange, and the peer's
// instance. The caller names addr in its errors; these name the step.
func (p *Port) Dial(ctx context.Context, addr string, kind Kind) (*net.TCPConn, uint64, error) {
	if p.Closed() {
		return nil, 0, transport.ErrClosed
	}
	if p.cfg.Secret != nil {
		// The handshake names addr; one it cannot carry gets no connection.
		if err := checkDialed(addr); err != nil {
			return nil, 0, fmt.Errorf("handshake: %w", err)
		}
	}
	hctx, cancel := context.WithTimeout(ctx, p.cfg.HandshakeTimeout)
	defer cancel()
	d := net.Dialer{KeepAliveConfig: keepAlive}
	nc, err := d.DialContext(hctx, "tcp", addr)
	if err != nil {
		// Keep the cause only: the caller names addr and the step already.
		if op := (*net.OpError)(nil); errors.As(err, &op) {
			err = op.Err
		}
		if sc := (*os.SyscallError)(nil); errors.As(err, &sc) {
			err = sc.Err
		}
		return nil, 0, p.DialErr(ctx, hctx, "connect", err)
	}
	c := nc.(*net.TCPConn)
	p.tune(c)
	instance, err := greet(hctx, c, p.cfg.Instance, kind, p.cfg.Secret, addr)
	if err == ErrNoRDMA {
		c.Close()
		return nil, 0, err
	}
	if err != nil {
		c.Close()
		return nil, 0, p.DialErr(ctx, hctx, "handshake", err)
	}
	return c, instance, nil
}

// DialErr says whether the caller's ctx or hctx, the handshake timeout
// derived from it, cut a step of opening a connection short, as the
// socket error alone does not.
func (p *Port) DialErr(ctx, hctx context.Context, step string, err error) error {
	if cerr := transport.ContextErr(ctx); cerr != nil {
		return fmt.Errorf("%s: %w: %w", step, cerr, err)
	}
	if transport.ContextErr(hctx) != nil {
		return fmt.Errorf("%s: no answer within %s: %w", step, p.cfg.HandshakeTimeout, err)
	}
	return fmt.Errorf("%s: %w", step, err)
}

// greet runs the client side of the handshake on c, dialed at addr,
// within ctx.
func greet(ctx context.Context, c *net.TCPConn, instance uint64, kind Kind, secret []byte, addr string) (uint64, error) {
	stop := context.AfterFunc(ctx, func() { c.Close() })
	defer stop()
	deadline, _ := ctx.Deadline()
	c.SetDeadline(deadline)
	var hb [helloSize]byte
	h := ours(instance, kind, secret)
	h.encode(&hb)
	if _, err := c.Write(hb[:]); err != nil {
		return 0, fmt.Errorf("sending the hello: %w", err)
	}
	var wb [welcomeSize]byte
	if err := read(c, wb[:], "welcome"); err != nil {
		return 0, err
	}
	var w welcome
	w.decode(&wb)
	if _, err := w.check(); err != nil {
		return 0, fmt.Errorf("%w: %v", transport.ErrIncompatible, err)
	}
	switch w.status {
	case statusOK:
	case statusNoRDMA:
		return 0, ErrNoRDMA
	case statusNeedSecret:
		return 0, authErr("the peer requires a peer secret, and this daemon has none: give both daemons the same peer secret")
	case statusNoSecret:
		return 0, authErr("the peer has no peer secret, and this daemon requires one: give both daemons the same peer secret")
	case statusBadKind:
		return 0, fmt.Errorf("%w: %w: the peer does not serve connections of kind %d (kinds 2 and 3, reads: a ferryd older than this one, or one serving no reads)", transport.ErrIncompatible, ErrUnknownKind, kind)
	default:
		return 0, fmt.Errorf("peer refused the handshake with status %d", w.status)
	}
	if w.kind != kind {
		return 0, fmt.Errorf("peer welcomed connection kind %d, this daemon asked for kind %d", w.kind, kind)
	}
	if w.auth() != h.auth() {
		// A server that skips the secret it should have checked is no
		// ferryd of this version, or an impostor.
		return 0, authErr("the peer accepted the handshake without the challenge both sides owe (peer flags %#x, ours %#x)", w.flags, h.flags)
	}
	if h.auth() {
		if err := prove(c, secret, kind, addr, instance, w.instance); err != nil {
			return 0, err
		}
	}
	if !stop() {
		return 0, ctx.Err() // ctx ended just now, and closed the connection
	}
	c.SetDeadline(time.Time{})
	return w.instance, nil
}

// prove answers the server's challenge with a challenge of its own,
// naming dialed, the address it dialed, and checks the server's proof in
// turn.
func prove(c *net.TCPConn, secret []byte, kind Kind, dialed string, clientInstance, serverInstance uint64) error {
	server := party{instance: serverInstance}
	if err := read(c, server.nonce[:], "nonce"); err != nil {
		return err
	}
	client := party{instance: clientInstance, nonce: newNonce()}
	p := proof(secret, roleClient, kind, dialed, client, server)
	if _, err := c.Write(append(appendDialed(client.nonce[:], dialed), p[:]...)); err != nil {
		return fmt.Errorf("sending the nonce, dialed address and proof: %w", err)
	}
	var vb [verdictSize]byte
	if err := read(c, vb[:], "verdict"); err != nil {
		return err
	}
	var v verdict
	v.decode(&vb)
	switch {
	case v.status == statusBadProof:
		return authErr("the peer refused this daemon's proof: the two daemons' peer secrets differ")
	case v.status == statusNotHere:
		return fmt.Errorf("%w: %w: %q led to another daemon, through something in between (a relay, NAT or port forwarding); if peers reach that daemon this way, it must advertise the address they dial", transport.ErrAuth, ErrMisdirected, dialed)
	case v.status == statusBadDialed:
		return fmt.Errorf("%w: the peer refused the dialed address %q as malformed, which this daemon took as valid", transport.ErrIncompatible, dialed)
	case v.status != statusOK:
		return fmt.Errorf("peer refused the proof with status %d", v.status)
	case !validProof(v.proof, secret, roleServer, kind, dialed, client, server):
		return authErr("proof mismatch: the peer does not hold this daemon's secret")
	}
	return nil
}

// read reads one handshake record, naming it when the peer cuts it short.
func read(c *net.TCPConn, b []byte, what string) error {
	if n, err := io.ReadFull(c, b); err != nil {
		if transport.PeerGone(err) {
			return fmt.Errorf("peer closed the connection after %d of the %d-byte %s: %w", n, len(b), what, err)
		}
		return fmt.Errorf("read %d of the %d-byte %s: %w", n, len(b), what, err)
	}
	return nil
}
