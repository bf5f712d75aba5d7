package daemon

import (
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"syscall"
	"time"
)

// listenControl opens the control socket at path, mode 0660, owned by
// group gid (-1: ferryd's own). If something answers there, another ferryd
// owns it and we refuse rather than steal it; a file nobody answers on is
// stale (a crashed daemon) and is replaced.
func listenControl(path string, gid int) (net.Listener, error) {
	if c, err := net.DialTimeout("unix", path, time.Second); err == nil {
		c.Close()
		return nil, fmt.Errorf("control socket %s is in use by a running ferryd: stop it first, or give this one another --socket", path)
	}
	if fi, err := os.Lstat(path); err == nil {
		if fi.Mode()&os.ModeSocket == 0 {
			return nil, fmt.Errorf("control socket path %s exists and is not a socket: remove it or choose another --socket", path)
		}
		if err := os.Remove(path); err != nil {
			return nil, fmt.Errorf("removing stale control socket %s: %w", path, err)
		}
	}
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		return nil, fmt.Errorf("control socket directory: %w", err)
	}
	// The umask makes the socket 0660 from its first moment; it is process
	// wide, which is fine this early in start-up (nothing else creates files).
	old := syscall.Umask(0o117)
	ln, err := net.Listen("unix", path)
	syscall.Umask(old)
	if err != nil {
		if errors.Is(err, syscall.EACCES) {
			return nil, fmt.Errorf("control socket %s: permission denied: run ferryd as a user that may write %s, or choose another --socket", path, filepath.Dir(path))
		}
		return nil, fmt.Errorf("control socket %s: %w", path, err)
	}
	if err := chownGroup(path, gid, "control socket"); err != nil {
		ln.Close()
		return nil, err
	}
	return ln, nil
}

// chownGroup gives the file at path to group gid (-1: leave it).
func chownGroup(path string, gid int, what string) error {
	if gid < 0 {
		return nil
	}
	if err := os.Chown(path, -1, gid); err != nil {
		return fmt.Errorf("giving the %s %s to group %d: %w: ferryd's user must be a member of that group (or run it as root)", what, path, gid, err)
	}
	return nil
}
