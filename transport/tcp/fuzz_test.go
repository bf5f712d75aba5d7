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
	"github.com/ferry-project/ferry/transport/peer"
	"github.com/ferry-project/ferry/transport/transporttest"
)

// The receive slots FuzzAcceptedConn writes into: two slots with gaps
// around them, so a byte landing outside a slot shows.
const (
	fuzzMem              = 64 << 10
	fuzzSlot1, fuzzSize1 = 0, 4096
	fuzzSlot2, fuzzSize2 = 8192, 8192
	fuzzMaxWrite         = 1 << 20
)

// Placeholders a seed writes where a slot's key goes (4 bytes standing
// for the 20 of a key): the keys are random.
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
	cfg := peer.Config{Sink: slots, IOTimeout: 2 * time.Second, HandshakeTimeout: 2 * time.Second, MaxWrite: fuzzMaxWrite}
	open := listen(f, cfg)
	cfg.Secret = fuzzSecret
	locked := listen(f, cfg)
	// The dialer of the authenticated handshakes.
	authed := listen(f, peer.Config{Sink: transporttest.NewSlots(0), HandshakeTimeout: 10 * time.Second, Secret: fuzzSecret})
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
		var nc net.Conn
		var err error
		if mode == fuzzAfterAuth {
			nc, _, err = authed.port.Dial(ctxFor(t, 10*time.Second), rx.Addr().String(), peer.KindData)
		} else {
			nc, err = net.Dial("tcp", rx.Addr().String())
		}
		if err != nil {
			t.Fatal(err)
		}
		defer nc.Close()
		// The receiver must close within its timeouts once the sender
		// has nothing more to say; 10 s is far beyond them.
		nc.SetDeadline(time.Now().Add(10 * time.Second))
		go func() {
			nc.Write(data) // the receiver may close before taking it all
			nc.(*net.TCPConn).CloseWrite()
		}()
		out, err := io.ReadAll(nc)
		if err != nil && !transport.PeerGone(err) {
			t.Fatalf("reading the receiver's answers: %v (it did not close the connection)", err)
		}
		transporttest.Served(t, rx.PortStats)
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
// secret; a verdict when the client announced one too), reading the
// records as peer/wire.go's notes lay them out, and returns what
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
	// A refused hello's welcome echoes the kind asked for, known or not:
	// only magic and version must be the receiver's own.
	if string(out[:4]) != "FERY" || binary.LittleEndian.Uint32(out[4:]) != version {
		t.Fatalf("receiver's welcome is malformed: magic %q, version %d", out[:4], binary.LittleEndian.Uint32(out[4:]))
	}
	auth := binary.LittleEndian.Uint32(out[20:])&flagAuth != 0
	status := binary.LittleEndian.Uint32(out[24:])
	out = out[welcomeSize:]
	if auth {
		if len(out) < nonceSize {
			if complete {
				t.Fatalf("receiver sent %d bytes of its %d-byte nonce", len(out), nonceSize)
			}
			return nil
		}
		out = out[nonceSize:]
	}
	if status != statusOK {
		if len(out) > 0 {
			t.Fatalf("receiver refused the handshake (status %d) yet sent %d more bytes", status, len(out))
		}
		return nil
	}
	if !auth {
		return out
	}
	// A client that sent no whole nonce, dialed address and proof gets no
	// verdict, unless the dialed address's length is out of bounds.
	if len(out) < verdictSize {
		if complete && len(out) > 0 {
			t.Fatalf("receiver sent %d bytes of its %d-byte verdict", len(out), verdictSize)
		}
		return nil
	}
	verdict := out[:verdictSize]
	out = out[verdictSize:]
	vstatus := binary.LittleEndian.Uint32(verdict)
	refusal := vstatus == statusBadProof || vstatus == statusNotHere || vstatus == statusBadDialed
	if vstatus != statusOK && (!refusal || bytes.ContainsFunc(verdict[4:], func(r rune) bool { return r != 0 }) || len(out) > 0) {
		t.Fatalf("receiver's refusal is malformed: verdict %x and %d more bytes", verdict, len(out))
	}
	return out
}

// checkReplies parses any number of well-formed replies. Unless
// complete, the last one may be cut short.
func checkReplies(t *testing.T, out []byte, complete bool) {
	t.Helper()
	for len(out) > 0 {
		if !complete && (len(out) < peer.ReplySize || len(out) < peer.ReplySize+int(binary.LittleEndian.Uint16(out[6:]))) {
			return
		}
		if len(out) < peer.ReplySize {
			t.Fatalf("receiver sent a %d-byte fragment of a reply: %x", len(out), out)
		}
		code, flags, n, err := peer.DecodeReply((*[peer.ReplySize]byte)(out[:peer.ReplySize]))
		if err != nil || len(out) < peer.ReplySize+n {
			t.Fatalf("receiver sent a malformed reply %x: %v", out, err)
		}
		msg := string(out[peer.ReplySize : peer.ReplySize+n])
		if code != transport.OK && (msg == "" || !strings.ContainsFunc(msg, func(r rune) bool { return r != ' ' })) {
			t.Fatalf("refusal %s carries no message", code)
		}
		out = out[peer.ReplySize+n:]
		if flags&peer.FlagClose != 0 && len(out) > 0 {
			t.Fatalf("receiver sent %d bytes after a reply that closes the connection", len(out))
		}
	}
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
	rx := listen(f, peer.Config{Sink: slots, IOTimeout: 2 * time.Second, HandshakeTimeout: 2 * time.Second, MaxWrite: fuzzMaxWrite, Limits: lim})
	tx := listen(f, peer.Config{Sink: transporttest.NewSlots(0), HandshakeTimeout: 5 * time.Second, IOTimeout: 5 * time.Second})
	header := func(addr, n uint64, key string) []byte {
		b := binary.LittleEndian.AppendUint64(nil, addr)
		b = binary.LittleEndian.AppendUint64(b, n)
		b = append(b, key...)
		return binary.LittleEndian.AppendUint32(b, 7)
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
		transporttest.Served(t, rx.PortStats)
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
		if _, err := s.Write(ctxFor(t, 10*time.Second), w); err != nil && !transport.IsRefusal(err) {
			t.Fatalf("a peer's write after the flood: %v", err)
		}
	})
}
