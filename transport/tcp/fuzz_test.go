package tcp

import (
	"bytes"
	"encoding/binary"
	"io"
	"net"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ferry-project/ferry/internal/connlimit"
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
		good := string(raw[:4]) == magic && binary.LittleEndian.Uint32(raw[4:]) == version && (kind == kindData || kind == kindRDMA)
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
		// The last 4 bytes are reserved: ignored, and sent as zeros.
		if !bytes.Equal(hdb[:HeaderSize-4], raw[:HeaderSize-4]) || binary.LittleEndian.Uint32(hdb[HeaderSize-4:]) != 0 {
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

// The receive slots FuzzAcceptedConn writes into: two slots with gaps
// around them, so a byte landing outside a slot shows.
const (
	fuzzMem              = 64 << 10
	fuzzSlot1, fuzzSize1 = 0, 4096
	fuzzSlot2, fuzzSize2 = 8192, 8192
	fuzzMaxWrite         = 1 << 20
)

// Placeholders a seed writes where a slot's key goes (4 bytes standing
// for the 16 of a key): the keys are random.
var fuzzKeyMarks = [2][]byte{[]byte("KEY1"), []byte("KEY2")}

// fuzzSecret is the peer secret of the fuzzed receivers and dialers that
// authenticate.
var fuzzSecret = []byte("fuzzing-peer-secret-0123456789")

// How FuzzAcceptedConn's bytes reach a receiver.
const (
	fuzzRaw        = iota // as they are, to a receiver without a secret
	fuzzAfterHello        // after a valid hello, to a receiver without a secret
	fuzzRawAuth           // as they are, to a receiver with a secret
	fuzzAfterAuth         // after a real authenticated handshake, to a receiver with a secret
	fuzzModes
)

// FuzzAcceptedConn sends arbitrary bytes to a real listening Transport
// (one without a secret and one with, mode picks how, see fuzzRaw...),
// then half-closes. The receiver must answer with well-formed records
// only, close the connection and end its goroutine, finish every write it
// accepted, and never touch memory outside the slots. Seeds:
// testdata/fuzz/FuzzAcceptedConn; KEY1 and KEY2 in them stand for the
// slots' keys.
func FuzzAcceptedConn(f *testing.F) {
	slots := transporttest.NewSlots(fuzzMem)
	keys := [2]transport.Key{slots.Add(fuzzSlot1, fuzzSize1), slots.Add(fuzzSlot2, fuzzSize2)}
	cfg := Config{Sink: slots, IOTimeout: 2 * time.Second, HandshakeTimeout: 2 * time.Second, MaxWrite: fuzzMaxWrite}
	open := listen(f, cfg)
	cfg.Secret = fuzzSecret
	locked := listen(f, cfg)
	f.Fuzz(func(t *testing.T, mode uint8, data []byte) {
		for i, mark := range fuzzKeyMarks {
			data = bytes.ReplaceAll(data, mark, keys[i][:])
		}
		mode %= fuzzModes
		rx := open
		if mode == fuzzRawAuth || mode == fuzzAfterAuth {
			rx = locked
		}
		if mode == fuzzAfterHello {
			data = append(helloBytes(version), data...)
		}
		nc, err := net.Dial("tcp", rx.Addr().String())
		if err != nil {
			t.Fatal(err)
		}
		defer nc.Close()
		// The receiver must close within its timeouts once the sender
		// has nothing more to say; 10 s is far beyond them.
		nc.SetDeadline(time.Now().Add(10 * time.Second))
		if mode == fuzzAfterAuth {
			c := &conn{nc: nc.(*net.TCPConn)}
			if _, err := c.greet(ctxFor(t, 10*time.Second), 42, kindData, fuzzSecret); err != nil {
				t.Fatalf("authenticated handshake: %v", err)
			}
			nc.SetDeadline(time.Now().Add(10 * time.Second))
		}
		go func() {
			nc.Write(data) // the receiver may close before taking it all
			nc.(*net.TCPConn).CloseWrite()
		}()
		out, err := io.ReadAll(nc)
		if err != nil && !transport.PeerGone(err) {
			t.Fatalf("reading the receiver's answers: %v (it did not close the connection)", err)
		}
		served(t, rx)
		// A receiver that closes with unread bytes resets the connection,
		// which can cut what it sent short: then only whole records count.
		if mode != fuzzAfterAuth {
			out = checkHandshake(t, out, len(data) >= helloSize, err == nil)
		}
		checkReplies(t, out, err == nil)
		if err := slots.Err(); err != nil {
			t.Fatal(err)
		}
		if n := slots.Pending(); n != 0 {
			t.Fatalf("%d accepted writes were never finished", n)
		}
		for _, gap := range [][2]int{{fuzzSlot1 + fuzzSize1, fuzzSlot2}, {fuzzSlot2 + fuzzSize2, fuzzMem}} {
			if i := bytes.IndexFunc(slots.Mem[gap[0]:gap[1]], func(r rune) bool { return r != 0 }); i >= 0 {
				t.Fatalf("byte %#x outside every slot was written", gap[0]+i)
			}
		}
	})
}

// checkHandshake parses a receiver's side of the handshake at the start
// of out (a welcome, owed for a whole hello; a nonce when it holds a
// secret; a verdict when the client announced one too) and returns what
// follows. Unless complete, the last record may be cut short.
func checkHandshake(t *testing.T, out []byte, owed, complete bool) []byte {
	t.Helper()
	if len(out) < welcomeSize && !complete {
		return nil
	}
	if len(out) == 0 && !owed {
		return nil // a hello cut short gets no welcome
	}
	if len(out) < welcomeSize {
		t.Fatalf("receiver sent %d bytes, less than a welcome: %x", len(out), out)
	}
	var w welcome
	w.decode((*[welcomeSize]byte)(out[:welcomeSize]))
	// A refused hello's welcome echoes the kind asked for, known or not:
	// only magic and version must be the receiver's own.
	if string(w.magic[:]) != magic || w.version != version {
		t.Fatalf("receiver's welcome is malformed: magic %q, version %d", w.magic[:], w.version)
	}
	out = out[welcomeSize:]
	if w.auth() {
		if len(out) < nonceSize {
			if complete {
				t.Fatalf("receiver sent %d bytes of its %d-byte nonce", len(out), nonceSize)
			}
			return nil
		}
		out = out[nonceSize:]
	}
	if w.status != statusOK {
		if len(out) > 0 {
			t.Fatalf("receiver refused the handshake (status %d) yet sent %d more bytes", w.status, len(out))
		}
		return nil
	}
	if !w.auth() {
		return out
	}
	// A client that sent no whole nonce and proof gets no verdict.
	if len(out) < verdictSize {
		if complete && len(out) > 0 {
			t.Fatalf("receiver sent %d bytes of its %d-byte verdict", len(out), verdictSize)
		}
		return nil
	}
	var v verdict
	v.decode((*[verdictSize]byte)(out[:verdictSize]))
	out = out[verdictSize:]
	if v.status != statusOK && (v.status != statusBadProof || v.proof != [proofSize]byte{} || len(out) > 0) {
		t.Fatalf("receiver's refusal is malformed: verdict %+v and %d more bytes", v, len(out))
	}
	return out
}

// checkReplies parses any number of well-formed replies. Unless
// complete, the last one may be cut short.
func checkReplies(t *testing.T, out []byte, complete bool) {
	t.Helper()
	for len(out) > 0 {
		if !complete && (len(out) < ReplySize || len(out) < ReplySize+int(binary.LittleEndian.Uint16(out[6:]))) {
			return
		}
		if len(out) < ReplySize {
			t.Fatalf("receiver sent a %d-byte fragment of a reply: %x", len(out), out)
		}
		code, flags, n, err := DecodeReply((*[ReplySize]byte)(out[:ReplySize]))
		if err != nil || len(out) < ReplySize+n {
			t.Fatalf("receiver sent a malformed reply %x: %v", out, err)
		}
		msg := string(out[ReplySize : ReplySize+n])
		if code != transport.OK && (msg == "" || !strings.ContainsFunc(msg, func(r rune) bool { return r != ' ' })) {
			t.Fatalf("refusal %s carries no message", code)
		}
		out = out[ReplySize+n:]
		if flags&FlagClose != 0 && len(out) > 0 {
			t.Fatalf("receiver sent %d bytes after a reply that closes the connection", len(out))
		}
	}
}

// fuzzProofMark in a FuzzDialedConn seed stands for the proof a server
// holding fuzzSecret owes the dialer, over the nonces of the connection.
var fuzzProofMark = []byte("PROOF")

// FuzzDialedConn is the other direction: a peer answers a dial with
// arbitrary bytes, as its welcome (and, when the dialer holds a secret,
// its nonce and verdict) and then as the reply to one write. The dialer
// must neither hang nor panic, and report success only when those bytes
// hold an OK welcome of this version for the kind asked, the server's
// valid proof when they authenticate, and an OK reply. Seeds:
// testdata/fuzz/FuzzDialedConn.
func FuzzDialedConn(f *testing.F) {
	plain := listen(f, Config{Sink: transporttest.NewSlots(0), HandshakeTimeout: 2 * time.Second, IOTimeout: 2 * time.Second})
	authed := listen(f, Config{Sink: transporttest.NewSlots(0), HandshakeTimeout: 2 * time.Second, IOTimeout: 2 * time.Second, Secret: fuzzSecret})
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
		addr := fakePeer(t, func(c net.Conn) {
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
				var nb [nonceSize + proofSize]byte
				if _, err := io.ReadFull(c, nb[:]); err != nil {
					sent <- a
					return
				}
				client := party{instance: h.instance, nonce: [nonceSize]byte(nb[:nonceSize])}
				server := party{instance: binary.LittleEndian.Uint64(answer[8:]), nonce: [nonceSize]byte(answer[welcomeSize:])}
				a.proof = proof(fuzzSecret, roleServer, h.kind, client, server)
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
		ctx := ctxFor(t, 10*time.Second)
		s, err := tx.Dial(ctx, addr)
		if err != nil {
			if !strings.Contains(err.Error(), "tcp dial "+addr) {
				t.Fatalf("dial error does not name the peer: %v", err)
			}
			return
		}
		defer s.Close()
		a := <-sent
		reply, ok := acceptedWelcome(a.bytes, withSecret, a.proof)
		if !ok {
			t.Fatalf("dial (secret %v) succeeded on the answer %x", withSecret, a.bytes)
		}
		err = s.Write(ctx, transport.Write{Src: make([]byte, 16), Remote: 0, Key: transport.Key{1}, Tag: 1})
		okReply := len(reply) >= ReplySize && binary.LittleEndian.Uint32(reply) == uint32(transport.OK) && binary.LittleEndian.Uint16(reply[6:]) == 0
		if err == nil && !okReply {
			t.Fatalf("write succeeded on the reply %x", reply)
		}
		if err != nil && !strings.Contains(err.Error(), addr) && !transport.IsRefusal(err) {
			t.Fatalf("write error does not name the peer: %v", err)
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
	if _, err := w.check(); err != nil || w.status != statusOK || w.kind != kindData || w.auth() != withSecret {
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

// FuzzPeerPortFlood drives the peer port as a crowd of unauthenticated
// clients: 1 to 8 connections at once from up to 4 loopback addresses,
// each sending (after a valid hello, if asked) the fuzzed bytes repeated
// 1 to 64 times (many headers per connection), then half-closing, against
// a receiver whose port holds 4 connections, 2 per address. The port
// must never hold more than its cap, answer with well-formed records
// only (a connection refused or closed to make room may get none), close
// every connection and end its goroutine, finish every write it
// accepted, never touch memory outside the slots, and still serve a
// peer's session afterwards. KEY1 and KEY2 in the bytes stand for the
// slots' keys.
func FuzzPeerPortFlood(f *testing.F) {
	slots := transporttest.NewSlots(fuzzMem)
	keys := [2]transport.Key{slots.Add(fuzzSlot1, fuzzSize1), slots.Add(fuzzSlot2, fuzzSize2)}
	lim := connlimit.Limits{Total: 4, PerSource: 2}
	rx := listen(f, Config{Sink: slots, IOTimeout: 2 * time.Second, HandshakeTimeout: 2 * time.Second, MaxWrite: fuzzMaxWrite, Limits: lim})
	tx := listen(f, Config{Sink: transporttest.NewSlots(0), HandshakeTimeout: 5 * time.Second, IOTimeout: 5 * time.Second})
	header := func(addr, n uint64, key string) []byte {
		b := binary.LittleEndian.AppendUint64(nil, addr)
		b = binary.LittleEndian.AppendUint64(b, n)
		b = append(b, key...)
		return binary.LittleEndian.AppendUint32(binary.LittleEndian.AppendUint32(b, 7), 0)
	}
	f.Add(uint8(8), uint8(1), true, []byte{})                                             // hello-only crowd
	f.Add(uint8(8), uint8(64), false, []byte("GET / HTTP/1.1\r\n\r\n"))                   // scanners
	f.Add(uint8(4), uint8(16), true, append(header(fuzzSlot1, 8, "KEY1"), "8 bytes!"...)) // a slot written again and again
	f.Add(uint8(6), uint8(20), true, header(fuzzSlot2, 4, "KEY9"))                        // guessed keys, bodies cut short
	f.Fuzz(func(t *testing.T, conns, reps uint8, hello bool, data []byte) {
		for i, mark := range fuzzKeyMarks {
			data = bytes.ReplaceAll(data, mark, keys[i][:])
		}
		msg := bytes.Repeat(data, int(reps)%64+1)
		if len(msg) > 1<<20 {
			msg = msg[:1<<20]
		}
		if hello {
			msg = append(helloBytes(version), msg...)
		}
		n := int(conns)%8 + 1
		outs := make([][]byte, n)
		clean := make([]bool, n)
		var wg sync.WaitGroup
		for i := range n {
			d := net.Dialer{LocalAddr: &net.TCPAddr{IP: net.IPv4(127, 0, 0, byte(2+i%4))}}
			nc, err := d.Dial("tcp", rx.Addr().String())
			if err != nil {
				t.Fatal(err)
			}
			wg.Go(func() {
				defer nc.Close()
				// Far beyond the receiver's timeouts: it must close first.
				nc.SetDeadline(time.Now().Add(10 * time.Second))
				go func() {
					nc.Write(msg) // the receiver may close before taking it all
					nc.(*net.TCPConn).CloseWrite()
				}()
				out, err := io.ReadAll(nc)
				if err != nil && !transport.PeerGone(err) {
					t.Errorf("connection %d: reading the receiver's answers: %v (it did not close the connection)", i, err)
				}
				outs[i], clean[i] = out, err == nil
			})
			if open := rx.PortStats().Open; open > lim.Total {
				t.Fatalf("the port holds %d connections, over its cap of %d", open, lim.Total)
			}
		}
		wg.Wait()
		served(t, rx)
		for i, out := range outs {
			// A connection the port refused, or closed to make room, may
			// have no welcome at all.
			out = checkHandshake(t, out, false, clean[i])
			checkReplies(t, out, clean[i])
		}
		if err := slots.Err(); err != nil {
			t.Fatal(err)
		}
		if p := slots.Pending(); p != 0 {
			t.Fatalf("%d accepted writes were never finished", p)
		}
		for _, gap := range [][2]int{{fuzzSlot1 + fuzzSize1, fuzzSlot2}, {fuzzSlot2 + fuzzSize2, fuzzMem}} {
			if i := bytes.IndexFunc(slots.Mem[gap[0]:gap[1]], func(r rune) bool { return r != 0 }); i >= 0 {
				t.Fatalf("byte %#x outside every slot was written", gap[0]+i)
			}
		}
		s, err := tx.Dial(ctxFor(t, 10*time.Second), rx.Addr().String())
		if err != nil {
			t.Fatalf("a peer's dial after the flood: %v", err)
		}
		defer s.Close()
		w := transport.Write{Src: make([]byte, 64), Remote: fuzzSlot2 + fuzzSize2 - 64, Key: keys[1], Tag: 0xf1}
		if err := s.Write(ctxFor(t, 10*time.Second), w); err != nil && !transport.IsRefusal(err) {
			t.Fatalf("a peer's write after the flood: %v", err)
		}
	})
}
