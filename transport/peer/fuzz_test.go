package peer

import (
	"bytes"
	"encoding/binary"
	"io"
	"net"
	"testing"
	"time"

	"github.com/ferry-project/ferry/transport"
	"github.com/ferry-project/ferry/transport/transporttest"
)

// FuzzWireRecords decodes the same bytes as every record of the wire
// protocol. Fixed-size records must encode back to the bytes they were
// decoded from, the hello check must agree with the magic and version,
// and a reply is accepted exactly when its message fits and an OK carries
// none. Seeds: testdata/fuzz/FuzzWireRecords.
func FuzzWireRecords(f *testing.F) {
	f.Fuzz(func(t *testing.T, data []byte) {
		var raw [ReplySize + MaxMessage]byte
		copy(raw[:], data)

		var h hello
		h.decode((*[helloSize]byte)(raw[:helloSize]))
		var hb [helloSize]byte
		h.encode(&hb)
		if !bytes.Equal(hb[:], raw[:helloSize]) {
			t.Fatalf("hello %x re-encodes as %x", raw[:helloSize], hb)
		}
		status, err := h.check()
		kind := binary.LittleEndian.Uint32(raw[16:])
		good := string(raw[:4]) == magic && binary.LittleEndian.Uint32(raw[4:]) == version && (Kind(kind) == KindData || Kind(kind) == KindRDMA)
		if good != (err == nil) || good != (status == statusOK) {
			t.Fatalf("hello %x: check() = %d, %v", raw[:helloSize], status, err)
		}

		var w welcome
		w.decode((*[welcomeSize]byte)(raw[:welcomeSize]))
		var wb [welcomeSize]byte
		w.encode(&wb)
		if !bytes.Equal(wb[:], raw[:welcomeSize]) {
			t.Fatalf("welcome %x re-encodes as %x", raw[:welcomeSize], wb)
		}

		var v verdict
		v.decode((*[verdictSize]byte)(raw[:verdictSize]))
		var vb [verdictSize]byte
		v.encode(&vb)
		if !bytes.Equal(vb[:], raw[:verdictSize]) {
			t.Fatalf("verdict %x re-encodes as %x", raw[:verdictSize], vb)
		}

		var hd Header
		hd.Decode((*[HeaderSize]byte)(raw[:HeaderSize]))
		var hdb [HeaderSize]byte
		hd.Encode(&hdb)
		if !bytes.Equal(hdb[:], raw[:HeaderSize]) {
			t.Fatalf("header %x re-encodes as %x", raw[:HeaderSize], hdb)
		}

		code, flags, n, err := DecodeReply((*[ReplySize]byte)(raw[:ReplySize]))
		wantCode := transport.Code(binary.LittleEndian.Uint32(raw[0:]))
		wantLen := int(binary.LittleEndian.Uint16(raw[6:]))
		valid := wantLen <= MaxMessage && (wantCode != transport.OK || wantLen == 0)
		if valid != (err == nil) {
			t.Fatalf("reply %x: DecodeReply error %v, want valid=%v", raw[:ReplySize], err, valid)
		}
		if err != nil {
			return
		}
		if code != wantCode || n != wantLen || flags != binary.LittleEndian.Uint16(raw[4:]) {
			t.Fatalf("reply %x decodes as %d %d %d", raw[:ReplySize], code, flags, n)
		}
		// What a receiver sends, a sender reads back unchanged.
		var out [ReplySize + MaxMessage]byte
		msg := string(raw[ReplySize : ReplySize+n])
		b := EncodeReply(&out, code, flags, msg)
		c2, f2, n2, err := DecodeReply((*[ReplySize]byte)(b[:ReplySize]))
		if err != nil || c2 != code || f2 != flags || string(b[ReplySize:ReplySize+n2]) != msg {
			t.Fatalf("reply %d %d %q round-trips as %d %d %q, %v", code, flags, msg, c2, f2, b[ReplySize:], err)
		}
	})
}

// fuzzProofMark in a FuzzDialedConn seed stands for the proof a server
// holding fuzzSecret owes the dialer, over the nonces of the connection.
var fuzzProofMark = []byte("PROOF")

// fuzzSecret is the peer secret of the fuzzed dialer that authenticates.
var fuzzSecret = []byte("fuzzing-peer-secret-0123456789")

// FuzzDialedConn: a peer answers a dial with arbitrary bytes, as its
// welcome (and, when the dialer holds a secret, its nonce and verdict)
// and then as the reply to one write's header. The dialer must neither
// hang nor panic, and take the connection only when those bytes hold an
// OK welcome of this version for the kind asked and the server's valid
// proof when they authenticate; the reply reads as OK only when it is
// one. Seeds: testdata/fuzz/FuzzDialedConn.
func FuzzDialedConn(f *testing.F) {
	plain := listen(f, Config{HandshakeTimeout: 2 * time.Second}, nil)
	authed := listen(f, Config{HandshakeTimeout: 2 * time.Second, Secret: fuzzSecret}, nil)
	f.Fuzz(func(t *testing.T, withSecret bool, answer []byte) {
		tx := plain
		if withSecret {
			tx = authed
		}
		// What the fake peer sent, and the proof it owed.
		type answered struct {
			bytes []byte
			proof [proofSize]byte
		}
		sent := make(chan answered, 1)
		addr := transporttest.FakePeer(t, func(c net.Conn) {
			c.SetDeadline(time.Now().Add(10 * time.Second))
			var hb [helloSize]byte
			if _, err := io.ReadFull(c, hb[:]); err != nil {
				return
			}
			var h hello
			h.decode(&hb)
			a := answered{bytes: answer}
			if h.auth() && len(answer) >= welcomeSize+nonceSize {
				// The welcome and nonce first, then, once the dialer's
				// nonce is in, the rest with the proof that nonce asks.
				c.Write(answer[:welcomeSize+nonceSize])
				nonce, dialed, _, err := readProving(c)
				if err != nil {
					sent <- a
					return
				}
				client := party{instance: h.instance, nonce: nonce}
				server := party{instance: binary.LittleEndian.Uint64(answer[8:]), nonce: [nonceSize]byte(answer[welcomeSize:])}
				a.proof = proof(fuzzSecret, roleServer, h.kind, dialed, client, server)
				head := answer[: welcomeSize+nonceSize : welcomeSize+nonceSize]
				a.bytes = append(head, bytes.Replace(answer[len(head):], fuzzProofMark, a.proof[:], 1)...)
				c.Write(a.bytes[welcomeSize+nonceSize:])
			} else {
				c.Write(answer)
			}
			sent <- a
			// Nothing more to say: the dialer sees the end at once rather
			// than after a timeout. Then take what it sends until it closes.
			c.(*net.TCPConn).CloseWrite()
			io.Copy(io.Discard, c)
		})
		c, _, err := tx.Dial(ctxFor(t, 10*time.Second), addr, KindData)
		if err != nil {
			return
		}
		defer c.Close()
		a := <-sent
		reply, ok := acceptedWelcome(a.bytes, withSecret, a.proof)
		if !ok {
			t.Fatalf("dial (secret %v) succeeded on the answer %x", withSecret, a.bytes)
		}
		var hb [HeaderSize]byte
		h := Header{Len: 16, Key: transport.Key{1}, Tag: 1}
		h.Encode(&hb)
		c.SetDeadline(time.Now().Add(10 * time.Second))
		c.Write(append(hb[:], make([]byte, 16)...))
		var fixed [ReplySize]byte
		r, _, err := ReadReply(c, &fixed, nil)
		okReply := len(reply) >= ReplySize && binary.LittleEndian.Uint32(reply) == uint32(transport.OK) && binary.LittleEndian.Uint16(reply[6:]) == 0
		if err == nil && r.Code == transport.OK && !okReply {
			t.Fatalf("the reply %x reads as OK", reply)
		}
	})
}

// acceptedWelcome says whether a dialer may take answer as a server's
// handshake (an OK welcome for a data connection, flagAuth exactly when
// the dialer holds a secret, and then an OK verdict with the proof owed),
// and returns what follows it.
func acceptedWelcome(a []byte, withSecret bool, owed [proofSize]byte) ([]byte, bool) {
	if len(a) < welcomeSize {
		return nil, false
	}
	var w welcome
	w.decode((*[welcomeSize]byte)(a[:welcomeSize]))
	if _, err := w.check(); err != nil || w.status != statusOK || w.kind != KindData || w.auth() != withSecret {
		return nil, false
	}
	a = a[welcomeSize:]
	if !withSecret {
		return a, true
	}
	if len(a) < nonceSize+verdictSize {
		return nil, false
	}
	var v verdict
	v.decode((*[verdictSize]byte)(a[nonceSize:]))
	if v.status != statusOK || v.proof != owed {
		return nil, false
	}
	return a[nonceSize+verdictSize:], true
}
