// Package transport defines what ferry needs from a data plane: one-sided
// writes with RDMA semantics. A sender writes n bytes from local memory to
// (remote address, key) on a session with a peer daemon, carrying a 32-bit
// tag (the width of an RDMA immediate) that the receiver sees on completion.
// The receiver accepts a write only into the live receive slot whose key it
// carries (a Key: a 120-bit capability, compared whole), and only inside
// that slot. Implementations:
// transport/tcp (everywhere) and rdma (verbs), both over the peer
// protocol of transport/peer. Each must pass the conformance suite in
// transport/transporttest.
package transport

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"syscall"
	"time"
)

// Sink is the receiving side's memory: the daemon's live receive slots.
// A transport calls Accept for each incoming write before placing any byte.
type Sink interface {
	// Accept runs on the receive path (Transport.Close waits for it), so it
	// must not block for long. It checks a write of n bytes at addr carrying
	// key and tag, and
	// returns the memory the bytes go to (len(dst) == n). The transport
	// must call done exactly once: with nil when all n bytes are in dst,
	// or with the error that stopped the write. Until done returns the slot
	// stays pinned, so freeing it cannot hand its memory to a newer slot.
	// A refusal is an *Refusal naming what was wrong.
	Accept(addr, n uint64, key Key, tag uint32) (dst []byte, done func(error), err error)
}

// DirectSink is a Sink that also takes writes nothing announced: RDMA
// WRITE WITH IMM straight into a slot, which rdma's arena-rkey mode lets
// authenticated peers post without asking first, for a Write marked
// Whole. Accept never sees such a write: its bytes are in place before
// the receiver hears of it, and all it hears is the immediate (the tag,
// which must be the slot key's Tag) and how many bytes the write placed.
// A slot's address must be the address of its first byte in this
// process, where the NIC places it.
type DirectSink interface {
	Sink
	// Arrived takes n bytes, already placed from its first byte on, as
	// the whole content of the live slot whose key's Tag is tag: the
	// slot arrives. A Refusal says why the bytes count for nothing: no
	// live slot has that tag (it was freed, or never was), the slot
	// holds its data already (a resend), or n is not its size (a write
	// longer than the slot ran past it). Like Accept it must not block
	// for long.
	Arrived(tag uint32, n uint64) error
}

// InPlaceSink is a Sink whose slots may lie in device memory the host
// cannot address (a GPU arena) that the transport registered with its
// NIC itself: rdma's GPU registration. A write there lands where it is
// addressed, with no host memory in between.
type InPlaceSink interface {
	Sink
	// AcceptInPlace is Accept for a write the NIC places at addr itself:
	// the same checks and the same done, and no dst. A slot whose bytes
	// are neither the arena's nor a device region's the transport
	// registered (RegionRegistrar.RegisterDeviceRegion) is refused: the
	// transport reaches only the memory it registered.
	AcceptInPlace(addr, n uint64, key Key, tag uint32) (done func(error), err error)
}

// EngineSink is an InPlaceSink that lends device memory a Mooncake
// engine registered (a CUDA region with an engine's address: ferryd's
// GPU engine memory), which a peer's write names at the engine's own
// address with the engine's key, while the transport registered it at
// the daemon's device address of it (rdma's RegisterEngineDevice).
type EngineSink interface {
	InPlaceSink
	// AcceptEngine is AcceptInPlace for a write addressed at an engine's
	// address: in false (and no error) when key is no engine's, or the
	// bytes are not wholly in one of its GPU regions registered so (the
	// write then goes through Accept); else at is where they land, the
	// daemon's device address of addr, with done as Accept's.
	AcceptEngine(addr, n uint64, key Key, tag uint32) (at uint64, done func(error), in bool, err error)
}

// ChunkSink is a Sink whose slots may lie in memory the host cannot
// address (a GPU arena, a CUDA region), which it fills by copies from
// host staging. A transport that reads a write's bytes off a stream in
// order (TCP) lands them through AcceptChunks: a write then holds one
// chunk of staging (ferryd's: 16 MiB) at a time, where Accept would
// lend staging for all n bytes at once. Host memory is lent as itself,
// in one piece, with no copy.
type ChunkSink interface {
	Sink
	// AcceptChunks is Accept for a write whose bytes the transport
	// reads in order: the same checks and refusals, the same pinning
	// and the same done, which the transport calls with nil once body
	// lent its last (empty) piece, or with the error that stopped the
	// write.
	AcceptChunks(addr, n uint64, key Key, tag uint32) (body Body, done func(error), err error)
}

// Body lends the memory an accepted write's bytes go to, a piece at a
// time: each call puts the bytes of the piece it lent before in place
// (the transport must have written all of them), then lends the next;
// an empty piece says all the write's bytes are in place. An error is
// the receiver's failure to place them (a copy into GPU memory failed),
// not the path's: the transport tells the sender (ReadBody returns it
// as a *PlaceError) and calls done with it.
type Body func() ([]byte, error)

// Whole is the Body of memory that takes a write's bytes where they
// lie: dst, in one piece.
func Whole(dst []byte) Body {
	return func() ([]byte, error) {
		piece := dst
		dst = nil
		return piece, nil
	}
}

// PlaceError is a write's bytes that the receiver read but could not put
// in place (Body's error): the sender's stream is in step, and it may
// be told why.
type PlaceError struct{ Err error }

func (e *PlaceError) Error() string { return e.Err.Error() }
func (e *PlaceError) Unwrap() error { return e.Err }

// IOChunk is how much of a write's bytes moves under one deadline, so a
// long write that keeps making progress never times out.
const IOChunk = 1 << 20

// Stream is what ReadBody reads from: a connection, or a request body
// with its connection's read deadline.
type Stream interface {
	io.Reader
	SetReadDeadline(time.Time) error
}

// ReadBody reads a write's n bytes from c into the pieces body lends,
// IOChunk bytes under each read deadline of timeout. A body whose
// pieces do not add up to n bytes, or that fails to place them, is a
// *PlaceError.
func ReadBody(c Stream, n uint64, body Body, timeout time.Duration) error {
	var got uint64
	for {
		piece, err := body()
		switch {
		case err != nil:
			return &PlaceError{err}
		case uint64(len(piece)) > n-got:
			return &PlaceError{fmt.Errorf("the receiver lent %d bytes for the next piece of a %d-byte write with %d bytes left", len(piece), n, n-got)}
		case len(piece) == 0 && got < n:
			return &PlaceError{fmt.Errorf("the receiver took %d bytes of a %d-byte write as all of it", got, n)}
		case len(piece) == 0:
			return nil
		}
		for off := 0; off < len(piece); {
			c.SetReadDeadline(time.Now().Add(timeout))
			m, err := io.ReadFull(c, piece[off:min(off+IOChunk, len(piece))])
			off += m
			got += uint64(m)
			if err != nil {
				return fmt.Errorf("read %d of a %d-byte body: %w", got, n, err)
			}
		}
	}
}

// Windows makes NIC-enforced windows over receive slots (rdma's windows
// mode): a peer writes a slot's bytes through its window's rkey, and the
// NIC refuses any byte outside them, and any write once it is closed.
type Windows interface {
	// Open makes a window over [addr, addr+n), on the rail (RDMA NIC)
	// nearest the memory's device, and returns it once the NIC enforces
	// it.
	Open(addr, n uint64) (Window, error)
	// Close invalidates w: once it returns, nothing lands through it,
	// and its memory may be reused. After an error the window may still
	// be open: keep its memory out of use.
	Close(w Window) error
}

// Window is a memory window over a slot: the rail it is bound on (the
// index of the receiver's RDMA NIC) and its rkey there. A slot's key
// names both (Key.WithWindowOn).
type Window struct {
	Rail uint8
	RKey uint32
}

// WindowSink is a DirectSink that puts a window over each slot: given
// the transport's Windows (UseWindows, once, before any slot is made),
// it opens one over every slot in the transport's memory as it makes
// it, names it in the slot's key (Key.WithWindowOn), and closes it before
// the slot's memory goes to another. A transport whose NIC has no
// windows never calls UseWindows.
type WindowSink interface {
	DirectSink
	UseWindows(Windows)
}

// RegionRegistrar is a Transport that reaches memory a client lent the
// daemon (a region: host memory the daemon mapped, or device memory it
// opened) once it registered it: rdma, which registers it with its NIC
// as it did the arena. Writes whose Src (or, for device memory, Device)
// lies in it, and writes into slots in it, then go without a copy. A
// transport that reads and writes host memory as it lies (TCP) needs
// none. The handle's Close drops the registration: only once no write
// from or into the memory is in flight and every window over it is
// closed.
type RegionRegistrar interface {
	RegisterRegion(mem []byte) (io.Closer, error)
	// RegisterDeviceRegion registers device memory the host cannot
	// address (a CUDA region, at its device pointer), which the
	// transport reaches only where it reaches its GPU arena in place:
	// writes from it then carry Device, and writes into its slots land
	// through AcceptInPlace.
	RegisterDeviceRegion(r Range) (io.Closer, error)
}

// Write is one one-sided write.
type Write struct {
	Src []byte // local bytes to send
	// Device, when Src is nil, is the source in device memory the host
	// cannot address (a GPU arena's, a CUDA region's): only a transport
	// that registered
	// that memory with its NIC reaches it (rdma's GPU registration); any
	// other Session refuses it with ErrHostOnly, and the caller copies
	// the bytes out to host memory first.
	Device Range
	Remote uint64 // destination address in the peer's arena
	Key    Key    // the receive slot's key
	Tag    uint32 // delivered to the receiver with the completion
	// Whole is the caller's word that Src is its slot's whole content:
	// Remote is the slot's address and Src as long as the slot (a send
	// of a staged embedding). A transport may then carry it with no
	// message per write (rdma's direct writes), the receiver knowing it
	// only by its tag and length. Pieces of a slot leave it false: a
	// resent piece must count once, which takes its range.
	Whole bool
}

// Len is the number of bytes w carries.
func (w *Write) Len() int {
	if w.Src == nil {
		return int(w.Device.Len)
	}
	return len(w.Src)
}

// Range is Len bytes of device memory at address Addr.
type Range struct {
	Addr, Len uint64
}

// ErrHostOnly is a write whose source is device memory (Write.Device) on
// a session that reads host memory only.
var ErrHostOnly = errors.New("this session reads host memory only: copy a device source out to host memory first")

// Transport is one data plane: a listener on the peer port that delivers
// incoming writes into its Sink, and a dialer of sessions to peers.
type Transport interface {
	Name() string
	// Addr is the peer-port listener's address.
	Addr() net.Addr
	// Dial opens a session to the peer daemon listening at addr
	// (host:port). The handshake runs before Dial returns.
	Dial(ctx context.Context, addr string) (Session, error)
	// Close stops the listener and ends every connection, in both
	// directions; writes in flight fail.
	Close() error
}

// Session is an open path to one peer. It is safe for concurrent use:
// concurrent writes do not wait behind one another's bytes.
type Session interface {
	// Transport names the data plane the session runs on: an rdma
	// transport's session to a peer without RDMA is a "tcp" one.
	Transport() string
	Peer() string
	// PeerInstance identifies the peer daemon's process; it changes when
	// the peer restarts.
	PeerInstance() uint64
	// Write returns once the peer has placed every byte (a completion),
	// with what the write took, or with an error. ctx bounds the whole
	// write; the error wraps ctx.Err() when ctx ended it, and ErrClosed
	// when the session or transport was closed. An error that is not a
	// Refusal does not prove the bytes did not land (the completion may be
	// what was lost), so a retry can meet a slot that already holds its
	// data.
	Write(ctx context.Context, w Write) (Report, error)
	Close() error
}

// Read is one piece of a read from a peer's memory: len(Dst) bytes at
// Addr of the memory its Key lets the reader read.
type Read struct {
	Addr uint64
	Key  Key
	Dst  []byte
}

// Reader is a Session that also reads from its peer: only memory the
// peer serves under a key (a ferry engine's registered memory, under its
// segment's key: Source), never its arena or slots. Read returns once
// every piece is in its Dst, or with the first piece's error: a
// *Refusal when the peer would not serve it (out_of_bounds: the range
// lies outside the memory the key names; no_slot: no memory has that
// key).
type Reader interface {
	Read(ctx context.Context, reads []Read) error
}

// Source is a Sink whose daemon serves reads too. ReadKeyed checks a
// read of n bytes at addr carrying key and returns the bytes, pinned
// until done is called; a refusal is a *Refusal naming what was wrong.
// Like Accept it must not block for long.
type Source interface {
	ReadKeyed(addr, n uint64, key Key) (src []byte, done func(), err error)
}

// Report is what a completed write took on the sending side.
type Report struct {
	// Registration is how the NIC reached the source.
	Registration Registration
	// Copied is the bytes the CPU copied for the write (through a bounce
	// buffer registered once): 0 when the NIC or the kernel read the
	// source where it lay.
	Copied int64
	// Messages is how many messages of its transport's protocol the write
	// exchanged with the receiver besides its bytes: a header and its
	// reply on ferry's peer protocol, a header and a status word on
	// Mooncake's TCP (the header alone in its version 1), none on
	// Mooncake's RDMA.
	Messages int
}

// Registration is how a write's source reached the NIC.
type Registration uint8

const (
	// RegisteredNone: the write registered nothing (a TCP write, or a
	// copy through a buffer registered once).
	RegisteredNone Registration = iota
	// RegisteredShared: the source lies inside a registration made
	// once: the daemon's memory's, or a region's (RegionRegistrar).
	RegisteredShared
	// RegisteredPerSend: the source was registered for this write, and
	// deregistered after it.
	RegisteredPerSend
)

// Code is a receiver's answer to a write, as carried on the wire.
type Code uint32

const (
	OK           Code = 0
	NoSlot       Code = 1 // no live receive slot at that address with that key
	OutOfBounds  Code = 3 // the write runs past the end of its slot, or is empty
	SlotBusy     Code = 4 // the slot already has a write landing
	ShuttingDown Code = 5 // the receiver is stopping
	Internal     Code = 6
)

// codeNames names the codes this release knows.
var codeNames = map[Code]string{
	OK: "ok", NoSlot: "no_slot", OutOfBounds: "out_of_bounds", SlotBusy: "slot_busy",
	ShuttingDown: "shutting_down", Internal: "internal",
}

// String is c's name, or code_<n> for a code this release does not know
// (a newer receiver's, or a hostile one's: any of 2^32).
func (c Code) String() string {
	if name, ok := codeNames[c]; ok {
		return name
	}
	return fmt.Sprintf("code_%d", uint32(c))
}

// Label is c as a metric labels it: its name, or "other" for a code this
// release does not know, so that a receiver cannot make new series.
func (c Code) Label() string {
	if name, ok := codeNames[c]; ok {
		return name
	}
	return "other"
}

// Refusal is a write (or a read) the peer would not serve, with its reason.
// The Sink returns it; a sender sees it back from Session.Write.
type Refusal struct {
	Code    Code
	Message string
}

func (r *Refusal) Error() string {
	return fmt.Sprintf("refused by the peer (%s): %s", r.Code, r.Message)
}

// ErrClosed is returned for work on a closed transport or session.
var ErrClosed = errors.New("transport closed")

// ErrAuth is wrapped by a dial the peer handshake refused for want of a
// shared secret (one side has none, or they differ). Unlike a broken
// path, re-dialing cannot fix it: the daemons' configuration must change.
var ErrAuth = errors.New("peer authentication failed")

// ErrStalled is wrapped by a write that waited io_timeout for a peer
// whose connection is sound (its NIC still acknowledges) while its daemon
// took nothing: stopped, or starved of CPU. Tearing the session down and
// re-dialing cannot help, and would fail the writes waiting behind it
// for another reason; the session carries on once the peer does.
var ErrStalled = errors.New("the peer's daemon made no progress")

// ErrIncompatible is wrapped by a dial whose peer speaks another protocol
// (another ferry version, or no ferry at all). Like ErrAuth, no re-dial
// fixes it.
var ErrIncompatible = errors.New("incompatible peer")

// IsRefusal reports whether err is a receiver's refusal, as opposed to a
// broken path (which a retry on a fresh session may fix).
func IsRefusal(err error) bool {
	var r *Refusal
	return errors.As(err, &r)
}

// PeerGone reports whether err says the peer closed or reset the
// connection (as opposed to a timeout or a local failure).
func PeerGone(err error) bool {
	return errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) ||
		errors.Is(err, syscall.EPIPE) || errors.Is(err, syscall.ECONNRESET)
}

// StatusName is the name the NIC gave the failure in err's chain (a verbs
// completion status, "RETRY_EXC_ERR"), or "" when none did. A transport's
// error carries one by a StatusName method; the daemon reports it as a
// failed transfer's ret.
func StatusName(err error) string {
	var named interface{ StatusName() string }
	if errors.As(err, &named) {
		return named.StatusName()
	}
	return ""
}

// ContextErr is ctx.Err(), but also DeadlineExceeded once the deadline has
// passed: a connection deadline set from ctx can fire before ctx's own
// timer does.
func ContextErr(ctx context.Context) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	if d, ok := ctx.Deadline(); ok && !time.Now().Before(d) {
		return context.DeadlineExceeded
	}
	return nil
}
