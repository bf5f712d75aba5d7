package rdma

import (
	"errors"
	"fmt"
	"strings"
	"time"

	"golang.org/x/sys/unix"

	"github.com/ferry-project/ferry/api"
	"github.com/ferry-project/ferry/transport"
)

// A GPU arena is registered with the NIC once, by the first of three
// paths that works (or the one --gpu-registration forces): its dmabuf
// (ibv_reg_dmabuf_mr), its device pointer (ibv_reg_mr, which needs
// nvidia-peermem), or its pinned host bounce area. On the first two the
// NIC reads and writes device memory itself: writes from and into the
// arena go with no copy. On the third the daemon copies through the
// bounce area, which needs no registration per write.

// DeviceMemory is a GPU arena as the NIC may reach it. Go never touches
// it: the transport hands its addresses to the NIC only.
type DeviceMemory struct {
	Base uint64 // the device pointer of its first byte
	Size uint64
	// DMABufFD is the arena exported as a dmabuf (Base at DMABufOffset
	// in it), -1 when it is not; DMABufErr says why not.
	DMABufFD     int
	DMABufOffset uint64
	DMABufErr    error
	// Bounce is the arena's pinned host bounce area (never Go memory).
	Bounce []byte
	// Path is the path to take, or api.GPURegistrationAuto (or "") for
	// the first that works.
	Path api.GPURegistration
}

// GPURegistration is which path registered the GPU arena, and why the
// others were not taken.
type GPURegistration struct {
	Asked api.GPURegistration
	Path  api.GPURegistration // "" when none worked
	// NotTaken is each other path: its error with what to do, or why it
	// was not tried.
	NotTaken []PathNotTaken
}

// PathNotTaken is a path not taken: Err when it failed, else Reason.
type PathNotTaken struct {
	Path   api.GPURegistration
	Err    error
	Reason string
}

// InPlace reports whether the NIC reaches the arena itself (dmabuf or
// peer memory): writes from and into it carry device addresses.
func (g *GPURegistration) InPlace() bool {
	return g != nil && (g.Path == api.GPURegistrationDMABuf || g.Path == api.GPURegistrationPeerMem)
}

// registerDevice registers cfg.Device by the paths it allows, recording
// each failure with its fix. A forced path that fails is an error; with
// auto, no path working leaves every write copied (mode none). On the
// paths where the NIC reaches the arena itself it registers for windows
// when the Sink makes them (windowed) and the NIC binds them over that
// memory, else for remote writes.
func (t *Transport) registerDevice(windowed bool) error {
	d := t.cfg.Device
	asked := d.Path
	if asked == "" {
		asked = api.GPURegistrationAuto
	}
	g := &GPURegistration{Asked: asked}
	t.reg = Registration{Mode: api.RegistrationNone, Bytes: int64(d.Size), GPU: g}
	t.noWindows = errors.New("the receiving Sink puts no windows over its slots")
	for _, p := range api.GPURegistrationPaths {
		if g.Path != "" || asked != api.GPURegistrationAuto && p != asked {
			why := fmt.Sprintf("not tried: --gpu-registration %s", asked)
			if g.Path != "" {
				why = fmt.Sprintf("not tried: %s was taken first", g.Path)
			}
			g.NotTaken = append(g.NotTaken, PathNotTaken{Path: p, Reason: why})
			continue
		}
		start := time.Now()
		var reg region
		var err, windowsErr error
		if windowed && p != api.GPURegistrationBounce {
			reg, t.windows, windowsErr = t.registerWindowed(func() (region, error) { return t.registerPath(p, windowBinding) }, d.Base, d.Size)
			t.noWindows = windowsErr
		}
		if reg == nil {
			reg, err = t.registerPath(p, peerWrites)
			if err != nil && windowsErr != nil && !strings.Contains(windowsErr.Error(), err.Error()) {
				// Both tries are the path's story when they failed apart:
				// a NIC may refuse MW_BIND alone, or the memory under
				// either.
				err = fmt.Errorf("%w; asked first with windows over the slots: %v", err, windowsErr)
			}
		}
		if err != nil {
			g.NotTaken = append(g.NotTaken, PathNotTaken{Path: p, Err: err})
			continue
		}
		t.reg.Took = time.Since(start)
		t.shared, g.Path, t.reg.Mode = reg, p, api.RegistrationShared
		if p == api.GPURegistrationBounce {
			t.mem, t.reg.Bytes = d.Bounce, int64(len(d.Bounce))
			t.noWindows = errors.New("the GPU arena's slots are out of the NIC's reach on the bounce path")
		} else {
			t.dev = transport.Range{Addr: d.Base, Len: d.Size}
		}
	}
	if g.Path != "" {
		return nil
	}
	var errs []error
	for _, n := range g.NotTaken {
		if n.Err == nil {
			continue
		}
		if n.Path == asked {
			return fmt.Errorf("--gpu-registration %s: %w; run with --gpu-registration auto to take the first path that works", asked, n.Err)
		}
		errs = append(errs, fmt.Errorf("%s: %w", n.Path, n.Err))
	}
	t.reg.Err = fmt.Errorf("no way to register the GPU arena with the NIC worked, so every write is copied through host memory: %w", errors.Join(errs...))
	return nil
}

// registerPath registers the arena by path p for u (the bounce area is
// never registered for windows: it holds no slot), or says why it
// cannot and what to do.
func (t *Transport) registerPath(p api.GPURegistration, u use) (region, error) {
	return t.registerPathRange(p, 0, t.cfg.Device.Size, u)
}

// registerPathRange is registerPath for the n bytes at offset off of
// the arena, at their device addresses; the bounce path registers the
// whole bounce area or nothing.
func (t *Transport) registerPathRange(p api.GPURegistration, off, n uint64, u use) (region, error) {
	d := t.cfg.Device
	if off > d.Size || n > d.Size-off {
		return nil, fmt.Errorf("%d bytes at offset %d pass the end of the %d-byte GPU arena", n, off, d.Size)
	}
	switch p {
	case api.GPURegistrationDMABuf:
		if d.DMABufFD < 0 {
			return nil, fmt.Errorf("the arena is not exported as a dmabuf (%v): %s", d.DMABufErr, noDMABufAdvice)
		}
		return t.registerDMABuf(d.DMABufFD, d.DMABufOffset+off, n, d.Base+off, u)
	case api.GPURegistrationPeerMem:
		return t.registerPeerMem(d.Base+off, n, d.Base+off, u)
	case api.GPURegistrationBounce:
		if off != 0 || n != d.Size {
			return nil, errors.New("on the bounce path the NIC reaches no GPU memory, so no part of the GPU arena is registered on its own: load nvidia-peermem or use dmabuf")
		}
		if len(d.Bounce) == 0 {
			return nil, errors.New("the arena has no pinned bounce area")
		}
		reg, err := t.nic.Register(d.Bounce, peerWrites)
		if err != nil {
			return nil, fmt.Errorf("registering the %d-byte pinned bounce area: %w (%s); %s", len(d.Bounce), err, errnoName(err), memlockLimit())
		}
		return reg, nil
	}
	return nil, fmt.Errorf("unknown GPU registration path %q: auto, dmabuf, peermem or bounce", p)
}

// registerDMABuf registers n bytes at offset off of dmabuf fd, reached
// at addresses from iova on, or says why not and what to do.
func (t *Transport) registerDMABuf(fd int, off, n, iova uint64, u use) (region, error) {
	reg, err := t.nic.RegisterDMABuf(fd, off, n, iova, u)
	if err != nil {
		return nil, fmt.Errorf("%w (%s): %s", err, errnoName(err), dmabufAdvice(err))
	}
	return reg, nil
}

// registerPeerMem registers n bytes of device memory at addr by its
// device pointer, reached at addresses from iova on, or says why not
// and what to do.
func (t *Transport) registerPeerMem(addr, n, iova uint64, u use) (region, error) {
	reg, err := t.nic.RegisterDevice(addr, n, iova, u)
	if err != nil {
		return nil, fmt.Errorf("%w (%s): %s", err, errnoName(err), peermemAdvice(err))
	}
	return reg, nil
}

// noDMABufAdvice is what to do when GPU memory has no dmabuf export.
const noDMABufAdvice = "dmabuf needs Linux 5.12 or later and NVIDIA's open GPU kernel modules; else load nvidia-peermem, or run with --gpu-registration bounce"

// dmabufAdvice says what a failed ibv_reg_dmabuf_mr means.
func dmabufAdvice(err error) string {
	if errors.Is(err, unix.EOPNOTSUPP) || errors.Is(err, unix.ENOSYS) || errors.Is(err, unix.EPROTONOSUPPORT) {
		return "the NIC's driver does not register dmabufs (mlx5 does from Linux 5.12; soft-RoCE never does): use such a NIC and kernel, load nvidia-peermem for the peermem path, or run with --gpu-registration bounce"
	}
	return "the NIC could not import the arena's dmabuf: check the kernel log; dmabuf needs Linux 5.12 or later, NVIDIA's open GPU kernel modules and a NIC driver with dmabuf support; else load nvidia-peermem, or run with --gpu-registration bounce"
}

// peermemAdvice says what a failed ibv_reg_mr of device memory means:
// users' most common "Bad address".
func peermemAdvice(err error) string {
	if errors.Is(err, unix.EFAULT) {
		return "the NIC's driver cannot pin GPU memory: load nvidia-peermem (modprobe nvidia-peermem), or use dmabuf (Linux 5.12 or later with NVIDIA's open GPU kernel modules), or run with --gpu-registration bounce"
	}
	return "the NIC could not register GPU memory: check that nvidia-peermem is loaded (lsmod | grep nvidia_peermem) and the kernel log, or run with --gpu-registration bounce"
}

// errnoName is the errno's name in err's chain ("EFAULT"), or "error".
func errnoName(err error) string {
	var errno unix.Errno
	if errors.As(err, &errno) {
		return unix.ErrnoName(errno)
	}
	return "error"
}
