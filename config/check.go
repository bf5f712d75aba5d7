package config

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/user"
	"strconv"

	"github.com/ferry-project/ferry/internal/size"
	"github.com/ferry-project/ferry/transport/peer"
)

// Check says what is wrong with the settings' values, one error per
// setting, each naming the setting by its key. Settings that came from
// Load are better checked by Loaded.Check, which names where each value
// came from.
func (s *Settings) Check() error {
	return s.check(func(key string) string { return key })
}

// Check is Settings.Check naming each setting as it was given: the flag,
// the variable, or the file and line.
func (l *Loaded) Check() error {
	return l.Settings.check(l.name)
}

func (s *Settings) check(name func(key string) string) error {
	var errs []error
	for _, o := range options {
		if o.check == nil {
			continue
		}
		if err := o.check(s); err != nil {
			errs = append(errs, fmt.Errorf("%s %q: %w", name(o.key), o.of(s).String(), err))
		}
	}
	return errors.Join(errs...)
}

// name spells a key the way its value was given.
func (l *Loaded) name(key string) string {
	switch src := l.Source[key]; src {
	case "":
		return key + " (default)"
	case "file":
		return fmt.Sprintf("%s: %s", l.where(l.lines[key], 0), key)
	default:
		return src
	}
}

// HugePageBytes is arena_huge_pages in bytes, 0 for ordinary pages.
func (s *Settings) HugePageBytes() int64 {
	n, _ := size.Parse(s.ArenaHugePages) // checked: "" or a size
	return n
}

func checkHugePages(s *Settings) error {
	if s.ArenaHugePages == "" {
		return nil
	}
	n, err := size.Parse(s.ArenaHugePages)
	if err != nil || n < 64<<10 || n&(n-1) != 0 {
		return errors.New("is not a huge page size: give one the kernel lists in /sys/kernel/mm/hugepages, e.g. \"2MiB\" or \"1GiB\", or leave it empty for ordinary pages")
	}
	return nil
}

// checkArenaFile refuses the setting that once put the arena in a file:
// a file's holders can shrink it under ferryd (SIGBUS), a sealed memfd's
// cannot, and the memfd takes no tmpfs's space.
func checkArenaFile(s *Settings) error {
	if s.ArenaFile == "" {
		return nil
	}
	return errors.New("is no longer used: the host-memory arena is a sealed memfd ferryd owns, which clients map through the descriptor GET /v1/arena passes; remove the setting, and for huge pages set arena_huge_pages (e.g. \"2MiB\") instead of a file on hugetlbfs")
}

// maxSocketPath is the longest path a Unix socket address holds
// (sun_path is 108 bytes with its terminating NUL).
const maxSocketPath = 107

func checkSocket(s *Settings) error {
	switch {
	case s.Socket == "":
		return errors.New("is empty: give the control socket's path, e.g. /run/ferry/ferryd.sock")
	case len(s.Socket) > maxSocketPath:
		return fmt.Errorf("is %d bytes long; a Unix socket's path holds at most %d: choose a shorter one", len(s.Socket), maxSocketPath)
	}
	return nil
}

func positive(of func(*Settings) Duration) func(*Settings) error {
	return func(s *Settings) error {
		if of(s).D() <= 0 {
			return errors.New("must be above zero")
		}
		return nil
	}
}

func intWithin(of func(*Settings) int, lo, hi int) func(*Settings) error {
	return func(s *Settings) error {
		if v := of(s); v < lo || v > hi {
			return fmt.Errorf("is outside %d..%d", lo, hi)
		}
		return nil
	}
}

func sizeWithin(of func(*Settings) Size, lo, hi int64) func(*Settings) error {
	return func(s *Settings) error {
		if v := of(s).Bytes(); v < lo || v > hi {
			return fmt.Errorf("is outside %s..%s", size.Format(lo), size.Format(hi))
		}
		return nil
	}
}

// hostPort checks a host:port setting; an optional one may be empty (off).
func hostPort(of func(*Settings) string, optional bool, example string) func(*Settings) error {
	return func(s *Settings) error {
		v := of(s)
		if v == "" && optional {
			return nil
		}
		_, port, err := net.SplitHostPort(v)
		if err == nil {
			_, err = strconv.ParseUint(port, 10, 16)
		}
		if err != nil {
			return fmt.Errorf("is not host:port (%s)", example)
		}
		return nil
	}
}

// LookupGroup resolves socket_group (a name or a numeric gid); "" is -1,
// meaning ferryd's own group.
func LookupGroup(name string) (int, error) {
	if name == "" {
		return -1, nil
	}
	if gid, err := strconv.ParseUint(name, 10, 31); err == nil {
		return int(gid), nil
	}
	g, err := user.LookupGroup(name)
	if err != nil {
		return -1, fmt.Errorf("%v: create the group (systemd-sysusers does, from sysusers.d/ferry.conf) or name an existing one", err)
	}
	gid, err := strconv.Atoi(g.Gid)
	if err != nil {
		return -1, fmt.Errorf("the group has the non-numeric gid %q", g.Gid)
	}
	return gid, nil
}

// maxSecretFile bounds what is read of a peer secret file: a secret is a
// line, not a file of any size.
const maxSecretFile = 4 << 10

// ReadPeerSecret reads the peer secret from path: a file only its owner
// may read (a secret others can read is no secret), holding at least
// peer.MinSecret bytes. Trailing whitespace is dropped so that a file
// written by echo works.
func ReadPeerSecret(path string) ([]byte, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	fi, err := f.Stat()
	if err != nil {
		return nil, err
	}
	if !fi.Mode().IsRegular() {
		return nil, fmt.Errorf("%s is not a regular file", path)
	}
	if perm := fi.Mode().Perm(); perm&0o077 != 0 {
		return nil, fmt.Errorf("%s has mode %04o: users other than its owner may read or write it; run chmod 600 %s", path, perm, path)
	}
	b, err := io.ReadAll(io.LimitReader(f, maxSecretFile+1))
	if err != nil {
		return nil, err
	}
	if len(b) > maxSecretFile {
		return nil, fmt.Errorf("%s is over %d bytes: it should hold one secret, e.g. from head -c 32 /dev/urandom | base64", path, maxSecretFile)
	}
	secret := bytes.TrimRight(b, " \t\r\n")
	if err := peer.CheckSecret(secret); err != nil {
		return nil, err
	}
	return secret, nil
}
