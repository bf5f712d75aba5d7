package daemon

import (
	"context"
	"net"
	"sync"

	"golang.org/x/sys/unix"
)

// maxPassedFDs bounds the descriptors one control connection may hold
// unclaimed: more are closed on arrival.
const maxPassedFDs = 4

// rightsListener accepts control connections that keep the descriptors a
// client passes beside its request (SCM_RIGHTS), for the handler that
// claims one (POST /v1/regions). It reads each connection's caller as
// it accepts it, so that a caller the allow-lists refuse holds no
// descriptor it passes for a moment longer than the read that brings it.
type rightsListener struct {
	net.Listener
	admit func(*caller) error
}

func (l rightsListener) Accept() (net.Conn, error) {
	c, err := l.Listener.Accept()
	if uc, ok := c.(*net.UnixConn); ok {
		who := readCaller(uc)
		return &rightsConn{UnixConn: uc, caller: who, refused: l.admit(who) != nil}, nil
	}
	return c, err
}

// rightsConn reads with recvmsg so that descriptors sent with the
// request's bytes are kept, not dropped by the kernel.
type rightsConn struct {
	*net.UnixConn
	caller  *caller // read when accepted
	refused bool    // the allow-lists refuse caller: its descriptors are closed on arrival

	// oob takes the control messages of one read; the HTTP server reads a
	// connection from one goroutine at a time.
	oob [64]byte

	mu  sync.Mutex
	fds []int // passed and not yet claimed
}

// Room in oob for the most descriptors one message may bring.
var _ [64 - unix.SizeofCmsghdr - 4*maxPassedFDs]byte

// Read is ReadMsgUnix as an io.Reader: on an error (a deadline passed)
// ReadMsgUnix counts -1 bytes, which no Read may return (bufio panics on
// it), so it reads as 0.
func (c *rightsConn) Read(b []byte) (int, error) {
	n, oobn, _, _, err := c.ReadMsgUnix(b, c.oob[:])
	if oobn > 0 {
		c.keep(c.oob[:oobn])
	}
	return max(n, 0), err
}

// keep holds the descriptors of control messages, up to maxPassedFDs,
// none for a refused caller.
func (c *rightsConn) keep(oob []byte) {
	msgs, err := unix.ParseSocketControlMessage(oob)
	if err != nil {
		return
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	for _, m := range msgs {
		fds, err := unix.ParseUnixRights(&m)
		if err != nil {
			continue
		}
		for _, fd := range fds {
			if !c.refused && len(c.fds) < maxPassedFDs {
				c.fds = append(c.fds, fd)
			} else {
				unix.Close(fd)
			}
		}
	}
}

// take claims the oldest descriptor passed on this connection, or -1.
func (c *rightsConn) take() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	if len(c.fds) == 0 {
		return -1
	}
	fd := c.fds[0]
	c.fds = c.fds[1:]
	return fd
}

func (c *rightsConn) Close() error {
	c.mu.Lock()
	for _, fd := range c.fds {
		unix.Close(fd)
	}
	c.fds = nil
	c.mu.Unlock()
	return c.UnixConn.Close()
}

// unixConn is the Unix socket under a control connection.
func unixConn(c net.Conn) (*net.UnixConn, bool) {
	switch c := c.(type) {
	case *rightsConn:
		return c.UnixConn, true
	case *net.UnixConn:
		return c, true
	}
	return nil, false
}

type connKey struct{}

// dropPassedFDs closes the descriptors passed on the request's
// connection and not claimed.
func dropPassedFDs(ctx context.Context) {
	if c, ok := ctx.Value(connKey{}).(*rightsConn); ok {
		for fd := c.take(); fd >= 0; fd = c.take() {
			unix.Close(fd)
		}
	}
}

// passedFD claims a descriptor the client passed on the request's
// connection, or -1 when it passed none.
func passedFD(ctx context.Context) int {
	if c, ok := ctx.Value(connKey{}).(*rightsConn); ok {
		return c.take()
	}
	return -1
}
