package peer

import (
	"crypto/hmac"
	"crypto/rand"
	"crypto/sha256"
	"encoding/binary"
	"fmt"

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
// everything this handshake fixed.
func proof(secret []byte, role string, kind Kind, client, server party) [proofSize]byte {
	m := hmac.New(sha256.New, secret)
	m.Write([]byte("ferry peer proof v3 " + role))
	var b [4 + 2*(8+nonceSize)]byte
	binary.LittleEndian.PutUint32(b[0:], uint32(kind))
	binary.LittleEndian.PutUint64(b[4:], client.instance)
	copy(b[12:], client.nonce[:])
	binary.LittleEndian.PutUint64(b[12+nonceSize:], server.instance)
	copy(b[20+nonceSize:], server.nonce[:])
	m.Write(b[:])
	var p [proofSize]byte
	m.Sum(p[:0])
	return p
}

// validProof says whether got is the proof role owes, in constant time.
func validProof(got [proofSize]byte, secret []byte, role string, kind Kind, client, server party) bool {
	want := proof(secret, role, kind, client, server)
	return hmac.Equal(got[:], want[:])
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
