// Command ferryctl drives a local ferryd over its control socket.
package main

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"sort"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/ferry-project/ferry/api"
	"github.com/ferry-project/ferry/client"
	"github.com/ferry-project/ferry/internal/size"
)

const usage = `ferryctl drives a local ferryd over its control socket.

Usage: ferryctl [--socket PATH] [--json] COMMAND [flags] [args]

Commands:
  status                              the daemon's memory, transport and sessions
  stage REQ_ID --shape R,C --dtype D [--device DEV] FILE|-
                                      stage an embedding (--zero-copy writes it in place)
  send REQ_ID --session HOST:PORT --addr ADDR --key KEY [--wait 2s]
  send REQ_ID --session mooncake://HOST:PORT --addr ADDR
                                      write into a Mooncake segment (its name and a buffer address)
  send REQ_ID --slot SLOT.json        send to a slot printed by 'ferryctl --json recv'
  recv REQ_ID --nbytes N | --shape R,C --dtype D [--mooncake] [--device DEV]
                                      allocate a receive slot; prints session, addr, key
  wait REQ_ID -o FILE [--for 30s] [--keep]
                                      wait for the data, write it, free the slot
  rm REQ_ID [--recv]                  delete a staged embedding (or free a receive slot)
  complete REQ_ID                     a Mooncake slot holds its data (its sender sent no notify)
  ls                                  staged embeddings and receive slots
  regions                             memory clients lent, and how the NIC reached it
  sessions [--teardown ID]            sessions to peer daemons

The socket defaults to $FERRY_SOCKET, else ` + api.DefaultSocket + `.
`

// globals are the flags every command takes.
type globals struct {
	socket  string
	json    bool
	timeout time.Duration
}

func (g *globals) register(fs *flag.FlagSet) {
	def := os.Getenv("FERRY_SOCKET")
	if def == "" {
		def = api.DefaultSocket
	}
	fs.StringVar(&g.socket, "socket", def, "ferryd's control socket")
	fs.BoolVar(&g.json, "json", false, "print JSON for scripts")
	fs.DurationVar(&g.timeout, "timeout", 60*time.Second, "give up on the daemon after this long")
}

func main() {
	err := run(os.Args[1:], os.Stdout)
	if errors.Is(err, flag.ErrHelp) {
		return // the usage was printed, as asked
	}
	if errors.Is(err, client.ErrUnreachable) {
		err = fmt.Errorf("%w; name ferryd's socket with --socket or FERRY_SOCKET", err)
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "ferryctl:", err)
		os.Exit(1)
	}
}

func run(args []string, out io.Writer) error {
	var g globals
	top := flag.NewFlagSet("ferryctl", flag.ContinueOnError)
	top.Usage = func() { fmt.Fprint(os.Stderr, usage) }
	g.register(top)
	if err := top.Parse(args); err != nil {
		return err
	}
	if top.NArg() == 0 {
		fmt.Fprint(os.Stderr, usage)
		return errors.New("no command given")
	}
	name, rest := top.Arg(0), top.Args()[1:]
	cmd, ok := commands[name]
	if !ok {
		return fmt.Errorf("unknown command %q: run ferryctl -h for the list", name)
	}
	// Globals given before the command are re-applied after the command's
	// flag set is made (which resets them to defaults), so both places work.
	given := map[string]string{}
	top.Visit(func(f *flag.Flag) { given[f.Name] = f.Value.String() })
	fs := flag.NewFlagSet("ferryctl "+name, flag.ContinueOnError)
	g.register(fs)
	for k, v := range given {
		_ = fs.Set(k, v)
	}
	run := cmd(fs)
	if err := fs.Parse(interleave(fs, rest)); err != nil {
		return err
	}
	ctx, cancel := context.WithTimeout(context.Background(), g.timeout)
	defer cancel()
	c := &client.Client{Socket: g.socket}
	return run(ctx, &env{c: c, g: &g, out: out, args: fs.Args()})
}

// interleave moves flags after positional arguments to the front, so
// "ferryctl send r1 --session x" works as people type it.
func interleave(fs *flag.FlagSet, args []string) []string {
	var flags, pos []string
	for i := 0; i < len(args); i++ {
		a := args[i]
		if a == "--" {
			pos = append(pos, args[i+1:]...)
			break
		}
		if !strings.HasPrefix(a, "-") || a == "-" {
			pos = append(pos, a)
			continue
		}
		flags = append(flags, a)
		name := strings.TrimLeft(a, "-")
		if strings.Contains(name, "=") {
			continue
		}
		if f := fs.Lookup(name); f != nil && i+1 < len(args) {
			if bf, ok := f.Value.(interface{ IsBoolFlag() bool }); ok && bf.IsBoolFlag() {
				continue
			}
			i++
			flags = append(flags, args[i])
		}
	}
	return append(flags, pos...)
}

// env is what a command runs with.
type env struct {
	c    *client.Client
	g    *globals
	out  io.Writer
	args []string
}

func (e *env) reqID() (string, error) {
	if len(e.args) == 0 {
		return "", errors.New("give the req_id as the first argument")
	}
	return e.args[0], api.CheckReqID(e.args[0])
}

// print writes v as JSON with --json, else the human line(s) from human.
func (e *env) print(v any, human func(w io.Writer)) error {
	if e.g.json {
		enc := json.NewEncoder(e.out)
		enc.SetIndent("", "  ")
		return enc.Encode(v)
	}
	human(e.out)
	return nil
}

type command func(fs *flag.FlagSet) func(ctx context.Context, e *env) error

var commands = map[string]command{
	"status":   cmdStatus,
	"stage":    cmdStage,
	"send":     cmdSend,
	"recv":     cmdRecv,
	"wait":     cmdWait,
	"rm":       cmdRm,
	"complete": cmdComplete,
	"ls":       cmdLs,
	"regions":  cmdRegions,
	"sessions": cmdSessions,
}

func cmdStatus(fs *flag.FlagSet) func(context.Context, *env) error {
	return func(ctx context.Context, e *env) error {
		st, err := e.c.Status(ctx)
		if err != nil {
			return err
		}
		return e.print(st, func(w io.Writer) {
			m := st.Memory
			fmt.Fprintf(w, "ferryd %s  pid %d  up %s\n", st.Version, st.PID, time.Since(st.StartedAt).Round(time.Second))
			fmt.Fprintf(w, "memory     %s (%s), arena %s, used %s, free %s, largest free %s\n",
				m.Kind, m.Device, size.Format(m.Size), size.Format(m.Used), size.Format(m.Free), size.Format(m.LargestFree))
			if m.ArenaFile != "" {
				fmt.Fprintf(w, "arena file %s\n", m.ArenaFile)
			}
			fmt.Fprintf(w, "chosen     %s\n", m.Reason)
			if len(st.Arenas) > 1 { // one per device: the first is memory's
				for _, a := range st.Arenas {
					nic := ""
					if a.NIC != nil {
						nic = fmt.Sprintf(", nic registered=%v", a.NIC.Registered)
						if len(a.NIC.NICs) > 0 {
							nic += " on " + strings.Join(a.NIC.NICs, ",")
						}
						if a.NIC.NICsWhy != "" {
							nic += " (" + a.NIC.NICsWhy + ")"
						}
					}
					fmt.Fprintf(w, "arena      %s (%s) %s, used %s, free %s, %d staged, %d slots%s\n",
						a.Device, a.Kind, size.Format(a.Size), size.Format(a.Used), size.Format(a.Free), a.Staged, a.Slots, nic)
				}
			}
			if g := m.CUDA; g != nil {
				fmt.Fprintf(w, "gpu        %s, %s, pci %s, driver CUDA %s; gpudirect_rdma=%v dmabuf=%v vmm=%v; dmabuf exported=%v; pinned bounce %s\n",
					g.Name, g.UUID, g.PCIBusID, g.DriverVersion, g.GPUDirectRDMA, g.DMABuf, g.VMM, g.DMABufExported, size.Format(g.BounceSize))
			}
			fmt.Fprintf(w, "transport  %s, listening on %s, advertised as %s\n", st.Transport.Name, st.Transport.Listen, st.Transport.Advertise)
			fmt.Fprintf(w, "           %s\n", st.Transport.Reason)
			if r := st.Transport.RDMA; r != nil {
				var nics []string
				for _, n := range r.NICs {
					nics = append(nics, n.Name)
				}
				if len(nics) == 0 {
					nics = append(nics, "none: "+r.Why)
				}
				fmt.Fprintf(w, "nics       %s\n", strings.Join(nics, ", "))
				if r.WriteMode != "" {
					fmt.Fprintf(w, "protection %s", r.WriteMode)
					if r.WriteModeWhy != "" {
						fmt.Fprintf(w, " (%s)", r.WriteModeWhy)
					}
					fmt.Fprintln(w)
				}
			}
			if mc := st.Mooncake; mc != nil {
				fmt.Fprintf(w, "mooncake   segment %s (handshake on %s, tcp data port %d)\n", mc.Segment, mc.RPC, mc.DataPort)
				if p := mc.RDMAPool; p != nil {
					fmt.Fprintf(w, "mooncake   rdma pool %s at %#x, %s used by %d slots, %s free\n", size.Format(p.Size), p.Addr, size.Format(p.Used), p.Slots, size.Format(p.Free))
				}
			}
			reg := st.Registration
			fmt.Fprintf(w, "register   %s (%s)", reg.Mode, reg.Reason)
			if reg.Millis > 0 {
				fmt.Fprintf(w, ", %s in %.1f ms", size.Format(reg.Bytes), reg.Millis)
			}
			fmt.Fprintf(w, ", %d per-send registrations\n", reg.PerSend)
			if g := reg.GPU; g != nil {
				path := string(g.Path)
				if path == "" {
					path = "none"
				}
				fmt.Fprintf(w, "gpu path   %s (--gpu-registration %s)\n", path, g.Asked)
				for _, n := range g.NotTaken {
					fmt.Fprintf(w, "  not %-7s %s\n", n.Path, n.Reason)
				}
			}
			fmt.Fprintf(w, "staged     %d embeddings, %d receive slots, %d sessions\n", st.Staged, st.Receives, len(st.Sessions))
			printAffinity(w, st.Affinity)
		})
	}
}

// printAffinity writes the GPU-to-NIC table, a line per GPU and NIC
// (docs/operations.md, "Hosts with many GPUs and NICs"), then its
// warnings.
func printAffinity(w io.Writer, a api.Affinity) {
	if len(a.Devices) == 0 {
		return
	}
	fmt.Fprintln(w, "affinity")
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "  GPU\tBUS ID\tNUMA\tNIC\tNETDEV\tGID\tDISTANCE\tWHY")
	dash := func(s string) string { return cmp.Or(s, "-") }
	for _, r := range a.Devices {
		nics := r.NICs
		if len(nics) == 0 {
			nics = []api.AffinityNIC{{}}
		}
		for _, n := range nics {
			fmt.Fprintf(tw, "  %s\t%s\t%d\t%s\t%s\t%s\t%s\t%s\n", r.Device, r.BusID, r.NUMANode, dash(n.Name), dash(n.Netdev), dash(n.GID), r.Distance, r.Why)
		}
	}
	tw.Flush()
	for _, warn := range a.Warnings {
		fmt.Fprintf(w, "warning    %s\n", warn)
	}
}

// shapeFlags are --shape and --dtype.
type shapeFlags struct{ shape, dtype string }

func (s *shapeFlags) register(fs *flag.FlagSet) {
	fs.StringVar(&s.shape, "shape", "", "tensor shape, e.g. 16,4096")
	fs.StringVar(&s.dtype, "dtype", "", "element type: "+strings.Join(api.DTypeNames(), ", "))
}

func (s *shapeFlags) nbytes() ([]int64, int64, error) {
	shape, err := api.ParseShape(s.shape)
	if err != nil {
		return nil, 0, err
	}
	n, _, err := api.NBytes(shape, s.dtype)
	return shape, n, err
}

func cmdStage(fs *flag.FlagSet) func(context.Context, *env) error {
	var sf shapeFlags
	sf.register(fs)
	zeroCopy := fs.Bool("zero-copy", false, "reserve a slice, write it through this process's own mapping of the arena, commit")
	device := fs.String("device", "", "the arena to stage into (cuda:1, cpu: one of ferryd's --device; default its first)")
	return func(ctx context.Context, e *env) error {
		id, err := e.reqID()
		if err != nil {
			return err
		}
		if len(e.args) != 2 {
			return errors.New("give the data file (or - for stdin) after the req_id")
		}
		shape, n, err := sf.nbytes()
		if err != nil {
			return err
		}
		in := os.Stdin
		if e.args[1] != "-" {
			if in, err = os.Open(e.args[1]); err != nil {
				return err
			}
			defer in.Close()
		}
		var emb api.Embedding
		switch {
		case *zeroCopy && *device != "":
			return errors.New("--zero-copy writes through a mapping of ferryd's first arena: drop --device, or drop --zero-copy to upload into that device's arena")
		case *zeroCopy:
			emb, err = stageInPlace(ctx, e.c, id, shape, sf.dtype, n, in)
		default:
			emb, err = e.c.StageOn(ctx, *device, id, shape, sf.dtype, io.LimitReader(in, n+1), n)
		}
		if err != nil {
			return err
		}
		return e.print(emb, func(w io.Writer) {
			fmt.Fprintf(w, "staged %s: %s %s, %d bytes at arena offset %d\n", emb.ReqID, api.ShapeString(emb.Shape), emb.DType, emb.NBytes, emb.Offset)
		})
	}
}

// stageInPlace is zero-copy staging: the bytes go from the file straight
// into ferryd's arena through this process's mapping of it.
func stageInPlace(ctx context.Context, c *client.Client, id string, shape []int64, dtype string, n int64, in io.Reader) (api.Embedding, error) {
	m, err := c.MapArena(ctx)
	if err != nil {
		if client.Code(err) == api.CodeBadRequest {
			err = fmt.Errorf("%w; ferryctl stages GPU memory by upload: drop --zero-copy", err)
		}
		return api.Embedding{}, err
	}
	defer m.Close()
	return c.StageInPlace(ctx, m, id, shape, dtype, func(dst []byte) error {
		if _, err := io.ReadFull(in, dst); err != nil {
			return fmt.Errorf("reading %d bytes for %s: %w", n, id, err)
		}
		return nil
	})
}

func parseUint(s, what string, bits int) (uint64, error) {
	v, err := strconv.ParseUint(s, 0, bits)
	if err != nil {
		return 0, fmt.Errorf("%s %q is not an unsigned integer (decimal or 0x hex)", what, s)
	}
	return v, nil
}

func cmdSend(fs *flag.FlagSet) func(context.Context, *env) error {
	session := fs.String("session", "", "the receiver's session (host:port), or mooncake://host:port of a Mooncake segment")
	addr := fs.String("addr", "", "the receiver's buffer_address")
	key := fs.String("key", "", "the receive slot's key, 40 hex digits (none for a Mooncake segment)")
	slotFile := fs.String("slot", "", "a JSON file with session, buffer_address and key (ferryctl --json recv output)")
	wait := fs.Duration("wait", 0, "wait this long for the req_id to be staged")
	return func(ctx context.Context, e *env) error {
		id, err := e.reqID()
		if err != nil {
			return err
		}
		req := api.SendRequest{Session: *session, WaitMS: wait.Milliseconds()}
		if *slotFile != "" {
			raw, err := os.ReadFile(*slotFile)
			if err != nil {
				return err
			}
			var slot api.ReceiveSlot
			if err := json.Unmarshal(raw, &slot); err != nil {
				return fmt.Errorf("%s is not a receive slot's JSON: %w", *slotFile, err)
			}
			req.Session, req.BufferAddress, req.Key, req.NBytes = slot.Session, slot.BufferAddress, slot.Key, slot.NBytes
		} else {
			if req.BufferAddress, err = parseUint(*addr, "--addr", 64); err != nil {
				return err
			}
			if *key != "" || !strings.HasPrefix(req.Session, "mooncake://") {
				if err := req.Key.UnmarshalText([]byte(*key)); err != nil {
					return fmt.Errorf("--key: %w", err)
				}
			}
		}
		res, err := e.c.Send(ctx, id, req)
		if err != nil {
			return err
		}
		return e.print(res, func(w io.Writer) {
			fmt.Fprintf(w, "sent %s: %d bytes to %s in %.3f ms (%.2f GB/s, %.2f Gbit/s), %s, %d write(s), attempts %d, shared_mr=%t\n",
				res.ReqID, res.NBytes, res.Session, res.Millis, res.GBps, res.GBps*8, res.Transport, res.Writes, res.Attempts, res.SharedMR)
		})
	}
}

func cmdRecv(fs *flag.FlagSet) func(context.Context, *env) error {
	var sf shapeFlags
	sf.register(fs)
	nbytes := fs.Int64("nbytes", 0, "slot size in bytes (or give --shape and --dtype)")
	mc := fs.Bool("mooncake", false, "let Mooncake senders write into the slot too (ferryd with --mooncake-listen)")
	device := fs.String("device", "", "the arena the slot is in (cuda:1, cpu: one of ferryd's --device; default its first)")
	return func(ctx context.Context, e *env) error {
		id, err := e.reqID()
		if err != nil {
			return err
		}
		n := *nbytes
		if sf.shape != "" || sf.dtype != "" {
			if _, n, err = sf.nbytes(); err != nil {
				return err
			}
		}
		slot, err := e.c.ReceiveWith(ctx, api.ReceiveRequest{ReqID: id, NBytes: n, Mooncake: *mc, Device: *device})
		if err != nil {
			return err
		}
		return e.print(slot, func(w io.Writer) {
			fmt.Fprintf(w, "session=%s buffer_address=%#x key=%s nbytes=%d", slot.Session, slot.BufferAddress, slot.Key, slot.NBytes)
			if slot.MooncakeSession != "" {
				fmt.Fprintf(w, " mooncake_session=%s", slot.MooncakeSession)
			}
			fmt.Fprintln(w)
		})
	}
}

func cmdWait(fs *flag.FlagSet) func(context.Context, *env) error {
	outFile := fs.String("o", "", "write the data to this file (- for stdout)")
	wait := fs.Duration("for", 30*time.Second, "how long to wait for the data")
	keep := fs.Bool("keep", false, "keep the receive slot after reading it")
	return func(ctx context.Context, e *env) error {
		id, err := e.reqID()
		if err != nil {
			return err
		}
		if *outFile == "" {
			return errors.New("give -o FILE (or -o - for stdout)")
		}
		data, err := e.c.Wait(ctx, id, *wait)
		if err != nil {
			return err
		}
		if *outFile == "-" {
			_, err = os.Stdout.Write(data)
		} else {
			err = os.WriteFile(*outFile, data, 0o644)
		}
		if err != nil {
			return err
		}
		if !*keep {
			if err := e.c.FreeReceive(ctx, id); err != nil {
				return err
			}
		}
		if *outFile == "-" {
			return nil
		}
		return e.print(map[string]any{"req_id": id, "nbytes": len(data), "file": *outFile}, func(w io.Writer) {
			fmt.Fprintf(w, "received %s: %d bytes -> %s\n", id, len(data), *outFile)
		})
	}
}

func cmdRm(fs *flag.FlagSet) func(context.Context, *env) error {
	recv := fs.Bool("recv", false, "free a receive slot instead of a staged embedding")
	return func(ctx context.Context, e *env) error {
		id, err := e.reqID()
		if err != nil {
			return err
		}
		what := "staged embedding"
		if *recv {
			what = "receive slot"
			err = e.c.FreeReceive(ctx, id)
		} else {
			err = e.c.Delete(ctx, id)
		}
		if err != nil {
			return err
		}
		return e.print(map[string]string{"req_id": id, "removed": what}, func(w io.Writer) {
			fmt.Fprintf(w, "removed %s %s\n", what, id)
		})
	}
}

func cmdComplete(fs *flag.FlagSet) func(context.Context, *env) error {
	return func(ctx context.Context, e *env) error {
		id, err := e.reqID()
		if err != nil {
			return err
		}
		info, err := e.c.CompleteReceive(ctx, id)
		if err != nil {
			return err
		}
		return e.print(info, func(w io.Writer) {
			fmt.Fprintf(w, "completed %s: %d bytes, arrived=%t\n", id, info.NBytes, info.Arrived)
		})
	}
}

func cmdLs(fs *flag.FlagSet) func(context.Context, *env) error {
	return func(ctx context.Context, e *env) error {
		embs, err := e.c.Embeddings(ctx)
		if err != nil {
			return err
		}
		recvs, err := e.c.Receives(ctx)
		if err != nil {
			return err
		}
		v := map[string]any{"embeddings": embs, "receives": recvs}
		return e.print(v, func(w io.Writer) {
			tw := tabwriter.NewWriter(w, 2, 8, 2, ' ', 0)
			fmt.Fprintln(tw, "KIND\tREQ_ID\tSTATE\tNBYTES\tSHAPE\tAGE")
			for _, x := range embs {
				fmt.Fprintf(tw, "staged\t%s\t%s\t%d\t%s %s\t%s\n", x.ReqID, x.State, x.NBytes, api.ShapeString(x.Shape), x.DType, time.Since(x.Since).Round(time.Millisecond))
			}
			for _, x := range recvs {
				state := "waiting"
				if x.Arrived {
					state = "arrived"
				}
				fmt.Fprintf(tw, "receive\t%s\t%s\t%d\t\t%s\n", x.ReqID, state, x.NBytes, time.Since(x.Since).Round(time.Millisecond))
			}
			tw.Flush()
		})
	}
}

// cmdRegions lists the regions: each one's registration with the NIC
// and, for memory an engine registered, the one for peers' writes at
// its addresses (GPU memory: the path it took), then why any failed.
func cmdRegions(fs *flag.FlagSet) func(context.Context, *env) error {
	return func(ctx context.Context, e *env) error {
		regions, err := e.c.Regions(ctx)
		if err != nil {
			return err
		}
		sort.Slice(regions, func(i, j int) bool { return regions[i].Name < regions[j].Name })
		return e.print(regions, func(w io.Writer) {
			tw := tabwriter.NewWriter(w, 2, 8, 2, ' ', 0)
			fmt.Fprintln(tw, "NAME\tKIND\tNBYTES\tUSES\tMOONCAKE_ADDR\tNIC\tENGINE NIC")
			var why []string
			for _, g := range regions {
				addr, nic, engine := "-", "-", "-"
				if g.MooncakeAddr != 0 {
					addr = fmt.Sprintf("%#x", g.MooncakeAddr)
				}
				if n := g.NIC; n != nil {
					nic = map[bool]string{true: "registered", false: "not registered"}[n.Registered]
					if n.Error != "" {
						why = append(why, fmt.Sprintf("%s: nic: %s", g.Name, n.Error))
					}
					if en := n.Engine; en != nil {
						engine = map[bool]string{true: "registered", false: "not registered"}[en.Registered]
						if en.GPU != nil && en.GPU.Path != "" {
							engine = "by " + string(en.GPU.Path)
						}
						if en.Error != "" {
							why = append(why, fmt.Sprintf("%s: engine nic: %s", g.Name, en.Error))
						} else if en.GPU != nil {
							for _, nt := range en.GPU.NotTaken {
								if nt.Failed {
									why = append(why, fmt.Sprintf("%s: engine nic: %s failed: %s", g.Name, nt.Path, nt.Reason))
								}
							}
						}
					}
				}
				fmt.Fprintf(tw, "%s\t%s\t%d\t%d\t%s\t%s\t%s\n", g.Name, g.Kind, g.NBytes, g.Uses, addr, nic, engine)
			}
			tw.Flush()
			for _, line := range why {
				fmt.Fprintln(w, line)
			}
		})
	}
}

func cmdSessions(fs *flag.FlagSet) func(context.Context, *env) error {
	teardown := fs.String("teardown", "", "close and forget the session with this id")
	return func(ctx context.Context, e *env) error {
		if *teardown != "" {
			if err := e.c.Teardown(ctx, *teardown); err != nil {
				return err
			}
			return e.print(map[string]string{"torn_down": *teardown}, func(w io.Writer) {
				fmt.Fprintf(w, "tore down session %s\n", *teardown)
			})
		}
		ss, err := e.c.Sessions(ctx)
		if err != nil {
			return err
		}
		sort.Slice(ss, func(i, j int) bool { return ss[i].ID < ss[j].ID })
		return e.print(ss, func(w io.Writer) {
			tw := tabwriter.NewWriter(w, 2, 8, 2, ' ', 0)
			fmt.Fprintln(tw, "ID\tTRANSPORT\tSTATE\tSENDS\tFAILURES\tLAST ERROR")
			for _, s := range ss {
				fmt.Fprintf(tw, "%s\t%s\t%s\t%d\t%d\t%s\n", s.ID, s.Transport, s.State, s.Sends, s.Failures, s.LastError)
			}
			tw.Flush()
		})
	}
}
