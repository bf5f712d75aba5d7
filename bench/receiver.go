package bench

import (
	"context"

	"github.com/ferry-project/ferry/api"
	"github.com/ferry-project/ferry/client"
	"github.com/ferry-project/ferry/mooncake"
)

// receiver is where a transfer run's sends land: a ferryd's receive
// slots, or a Mooncake segment's buffer.
type receiver interface {
	op() string // the rows' Op
	// room is the free memory slots can take, and their alignment.
	room(ctx context.Context) (free, align int64, err error)
	// slot is where the i-th send of a round goes.
	slot(ctx context.Context, id string, i int, sz int64) (api.SendRequest, error)
	free(ctx context.Context, id string) error
	// read returns what arrived in a slot.
	read(ctx context.Context, id string, slot api.SendRequest, sz int64) ([]byte, error)
}

type ferryReceiver struct{ c *client.Client }

func (f ferryReceiver) op() string { return "send" }

func (f ferryReceiver) room(ctx context.Context) (int64, int64, error) {
	st, err := f.c.Status(ctx)
	return st.Memory.Free, st.Memory.Alignment, err
}

func (f ferryReceiver) slot(ctx context.Context, id string, _ int, sz int64) (api.SendRequest, error) {
	s, err := f.c.Receive(ctx, id, sz)
	return api.SendRequest{Session: s.Session, BufferAddress: s.BufferAddress, Key: s.Key, NBytes: s.NBytes}, err
}

func (f ferryReceiver) free(ctx context.Context, id string) error { return f.c.FreeReceive(ctx, id) }

func (f ferryReceiver) read(ctx context.Context, id string, _ api.SendRequest, _ int64) ([]byte, error) {
	return f.c.Wait(ctx, id, 0)
}

// MooncakeTarget is a Mooncake segment with one registered buffer that a
// run writes into: the i-th send of a round goes to the i-th block of
// the buffer. It is read back with a Mooncake READ.
type MooncakeTarget struct {
	Segment string // "ip:rpcport"
	Base    uint64
	Length  int64
}

// mooncakeAlign keeps blocks apart as a receiver's arena would.
const mooncakeAlign = 256

func (m *MooncakeTarget) op() string { return "send_mooncake" }

func (m *MooncakeTarget) room(context.Context) (int64, int64, error) {
	return m.Length, mooncakeAlign, nil
}

func (m *MooncakeTarget) slot(_ context.Context, _ string, i int, sz int64) (api.SendRequest, error) {
	per := (sz + mooncakeAlign - 1) / mooncakeAlign * mooncakeAlign
	return api.SendRequest{Session: mooncake.Scheme + m.Segment, BufferAddress: m.Base + uint64(int64(i)*per)}, nil
}

func (m *MooncakeTarget) free(context.Context, string) error { return nil }

func (m *MooncakeTarget) read(ctx context.Context, _ string, slot api.SendRequest, sz int64) ([]byte, error) {
	seg, err := mooncake.FetchSegment(ctx, m.Segment, &mooncake.Segment{Name: "ferrybench", Protocol: "tcp"})
	if err != nil {
		return nil, err
	}
	buf := make([]byte, sz)
	err = mooncake.Read(ctx, mooncake.Request{Data: seg.DataAddr(m.Segment), Addr: slot.BufferAddress, Buf: buf, V2: seg.TCPProtoVersion >= 2})
	return buf, err
}
