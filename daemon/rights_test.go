package daemon

import (
	"net"
	"os"
	"testing"

	"golang.org/x/sys/unix"
)

// A control connection keeps at most maxPassedFDs descriptors unclaimed:
// the rest are closed on arrival, so no client can make ferryd hold more.
func TestPassedDescriptorsAreBounded(t *testing.T) {
	client, rc := rightsPair(t, false)

	var passed []int
	for range maxPassedFDs + 2 {
		r, w, err := os.Pipe()
		if err != nil {
			t.Fatal(err)
		}
		w.Close()
		passed = append(passed, int(r.Fd()))
		defer r.Close()
	}
	if _, _, err := client.WriteMsgUnix([]byte("POST"), unix.UnixRights(passed...), nil); err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, 16)
	if n, err := rc.Read(buf); err != nil || string(buf[:n]) != "POST" {
		t.Fatalf("read %q, %v", buf[:n], err)
	}
	kept := 0
	for fd := rc.take(); fd >= 0; fd = rc.take() {
		kept++
		unix.Close(fd)
	}
	if kept != maxPassedFDs {
		t.Fatalf("kept %d of %d descriptors passed, want %d", kept, len(passed), maxPassedFDs)
	}
}

// rightsPair is a connected pair of Unix sockets: the client's end, and
// the control connection's (refused: its caller is off the allow-lists).
// Both close when the test ends.
func rightsPair(t *testing.T, refused bool) (*net.UnixConn, *rightsConn) {
	t.Helper()
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	conn := func(fd int) *net.UnixConn {
		f := os.NewFile(uintptr(fd), "sock")
		defer f.Close()
		c, err := net.FileConn(f)
		if err != nil {
			t.Fatal(err)
		}
		return c.(*net.UnixConn)
	}
	client := conn(fds[0])
	rc := &rightsConn{UnixConn: conn(fds[1]), refused: refused}
	t.Cleanup(func() { client.Close(); rc.Close() })
	return client, rc
}
