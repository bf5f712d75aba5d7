package peer

import (
	"fmt"

	"github.com/ferry-project/ferry/transport"
)

// ErrUnmatched ends a connection that sent MaxUnmatched writes matching no
// receive slot: a sender guessing keys, or one holding many stale slots.
var ErrUnmatched = fmt.Errorf("closed the connection after %d writes that matched no receive slot (keys guessed, or slots long gone)", MaxUnmatched)

// Gate admits the writes announced on one accepted connection: within
// the size limit, and into what the Sink accepts. A connection that keeps
// sending writes no slot matches is closed.
type Gate struct {
	sink      transport.Sink
	maxWrite  uint64
	what      string // the connection, as errors name it: "connection", "lane"
	unmatched int    // writes refused for matching no slot
}

// Gate makes the gate of an accepted connection (what: "connection",
// "lane").
func (p *Port) Gate(what string) *Gate {
	return &Gate{sink: p.cfg.Sink, maxWrite: p.cfg.MaxWrite, what: what}
}

// Refused is a write a gate turned away: the reply it gets and, when
// End is set, why the connection closes after that reply (the reply
// carries FlagClose).
type Refused struct {
	Code transport.Code
	Msg  string
	End  error
}

// Flags are the reply's flags.
func (r *Refused) Flags() uint16 {
	if r.End != nil {
		return FlagClose
	}
	return 0
}

// Admit checks h. An accepted write gets the memory its bytes go to and
// the done the Sink's Accept gave; a refused one, what to reply.
func (g *Gate) Admit(h *Header) (dst []byte, done func(error), refused *Refused) {
	refused = g.admit(h, func() (err error) {
		dst, done, err = g.sink.Accept(h.Addr, h.Len, h.Key, h.Tag)
		if err == nil && uint64(len(dst)) != h.Len {
			err = fmt.Errorf("sink gave %d bytes of memory for a %d-byte write", len(dst), h.Len)
			done(err)
		}
		return err
	})
	if refused != nil {
		return nil, nil, refused
	}
	return dst, done, nil
}

// AdmitBody is Admit for a transport that reads a write's bytes off a
// stream in order: through the Sink's AcceptChunks where it has one
// (memory the host cannot address then takes host staging a chunk at a
// time), else Accept's memory as one piece.
func (g *Gate) AdmitBody(h *Header) (body transport.Body, done func(error), refused *Refused) {
	cs, ok := g.sink.(transport.ChunkSink)
	if !ok {
		dst, done, refused := g.Admit(h)
		if refused != nil {
			return nil, nil, refused
		}
		return transport.Whole(dst), done, nil
	}
	refused = g.admit(h, func() (err error) {
		body, done, err = cs.AcceptChunks(h.Addr, h.Len, h.Key, h.Tag)
		return err
	})
	if refused != nil {
		return nil, nil, refused
	}
	return body, done, nil
}

// AdmitInPlace is Admit for a write the transport's NIC places where h
// addresses it, in memory the transport registered (sink's
// AcceptInPlace): no host memory is handed out.
func (g *Gate) AdmitInPlace(h *Header, sink transport.InPlaceSink) (done func(error), refused *Refused) {
	refused = g.admit(h, func() (err error) {
		done, err = sink.AcceptInPlace(h.Addr, h.Len, h.Key, h.Tag)
		return err
	})
	if refused != nil {
		return nil, refused
	}
	return done, nil
}

// AdmitEngine is AdmitInPlace for a write into device memory an engine
// registered, addressed at the engine's address (sink's AcceptEngine):
// in false when h is no such write, for Admit to take.
func (g *Gate) AdmitEngine(h *Header, sink transport.EngineSink) (at uint64, done func(error), in bool, refused *Refused) {
	refused = g.admit(h, func() (err error) {
		at, done, in, err = sink.AcceptEngine(h.Addr, h.Len, h.Key, h.Tag)
		return err
	})
	return at, done, in, refused
}

// admit checks h's size, then runs accept: nil, or what to reply.
func (g *Gate) admit(h *Header, accept func() error) *Refused {
	if h.Len > g.maxWrite {
		return &Refused{Code: transport.OutOfBounds,
			Msg: fmt.Sprintf("write of %d bytes exceeds this receiver's limit of %d bytes", h.Len, g.maxWrite),
			End: fmt.Errorf("refused a write of %d bytes (limit %d) and closed the %s", h.Len, g.maxWrite, g.what)}
	}
	err := accept()
	if err == nil {
		return nil
	}
	code, msg := Refusal(err)
	return &Refused{Code: code, Msg: msg, End: g.Unmatched(err)}
}

// Refusing is what to reply to a read the daemon refused with err (its
// code, flags and message), and the error that ends the connection when
// it was the MaxUnmatched-th guess (Unmatched), else nil.
func (g *Gate) Refusing(err error) (transport.Code, uint16, string, error) {
	code, msg := Refusal(err)
	end := g.Unmatched(err)
	flags := uint16(0)
	if end != nil {
		flags = FlagClose
	}
	return code, flags, msg, end
}

// ReadTooLarge is the refusal of a read of n bytes above limit (its
// message, and the error that ends the connection), or "" and nil.
func ReadTooLarge(n, limit uint64) (string, error) {
	if n <= limit {
		return "", nil
	}
	return fmt.Sprintf("a read of %d bytes exceeds this daemon's limit of %d bytes: read smaller pieces", n, limit),
		fmt.Errorf("refused a read of %d bytes (limit %d) and closed the connection", n, limit)
}

// Unmatched counts a write the Sink refused (err) when it matched no
// slot, whether announced (Admit) or placed before the receiver heard of
// it (rdma's direct writes): the MaxUnmatched-th ends the connection,
// with ErrUnmatched, so a sender guessing keys or tags pays a connection
// per MaxUnmatched guesses. Nil otherwise.
func (g *Gate) Unmatched(err error) error {
	if code, _ := Refusal(err); code == transport.NoSlot {
		if g.unmatched++; g.unmatched >= MaxUnmatched {
			return ErrUnmatched
		}
	}
	return nil
}
