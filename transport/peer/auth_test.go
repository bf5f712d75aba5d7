package peer

import (
	"bytes"
	"encoding/binary"
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

// proving is what a client sends after the server's nonce: its nonce,
// the length of dialed (u16) and dialed, and its proof (wire.go's notes).
func proving(nonce [nonceSize]byte, dialed string, p [proofSize]byte) []byte {
	b := binary.LittleEndian.AppendUint16(nonce[:], uint16(len(dialed)))
	return append(append(b, dialed...), p[:]...)
}

// readVerdict reads the server's verdict and checks that the server
// closes after a refusal.
func readVerdict(t *testing.T, nc net.Conn) verdict {
	t.Helper()
	var vb [verdictSize]byte
	if _, err := io.ReadFull(nc, vb[:]); err != nil {
		t.Fatalf("reading the verdict: %v", err)
	}
	var v verdict
	v.decode(&vb)
	if v.status == statusOK {
		return v
	}
	if v.proof != [proofSize]byte{} {
		t.Errorf("refusal %d carries a proof", v.status)
	}
	if n, err := nc.Read(vb[:]); err != io.EOF {
		t.Errorf("after the refusal: %d bytes and %v, want the connection closed", n, err)
	}
	return v
}

// readProving reads what a client sends after the server's nonce, as a
// server would.
func readProving(c net.Conn) (nonce [nonceSize]byte, dialed string, p [proofSize]byte, err error) {
	var b [nonceSize + 2]byte
	if _, err = io.ReadFull(c, b[:]); err != nil {
		return
	}
	rest := make([]byte, binary.LittleEndian.Uint16(b[nonceSize:])+proofSize)
	if _, err = io.ReadFull(c, rest); err != nil {
		return
	}
	n := len(rest) - proofSize
	return [nonceSize]byte(b[:nonceSize]), string(rest[:n]), [proofSize]byte(rest[n:]), nil
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
	l.Has(t, "handshake from "+nc.LocalAddr().String(), "read 5 of the peer's 34-byte nonce and dialed address length", "EOF")
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
		dialed := rx.Addr().String()
		nc.Write(proving(client.nonce, dialed, proof(secretA, roleServer, KindData, dialed, client, server)))
		if v := readVerdict(t, nc); v.status != statusBadProof {
			t.Fatalf("verdict %+v, want a refusal for the proof", v)
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
			_, _, p, err := readProving(c)
			if err != nil {
				return
			}
			v := verdict{proof: p}
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
	addr := transporttest.FakePeer(t, welcomeAs(7, statusBadVersion))
	_, _, err := tx.Dial(ctxFor(t, 10*time.Second), addr, KindData)
	for _, w := range []string{"peer speaks version 7", "this daemon speaks version 8", "upgrade the older daemon"} {
		if err == nil || !strings.Contains(err.Error(), w) {
			t.Errorf("dial error %v does not mention %q", err, w)
		}
	}
}

// TestAuthRelayed: a host without the secret that a daemon can be made
// to dial (M) relays its handshake to another daemon holding the secret
// (B). B must refuse, the dialer's proof naming M, and both say why.
func TestAuthRelayed(t *testing.T) {
	var l transporttest.Logs
	b := listen(t, Config{Secret: secretA, Logf: l.Logf}, nil)
	a := listen(t, Config{Secret: secretA}, nil)
	m := transporttest.Listener(t)
	transporttest.Relay(t, m, b.Addr().String())
	c, instance, err := a.Dial(ctxFor(t, 10*time.Second), m.Addr().String(), KindData)
	if err == nil {
		c.Close()
		t.Fatalf("the handshake relayed through %s authenticated with %s (instance %#x)", m.Addr(), b.Addr(), instance)
	}
	if !errors.Is(err, transport.ErrAuth) || !errors.Is(err, ErrMisdirected) {
		t.Errorf("dial error %v is not ErrAuth and ErrMisdirected", err)
	}
	for _, w := range []string{"does not take the address dialed as its own", `"` + m.Addr().String() + `" led to another daemon`, "a relay, NAT or port forwarding", "must advertise the address they dial"} {
		if !strings.Contains(err.Error(), w) {
			t.Errorf("dial error %q does not mention %q", err, w)
		}
	}
	transporttest.Served(t, b.Stats)
	l.Has(t, "handshake from 127.0.0.1:", "peer authentication failed", `the peer dialed "`+m.Addr().String()+`", which is not this daemon's address`,
		"reached at "+b.Addr().String(), "advertise the address they dial")
	l.None(t, "proof mismatch")
	stillServes(t, b)
}

// TestAuthDialedAddress: a dialer's proof of the address it dialed passes
// where that address names the server: its advertised address (here a
// name, behind port forwarding), or the address the connection arrived
// on; another name for it is refused.
func TestAuthDialedAddress(t *testing.T) {
	tx := listen(t, Config{Secret: secretA}, nil)
	t.Run("Advertised", func(t *testing.T) {
		front := transporttest.Listener(t) // port forwarding to rx
		_, port, _ := net.SplitHostPort(front.Addr().String())
		rx := listen(t, Config{Secret: secretA, Advertise: "LocalHost:" + port}, nil)
		transporttest.Relay(t, front, rx.Addr().String())
		c, instance, err := tx.Dial(ctxFor(t, 10*time.Second), "localhost:"+port, KindData)
		if err != nil {
			t.Fatalf("dial by the advertised name: %v", err)
		}
		c.Close()
		if instance != rx.Instance() {
			t.Errorf("the dial reached instance %#x, want %#x", instance, rx.Instance())
		}
	})
	t.Run("ArrivedOn", func(t *testing.T) {
		rx := listen(t, Config{Secret: secretA}, nil)
		c, _, err := tx.Dial(ctxFor(t, 10*time.Second), rx.Addr().String(), KindData)
		if err != nil {
			t.Fatalf("dial by the address connections arrive on: %v", err)
		}
		c.Close()
	})
	// Behind NAT the address connections arrive on is a private one,
	// which a relay on the dialer's side may hold too.
	t.Run("ArrivedOnWhenAdvertised", func(t *testing.T) {
		rx := listen(t, Config{Secret: secretA, Advertise: "peer.invalid:7000"}, nil)
		_, _, err := tx.Dial(ctxFor(t, 10*time.Second), rx.Addr().String(), KindData)
		if !errors.Is(err, ErrMisdirected) {
			t.Fatalf("dial by the address connections arrive on, where another is advertised: %v, want ErrMisdirected", err)
		}
	})
	t.Run("OtherName", func(t *testing.T) {
		var l transporttest.Logs
		rx := listen(t, Config{Secret: secretA, Advertise: "peer.invalid:7000", Logf: l.Logf}, nil)
		_, port, _ := net.SplitHostPort(rx.Addr().String())
		_, _, err := tx.Dial(ctxFor(t, 10*time.Second), "localhost:"+port, KindData)
		if !errors.Is(err, ErrMisdirected) {
			t.Fatalf("dial by a name the peer does not advertise: %v, want ErrMisdirected", err)
		}
		transporttest.Served(t, rx.Stats)
		l.Has(t, `the peer dialed "localhost:`+port+`"`, `advertised as "peer.invalid:7000", listening on "127.0.0.1:0"`)
	})
}

func TestNames(t *testing.T) {
	p := &Port{cfg: Config{Addr: "peer-b.example:7000", Advertise: "10.0.0.5:7000"}}
	local := &net.TCPAddr{IP: net.ParseIP("192.168.1.5"), Port: 7000}
	for dialed, want := range map[string]bool{
		"10.0.0.5:7000":           true,  // advertised
		"[::ffff:10.0.0.5]:7000":  true,  // the same IP
		"192.168.1.5:7000":        false, // arrived on: taken only where nothing is advertised
		"Peer-B.Example:7000":     true,  // listening on, names in any case
		"10.0.0.5:7001":           false, // another port
		"10.0.0.6:7000":           false,
		"peer-b.example.org:7000": false,
	} {
		if got := p.names(dialed, local); got != want {
			t.Errorf("names(%q) = %v, want %v", dialed, got, want)
		}
	}
	p.cfg.Advertise = ""
	for dialed, want := range map[string]bool{
		"192.168.1.5:7000":    true, // arrived on
		"peer-b.example:7000": true, // listening on
		"10.0.0.5:7000":       false,
	} {
		if got := p.names(dialed, local); got != want {
			t.Errorf("with nothing advertised, names(%q) = %v, want %v", dialed, got, want)
		}
	}
	// A wildcard names no one host.
	p = &Port{cfg: Config{Addr: ":7000", Advertise: "0.0.0.0:7000"}}
	for _, dialed := range []string{":7000", "0.0.0.0:7000", "[::]:7000"} {
		if p.names(dialed, local) {
			t.Errorf("names(%q) with a wildcard listen and advertise: true", dialed)
		}
	}
}

// TestAuthBadDialed: a dialed address field out of bounds, or no
// host:port, is refused with status 9 and logged naming what is wrong;
// one that another proof was made for is a proof mismatch.
func TestAuthBadDialed(t *testing.T) {
	var l transporttest.Logs
	rx := listen(t, Config{Secret: secretA, Logf: l.Logf}, nil)
	for _, c := range []struct {
		name   string
		send   func(client, server party) []byte
		status uint32
		log    string
	}{
		{"Empty", func(client, _ party) []byte { return append(client.nonce[:], 0, 0) }, statusBadDialed,
			"the dialed address has 0 bytes; a handshake carries 1 to 512"},
		{"TooLong", func(client, _ party) []byte { return append(client.nonce[:], 0x01, 0x02) }, statusBadDialed,
			"the dialed address has 513 bytes; a handshake carries 1 to 512"},
		{"NoPort", func(client, server party) []byte {
			return proving(client.nonce, "peer-b", proof(secretA, roleClient, KindData, "peer-b", client, server))
		}, statusBadDialed, `the dialed address "peer-b" is no host:port`},
		// A stranger's line break stays quoted: no forged log line.
		{"LineBreak", func(client, server party) []byte {
			return proving(client.nonce, "x\nlevel=error", proof(secretA, roleClient, KindData, "x\nlevel=error", client, server))
		}, statusBadDialed, `the dialed address "x\nlevel=error" is no host:port (a host, a colon and a port)`},
		{"Rewritten", func(client, server party) []byte {
			return proving(client.nonce, rx.Addr().String(), proof(secretA, roleClient, KindData, "127.0.0.1:1", client, server))
		}, statusBadProof, "proof mismatch"},
	} {
		t.Run(c.name, func(t *testing.T) {
			nc, client, server := rawAuth(t, rx)
			nc.Write(c.send(client, server))
			if v := readVerdict(t, nc); v.status != c.status {
				t.Fatalf("verdict status %d, want %d", v.status, c.status)
			}
			transporttest.Served(t, rx.Stats)
			l.Has(t, "handshake from "+nc.LocalAddr().String(), c.log)
		})
	}
	stillServes(t, rx)
}

// TestAuthServerProofBindsDialed: a server's proof made for another
// dialed address than the dialer's is refused by the dialer.
func TestAuthServerProofBindsDialed(t *testing.T) {
	addr := transporttest.FakePeer(t, func(c net.Conn) {
		var hb [helloSize]byte
		if _, err := io.ReadFull(c, hb[:]); err != nil {
			return
		}
		var wb [welcomeSize]byte
		w := welcome{hello: ours(7, KindData, secretA)}
		w.encode(&wb)
		server := party{instance: 7, nonce: newNonce()}
		c.Write(append(wb[:], server.nonce[:]...))
		nonce, _, _, err := readProving(c)
		if err != nil {
			return
		}
		client := party{instance: binary.LittleEndian.Uint64(hb[8:]), nonce: nonce}
		v := verdict{proof: proof(secretA, roleServer, KindData, "127.0.0.1:1", client, server)}
		var vb [verdictSize]byte
		v.encode(&vb)
		c.Write(vb[:])
	})
	tx := listen(t, Config{Secret: secretA}, nil)
	_, _, err := tx.Dial(ctxFor(t, 10*time.Second), addr, KindData)
	if !errors.Is(err, transport.ErrAuth) || !strings.Contains(err.Error(), "proof mismatch") {
		t.Fatalf("dial error %v, want a proof mismatch", err)
	}
}

// TestDialAddressTooLong: a dialer with a secret refuses, before
// connecting, an address its handshake cannot carry.
func TestDialAddressTooLong(t *testing.T) {
	tx := listen(t, Config{Secret: secretA}, nil)
	addr := strings.Repeat("a", 600) + ":7000"
	_, _, err := tx.Dial(ctxFor(t, 10*time.Second), addr, KindData)
	if err == nil || !strings.Contains(err.Error(), "the dialed address has 605 bytes; a handshake carries 1 to 512") {
		t.Fatalf("dial error %v, want one naming the address's length", err)
	}
}
