package peer

import (
	"bytes"
	"errors"
	"io"
	"net"
	"strings"
	"testing"
	"time"

	"github.com/ferry-project/ferry/transport"
	"github.com/ferry-project/ferry/transport/transporttest"
)

var (
	secretA = []byte("0123456789abcdef-secret-A")
	secretB = []byte("0123456789abcdef-secret-B")
)

func TestAuthSameSecret(t *testing.T) {
	rx := listen(t, Config{Secret: secretA}, nil)
	tx := listen(t, Config{Secret: bytes.Clone(secretA)}, nil)
	c, instance, err := tx.Dial(ctxFor(t, 10*time.Second), rx.Addr().String(), KindData)
	if err != nil {
		t.Fatalf("dial with the same secret: %v", err)
	}
	c.Close()
	if instance != rx.Instance() {
		t.Errorf("the dial saw instance %#x, want %#x", instance, rx.Instance())
	}
}

// TestAuthRefused dials between transports whose secrets do not match;
// the dialer's error and the listener's log name why, both ways round.
func TestAuthRefused(t *testing.T) {
	for _, c := range []struct {
		name        string
		tx, rx      []byte
		dialErr     string
		listenerLog string
	}{
		{"WrongSecret", secretA, secretB, "the peer refused this daemon's proof", "proof mismatch"},
		{"WrongSecretOtherWay", secretB, secretA, "the peer refused this daemon's proof", "proof mismatch"},
		{"DialerWithout", nil, secretA, "the peer requires a peer secret", "peer has no secret"},
		{"ListenerWithout", secretA, nil, "the peer has no peer secret", "peer has a secret"},
	} {
		t.Run(c.name, func(t *testing.T) {
			var l transporttest.Logs
			rx := listen(t, Config{Secret: c.rx, Logf: l.Logf}, nil)
			tx := listen(t, Config{Secret: c.tx}, nil)
			_, _, err := tx.Dial(ctxFor(t, 10*time.Second), rx.Addr().String(), KindData)
			if !errors.Is(err, transport.ErrAuth) {
				t.Fatalf("dial error %v is not ErrAuth", err)
			}
			for _, w := range []string{"peer authentication failed", c.dialErr, "peer secret"} {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("dial error %q does not mention %q", err, w)
				}
			}
			transporttest.Served(t, rx.Stats)
			l.Has(t, "handshake from 127.0.0.1:", "peer authentication failed", c.listenerLog)
			// The refusal costs the listener nothing: a peer with its
			// secret still gets through.
			stillServes(t, rx)
		})
	}
}

// rawAuth dials tr and sends an authenticating hello; it returns the
// connection and both parties (the client's nonce not sent yet), after
// the welcome and the server's nonce.
func rawAuth(t *testing.T, tr *Port) (net.Conn, party, party) {
	t.Helper()
	nc := transporttest.Dial(t, tr.Addr().String())
	client := party{instance: 42, nonce: newNonce()}
	var hb [helloSize]byte
	h := ours(client.instance, KindData, secretA)
	h.encode(&hb)
	nc.Write(hb[:])
	var wb [welcomeSize + nonceSize]byte
	if _, err := io.ReadFull(nc, wb[:]); err != nil {
		t.Fatalf("reading the welcome and nonce: %v", err)
	}
	var w welcome
	w.decode((*[welcomeSize]byte)(wb[:welcomeSize]))
	if w.status != statusOK || !w.auth() {
		t.Fatalf("welcome %+v, want status ok with flagAuth", w)
	}
	return nc, client, party{instance: w.instance, nonce: [nonceSize]byte(wb[welcomeSize:])}
}

// TestAuthPeerGoneBeforeProof: a client that closes before its proof is
// all in proved nothing either way; the listener logs a short read, not an
// authentication failure.
func TestAuthPeerGoneBeforeProof(t *testing.T) {
	var l transporttest.Logs
	rx := listen(t, Config{Secret: secretA, Logf: l.Logf}, nil)
	nc, client, _ := rawAuth(t, rx)
	nc.Write(client.nonce[:5])
	nc.Close()
	transporttest.Served(t, rx.Stats)
	l.Has(t, "handshake from "+nc.LocalAddr().String(), "read 5 of the peer's", "nonce and proof", "EOF")
	l.None(t, "peer authentication failed")
}

// TestAuthReflectedProof sends back a proof made for the other role, over
// the very nonces of the handshake: each side must refuse it.
func TestAuthReflectedProof(t *testing.T) {
	t.Run("ToListener", func(t *testing.T) {
		var l transporttest.Logs
		rx := listen(t, Config{Secret: secretA, Logf: l.Logf}, nil)
		// A client that could make the server's proof still cannot pass
		// it off as its own.
		nc, client, server := rawAuth(t, rx)
		p := proof(secretA, roleServer, KindData, client, server)
		nc.Write(append(client.nonce[:], p[:]...))
		var vb [verdictSize]byte
		if _, err := io.ReadFull(nc, vb[:]); err != nil {
			t.Fatalf("reading the verdict: %v", err)
		}
		var v verdict
		v.decode(&vb)
		if v.status != statusBadProof || v.proof != [proofSize]byte{} {
			t.Fatalf("verdict %+v, want a refusal without a proof", v)
		}
		if n, err := nc.Read(vb[:]); err != io.EOF {
			t.Errorf("after the refusal: %d bytes and %v, want the connection closed", n, err)
		}
		transporttest.Served(t, rx.Stats)
		l.Has(t, "handshake from "+nc.LocalAddr().String(), "proof mismatch")
	})
	t.Run("ToDialer", func(t *testing.T) {
		// A server without the secret echoes the client's own proof.
		addr := transporttest.FakePeer(t, func(c net.Conn) {
			var hb [helloSize]byte
			if _, err := io.ReadFull(c, hb[:]); err != nil {
				return
			}
			var h hello
			h.decode(&hb)
			var wb [welcomeSize]byte
			w := welcome{hello: ours(7, h.kind, secretB)}
			w.encode(&wb)
			nonce := newNonce()
			c.Write(append(wb[:], nonce[:]...))
			var b [nonceSize + proofSize]byte
			if _, err := io.ReadFull(c, b[:]); err != nil {
				return
			}
			v := verdict{proof: [proofSize]byte(b[nonceSize:])}
			var vb [verdictSize]byte
			v.encode(&vb)
			c.Write(vb[:])
		})
		tx := listen(t, Config{Secret: secretA}, nil)
		_, _, err := tx.Dial(ctxFor(t, 10*time.Second), addr, KindData)
		if !errors.Is(err, transport.ErrAuth) || !strings.Contains(err.Error(), "proof mismatch") {
			t.Fatalf("dial error %v, want a proof mismatch", err)
		}
	})
}

func TestShortSecret(t *testing.T) {
	for _, secret := range [][]byte{{}, []byte("fifteen bytes!!")} {
		_, err := Listen(Config{Addr: "127.0.0.1:0", Sink: transporttest.NewSlots(0), Secret: secret})
		if err == nil || !strings.Contains(err.Error(), "at least 16") {
			t.Errorf("secret of %d bytes: Listen error %v, want one naming the minimum", len(secret), err)
		}
	}
}

// TestAuthDialOlderPeer: a dialer with a secret sends nothing past its
// hello before the welcome, so a daemon of the previous version reads it
// whole and its version mismatch reaches the dialer intact.
func TestAuthDialOlderPeer(t *testing.T) {
	tx := listen(t, Config{Secret: secretA}, nil)
	addr := transporttest.FakePeer(t, welcomeAs(2, statusBadVersion))
	_, _, err := tx.Dial(ctxFor(t, 10*time.Second), addr, KindData)
	for _, w := range []string{"peer speaks version 2", "this daemon speaks version 5", "upgrade the older daemon"} {
		if err == nil || !strings.Contains(err.Error(), w) {
			t.Errorf("dial error %v does not mention %q", err, w)
		}
	}
}
