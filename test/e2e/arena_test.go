package e2e

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// lentArena asks d for its arena's descriptor (GET /v1/arena), as a
// client does, and returns it: the caller's to close.
func lentArena(t *testing.T, d *daemon) int {
	t.Helper()
	conn, err := net.Dial("unix", d.socket)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	uc := conn.(*net.UnixConn)
	uc.SetDeadline(time.Now().Add(10 * time.Second))
	if _, err := io.WriteString(uc, "GET /v1/arena HTTP/1.1\r\nHost: ferryd\r\nConnection: close\r\n\r\n"); err != nil {
		t.Fatal(err)
	}
	var answer []byte
	var fds []int
	buf, oob := make([]byte, 4096), make([]byte, unix.CmsgSpace(4*4))
	for {
		n, oobn, _, _, err := uc.ReadMsgUnix(buf, oob)
		answer = append(answer, buf[:max(n, 0)]...)
		if msgs, perr := unix.ParseSocketControlMessage(oob[:oobn]); perr == nil {
			for _, m := range msgs {
				got, _ := unix.ParseUnixRights(&m)
				fds = append(fds, got...)
			}
		}
		if errors.Is(err, io.EOF) || err == nil && n == 0 {
			break
		}
		if err != nil {
			t.Fatalf("reading the answer to GET /v1/arena: %v", err)
		}
	}
	if len(fds) != 1 || !bytes.HasPrefix(answer, []byte("HTTP/1.1 200")) {
		t.Fatalf("GET /v1/arena: %d descriptors, answer %q", len(fds), answer)
	}
	return fds[0]
}

// arenaDescriptor is the /proc path of ferryd pid's arena memfd.
func arenaDescriptor(t *testing.T, pid int) string {
	t.Helper()
	dir := fmt.Sprintf("/proc/%d/fd", pid)
	ents, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range ents {
		if target, _ := os.Readlink(filepath.Join(dir, e.Name())); strings.HasPrefix(target, "/memfd:ferry-arena") {
			return filepath.Join(dir, e.Name())
		}
	}
	t.Fatalf("ferryd pid %d holds no memfd:ferry-arena: %s", pid, openFiles(pid))
	return ""
}

// An admitted caller that shrinks (or grows) the arena it was lent is
// refused by the kernel (the memfd is sealed), and ferryd goes on
// serving uploads and a peer's writes into the same arena. (The arena
// was a plain file: ftruncate(fd, 0) made ferryd's next touch SIGBUS.)
func TestLentArenaCannotBeShrunk(t *testing.T) {
	snd, rcv := pair(t, "--arena-size", "8MiB")
	for _, d := range []*daemon{snd, rcv} {
		fd := lentArena(t, d)
		for _, n := range []int64{0, 4096, 1 << 40} {
			if err := unix.Ftruncate(fd, n); !errors.Is(err, unix.EPERM) {
				t.Errorf("ftruncate(%d) of the arena ferryd pid %d lent: %v; want EPERM", n, d.cmd.Process.Pid, err)
			}
		}
		unix.Close(fd)
	}
	// Every page of both arenas is touched: an upload that fills the
	// sender's, a send whose bytes land at the end of the receiver's.
	st, err := rcv.c.Status(ctxT(t))
	if err != nil {
		t.Fatal(err)
	}
	n := st.Memory.Size
	data := randomBytes(int(n), 32)
	if _, err := snd.c.Stage(ctxT(t), "whole", []int64{n}, "uint8", bytes.NewReader(data), n); err != nil {
		t.Fatalf("uploading the whole arena after the shrink was refused: %v", err)
	}
	res, err := snd.c.Send(ctxT(t), "whole", slotFor(t, rcv, "whole", n))
	if err != nil {
		t.Fatalf("sending into the peer after the shrink was refused: %v (%+v)", err, res)
	}
	got, err := rcv.c.Wait(ctxT(t), "whole", 10*time.Second)
	if err != nil || !bytes.Equal(got, data) {
		t.Fatalf("the peer's write: %d bytes, %v; want the %d bytes sent", len(got), err, n)
	}
	snd.alive(t)
	rcv.alive(t)
}
