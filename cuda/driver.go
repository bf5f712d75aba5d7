// Package cuda drives NVIDIA GPUs through the CUDA driver API, loaded at
// run time from libcuda.so.1 (dlopen), so ferryd builds with gcc alone and
// starts on hosts without a GPU. It covers what ferry's arena needs:
// devices and their attributes, one device allocation holding the arena,
// CUDA IPC handles for local clients, a dmabuf for the NIC, pinned host
// memory and copies. Every call that needs a context runs on one locked OS
// thread per device, with the device's primary context current.
package cuda

/*
#include <stdlib.h>
#include "cuda.h"
*/
import "C"

import (
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"unsafe"

	"github.com/ferry-project/ferry/internal/dl"
)

// Library is the driver library ferry loads.
const Library = "libcuda.so.1"

// symbols are the driver entry points, looked up with dlsym. cuda.h maps
// each API name to its current versioned symbol (cuMemAlloc ->
// cuMemAlloc_v2, ...); the table names those directly, since dlsym sees no
// macros.
type symbols struct {
	getErrorName, getErrorString, init, driverGetVersion                               unsafe.Pointer
	deviceGetCount, deviceGet, deviceGetName, deviceGetUUID, deviceGetPCIBusID         unsafe.Pointer
	deviceTotalMem, deviceGetAttribute                                                 unsafe.Pointer
	primaryCtxRetain, primaryCtxRelease, ctxSetCurrent                                 unsafe.Pointer
	memAlloc, memFree, memcpyHtoD, memcpyDtoH, pointerSetAttribute, memGetAddressRange unsafe.Pointer
	ipcGetMemHandle, ipcOpenMemHandle, ipcCloseMemHandle, memHostAlloc, memFreeHost    unsafe.Pointer
	memGetHandleForAddressRange                                                        unsafe.Pointer // optional: CUDA 11.7+
}

// symbol is one table entry: the first of names the library has is used.
type symbol struct {
	names    []string
	optional bool
	dst      *unsafe.Pointer
}

func (s *symbols) table() []symbol {
	req := func(dst *unsafe.Pointer, names ...string) symbol { return symbol{names: names, dst: dst} }
	return []symbol{
		req(&s.getErrorName, "cuGetErrorName"),
		req(&s.getErrorString, "cuGetErrorString"),
		req(&s.init, "cuInit"),
		req(&s.driverGetVersion, "cuDriverGetVersion"),
		req(&s.deviceGetCount, "cuDeviceGetCount"),
		req(&s.deviceGet, "cuDeviceGet"),
		req(&s.deviceGetName, "cuDeviceGetName"),
		req(&s.deviceGetUUID, "cuDeviceGetUuid_v2", "cuDeviceGetUuid"),
		req(&s.deviceGetPCIBusID, "cuDeviceGetPCIBusId"),
		req(&s.deviceTotalMem, "cuDeviceTotalMem_v2"),
		req(&s.deviceGetAttribute, "cuDeviceGetAttribute"),
		req(&s.primaryCtxRetain, "cuDevicePrimaryCtxRetain"),
		req(&s.primaryCtxRelease, "cuDevicePrimaryCtxRelease_v2"),
		req(&s.ctxSetCurrent, "cuCtxSetCurrent"),
		req(&s.memAlloc, "cuMemAlloc_v2"),
		req(&s.memFree, "cuMemFree_v2"),
		req(&s.memcpyHtoD, "cuMemcpyHtoD_v2"),
		req(&s.memcpyDtoH, "cuMemcpyDtoH_v2"),
		req(&s.pointerSetAttribute, "cuPointerSetAttribute"),
		req(&s.memGetAddressRange, "cuMemGetAddressRange_v2"),
		req(&s.ipcGetMemHandle, "cuIpcGetMemHandle"),
		req(&s.ipcOpenMemHandle, "cuIpcOpenMemHandle_v2"),
		req(&s.ipcCloseMemHandle, "cuIpcCloseMemHandle"),
		req(&s.memHostAlloc, "cuMemHostAlloc"),
		req(&s.memFreeHost, "cuMemFreeHost"),
		{names: []string{"cuMemGetHandleForAddressRange"}, optional: true, dst: &s.memGetHandleForAddressRange},
	}
}

// symbolSource is where resolve looks symbols up: a *dl.Lib.
type symbolSource interface {
	Name() string
	Sym(name string) (unsafe.Pointer, error)
}

// resolve fills each entry of table from lib. A missing optional symbol
// stays nil (its feature reports itself unavailable); missing required
// ones are all named in one ErrNoDriver error.
func resolve(lib symbolSource, table []symbol) error {
	var missing []string
	for _, s := range table {
		for _, name := range s.names {
			if p, err := lib.Sym(name); err == nil && p != nil {
				*s.dst = p
				break
			}
		}
		if *s.dst == nil && !s.optional {
			missing = append(missing, strings.Join(s.names, " or "))
		}
	}
	if len(missing) > 0 {
		return fmt.Errorf("%w: %s lacks %s: the NVIDIA driver is older than ferry needs; install a newer one",
			ErrNoDriver, lib.Name(), strings.Join(missing, ", "))
	}
	return nil
}

// Driver is the loaded and initialised CUDA driver.
type Driver struct {
	lib     *dl.Lib
	sym     symbols
	version int
}

var (
	loadOnce sync.Once
	loadDrv  *Driver
	loadErr  error
	// loaded lets Result name codes the built-in table does not know.
	loaded atomic.Pointer[Driver]
)

// Load loads libcuda.so.1 and initialises it (cuInit), once per process.
// It fails with ErrNoDriver when the library is missing or incomplete, and
// with ErrNoDevice when the driver finds no GPU.
func Load() (*Driver, error) {
	loadOnce.Do(func() { loadDrv, loadErr = load(Library) })
	return loadDrv, loadErr
}

func load(name string) (*Driver, error) {
	lib, err := dl.Open(name)
	if err != nil {
		var de *dl.Error
		if errors.As(err, &de) {
			// dlerror's text already names the library.
			return nil, fmt.Errorf("%w: %s", ErrNoDriver, de.Message)
		}
		return nil, fmt.Errorf("%w: %v", ErrNoDriver, err)
	}
	d := &Driver{lib: lib}
	if err := resolve(lib, d.sym.table()); err != nil {
		lib.Close()
		return nil, err
	}
	loaded.CompareAndSwap(nil, d)
	if err := check("cuInit", Result(C.ferry_cuInit(d.sym.init, 0))); err != nil {
		return nil, err
	}
	var v C.int
	if err := check("cuDriverGetVersion", Result(C.ferry_cuDriverGetVersion(d.sym.driverGetVersion, &v))); err != nil {
		return nil, err
	}
	d.version = int(v)
	return d, nil
}

// Version is the CUDA version the driver supports, e.g. "12.4".
func (d *Driver) Version() string {
	return fmt.Sprintf("%d.%d", d.version/1000, d.version%1000/10)
}

func (d *Driver) errorName(r Result) (string, bool) {
	var s *C.char
	if C.ferry_cuGetErrorName(d.sym.getErrorName, C.CUresult(r), &s) != 0 || s == nil {
		return "", false
	}
	return C.GoString(s), true
}

func (d *Driver) errorString(r Result) (string, bool) {
	var s *C.char
	if C.ferry_cuGetErrorString(d.sym.getErrorString, C.CUresult(r), &s) != 0 || s == nil {
		return "", false
	}
	return C.GoString(s), true
}

// DeviceCount is how many GPUs the driver sees.
func (d *Driver) DeviceCount() (int, error) {
	var n C.int
	if err := check("cuDeviceGetCount", Result(C.ferry_cuDeviceGetCount(d.sym.deviceGetCount, &n))); err != nil {
		return 0, err
	}
	return int(n), nil
}

// Device attributes ferry reports (CUdevice_attribute values of cuda.h).
const (
	attrUnifiedAddressing = 41
	attrVMM               = 102 // CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED
	attrGPUDirectRDMA     = 116
	attrDMABuf            = 124
)

// Info describes one GPU.
type Info struct {
	Ordinal           int
	Name              string
	UUID              string // GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx, as nvidia-smi prints it
	PCIBusID          string // domain:bus:device.function in lower case, as sysfs names it
	TotalMemory       int64
	GPUDirectRDMA     bool // the NIC may read and write its memory directly
	DMABuf            bool // its memory can be exported as a dmabuf (for ibv_reg_dmabuf_mr)
	VMM               bool // cuMemCreate/cuMemMap are supported
	UnifiedAddressing bool
}

// String is "cuda:N (name)".
func (i Info) String() string { return fmt.Sprintf("cuda:%d (%s)", i.Ordinal, i.Name) }

// info reads a device's description; none of these calls needs a context.
func (d *Driver) info(ordinal int, dev C.CUdevice) (Info, error) {
	in := Info{Ordinal: ordinal}
	var name [256]C.char
	var uuid C.ferry_uuid
	var bus [64]C.char
	var total C.size_t
	errs := []error{
		check("cuDeviceGetName", Result(C.ferry_cuDeviceGetName(d.sym.deviceGetName, &name[0], C.int(len(name)), dev))),
		check("cuDeviceGetUuid", Result(C.ferry_cuDeviceGetUuid(d.sym.deviceGetUUID, &uuid, dev))),
		check("cuDeviceGetPCIBusId", Result(C.ferry_cuDeviceGetPCIBusId(d.sym.deviceGetPCIBusID, &bus[0], C.int(len(bus)), dev))),
		check("cuDeviceTotalMem_v2", Result(C.ferry_cuDeviceTotalMem(d.sym.deviceTotalMem, &total, dev))),
	}
	for attr, dst := range map[int]*bool{
		attrUnifiedAddressing: &in.UnifiedAddressing, attrVMM: &in.VMM,
		attrGPUDirectRDMA: &in.GPUDirectRDMA, attrDMABuf: &in.DMABuf,
	} {
		var v C.int
		// An attribute newer than the driver reads as unsupported.
		if C.ferry_cuDeviceGetAttribute(d.sym.deviceGetAttribute, &v, C.int(attr), dev) == 0 {
			*dst = v != 0
		}
	}
	if err := errors.Join(errs...); err != nil {
		return in, fmt.Errorf("describing cuda:%d: %w", ordinal, err)
	}
	in.Name = C.GoString(&name[0])
	in.UUID = formatUUID(C.GoBytes(unsafe.Pointer(&uuid), 16))
	in.PCIBusID = sysfsBusID(C.GoString(&bus[0]))
	in.TotalMemory = int64(total)
	return in, nil
}

// sysfsBusID writes a PCI address the way /sys/bus/pci/devices names it
// (0000:3b:00.0): lower case, a 4-digit domain, so it can be compared with
// a NIC's address there.
func sysfsBusID(id string) string {
	var dom, bus, dev, fn uint
	if n, err := fmt.Sscanf(id, "%x:%x:%x.%x", &dom, &bus, &dev, &fn); err != nil || n != 4 {
		return strings.ToLower(id)
	}
	return fmt.Sprintf("%04x:%02x:%02x.%x", dom, bus, dev, fn)
}

func formatUUID(b []byte) string {
	return fmt.Sprintf("GPU-%x-%x-%x-%x-%x", b[0:4], b[4:6], b[6:8], b[8:10], b[10:16])
}
