package daemon

import (
	"errors"
	"fmt"
	"slices"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/rs/zerolog"

	"github.com/ferry-project/ferry/api"
	"github.com/ferry-project/ferry/arena"
	"github.com/ferry-project/ferry/config"
	"github.com/ferry-project/ferry/cuda"
	"github.com/ferry-project/ferry/internal/memlimit"
	"github.com/ferry-project/ferry/internal/size"
	"github.com/ferry-project/ferry/rdma"
)

// memory is the arena's memory (--device): a sealed memfd clients map
// through the descriptor GET /v1/arena passes, or a GPU allocation
// clients open by its IPC handle.
type memory struct {
	arena.Memory
	device string // "cpu" or "cuda:N"
	reason string // why this memory

	host *arena.HostFile // for host memory
	gpu  *cuda.Arena     // for GPU memory
	dev  *cuda.Device
	drv  *cuda.Driver
}

// openMemories allocates an arena's memory on each device --device
// lists, in order, --arena-size's size for each (cuda:all: every GPU the
// driver lists). What was opened is closed again when one fails.
func openMemories(cfg Config, log zerolog.Logger) ([]*memory, error) {
	devs, err := cfg.Device.List()
	if err != nil {
		return nil, fmt.Errorf("--device %s: %w", cfg.Device, err)
	}
	if i := slices.Index(devs, config.DeviceAllGPUs); i >= 0 {
		gpus, err := allGPUs()
		if err != nil {
			return nil, fmt.Errorf("--device %s: %s", cfg.Device, missingGPU(err))
		}
		devs = slices.Replace(devs, i, i+1, gpus...)
	}
	if n := len(cfg.ArenaSize.List()); n > 1 && n != len(devs) {
		return nil, fmt.Errorf("--arena-size %s lists %d sizes for the %d devices of --device %s: give one size for every arena, or one per device", cfg.ArenaSize, n, len(devs), cfg.Device)
	}
	var out []*memory
	for i, dev := range devs {
		m, err := openMemory(cfg, dev, cfg.ArenaSize.For(i), log)
		if err != nil {
			for _, o := range out {
				_ = o.close()
			}
			return nil, err
		}
		out = append(out, m)
	}
	return out, nil
}

// allGPUs is cuda:0 onwards, every GPU the driver lists.
func allGPUs() ([]config.Device, error) {
	drv, err := cuda.Load()
	if err != nil {
		return nil, err
	}
	n, err := gpuCount(drv)
	out := make([]config.Device, n)
	for i := range out {
		out[i] = config.Device(fmt.Sprintf("cuda:%d", i))
	}
	return out, err
}

// gpuCount is how many GPUs drv lists; none is an error.
func gpuCount(drv *cuda.Driver) (int, error) {
	n, err := drv.DeviceCount()
	if err == nil && n == 0 {
		err = fmt.Errorf("%w: the driver (CUDA %s) sees no GPU", cuda.ErrNoDevice, drv.Version())
	}
	return n, err
}

// openMemory allocates one arena's memory, of size bytes on dev. auto
// takes cuda:0 when the driver and a GPU are there, else host memory
// with one INFO line saying why; cuda:N without them fails with a
// sentence naming what is missing.
func openMemory(cfg Config, dev config.Device, size config.Size, log zerolog.Logger) (*memory, error) {
	ordinal, err := dev.Ordinal()
	if err != nil {
		return nil, fmt.Errorf("--device %s: %w", dev, err)
	}
	reason := "--device cpu"
	if dev != config.DeviceCPU {
		drv, err := cuda.Load()
		if err == nil && ordinal < 0 {
			_, err = gpuCount(drv)
		}
		switch {
		case err == nil:
			return openGPU(cfg, dev, size, log, drv, max(ordinal, 0))
		case ordinal >= 0:
			return nil, fmt.Errorf("--device %s: %s", dev, missingGPU(err))
		}
		reason = "--device auto found no usable GPU: " + missingGPU(err)
		log.Info().Str("reason", reason).Msg("the arena is in host memory")
	}
	setting := "--arena-size " + string(size)
	if cfg.ArenaHugePages != "" {
		setting += ", --arena-huge-pages " + cfg.ArenaHugePages
	} else if err := hostRoom(size.Bytes(), memlimit.Host); err != nil {
		return nil, fmt.Errorf("%s: %w", setting, err)
	}
	host, err := arena.NewSealedMemory(size.Bytes(), cfg.HugePageBytes())
	if err != nil {
		return nil, fmt.Errorf("%s: %w", setting, err)
	}
	return &memory{Memory: host, device: string(config.DeviceCPU), reason: reason, host: host}, nil
}

// hostRoom refuses an arena of n bytes of ordinary pages that this host
// cannot have: more than its available memory (MemAvailable), or than
// ferryd's cgroup memory limit (MemoryMax=). Reserving it would
// otherwise end in the OOM killer, not in an error that names the
// setting. Huge pages need no check: the kernel refuses them cleanly.
func hostRoom(n int64, roots memlimit.Roots) error {
	avail, err := roots.Available()
	if err != nil {
		return err
	}
	if n > avail {
		return fmt.Errorf("the arena needs %s of memory and this host has %s available (MemAvailable in %s/meminfo): lower arena_size, or free memory", size.Format(n), size.Format(avail), roots.Proc)
	}
	lim, limited, err := roots.Read()
	if err == nil && limited && n > lim.Bytes {
		return fmt.Errorf("the arena needs %s of memory and ferryd's cgroup may hold %s (%s, MemoryMax= of its unit): lower arena_size, or raise MemoryMax= above it", size.Format(n), size.Format(lim.Bytes), lim.File)
	}
	return nil
}

// missingGPU says what is missing, and what to do, in one sentence.
func missingGPU(err error) string {
	switch {
	case errors.Is(err, cuda.ErrNoDriver):
		return fmt.Sprintf("%v: install the NVIDIA driver (it provides %s), or run with --device cpu", err, cuda.Library)
	case errors.Is(err, cuda.ErrNoDevice):
		return fmt.Sprintf("%v: check nvidia-smi and CUDA_VISIBLE_DEVICES, or run with --device cpu", err)
	}
	return fmt.Sprintf("the CUDA driver failed: %v: check nvidia-smi and the kernel log, or run with --device cpu", err)
}

func openGPU(cfg Config, device config.Device, size config.Size, log zerolog.Logger, drv *cuda.Driver, ordinal int) (*memory, error) {
	dev, err := drv.Open(ordinal)
	if err != nil {
		return nil, fmt.Errorf("--device %s: %s", device, missingGPU(err))
	}
	gpu, err := cuda.NewArena(dev, size.Bytes(), min(cfg.BounceSize.Bytes(), size.Bytes()))
	if err != nil {
		dev.Close()
		return nil, fmt.Errorf("--device %s, --arena-size %s, --bounce-size %s: %w", device, size, cfg.BounceSize, err)
	}
	in := dev.Info()
	m := &memory{Memory: gpu, device: fmt.Sprintf("cuda:%d", ordinal), gpu: gpu, dev: dev, drv: drv,
		reason: fmt.Sprintf("--device %s: %v", device, in)}
	ev := log.Info().Str("device", m.device).Str("name", in.Name).Str("uuid", in.UUID).Str("pci_bus_id", in.PCIBusID).
		Str("driver", drv.Version()).Int64("arena_size", gpu.Size()).Int64("bounce_size", int64(len(gpu.BounceArea()))).
		Bool("gpudirect_rdma", in.GPUDirectRDMA).Bool("dmabuf", in.DMABuf).Bool("vmm", in.VMM)
	if _, err := gpu.IPCHandle(); err != nil {
		ev = ev.Str("ipc_error", err.Error())
	}
	if err := m.dmabufErr(); err != nil {
		ev = ev.Str("dmabuf_reason", err.Error())
	}
	ev.Bool("dmabuf_exported", m.dmabufErr() == nil).Msg("the arena is in GPU memory")
	return m, nil
}

func (m *memory) dmabufErr() error {
	_, _, err := m.gpu.DMABuf()
	return err
}

// nicView is the GPU arena as the RDMA transport registers it, by path.
func (m *memory) nicView(path api.GPURegistration) *rdma.DeviceMemory {
	fd, off, err := m.gpu.DMABuf()
	return &rdma.DeviceMemory{Base: m.gpu.Base(), Size: uint64(m.gpu.Size()), DMABufFD: fd, DMABufOffset: uint64(off), DMABufErr: err,
		Bounce: m.gpu.BounceArea(), Path: path}
}

// Path names the memory clients map (arena.SealedName), "" for GPU
// memory.
func (m *memory) Path() string {
	if m.host == nil {
		return ""
	}
	return m.host.Path()
}

// HugePages reports whether a host arena is in huge pages.
func (m *memory) HugePages() bool { return m.host != nil && m.host.HugePages() }

// ipc is what a client needs to open a GPU arena; nil for host memory or
// when the driver gave no handle.
func (m *memory) ipc() *api.CUDAIPC {
	if m.gpu == nil {
		return nil
	}
	h, err := m.gpu.IPCHandle()
	if err != nil {
		return nil
	}
	return &api.CUDAIPC{Device: m.device, IPCHandle: h[:]}
}

// status describes a GPU arena for GET /v1/status; nil for host memory.
func (m *memory) status() *api.CUDAStatus {
	if m.gpu == nil {
		return nil
	}
	in := m.gpu.Device()
	st := &api.CUDAStatus{
		Name: in.Name, UUID: in.UUID, PCIBusID: in.PCIBusID, TotalMemory: in.TotalMemory,
		DriverVersion: m.drv.Version(), GPUDirectRDMA: in.GPUDirectRDMA, DMABuf: in.DMABuf, VMM: in.VMM,
		UnifiedAddressing: in.UnifiedAddressing, BounceSize: int64(len(m.gpu.BounceArea())),
		BounceFallbacks: m.gpu.BounceFallbacks(), StagingPeak: m.gpu.StagingPeak(), DMABufExported: m.dmabufErr() == nil,
	}
	if h, err := m.gpu.IPCHandle(); err == nil {
		st.IPCHandle = h[:]
	} else {
		st.IPCError = err.Error()
	}
	if err := m.dmabufErr(); err != nil {
		st.DMABufReason = err.Error()
	}
	return st
}

// collectors are a GPU arena's copy counters (its own and its CUDA
// regions'), 0 for host memory (which the host reads and writes in
// place): a NIC that reaches the GPU memory directly leaves them still
// during transfers.
func (m *memory) collectors() []prometheus.Collector {
	copied := func(to int) float64 {
		if m.gpu == nil {
			return 0
		}
		in, out := m.gpu.CopiedBytes()
		return float64([]int64{in, out}[to])
	}
	const help = "Bytes copied between GPU memory (the arena, CUDA regions) and host memory by direction (to_device: uploads and received writes staged in host memory; to_host: sends and reads staged in host memory); 0 for a host arena."
	return []prometheus.Collector{
		prometheus.NewCounterFunc(prometheus.CounterOpts{Name: "ferry_gpu_copied_bytes_total", Help: help, ConstLabels: prometheus.Labels{"direction": "to_device"}},
			func() float64 { return copied(0) }),
		prometheus.NewCounterFunc(prometheus.CounterOpts{Name: "ferry_gpu_copied_bytes_total", Help: help, ConstLabels: prometheus.Labels{"direction": "to_host"}},
			func() float64 { return copied(1) }),
		prometheus.NewCounterFunc(prometheus.CounterOpts{
			Name: "ferry_gpu_bounce_fallbacks_total",
			Help: "Copies to or from the GPU arena staged in pageable memory because the pinned bounce area was full (at most the arena's size is lent so, past which a copy is refused; raise --bounce-size if it keeps rising); 0 for a host arena.",
		}, func() float64 {
			if m.gpu == nil {
				return 0
			}
			return float64(m.gpu.BounceFallbacks())
		}),
	}
}

// close frees the memory, then lets go of the GPU.
func (m *memory) close() error {
	err := m.Memory.Close()
	if m.dev != nil {
		err = errors.Join(err, m.dev.Close())
	}
	return err
}

// registration says how the arena is made visible to the NIC. The TCP
// transport registers nothing: it reads and writes host memory directly, and
// stages a GPU arena's bytes in the pinned bounce area.
func (d *Daemon) registration() api.Registration {
	reg := d.dp.registration()
	if reg.Mode == api.RegistrationNone && d.mem.gpu != nil {
		reg.Reason = "the tcp transport copies GPU memory through the pinned host bounce area (cuMemcpyHtoD/DtoH); there is nothing to register with a NIC"
	}
	return reg
}
