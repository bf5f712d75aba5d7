package rdma

import "errors"

// The seam between the transport's logic and libibverbs. verbs.go
// implements it over a real device; simnic.go simulates one in memory, for
// the tests on hosts without RDMA and for measuring ferry's own CPU per
// send (SendCPU), and the soft-RoCE VM runs the same tests on the real one.

// nic is one opened port of an RDMA device with its protection domain.
type nic interface {
	// Endpoint is the port's address (GID, LID, active MTU); QPN and PSN
	// are filled per queue pair.
	Endpoint() endpoint
	// Register makes mem reachable by the NIC for u. mem must not be Go
	// heap memory (the NIC keeps its address): mmap'd or C memory only.
	Register(mem []byte, u use) (region, error)
	// RegisterAt is Register with the memory reached at addresses from
	// iova on instead of its own: work requests, the peers' included,
	// name its first byte iova (ibv_reg_mr_iova).
	RegisterAt(mem []byte, iova uint64, u use) (region, error)
	// RegisterDevice registers size bytes of device memory at addr, which
	// the host cannot address (peer memory: nvidia-peermem pins it),
	// reached at addresses from iova on (addr itself, but for an engine's
	// GPU memory: its owner's address of it).
	RegisterDevice(addr, size, iova uint64, u use) (region, error)
	// RegisterDMABuf registers size bytes at offset of dmabuf fd, reached
	// at addresses from iova on (the device pointer of its first byte).
	RegisterDMABuf(fd int, offset, size, iova uint64, u use) (region, error)
	// NewQP makes an RC queue pair with its own completion queue and
	// completion channel.
	NewQP(sendDepth, recvDepth int) (queuePair, error)
	// Windows is nil when the device binds type 1 memory windows, else
	// why it does not.
	Windows() error
	// AllocWindow allocates a type 1 memory window, bound to nothing.
	AllocWindow() (window, error)
	Close() error
}

// use is what a registration lets the NIC do with its memory besides
// reading and writing it for this host's own work requests. A
// registration lets peers write under its own rkey only where a peer is
// given that rkey on purpose: a peer that guesses or keeps an rkey
// reaches nothing else.
type use int

const (
	// localUse: no peer writes it (send sources, bounce buffers, regions
	// outside windows mode).
	localUse use = iota
	// peerWrites: peers write it under its own rkey.
	peerWrites
	// windowBinding: peers write it only through windows bound over it
	// (windows.go); its own rkey lets no peer write.
	windowBinding
	// peerReadsWrites: peers write and read it under its own rkey: an
	// engine region (engines.go), which Mooncake peers may read.
	peerReadsWrites
)

// window is a type 1 memory window: what a peer may write through it is
// what its last bind (queuePair.Bind) allowed.
type window interface {
	Close() error
}

// region is a memory registration.
type region interface {
	LKey() uint32
	RKey() uint32
	Close() error
}

// queuePair is an RC QP and the completion queue it reports to. Post,
// PostRecvs, Poll, Arm and Break may run concurrently with each other;
// Close runs alone, after Stop and after the last Wait has returned.
type queuePair interface {
	QPN() uint32
	// Connect takes the QP through INIT, RTR and RTS towards remote; psn
	// is the first PSN this side sends (its endpoint's PSN).
	Connect(psn uint32, remote endpoint) error
	Post(ops []op) error
	// PostRecvs posts n receives without buffers, one for each WRITE
	// WITH IMM that may arrive.
	PostRecvs(n int) error
	// Poll takes up to len(into) completions, without blocking.
	Poll(into []completion) (int, error)
	// Arm asks for an event at the next completion; Wait blocks for it.
	Arm() error
	// Wait returns errStopped once Stop has run.
	Wait() error
	Stop()
	// Bind posts a signaled bind of w over [addr, addr+n) of r that
	// allows remote writes, or with n 0 one that invalidates w; its
	// completion carries wrid. It returns the rkey a write through w
	// names from then on: the bind holds once it completed.
	Bind(w window, r region, addr, n, wrid uint64) (uint32, error)
	// Break moves the QP to the error state: the NIC stops working on it
	// and completes whatever is posted with WR_FLUSH_ERR.
	Break() error
	Close() error
}

var errStopped = errors.New("queue pair stopped")

// endpoint is one end of an RC connection, as the other end needs it.
type endpoint struct {
	GID [16]byte
	LID uint16
	MTU mtu // the port's active MTU; both ends use the smaller
	QPN uint32
	PSN uint32
}

// op is one work request: an RDMA WRITE (with an immediate when WithImm),
// or an RDMA READ, which ferry posts only to read a peer's engine region
// (reads.go) and its lanes refuse (Mooncake QPs and the QPs of reads
// answer one of an engine region).
type op struct {
	WRID       uint64
	Local      uint64 // address of the local bytes, inside the region of LKey
	Remote     uint64
	Len        uint32
	LKey, RKey uint32
	Imm        uint32
	Signaled   bool
	WithImm    bool
	Read       bool
}

// completion is one work completion.
type completion struct {
	WRID      uint64
	Status    wcStatus
	Opcode    uint32
	ByteLen   uint32
	Imm       uint32
	HasImm    bool
	VendorErr uint32
}
