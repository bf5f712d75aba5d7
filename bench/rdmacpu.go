package bench

import (
	"context"
	"fmt"
	"io"

	"github.com/ferry-project/ferry/internal/size"
	"github.com/ferry-project/ferry/rdma"
	"github.com/ferry-project/ferry/transport/peer"
	"github.com/ferry-project/ferry/transport/tcp"
)

// OpSendCPU is a row of ferry's own CPU per RDMA send (rdma.SendCPU).
const OpSendCPU = "send_cpu"

// SendCPU modes: how the sends reach the receiver's memory.
const (
	CPUDirect  = "direct"  // authenticated peers: under the arena's rkey, no control message (as in windows mode)
	CPUGranted = "granted" // a header and its grant per send
)

// How the simulated NIC carries out work requests (rdma.CPUConfig.Inline):
// the two bracket ferry's CPU per send on a hardware NIC.
const (
	NICEngine = "engine" // a send engine goroutine per QP, woken per post: an upper bound
	NICInline = "inline" // inside the post, completed at once: a lower bound
)

// CPU is what a send cost the host's CPU, per send.
type CPU struct {
	Mode       string  `json:"mode"`                 // the receiver's protection mode: arena-rkey or grant
	NIC        string  `json:"nic"`                  // how the simulated NIC runs work requests: NICEngine or NICInline
	PerSend    float64 `json:"cpu_us_per_send"`      // ferry's own: the simulated NIC's send engines left out
	NICLeftOut float64 `json:"nic_us_left_out"`      // those engines' CPU: key checks, copy, completions
	WithNIC    float64 `json:"with_nic_us_per_send"` // the process's CPU, both
	Control    float64 `json:"control_per_send"`     // the sender's control messages (headers sent, grants read)
	Posts      float64 `json:"posts_per_send"`       // ibv_post_send calls
	Credits    float64 `json:"credit_per_send"`      // receive credits read (flow control)
	Stalls     uint64  `json:"credit_stalls"`        // sends that waited for a credit
}

// SendCPUConfig is an rdma-cpu run: each mode at each concurrency.
type SendCPUConfig struct {
	Size        int64
	Sends       int // measured per point, after a warm-up round
	Concurrency []int
	Lanes       int
	Modes       []string  // CPUDirect, CPUGranted
	NIC         string    // NICEngine or NICInline
	Progress    io.Writer // a line per point; nil for none
}

// SendCPU measures ferry's own CPU per send over the simulated NIC (see
// rdma.SendCPU): no device and no daemon, both transports in this
// process, the simulated NIC's own work left out.
func SendCPU(ctx context.Context, cfg SendCPUConfig) ([]Row, error) {
	for _, m := range cfg.Modes {
		if m != CPUDirect && m != CPUGranted {
			return nil, fmt.Errorf("mode %q: use %s or %s", m, CPUDirect, CPUGranted)
		}
	}
	if cfg.NIC != NICEngine && cfg.NIC != NICInline {
		return nil, fmt.Errorf("simulated NIC %q: use %s or %s", cfg.NIC, NICEngine, NICInline)
	}
	var rows []Row
	for _, c := range cfg.Concurrency {
		for _, m := range cfg.Modes {
			if cfg.Progress != nil {
				fmt.Fprintf(cfg.Progress, "rdma-cpu %s %s x%d over %d lanes, %s NIC: %d sends\n", m, size.Format(cfg.Size), c, cfg.Lanes, cfg.NIC, cfg.Sends)
			}
			r, err := rdma.SendCPU(ctx, rdma.CPUConfig{Size: int(cfg.Size), Sends: cfg.Sends, InFlight: c, Lanes: cfg.Lanes, Direct: m == CPUDirect, Inline: cfg.NIC == NICInline,
				TCP: func(p *peer.Port) rdma.Fallback { return tcp.Over(p) }})
			if err != nil {
				return rows, fmt.Errorf("rdma-cpu %s %s x%d: %w", m, size.Format(cfg.Size), c, err)
			}
			row := Row{Op: OpSendCPU, Size: cfg.Size, Concurrency: c, Lanes: cfg.Lanes,
				CPU: &CPU{Mode: r.Mode, NIC: cfg.NIC, PerSend: r.CPU, NICLeftOut: r.NIC, WithNIC: r.CPU + r.NIC, Control: r.Control, Posts: r.Posts, Credits: r.Credits, Stalls: r.Stalls}}
			row.Iterations, row.Seconds = r.Sends, r.Wall.Seconds()
			row.OpsPerSec = float64(r.Sends) / r.Wall.Seconds()
			rows = append(rows, row)
		}
	}
	return rows, nil
}

// WriteCPU prints a cpu_us_per_send= line per row of SendCPU.
func WriteCPU(w io.Writer, rows []Row) {
	for _, r := range rows {
		if r.CPU == nil {
			continue
		}
		fmt.Fprintf(w, "rdma-cpu mode=%s nic=%s size=%s in_flight=%d lanes=%d sends=%d cpu_us_per_send=%.2f nic_us_left_out=%.2f with_nic_us_per_send=%.2f control_per_send=%.2f posts_per_send=%.2f credit_per_send=%.3f credit_stalls=%d\n",
			r.CPU.Mode, r.CPU.NIC, size.Format(r.Size), r.Concurrency, r.Lanes, r.Iterations, r.CPU.PerSend, r.CPU.NICLeftOut, r.CPU.WithNIC, r.CPU.Control, r.CPU.Posts, r.CPU.Credits, r.CPU.Stalls)
	}
}
