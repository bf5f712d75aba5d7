package api

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"time"
)

// TransferRequest: POST /v1/transfers. One call moves many pieces (a KV
// cache's pages, scattered) and completes once; it is answered at once
// with the transfer's id, and runs in the background.
type TransferRequest struct {
	// Sources are where pieces are read: staged req_ids (or regions).
	Sources []TransferSource `json:"sources"`
	// Destinations are receive slots, each as its receiver's
	// POST /v1/receives gave it (session, buffer_address and key; the
	// rest of the descriptor may come along and is checked against).
	Destinations []ReceiveSlot `json:"destinations"`
	// Items are the pieces, each five integers: [source index, source
	// offset, destination index, destination offset, nbytes]. Arrays
	// rather than objects keep a batch of thousands a small body.
	Items Items `json:"items"`
	// KeepSources leaves the staged sources staged after the transfer
	// succeeds; by default they are freed, as a send frees its entry.
	// A failed transfer always leaves them staged.
	KeepSources bool `json:"keep_sources,omitempty"`
}

// Limits on one POST /v1/transfers, checked as its body is read: past
// one, reading stops and the transfer is refused whole (too_large), so
// that no body makes ferryd hold more than these, however it is written.
const (
	// MaxTransferBody is the most bytes a transfer's body may have.
	MaxTransferBody = 16 << 20
	// MaxTransferItems is the most items one transfer carries: 16 MiB
	// of items of 16 bytes each. Real items are longer (offsets past a
	// few digits: [0,1048576,0,2097152,65536], is 28 bytes), so their
	// body reaches MaxTransferBody first; only items of single digits
	// such as [0,0,0,0,1], reach this count first, which bounds what
	// reading a body of them holds (some 64 MiB).
	MaxTransferItems = 1 << 20
	// MaxTransferSources and MaxTransferDestinations are the most
	// sources and destinations one transfer lists: far more than a
	// batch of pages needs (a source per staged entry or region, a
	// destination per receive slot), and few enough that a body of
	// [{},{},...] (3 bytes each, some 100 once read) is not half a
	// gigabyte.
	MaxTransferSources      = 1 << 16
	MaxTransferDestinations = 1 << 16
)

// LimitError is a request past one of the limits above; the message
// names the limit and says to split the transfer.
type LimitError struct{ msg string }

func (e *LimitError) Error() string { return e.msg }

func tooMany(n int, what string) error {
	return &LimitError{msg: fmt.Sprintf(
		"the transfer lists more than %d %s, the most one transfer may: split it into several transfers", n, what)}
}

// UnmarshalJSON reads a transfer's body with its sources and
// destinations counted as they are read, refusing past
// MaxTransferSources and MaxTransferDestinations (Items counts its own).
// Unknown fields are refused, in the body and in each source and
// destination; field names match ignoring case, as encoding/json's do.
// It walks the object itself, handing each field's bytes to its reader:
// a json.Decoder would scan the items twice more before their parser.
func (r *TransferRequest) UnmarshalJSON(b []byte) error {
	p := itemParser{b: b}
	p.space()
	if p.lit("null") {
		return nil // leaves it as it was, as encoding/json does
	}
	if !p.byte('{') {
		return fmt.Errorf("a transfer is a JSON object of sources, destinations and items")
	}
	for first := true; ; first = false {
		p.space()
		if p.byte('}') {
			return nil
		}
		if !first && !p.byte(',') {
			return fmt.Errorf("a comma or } must follow a field of the transfer (at byte %d)", p.i)
		}
		p.space()
		key, ok := p.str()
		if p.space(); !ok || !p.byte(':') {
			return fmt.Errorf("a field name and : expected (at byte %d)", p.i)
		}
		p.space()
		v, ok := p.value()
		if !ok {
			return fmt.Errorf("the value of %q is cut short", key)
		}
		var err error
		switch {
		case strings.EqualFold(key, "sources"):
			r.Sources, err = decodeList[TransferSource](v, "source", "sources", MaxTransferSources)
		case strings.EqualFold(key, "destinations"):
			r.Destinations, err = decodeList[ReceiveSlot](v, "destination", "destinations", MaxTransferDestinations)
		case strings.EqualFold(key, "items"):
			err = r.Items.UnmarshalJSON(v)
		case strings.EqualFold(key, "keep_sources"):
			if err = json.Unmarshal(v, &r.KeepSources); err != nil {
				err = fmt.Errorf("keep_sources: %w", err)
			}
		default:
			err = fmt.Errorf("json: unknown field %q", key)
		}
		if err != nil {
			return err
		}
	}
}

// decodeList reads a JSON array of objects element by element, refusing
// it once it holds more than most.
func decodeList[T any](b []byte, one, many string, most int) ([]T, error) {
	dec := json.NewDecoder(bytes.NewReader(b))
	dec.DisallowUnknownFields()
	tok, err := dec.Token()
	switch {
	case err != nil:
		return nil, err
	case tok == nil:
		return nil, nil
	case tok != json.Delim('['):
		return nil, fmt.Errorf("%s must be an array of objects, not %v", many, tok)
	}
	out := []T{}
	for dec.More() {
		if len(out) == most {
			return nil, tooMany(most, many)
		}
		var v T
		if err := dec.Decode(&v); err != nil {
			return nil, fmt.Errorf("%s %d: %w", one, len(out), err)
		}
		out = append(out, v)
	}
	_, err = dec.Token() // the closing ]
	return out, err
}

// TransferSource names one source of a transfer's pieces: a staged
// req_id, or a region (exactly one of the two).
type TransferSource struct {
	ReqID  string `json:"req_id,omitempty"` // a staged embedding
	Region string `json:"region,omitempty"` // a registered region
}

// The fields of an item, in order.
const (
	ItemSource = iota
	ItemSourceOffset
	ItemDestination
	ItemDestinationOffset
	ItemNBytes
	ItemFields
)

// itemFieldNames names an item's fields, in order, for errors.
var itemFieldNames = [ItemFields]string{"source", "source_offset", "destination", "destination_offset", "nbytes"}

// Transfer states.
const (
	TransferRunning = "running"
	TransferDone    = "done"
	TransferFailed  = "failed"
)

// Transfer describes a batch transfer: POST /v1/transfers answers it
// (state running), GET /v1/transfers/{id} and the event stream report it.
type Transfer struct {
	ID    string `json:"transfer_id"`
	State string `json:"state"` // running, done, failed
	Items int    `json:"items"`
	// Writes is how many writes the items became once adjacent pieces
	// (contiguous at both ends) were merged.
	Writes     int     `json:"writes"`
	WritesDone int     `json:"writes_done"`
	NBytes     int64   `json:"nbytes"`
	Millis     float64 `json:"ms,omitempty"` // from start to the end, once ended
	// Error is why a failed transfer failed (its code is refused or
	// transfer_failed); Item is the index of an item that failed.
	Error *Error    `json:"error,omitempty"`
	Item  *int      `json:"item,omitempty"`
	Since time.Time `json:"since"`
}

// Event kinds on GET /v1/events.
const (
	EventArrived        = "arrived"         // a receive slot's data arrived
	EventTransferDone   = "transfer_done"   // a batch transfer delivered every piece
	EventTransferFailed = "transfer_failed" // a batch transfer failed
)

// Event is one thing that happened, in order of Seq.
type Event struct {
	Seq        uint64    `json:"seq"`
	Kind       string    `json:"kind"`
	ReqID      string    `json:"req_id,omitempty"`      // arrived
	TransferID string    `json:"transfer_id,omitempty"` // transfer_*
	NBytes     int64     `json:"nbytes"`
	Error      *Error    `json:"error,omitempty"` // transfer_failed
	Time       time.Time `json:"time"`
}

// Events answers GET /v1/events?after=N&wait=D: the events after seq N,
// waiting up to D for the first. Next is the after= of the following
// call. Missed counts events after N that are no longer kept (the daemon
// keeps the most recent ones): a caller that missed some lists what it
// waits for (GET /v1/receives, GET /v1/transfers/{id}) once.
type Events struct {
	Events []Event `json:"events"`
	Next   uint64  `json:"next"`
	Missed uint64  `json:"missed,omitempty"`
}

// RegionRequest registers memory a client owns: POST /v1/regions, with
// the memory's file descriptor passed beside the request (SCM_RIGHTS on
// the control socket): a memfd sealed against shrinking (F_SEAL_SHRINK),
// so that no one can cut the mapping short under ferryd.
type RegionRequest struct {
	Name   string `json:"name"`
	NBytes int64  `json:"nbytes"` // from the memfd's start (or FDOffset), or from CUDA.Offset
	// FDOffset is where in the memfd the region starts (any byte): ferryd
	// maps only the pages holding [FDOffset, FDOffset+NBytes). ferry's
	// allocator lends one memfd per process, and each registered tensor
	// is a region of it.
	FDOffset int64 `json:"fd_offset,omitempty"`
	// CUDA, instead of a descriptor, lends GPU memory: an allocation on
	// ferryd's GPU, by its IPC handle.
	CUDA *RegionCUDA `json:"cuda,omitempty"`
	// MooncakeAddr, when not 0, opens a memfd region to Mooncake peers'
	// writes at this address, its owner's own virtual address of the
	// memfd's first byte: ferryd's Mooncake segment (tcp) lists
	// [MooncakeAddr, +NBytes) among its buffers, and a write there lands
	// in the region, which its owner maps at that address
	// (ferry.mooncake.TransferEngine's register_memory).
	MooncakeAddr uint64 `json:"mooncake_addr,omitempty"`
	// MooncakeSegment, with MooncakeAddr, lists the region in that engine
	// segment (POST /v1/mooncake/segments) instead of ferryd's own: an
	// engine's segment lists exactly the memory its engine registered.
	MooncakeSegment string `json:"mooncake_segment,omitempty"`
}

// RegionCUDA names GPU memory a client lends: the allocation its IPC
// handle (cuIpcGetMemHandle) names, from Offset in it (a tensor of a
// caching allocator lies inside a larger allocation).
type RegionCUDA struct {
	Device    string `json:"device"`     // "cuda:N", ferryd's own GPU
	IPCHandle []byte `json:"ipc_handle"` // the 64-byte CUipcMemHandle, base64 in JSON
	Offset    int64  `json:"offset"`
}

// Region describes a registered region.
type Region struct {
	Name   string `json:"name"`
	NBytes int64  `json:"nbytes"`
	Kind   string `json:"kind"` // "host" (a memfd) or "cuda"
	// Slots and Uses count the receive slots in it and the transfers and
	// writes using it now; DELETE waits for Uses to end.
	Slots   int       `json:"slots"`
	Uses    int       `json:"uses"`
	Closing bool      `json:"closing,omitempty"`
	Since   time.Time `json:"since"`
	// MooncakeAddr is where Mooncake peers write into it; absent when
	// they do not.
	MooncakeAddr    uint64 `json:"mooncake_addr,omitempty"`
	MooncakeSegment string `json:"mooncake_segment,omitempty"` // the engine segment listing it; absent: ferryd's own
	// NIC says whether the RDMA NIC reaches the region where it lies;
	// absent when the transport is TCP.
	NIC *RegionNIC `json:"nic,omitempty"`
}

// RegionNIC is a region's registration with the RDMA NIC, made once
// when the region is registered. Without it (Error says why) RDMA
// copies the region's writes through bounce and staging buffers. A
// closing region still Registered with an Error is one whose
// registration the NIC would not drop: DELETE it again to retry.
type RegionNIC struct {
	Registered bool   `json:"registered"`
	Error      string `json:"error,omitempty"`
	// NICs, for a device's arena over RDMA, are the NICs its sends go
	// out through (its device's nearest, from the affinity table, that
	// the transport drives); NICsWhy says why a NIC named there is not
	// one of them.
	NICs    []string `json:"nics,omitempty"`
	NICsWhy string   `json:"nics_why,omitempty"`
	// Engine, for memory lent with a mooncake_addr, is its registration
	// for peers' writes and reads at the engine's addresses.
	Engine *RegionEngineNIC `json:"engine,omitempty"`
}

// RegionEngineNIC is the registration of memory an engine registered
// for peers' one-sided writes and reads at the engine's own addresses.
// Where it failed (Error says why) GPU memory is refused when ferryd's
// Mooncake segments speak rdma; over tcp ones, ferry peers' writes into
// it go through host staging.
type RegionEngineNIC struct {
	Registered bool   `json:"registered"`
	Error      string `json:"error,omitempty"`
	// GPU, for GPU memory, is the path it went by (dmabuf or peermem)
	// and why not the others, as status's registration.gpu says for the
	// GPU arena.
	GPU *GPURegistrationStatus `json:"gpu,omitempty"`
}

// Items are a transfer's pieces, each an array of integers (ItemFields
// of them; the daemon checks the count, naming the item). Reading them
// refuses an item with more than ItemFields at its first extra field,
// and more than MaxTransferItems items at the first past the limit.
type Items [][]int64

// UnmarshalJSON reads items with a parser of their one shape: the
// reflection decoder spends about a microsecond an item, which for a
// batch of thousands of pages is as long as moving them. The items'
// integers lie in one array, made once: a batch is one allocation, not
// one an item.
func (it *Items) UnmarshalJSON(b []byte) error {
	p := itemParser{b: b}
	p.space()
	if p.lit("null") {
		*it = nil
		return nil
	}
	if !p.byte('[') {
		return p.fail("items must be an array of [source, source_offset, destination, destination_offset, nbytes] arrays")
	}
	// Each item opens with a [, so there are at most this many.
	most := min(bytes.Count(b[p.i:], []byte{'['}), MaxTransferItems)
	out := make(Items, 0, most)
	fields := make([]int64, 0, most*ItemFields)
	for first := true; ; first = false {
		p.space()
		if p.byte(']') {
			break
		}
		if !first && !p.byte(',') {
			return p.fail("items: a comma or ] must follow item %d", len(out)-1)
		}
		p.space()
		if len(out) == MaxTransferItems {
			return &LimitError{msg: fmt.Sprintf(
				"the transfer has more than %d items, the most one transfer may: split them into several transfers", MaxTransferItems)}
		}
		if !p.byte('[') {
			return p.fail("items: item %d is not an array of integers", len(out))
		}
		start := len(fields)
		for f := 0; ; f++ {
			p.space()
			if p.byte(']') {
				break
			}
			if f > 0 && !p.byte(',') {
				return p.fail("items: item %d: a comma or ] must follow field %d", len(out), f-1)
			}
			if f == ItemFields {
				return p.fail("items: item %d has more than %d fields: an item is [source, source_offset, destination, destination_offset, nbytes]",
					len(out), ItemFields)
			}
			p.space()
			v, err := p.int()
			if err != nil {
				return p.fail("items: item %d: field %d (%s) %v", len(out), f, itemFieldNames[f], err)
			}
			fields = append(fields, v)
		}
		out = append(out, fields[start:len(fields):len(fields)])
	}
	*it = out
	return nil
}

// itemParser walks the JSON of Items.
type itemParser struct {
	b []byte
	i int
}

func (p *itemParser) space() {
	for p.i < len(p.b) && (p.b[p.i] == ' ' || p.b[p.i] == '\n' || p.b[p.i] == '\t' || p.b[p.i] == '\r') {
		p.i++
	}
}

func (p *itemParser) byte(c byte) bool {
	if p.i < len(p.b) && p.b[p.i] == c {
		p.i++
		return true
	}
	return false
}

// str reads a JSON string.
func (p *itemParser) str() (string, bool) {
	start := p.i
	if !p.byte('"') {
		return "", false
	}
	escaped := false
	for ; p.i < len(p.b); p.i++ {
		switch p.b[p.i] {
		case '\\':
			escaped = true
			p.i++ // the escaped byte is never the closing quote
		case '"':
			p.i++
			if !escaped {
				return string(p.b[start+1 : p.i-1]), true
			}
			var s string
			err := json.Unmarshal(p.b[start:p.i], &s)
			return s, err == nil
		}
	}
	return "", false
}

// value steps over one JSON value and returns its bytes, unchecked: the
// reader they are handed to checks them.
func (p *itemParser) value() ([]byte, bool) {
	start, depth := p.i, 0
	for p.i < len(p.b) {
		switch c := p.b[p.i]; c {
		case '"':
			if _, ok := p.str(); !ok {
				return nil, false
			}
			if depth == 0 {
				return p.b[start:p.i], true
			}
			continue
		case '[', '{':
			depth++
		case ']', '}':
			if depth == 0 { // a scalar ends before its container does
				return p.b[start:p.i], p.i > start
			}
			if depth--; depth == 0 {
				p.i++
				return p.b[start:p.i], true
			}
		case ',', ' ', '\t', '\n', '\r':
			if depth == 0 {
				return p.b[start:p.i], p.i > start
			}
		}
		p.i++
	}
	return p.b[start:p.i], depth == 0 && p.i > start
}

func (p *itemParser) lit(s string) bool {
	if len(p.b)-p.i >= len(s) && string(p.b[p.i:p.i+len(s)]) == s {
		p.i += len(s)
		return true
	}
	return false
}

var (
	errNotInt   = errors.New("is not an integer")
	errIntRange = errors.New("is out of range: an item's fields are integers from -9223372036854775808 to 9223372036854775807")
)

// int reads a JSON number that is a whole int64 (no fraction, no
// exponent, no overflow): errNotInt or errIntRange otherwise.
func (p *itemParser) int() (int64, error) {
	neg := p.byte('-')
	start := p.i
	var v uint64
	for p.i < len(p.b) && p.b[p.i] >= '0' && p.b[p.i] <= '9' {
		// Checked before the digit goes in: past (1<<63)/10, v*10 wraps
		// uint64 for long enough numbers (2^64 read as 0).
		if v > (1<<63)/10 {
			return 0, errIntRange
		}
		v = v*10 + uint64(p.b[p.i]-'0')
		if v > 1<<63 {
			return 0, errIntRange
		}
		p.i++
	}
	if p.i == start || p.i < len(p.b) && (p.b[p.i] == '.' || p.b[p.i] == 'e' || p.b[p.i] == 'E') {
		return 0, errNotInt
	}
	if neg {
		return -int64(v), nil // -(1<<63) wraps to itself, the least int64
	}
	if v == 1<<63 {
		return 0, errIntRange
	}
	return int64(v), nil
}

func (p *itemParser) fail(format string, args ...any) error {
	return fmt.Errorf(format+" (at byte %d of the items)", append(args, p.i)...)
}

// EngineSegmentRequest opens a Mooncake segment for one engine
// (ferry.mooncake.TransferEngine): POST /v1/mooncake/segments.
type EngineSegmentRequest struct {
	// Port is its RPC port on the host of --mooncake-listen; 0: one the
	// kernel picks.
	Port int `json:"port,omitempty"`
}

// EngineSegment describes an engine's own Mooncake segment: its session
// id, ports, the process it belongs to and the buffers it lists.
type EngineSegment struct {
	ID       string    `json:"id"`
	Session  string    `json:"session"` // "host:rpc_port", the engine's session id
	RPCPort  int       `json:"rpc_port"`
	DataPort int       `json:"data_port"`
	PID      int32     `json:"pid"`
	Regions  int       `json:"regions"` // registered memory it lists
	Since    time.Time `json:"since"`
	// Notifies is the Mooncake notifies it received and its engine has
	// not taken yet; NotifiesRefused those it refused, ever, for want of
	// room (1024 unread, or 256 KiB of them).
	Notifies        int    `json:"notifies"`
	NotifiesRefused uint64 `json:"notifies_refused"`
}

// Notify is a Mooncake notify: its sender's name and its message.
type Notify struct {
	Name      string `json:"name"`
	NotifyMsg string `json:"notify_msg"`
}

// Notifies answers POST /v1/mooncake/segments/{id}/notifies/drain: the
// notifies the segment received since the last drain, oldest first, and
// how many it refused for want of room since it opened.
type Notifies struct {
	Notifies []Notify `json:"notifies"`
	Refused  uint64   `json:"refused"`
}

// NotifyRequest sends a Mooncake notify to the RPC port of the segment
// Session ("host:rpc_port"): POST /v1/mooncake/notifies.
type NotifyRequest struct {
	Session   string `json:"session"`
	Name      string `json:"name"`
	NotifyMsg string `json:"notify_msg"`
}

// ReadRequest reads from a ferry engine's registered memory (another
// ferry.mooncake.TransferEngine's, through its ferryd): POST /v1/reads.
// The answer's body is the pieces' bytes, one after another.
type ReadRequest struct {
	// Session is the engine's session id, "host:rpc_port" (or
	// "mooncake://host:rpc_port").
	Session string `json:"session"`
	// Pieces are [address, length] in the engine's registered memory, at
	// its own addresses.
	Pieces [][2]uint64 `json:"pieces"`
	// Region, if set, is a registered host region the pieces land in, at
	// RegionOffsets (one per piece): the answer is then a ReadResult, and
	// on the rdma transport the NIC places the bytes there itself.
	Region        string   `json:"region,omitempty"`
	RegionOffsets []uint64 `json:"region_offsets,omitempty"`
}

// ReadResult answers a read that landed in a region.
type ReadResult struct {
	NBytes uint64 `json:"nbytes"`
}
