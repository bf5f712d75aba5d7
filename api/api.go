// Package api holds the wire types of ferryd's control API (HTTP/1.1 + JSON
// over a Unix socket, under /v1). The server (daemon), the Go client
// (client) and ferryctl share them; nothing here does I/O.
package api

import (
	"maps"
	"time"

	"github.com/ferry-project/ferry/transport"
)

// DefaultSocket is where ferryd listens for local clients unless told.
const DefaultSocket = "/run/ferry/ferryd.sock"

// DefaultPeerPort is the port daemons dial each other on.
const DefaultPeerPort = 17100

// Error codes carried in the error envelope. Each pairs with one HTTP
// status: StatusOf.
const (
	CodeBadRequest     = "bad_request"        // 400: malformed or invalid input
	CodeRefused        = "refused"            // 400: the peer refused the write (no slot with that address and key, slot too small)
	CodeNoEmbedding    = "no_embedding"       // 404: send of a req_id that is not staged
	CodeNotFound       = "not_found"          // 404: unknown receive slot, session or route
	CodeMethod         = "method_not_allowed" // 405: known path, wrong method
	CodeForbidden      = "forbidden"          // 403: the caller's uid/gid is not on the allow-list
	CodeExists         = "exists"             // 409: req_id already in use
	CodeBusy           = "busy"               // 409: the entry is being sent
	CodeTooLarge       = "too_large"          // 413: larger than the whole arena or a request limit
	CodeArenaFull      = "arena_full"         // 507: fits the arena, but not the free space now
	CodeTransferFailed = "transfer_failed"    // 502: the transport failed after retries
	CodeTimeout        = "timeout"            // 504: a wait ran out
	CodeUnavailable    = "unavailable"        // 503: the daemon is shutting down
	CodeInternal       = "internal"           // 500
)

// statuses is each error code's HTTP status.
var statuses = map[string]int{
	CodeBadRequest: 400, CodeRefused: 400, CodeForbidden: 403, CodeNoEmbedding: 404, CodeNotFound: 404,
	CodeMethod: 405, CodeExists: 409, CodeBusy: 409, CodeTooLarge: 413, CodeInternal: 500,
	CodeTransferFailed: 502, CodeUnavailable: 503, CodeTimeout: 504, CodeArenaFull: 507,
}

// StatusOf is the HTTP status an error code goes with; 500 for a code
// this package does not know.
func StatusOf(code string) int {
	if s, ok := statuses[code]; ok {
		return s
	}
	return 500
}

// Codes is every error code, with its status.
func Codes() map[string]int { return maps.Clone(statuses) }

// ErrorBody is the one error envelope: {"error":{"code","message"}}.
type ErrorBody struct {
	Error Error `json:"error"`
}

type Error struct {
	Code    string `json:"code"`
	Message string `json:"message"`
}

// Status answers GET /v1/status.
type Status struct {
	Version   string       `json:"version"`
	PID       int          `json:"pid"`
	Instance  string       `json:"instance"`
	StartedAt time.Time    `json:"started_at"`
	Memory    MemoryStatus `json:"memory"`
	// Arenas is each device's arena, in --device's order; the first is
	// Memory's.
	Arenas       []ArenaStatus     `json:"arenas"`
	Registration Registration      `json:"registration"`
	Transport    TransportStatus   `json:"transport"`
	Mooncake     *MooncakeStatus   `json:"mooncake,omitempty"` // with --mooncake-listen
	Staged       int               `json:"staged"`
	Receives     int               `json:"receives"`
	Regions      RegionsStatus     `json:"regions"`
	Sessions     []Session         `json:"sessions"`
	Settings     Settings          `json:"settings"`
	Counters     map[string]uint64 `json:"counters"`
	// Affinity pairs each GPU with its nearest RDMA NICs (docs/operations.md).
	Affinity Affinity `json:"affinity"`
}

// Affinity is the GPU-to-NIC table ferryd read from the PCIe topology
// (sysfs) at start, or took from the configuration's affinity map.
type Affinity struct {
	Devices []DeviceAffinity `json:"devices"`
	// Warnings: GPUs with no NIC near them, NICs or devices sysfs does
	// not show; each a sentence saying what it costs.
	Warnings []string `json:"warnings,omitempty"`
}

// DeviceAffinity is one GPU's row: its nearest NICs, nearest first, how
// near (Distance) and why.
type DeviceAffinity struct {
	Device   string `json:"device"`    // "cuda:N"
	BusID    string `json:"bus_id"`    // as sysfs names it, e.g. 0000:3b:00.0
	NUMANode int    `json:"numa_node"` // -1: the kernel does not say
	// Distance is "pcie switch", "root port", "numa node", "other" (no
	// NIC nearer than across the host), or "configured".
	Distance string        `json:"distance"`
	Why      string        `json:"why"`
	NICs     []AffinityNIC `json:"nics"`
}

// AffinityNIC is one NIC as the affinity table shows it.
type AffinityNIC struct {
	Name     string `json:"name"`             // e.g. mlx5_0
	BusID    string `json:"bus_id,omitempty"` // empty for a virtual NIC (soft-RoCE)
	NUMANode int    `json:"numa_node"`
	Netdev   string `json:"netdev,omitempty"`
	GID      string `json:"gid,omitempty"` // port 1's RoCE v2 IPv4 GID, else its GID 0
}

// RegionsStatus is the memory clients lent ferryd (POST /v1/regions).
type RegionsStatus struct {
	Count int `json:"count"` // registered, closing ones included
	// HostBytes is the host memory they hold (memfds; CUDA regions hold
	// none), with regions being registered; HostLimit bounds it
	// (max_region_bytes on this host; 0: no bound).
	HostBytes int64 `json:"host_bytes"`
	HostLimit int64 `json:"host_limit"`
}

// MooncakeStatus is ferryd serving as a Mooncake segment.
type MooncakeStatus struct {
	Segment  string `json:"segment"`   // "ip:rpcport", the name Mooncake senders use
	RPC      string `json:"rpc"`       // the handshake listener
	DataPort int    `json:"data_port"` // the TCP data port, as the descriptor names it
	Engines  int    `json:"engines"`   // engine segments open (GET /v1/mooncake/segments)
	// RDMAPool is the Mooncake pool when the segment speaks rdma: the
	// only memory its descriptor lists, where slots made with mooncake
	// lie (mooncake_rdma_pool).
	RDMAPool *MooncakePool `json:"rdma_pool,omitempty"`
}

// MooncakePool is the part of the first arena Mooncake peers write
// into over RDMA: its address, size and use, in bytes and slots (freed
// slots in quarantine among them).
type MooncakePool struct {
	Addr  uint64 `json:"addr"`
	Size  int64  `json:"size"`
	Used  int64  `json:"used"`
	Free  int64  `json:"free"`
	Slots int    `json:"slots"`
}

type MemoryStatus struct {
	Kind        string `json:"kind"`   // "host" or "cuda"
	Device      string `json:"device"` // "cpu" or "cuda:N"
	Reason      string `json:"reason"` // why this memory: the --device asked for, or why auto chose it
	ArenaFile   string `json:"arena_file"`
	ArenaBase   uint64 `json:"arena_base"`
	HugePages   bool   `json:"huge_pages"`
	Size        int64  `json:"size"`
	Used        int64  `json:"used"`
	Free        int64  `json:"free"`
	LargestFree int64  `json:"largest_free"`
	Allocations int    `json:"allocations"`
	Alignment   int64  `json:"alignment"`
	// CUDA describes the GPU and the device arena when Kind is "cuda".
	CUDA *CUDAStatus `json:"cuda,omitempty"`
}

// CUDAStatus describes a GPU arena: the device, what it supports, and
// what ferryd could export of the arena.
type CUDAStatus struct {
	Name              string `json:"name"`
	UUID              string `json:"uuid"`
	PCIBusID          string `json:"pci_bus_id"`
	TotalMemory       int64  `json:"total_memory"`
	DriverVersion     string `json:"driver_version"` // CUDA version of the driver, e.g. "12.4"
	GPUDirectRDMA     bool   `json:"gpudirect_rdma"`
	DMABuf            bool   `json:"dmabuf"`
	VMM               bool   `json:"vmm"`
	UnifiedAddressing bool   `json:"unified_addressing"`
	IPCHandle         []byte `json:"ipc_handle,omitempty"` // base64; see CUDAIPC
	IPCError          string `json:"ipc_error,omitempty"`  // why there is no IPC handle
	DMABufExported    bool   `json:"dmabuf_exported"`
	DMABufReason      string `json:"dmabuf_reason,omitempty"` // why the arena is not exported as a dmabuf
	BounceSize        int64  `json:"bounce_size"`             // pinned host memory copies are staged in
	BounceFallbacks   int64  `json:"bounce_fallbacks"`        // copies staged in pageable memory: the pinned area was full
	StagingPeak       int64  `json:"staging_peak"`            // the most host memory lent at once to stage copies, pinned and pageable, since start
}

// CUDAIPC is how a client reaches a GPU arena from its own process: open
// IPCHandle with cuIpcOpenMemHandle on Device (torch and cupy can wrap the
// pointer), then the bytes of an entry or slot are at that base + offset.
// It is absent for a host-memory arena, which clients map as ArenaFile.
type CUDAIPC struct {
	Device    string `json:"device"`     // "cuda:N"
	IPCHandle []byte `json:"ipc_handle"` // the 64-byte CUipcMemHandle, base64 in JSON
}

// ArenaStatus is one device's arena: its size and use, and the staged
// entries and receive slots in it.
type ArenaStatus struct {
	Device string `json:"device"` // "cpu" or "cuda:N"
	Kind   string `json:"kind"`   // "host" or "cuda"
	Size   int64  `json:"size"`
	Used   int64  `json:"used"`
	Free   int64  `json:"free"`
	Staged int    `json:"staged"`
	Slots  int    `json:"slots"`
	// NIC says whether the RDMA NIC registered it (nil without RDMA).
	NIC *RegionNIC `json:"nic,omitempty"`
}

// RegistrationMode is how the arena is made visible to the NIC, spelt
// the same in the rdma_registration setting, status and metric labels.
type RegistrationMode string

const (
	RegistrationShared  RegistrationMode = "shared"   // the whole arena, once at start
	RegistrationPerSend RegistrationMode = "per-send" // each write registers its own range
	RegistrationNone    RegistrationMode = "none"     // no NIC: the TCP transport registers nothing
)

// Registration says how the arena is made visible to the NIC.
type Registration struct {
	Mode   RegistrationMode `json:"mode"`
	Reason string           `json:"reason"`
	Bytes  int64            `json:"bytes,omitempty"`
	// Millis is how long the shared registration took (or took to fail).
	Millis float64 `json:"ms,omitempty"`
	// PerSend counts the writes that registered their own range (on
	// either side) since start.
	PerSend uint64 `json:"per_send_registrations"`
	// GPU is how a GPU arena met the RDMA NIC; nil for a host arena or
	// without RDMA.
	GPU *GPURegistrationStatus `json:"gpu,omitempty"`
}

// GPURegistration is a way of registering a GPU arena with the RDMA NIC,
// spelt the same in the gpu_registration setting, status and metric
// labels.
type GPURegistration string

const (
	GPURegistrationAuto    GPURegistration = "auto"    // the first of dmabuf, peermem, bounce that works
	GPURegistrationDMABuf  GPURegistration = "dmabuf"  // the arena's dmabuf (ibv_reg_dmabuf_mr): NIC <-> GPU
	GPURegistrationPeerMem GPURegistration = "peermem" // the device pointer (ibv_reg_mr, nvidia-peermem): NIC <-> GPU
	GPURegistrationBounce  GPURegistration = "bounce"  // the pinned host bounce area: copies around each transfer
)

// GPURegistrationPaths are the paths in the order auto tries them.
var GPURegistrationPaths = []GPURegistration{GPURegistrationDMABuf, GPURegistrationPeerMem, GPURegistrationBounce}

// GPURegistrationStatus says which path registered a GPU arena and why
// the others did not.
type GPURegistrationStatus struct {
	Asked GPURegistration `json:"asked"` // --gpu-registration
	// Path is the one taken, "" when none worked (every write is then
	// copied, and NotTaken says why).
	Path     GPURegistration   `json:"path"`
	NotTaken []GPUPathNotTaken `json:"not_taken"`
}

// GPUPathNotTaken is a registration path not taken and why: it failed
// (with what to do), or it was not tried.
type GPUPathNotTaken struct {
	Path   GPURegistration `json:"path"`
	Failed bool            `json:"failed"`
	Reason string          `json:"reason"`
}

type TransportStatus struct {
	Name      string      `json:"name"` // "rdma" or "tcp"
	Listen    string      `json:"listen"`
	Advertise string      `json:"advertise"`
	Reason    string      `json:"reason"` // why this transport
	RDMA      *RDMAStatus `json:"rdma,omitempty"`
}

// RDMAStatus is what discovery saw and what the daemon chose (--transport
// auto or rdma).
type RDMAStatus struct {
	NICs []NIC `json:"nics"`
	// Why says why NICs is empty.
	Why    string     `json:"why,omitempty"`
	Chosen *NICChoice `json:"chosen,omitempty"`
	// WriteMode is how peers' writes reach this receiver's slots when
	// the RDMA transport runs, best first: "windows" (any peer writes a
	// whole slot directly through a NIC-enforced memory window over it),
	// "arena-rkey" (peers proving the peer secret write a whole slot
	// directly under the arena's rkey) or "grant" (a header and a grant
	// per write). docs/rdma.md. WriteModeWhy says why not a better one.
	WriteMode    string `json:"write_mode,omitempty"`
	WriteModeWhy string `json:"write_mode_why,omitempty"`
	// Rails are the RDMA devices the transport drives (--rdma-device),
	// Chosen first, each with what left through it as sender; Skipped,
	// with --rdma-device all, the devices left out and why.
	Rails   []Rail   `json:"rails,omitempty"`
	Skipped []string `json:"rails_skipped,omitempty"`
	// StripeMin is the size from which a send is striped over the rails.
	StripeMin int64 `json:"stripe_min_bytes,omitempty"`
}

// Rail is one RDMA device the transport drives: its port and GID, and
// the writes and striped pieces that left through it, with their bytes.
type Rail struct {
	NICChoice
	Sends uint64 `json:"sends"`
	Bytes uint64 `json:"bytes"`
	// Received is the writes and pieces that came in through it and
	// were delivered, ReceivedBytes their bytes.
	Received      uint64 `json:"received"`
	ReceivedBytes uint64 `json:"received_bytes"`
}

// NIC is an RDMA device.
type NIC struct {
	Name    string    `json:"name"`
	Netdevs []string  `json:"netdevs,omitempty"`
	PCI     string    `json:"pci,omitempty"` // empty for a virtual device (soft-RoCE)
	FW      string    `json:"fw,omitempty"`
	Ports   []NICPort `json:"ports"`
}

type NICPort struct {
	Num       int               `json:"num"`
	State     string            `json:"state"`
	Active    bool              `json:"active"`
	LinkLayer string            `json:"link_layer"` // "Ethernet" (RoCE) or "InfiniBand"
	MTU       int               `json:"active_mtu"`
	LID       uint16            `json:"lid,omitempty"`
	GIDs      []GID             `json:"gids"`
	Counters  map[string]uint64 `json:"counters,omitempty"`
}

type GID struct {
	Index  int    `json:"index"`
	GID    string `json:"gid"`
	Type   string `json:"type"` // "IB", "RoCE v1", "RoCE v2"
	Netdev string `json:"netdev,omitempty"`
}

// NICChoice is the port and GID the RDMA transport uses, and why.
type NICChoice struct {
	Device    string `json:"device"`
	Port      int    `json:"port"`
	GIDIndex  int    `json:"gid_index"`
	GID       string `json:"gid"`
	GIDType   string `json:"gid_type"`
	Netdev    string `json:"netdev,omitempty"`
	LinkLayer string `json:"link_layer"`
	MTU       int    `json:"active_mtu"`
	Why       string `json:"why"`
}

type Settings struct {
	SlowThreshold string `json:"slow_threshold"`
	SendRetries   int    `json:"send_retries"`
	SendTimeout   string `json:"send_timeout"`
	StageTTL      string `json:"stage_ttl"`
	ReceiveTTL    string `json:"receive_ttl"`
}

// Embedding describes a staged (or reserved) entry.
type Embedding struct {
	ReqID     string    `json:"req_id"`
	State     string    `json:"state"` // "reserved", "staged", "sending"
	Shape     []int64   `json:"shape,omitempty"`
	DType     string    `json:"dtype,omitempty"`
	NBytes    int64     `json:"nbytes"`
	Device    string    `json:"device"` // the device whose arena holds it
	Offset    int64     `json:"offset"`
	Since     time.Time `json:"since"`
	ArenaFile string    `json:"arena_file,omitempty"`
	*CUDAIPC
}

// SliceRequest asks for an arena slice to fill in place (zero-copy staging):
// POST /v1/embeddings/{req_id}/slice. Give shape+dtype, or nbytes alone.
type SliceRequest struct {
	Shape  []int64 `json:"shape,omitempty"`
	DType  string  `json:"dtype,omitempty"`
	NBytes int64   `json:"nbytes,omitempty"`
	// Device names the arena ("cuda:1", "cpu"); empty: the first.
	Device string `json:"device,omitempty"`
}

// Arena answers GET /v1/arena on a host-memory arena. The answer carries
// the arena's descriptor (SCM_RIGHTS, with the answer's first bytes): the
// arena is a sealed memfd with no path, so this is how a caller the
// allow-lists admit maps it, read-write and MAP_SHARED, Size bytes.
type Arena struct {
	ArenaFile string `json:"arena_file"` // for messages; clients map the descriptor
	Size      int64  `json:"size"`
	HugePages bool   `json:"huge_pages"`
}

// Slice is where a client writes through its own mapping of the arena
// (GET /v1/arena), or of the GPU arena, through CUDAIPC.
type Slice struct {
	ReqID     string `json:"req_id"`
	ArenaFile string `json:"arena_file"`
	Offset    int64  `json:"offset"`
	NBytes    int64  `json:"nbytes"`
	Device    string `json:"device"` // the device whose arena holds it
	*CUDAIPC         // set instead of ArenaFile for a GPU arena
}

// CommitRequest seals a zero-copy slice: POST /v1/embeddings/{req_id}/commit.
type CommitRequest struct {
	Shape []int64 `json:"shape"`
	DType string  `json:"dtype"`
}

// SendRequest: POST /v1/embeddings/{req_id}/send.
// KeyHeader carries a POST /v1/writes' slot key: a capability, kept out
// of the URL.
const KeyHeader = "Ferry-Key"

// WriteStreamProtocol is the Upgrade a POST /v1/writes/stream asks for:
// the connection then carries binary write frames (docs/api.md).
const WriteStreamProtocol = "ferry-writes/1"

type SendRequest struct {
	Session       string `json:"session"`
	BufferAddress uint64 `json:"buffer_address"`
	// Key is the receive slot's key, passed along as the receiver's
	// POST /v1/receives gave it (40 hex digits).
	Key transport.Key `json:"key"`
	// WaitMS waits this long for the req_id to be staged, to cover a stage
	// that races the send. 0 fails at once.
	WaitMS int64 `json:"wait_ms,omitempty"`
	// NBytes is the slot's size, as the receiver's POST /v1/receives gave
	// it (optional): a staged embedding larger than it is refused before
	// anything moves, and over RDMA between peers sharing the peer secret
	// only a send that fills it exactly goes direct (docs/rdma.md).
	NBytes int64 `json:"nbytes,omitempty"`
}

type SendResult struct {
	ReqID     string  `json:"req_id"`
	Session   string  `json:"session"`
	NBytes    int64   `json:"nbytes"`
	Millis    float64 `json:"ms"`
	GBps      float64 `json:"gb_per_s"`
	Transport string  `json:"transport"`
	SharedMR  bool    `json:"shared_mr"`
	Attempts  int     `json:"attempts"`
	// Writes is how many writes carried the bytes: 1, or up to
	// tcp_stripes pieces at once over TCP. A piece copied out of GPU
	// memory in chunks counts once.
	Writes int `json:"writes"`
}

// ReceiveRequest: POST /v1/receives.
type ReceiveRequest struct {
	ReqID  string `json:"req_id"`
	NBytes int64  `json:"nbytes"`
	// Mooncake opens the slot to Mooncake Transfer Engine senders too
	// (with --mooncake-listen): their writes carry no key, so only a
	// slot that asks for them takes them.
	Mooncake bool `json:"mooncake,omitempty"`
	// Region places the slot in a region the receiving client registered
	// (POST /v1/regions), at RegionOffset, instead of in the arena: the
	// bytes land in the client's own memory.
	Region       string `json:"region,omitempty"`
	RegionOffset int64  `json:"region_offset,omitempty"`
	// Device names the arena the slot is in ("cuda:3", "cpu"), one of
	// --device's; empty: the first.
	Device string `json:"device,omitempty"`
}

// ReceiveSlot is what a receiver hands to the sender out of band.
type ReceiveSlot struct {
	ReqID         string `json:"req_id"`
	Session       string `json:"session"`
	BufferAddress uint64 `json:"buffer_address"`
	// Key is the slot's key: its capability (120 random bits), its rail
	// (the receiver's NIC nearest the slot's device) and the rkey of the
	// memory window over it there (windows mode; else zeros), as 40 hex
	// digits (transport.Key). Treat it as an opaque string and pass it to the
	// sender unchanged.
	Key    transport.Key `json:"key"`
	NBytes int64         `json:"nbytes"`
	// Device is the device whose arena holds the slot ("cuda:3", "cpu";
	// empty for a slot in a region).
	Device string `json:"device,omitempty"`
	// MooncakeSession is the receiver's Mooncake segment name
	// ("ip:rpcport") for a slot made with "mooncake": true: a Mooncake
	// sender writes nbytes to buffer_address in that segment.
	MooncakeSession string `json:"mooncake_session,omitempty"`
}

// Receive describes a slot: GET /v1/receives/{req_id}?format=json.
type Receive struct {
	ReceiveSlot
	// Device is ReceiveSlot's, and the CUDA IPC handle's below (the
	// same device): declared here, it is the one "device" JSON carries.
	Device   string `json:"device,omitempty"`
	Arrived  bool   `json:"arrived"`
	Received int64  `json:"received"` // bytes that arrived
	Tag      uint32 `json:"tag"`      // the tag the write carried (the key's first 32 bits)
	Mooncake bool   `json:"mooncake"` // open to Mooncake senders
	// WritesInFlight counts writes landing in the slot now. A slot freed
	// meanwhile keeps its memory until they end, so a newer slot never
	// receives their bytes.
	WritesInFlight int `json:"writes_in_flight"`
	// Waiters counts the waits (GET ?wait=) in flight for its data. While
	// ferryd drains, a slot with one still takes its sender's write.
	Waiters int `json:"waiters"`
	// Offset is where the slot lies in the arena, or in Region when the
	// slot is in a registered region.
	Offset    int64     `json:"offset"`
	Region    string    `json:"region,omitempty"`
	ArenaFile string    `json:"arena_file"`
	Since     time.Time `json:"since"`
	*CUDAIPC
}

// Headers on the raw-bytes answer of GET /v1/receives/{req_id}.
const (
	HeaderNBytes = "Ferry-Nbytes"
	HeaderTag    = "Ferry-Tag"
)

// Session is an open path to a peer daemon.
type Session struct {
	ID           string    `json:"id"`
	Peer         string    `json:"peer"`
	Transport    string    `json:"transport"`
	State        string    `json:"state"` // "connected" or "down" (torn down; re-dialed on the next send)
	PeerInstance string    `json:"peer_instance"`
	DialedAt     time.Time `json:"dialed_at"`
	Sends        uint64    `json:"sends"`
	Failures     uint64    `json:"failures"`
	LastError    string    `json:"last_error,omitempty"`
}
