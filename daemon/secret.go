package daemon

import (
	"bytes"
	"fmt"
	"io"
	"os"

	"github.com/ferry-project/ferry/transport/tcp"
)

// maxSecretFile bounds what is read of a --peer-secret-file: a secret is
// a line, not a file of any size.
const maxSecretFile = 4 << 10

// readPeerSecret reads the peer secret from path: a file only its owner
// may read (a secret others can read is no secret), holding at least
// tcp.MinSecret bytes. Trailing whitespace is dropped so that a file
// written by echo works.
func readPeerSecret(path string) ([]byte, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, fmt.Errorf("--peer-secret-file: %w", err)
	}
	defer f.Close()
	fi, err := f.Stat()
	if err != nil {
		return nil, fmt.Errorf("--peer-secret-file: %w", err)
	}
	if !fi.Mode().IsRegular() {
		return nil, fmt.Errorf("--peer-secret-file %s is not a regular file", path)
	}
	if perm := fi.Mode().Perm(); perm&0o077 != 0 {
		return nil, fmt.Errorf("--peer-secret-file %s has mode %04o: users other than its owner may read or write it; run chmod 600 %s", path, perm, path)
	}
	b, err := io.ReadAll(io.LimitReader(f, maxSecretFile+1))
	if err != nil {
		return nil, fmt.Errorf("--peer-secret-file %s: %w", path, err)
	}
	if len(b) > maxSecretFile {
		return nil, fmt.Errorf("--peer-secret-file %s is over %d bytes: it should hold one secret, e.g. from head -c 32 /dev/urandom | base64", path, maxSecretFile)
	}
	secret := bytes.TrimRight(b, " \t\r\n")
	if err := tcp.CheckSecret(secret); err != nil {
		return nil, fmt.Errorf("--peer-secret-file %s: %w", path, err)
	}
	return secret, nil
}
