package daemon

import (
	"net"
	"os"
	"path/filepath"
	"slices"
	"testing"
)

// The kernel's record of a real connection: this process on both ends.
func TestReadCallerFromARealConnection(t *testing.T) {
	ln, err := net.Listen("unix", filepath.Join(t.TempDir(), "c.sock"))
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	dialed, err := net.Dial("unix", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer dialed.Close()
	conn, err := ln.Accept()
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()

	c := readCaller(conn.(*net.UnixConn))
	if c.err != nil {
		t.Fatal(c.err)
	}
	if int(c.pid) != os.Getpid() || int(c.uid) != os.Getuid() || int(c.gid) != os.Getgid() {
		t.Fatalf("caller pid %d uid %d gid %d, want %d %d %d", c.pid, c.uid, c.gid, os.Getpid(), os.Getuid(), os.Getgid())
	}
	groups, err := os.Getgroups()
	if err != nil {
		t.Fatal(err)
	}
	got := make([]int, len(c.groups))
	for i, g := range c.groups {
		got[i] = int(g)
	}
	slices.Sort(got)
	slices.Sort(groups)
	if !slices.Equal(got, groups) {
		t.Fatalf("supplementary groups %v, want %v", got, groups)
	}
}

func TestAdmit(t *testing.T) {
	me := uint32(os.Getuid())
	stranger := me + 4242
	d := &Daemon{}
	anyone := &caller{uid: stranger, gid: 9}
	if err := d.admit(anyone); err != nil {
		t.Fatalf("without an allow-list anyone who opens the socket is admitted: %v", err)
	}
	d.cfg.AllowUIDs, d.cfg.AllowGIDs = []uint32{7}, []uint32{44}
	for _, c := range []struct {
		who  *caller
		want bool
	}{
		{&caller{uid: 7, gid: 9}, true},
		{&caller{uid: stranger, gid: 44}, true},
		{&caller{uid: stranger, gid: 9, groups: []uint32{3, 44}}, true},
		{&caller{uid: 0, gid: 0}, true},
		{&caller{uid: me, gid: 9}, true},
		{&caller{uid: stranger, gid: 9, groups: []uint32{3}}, false},
		{&caller{err: os.ErrPermission}, false},
	} {
		if err := d.admit(c.who); (err == nil) != c.want {
			t.Errorf("admit(%+v) = %v, want admitted=%v", c.who, err, c.want)
		}
	}
}

func TestInflightDrain(t *testing.T) {
	var f inflight
	if !f.enter() || !f.enter() {
		t.Fatal("requests refused before a drain")
	}
	idle, n := f.close()
	if n != 2 {
		t.Fatalf("close saw %d in flight, want 2", n)
	}
	if f.enter() {
		t.Fatal("a request admitted after close")
	}
	f.leave()
	select {
	case <-idle:
		t.Fatal("idle with one request still in flight")
	default:
	}
	f.leave()
	<-idle // closed by the last leave; a hang here fails the test by its timeout
}
