package peer

import (
	"crypto/hmac"
	"crypto/rand"
	"crypto/sha256"
	"encoding/binary"
	"fmt"
	"net"
	"net/netip"
	"strings"

	"github.com/ferry-project/ferry/transport"
)

// Roles a proof is made for (wire.go's handshake).
const (
	roleClient = "client"
	roleServer = "server"
)

// party is one side's part of an authenticated handshake.
type party struct {
	instance uint64
	nonce    [nonceSize]byte
}

// newNonce is a fresh challenge: unpredictable, so no proof recorded on
// an earlier connection answers it.
func newNonce() [nonceSize]byte {
	var n [nonceSize]byte
	rand.Read(n[:]) // crypto/rand.Read never fails on Linux
	return n
}

// proof is what the side in role sends to show it holds secret, bound to
// everything this handshake fixed, the address the client dialed
// included (checkDialed passed it).
func proof(secret []byte, role string, kind Kind, dialed string, client, server party) [proofSize]byte {
	m := hmac.New(sha256.New, secret)
	m.Write([]byte("ferry peer proof v4 " + role))
	m.Write(binary.LittleEndian.AppendUint32(nil, uint32(kind)))
	m.Write(appendDialed(nil, dialed))
	var b [2 * (8 + nonceSize)]byte
	binary.LittleEndian.PutUint64(b[0:], client.instance)
	copy(b[8:], client.nonce[:])
	binary.LittleEndian.PutUint64(b[8+nonceSize:], server.instance)
	copy(b[16+nonceSize:], server.nonce[:])
	m.Write(b[:])
	var p [proofSize]byte
	m.Sum(p[:0])
	return p
}

// validProof says whether got is the proof role owes, in constant time.
func validProof(got [proofSize]byte, secret []byte, role string, kind Kind, dialed string, client, server party) bool {
	want := proof(secret, role, kind, dialed, client, server)
	return hmac.Equal(got[:], want[:])
}

// appendDialed appends the dialed address as the handshake carries it:
// its length, u16, then its bytes.
func appendDialed(b []byte, dialed string) []byte {
	return append(binary.LittleEndian.AppendUint16(b, uint16(len(dialed))), dialed...)
}

// checkDialedLen says what is wrong with n as the length of a dialed
// address, if anything.
func checkDialedLen(n int) error {
	if n == 0 || n > maxDialed {
		return fmt.Errorf("the dialed address has %d bytes; a handshake carries 1 to %d", n, maxDialed)
	}
	return nil
}

// checkDialed says what is wrong with addr as the dialed address of a
// handshake, if anything.
func checkDialed(addr string) error {
	if err := checkDialedLen(len(addr)); err != nil {
		return err
	}
	if _, _, err := net.SplitHostPort(addr); err != nil {
		// The address goes quoted: it is a stranger's, unauthenticated,
		// and SplitHostPort's error repeats it as it came.
		return fmt.Errorf("the dialed address %q is no host:port (a host, a colon and a port)", addr)
	}
	return nil
}

// sameAddr says whether the host:port addresses a and b, as written,
// name the same endpoint: equal ports, and hosts that are the same IP or
// the same name in any letter case (as DNS compares names). A host that
// names no one host (empty, 0.0.0.0 or ::) matches nothing.
func sameAddr(a, b string) bool {
	ah, ap, err := net.SplitHostPort(a)
	if err != nil || ah == "" {
		return false
	}
	bh, bp, err := net.SplitHostPort(b)
	if err != nil || ap != bp {
		return false
	}
	ai, aerr := netip.ParseAddr(ah)
	bi, berr := netip.ParseAddr(bh)
	if aerr == nil && berr == nil {
		return !ai.IsUnspecified() && ai.Unmap() == bi.Unmap()
	}
	return strings.EqualFold(ah, bh)
}

// authErr is a handshake refused for want of a shared secret: no retry
// helps until an operator gives both daemons the same one.
func authErr(format string, args ...any) error {
	return fmt.Errorf("%w: %s", transport.ErrAuth, fmt.Sprintf(format, args...))
}

// CheckSecret says what is wrong with a peer secret, if anything.
func CheckSecret(secret []byte) error {
	if len(secret) < MinSecret {
		return fmt.Errorf("the peer secret has %d bytes; it needs at least %d (e.g. head -c 32 /dev/urandom | base64)", len(secret), MinSecret)
	}
	return nil
}
