package daemon

import (
	"context"
	"fmt"
	"net"
	"os"
	"slices"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/ferry-project/ferry/api"
)

// caller is the local process on the other end of a control connection,
// as the kernel reports it when the connection is made (SO_PEERCRED and
// SO_PEERGROUPS): it cannot be forged by the client.
type caller struct {
	pid    int32
	uid    uint32
	gid    uint32
	groups []uint32 // supplementary groups
	err    error    // why the credentials could not be read
}

type callerKey struct{}

// withCaller is the http.Server's ConnContext: the credentials read once
// per connection, when it was accepted.
// The connection goes along too, for a handler that claims a descriptor
// passed on it.
func withCaller(ctx context.Context, c net.Conn) context.Context {
	who := &caller{err: fmt.Errorf("%T is not a control connection", c)}
	if rc, ok := c.(*rightsConn); ok {
		who = rc.caller
	}
	return context.WithValue(context.WithValue(ctx, callerKey{}, who), connKey{}, c)
}

func callerOf(ctx context.Context) *caller {
	if c, ok := ctx.Value(callerKey{}).(*caller); ok {
		return c
	}
	return &caller{err: fmt.Errorf("no credentials on this connection")}
}

func readCaller(uc *net.UnixConn) *caller {
	raw, err := uc.SyscallConn()
	if err != nil {
		return &caller{err: err}
	}
	out := &caller{}
	cerr := raw.Control(func(fd uintptr) {
		cred, err := unix.GetsockoptUcred(int(fd), unix.SOL_SOCKET, unix.SO_PEERCRED)
		if err != nil {
			out.err = fmt.Errorf("SO_PEERCRED: %w", err)
			return
		}
		out.pid, out.uid, out.gid = cred.Pid, cred.Uid, cred.Gid
		out.groups, out.err = peerGroups(int(fd))
	})
	if cerr != nil {
		out.err = cerr
	}
	return out
}

// peerGroups reads SO_PEERGROUPS, which x/sys/unix has no helper for: an
// array of gid_t whose needed size the kernel reports with ERANGE.
func peerGroups(fd int) ([]uint32, error) {
	buf := make([]uint32, 32)
	for {
		n := uint32(len(buf) * 4)
		_, _, e := unix.Syscall6(unix.SYS_GETSOCKOPT, uintptr(fd), unix.SOL_SOCKET, unix.SO_PEERGROUPS,
			uintptr(unsafe.Pointer(&buf[0])), uintptr(unsafe.Pointer(&n)), 0)
		switch {
		case e == unix.ERANGE && int(n/4) > len(buf):
			buf = make([]uint32, n/4)
		case e != 0:
			return nil, fmt.Errorf("SO_PEERGROUPS: %w", e)
		default:
			return buf[:n/4], nil
		}
	}
}

// admit refuses a caller the allow-list does not name. Root and ferryd's
// own user are always admitted: they can read the arena file anyway.
func (d *Daemon) admit(c *caller) error {
	if len(d.cfg.AllowUIDs) == 0 && len(d.cfg.AllowGIDs) == 0 {
		return nil
	}
	if c.err != nil {
		return apiErr(api.CodeForbidden,
			"ferryd could not read this connection's credentials (%v), so the uid/gid allow-list cannot admit it", c.err)
	}
	if c.uid == 0 || c.uid == uint32(os.Getuid()) || slices.Contains(d.cfg.AllowUIDs, c.uid) ||
		slices.Contains(d.cfg.AllowGIDs, c.gid) ||
		slices.ContainsFunc(c.groups, func(g uint32) bool { return slices.Contains(d.cfg.AllowGIDs, g) }) {
		return nil
	}
	return apiErr(api.CodeForbidden,
		"uid %d (pid %d, gid %d) may not use this ferryd: it is not in allow_uids and none of its groups is in allow_gids; ask the operator to add it to ferryd's configuration and restart ferryd",
		c.uid, c.pid, c.gid)
}
