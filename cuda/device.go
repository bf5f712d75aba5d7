package cuda

/*
#include "cuda.h"
*/
import "C"

import (
	"fmt"
	"unsafe"
)

// IPCHandle is a CUDA IPC memory handle (CUipcMemHandle): another process
// on the host opens it with cuIpcOpenMemHandle to map the allocation.
type IPCHandle [64]byte

// The conversions between IPCHandle and the C struct need equal sizes.
var _ = [1]struct{}{}[unsafe.Sizeof(C.ferry_ipc_handle{})-unsafe.Sizeof(IPCHandle{})]

// Device is one GPU with its primary context retained (the context the
// CUDA runtime, and so torch, uses too) and a thread for its calls.
type Device struct {
	drv  *Driver
	cu   C.CUdevice
	ctx  C.CUcontext
	info Info
	w    *worker
}

// Open retains the primary context of GPU ordinal and starts its thread.
// A missing ordinal fails with ErrNoDevice naming what exists.
func (d *Driver) Open(ordinal int) (*Device, error) {
	n, err := d.DeviceCount()
	if err != nil {
		return nil, err
	}
	if ordinal < 0 || ordinal >= n {
		return nil, fmt.Errorf("%w: cuda:%d does not exist: the driver sees %d CUDA device(s)%s",
			ErrNoDevice, ordinal, n, ordinals(n))
	}
	dev := &Device{drv: d}
	if dev.cu, dev.info, err = d.describe(ordinal); err != nil {
		return nil, err
	}
	dev.w, err = startWorker(func() error {
		if err := check("cuDevicePrimaryCtxRetain", Result(C.ferry_cuDevicePrimaryCtxRetain(d.sym.primaryCtxRetain, &dev.ctx, dev.cu))); err != nil {
			return err
		}
		if err := check("cuCtxSetCurrent", Result(C.ferry_cuCtxSetCurrent(d.sym.ctxSetCurrent, dev.ctx))); err != nil {
			C.ferry_cuDevicePrimaryCtxRelease(d.sym.primaryCtxRelease, dev.cu)
			return err
		}
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("%v: %w", dev.info, err)
	}
	return dev, nil
}

// Describe reads GPU ordinal's description (its PCI bus id among it)
// without opening it: no context, no thread.
func (d *Driver) Describe(ordinal int) (Info, error) {
	_, in, err := d.describe(ordinal)
	return in, err
}

func (d *Driver) describe(ordinal int) (C.CUdevice, Info, error) {
	var cu C.CUdevice
	if err := check("cuDeviceGet", Result(C.ferry_cuDeviceGet(d.sym.deviceGet, &cu, C.int(ordinal)))); err != nil {
		return cu, Info{}, fmt.Errorf("cuda:%d: %w", ordinal, err)
	}
	in, err := d.info(ordinal, cu)
	return cu, in, err
}

func ordinals(n int) string {
	if n == 0 {
		return ""
	}
	return fmt.Sprintf(" (cuda:0 to cuda:%d)", n-1)
}

// Info describes the device.
func (dev *Device) Info() Info { return dev.info }

// Close releases the primary context and ends the device's thread. Memory
// allocated through the device must be freed first.
func (dev *Device) Close() error {
	return dev.w.stop(func() error {
		return dev.call("cuDevicePrimaryCtxRelease_v2", C.ferry_cuDevicePrimaryCtxRelease(dev.drv.sym.primaryCtxRelease, dev.cu))
	})
}

// call names a result; it runs on the device thread.
func (dev *Device) call(name string, r C.CUresult) error {
	if err := check(name, Result(r)); err != nil {
		return fmt.Errorf("cuda:%d: %w", dev.info.Ordinal, err)
	}
	return nil
}

// run runs f on the device's thread.
func (dev *Device) run(f func() error) error {
	if err := dev.w.do(f); err != nil {
		if err == errClosed {
			return fmt.Errorf("cuda:%d: %w", dev.info.Ordinal, err)
		}
		return err
	}
	return nil
}

// Alloc allocates n bytes of device memory with cuMemAlloc: plain device
// memory, never managed memory, which would migrate pages behind the NIC's
// back.
func (dev *Device) Alloc(n int64) (uint64, error) {
	var p C.CUdeviceptr
	err := dev.run(func() error {
		return dev.call("cuMemAlloc_v2", C.ferry_cuMemAlloc(dev.drv.sym.memAlloc, &p, C.size_t(n)))
	})
	return uint64(p), err
}

// Free frees memory from Alloc.
func (dev *Device) Free(p uint64) error {
	return dev.run(func() error {
		return dev.call("cuMemFree_v2", C.ferry_cuMemFree(dev.drv.sym.memFree, C.CUdeviceptr(p)))
	})
}

// SetSyncMemops sets CU_POINTER_ATTRIBUTE_SYNC_MEMOPS on the allocation at
// p: a synchronous copy into it has then landed when the call returns,
// before a peer or the NIC reads the memory.
func (dev *Device) SetSyncMemops(p uint64) error {
	return dev.run(func() error {
		return dev.call("cuPointerSetAttribute(SYNC_MEMOPS)", C.ferry_setSyncMemops(dev.drv.sym.pointerSetAttribute, C.CUdeviceptr(p)))
	})
}

// IPCHandle returns the IPC handle of the allocation starting at p.
func (dev *Device) IPCHandle(p uint64) (IPCHandle, error) {
	var h C.ferry_ipc_handle
	err := dev.run(func() error {
		return dev.call("cuIpcGetMemHandle", C.ferry_cuIpcGetMemHandle(dev.drv.sym.ipcGetMemHandle, &h, C.CUdeviceptr(p)))
	})
	return *(*IPCHandle)(unsafe.Pointer(&h)), err
}

// OpenIPC maps another process's allocation into this one and returns its
// base address here. Close it with CloseIPC. (A process cannot open its
// own handles.)
func (dev *Device) OpenIPC(h IPCHandle) (uint64, error) {
	ch := *(*C.ferry_ipc_handle)(unsafe.Pointer(&h))
	var p C.CUdeviceptr
	err := dev.run(func() error {
		return dev.call("cuIpcOpenMemHandle_v2", C.ferry_cuIpcOpenMemHandle(dev.drv.sym.ipcOpenMemHandle, &p, &ch))
	})
	return uint64(p), err
}

// AddressRange returns the allocation holding p: its base and size
// (cuMemGetAddressRange), for memory of this process's or opened by IPC.
func (dev *Device) AddressRange(p uint64) (base uint64, size int64, err error) {
	var b C.CUdeviceptr
	var n C.size_t
	err = dev.run(func() error {
		return dev.call("cuMemGetAddressRange_v2", C.ferry_cuMemGetAddressRange(dev.drv.sym.memGetAddressRange, &b, &n, C.CUdeviceptr(p)))
	})
	return uint64(b), int64(n), err
}

// CloseIPC unmaps memory from OpenIPC.
func (dev *Device) CloseIPC(p uint64) error {
	return dev.run(func() error {
		return dev.call("cuIpcCloseMemHandle", C.ferry_cuIpcCloseMemHandle(dev.drv.sym.ipcCloseMemHandle, C.CUdeviceptr(p)))
	})
}

// ExportDMABuf exports [p, p+n) as a dmabuf file descriptor, which
// ibv_reg_dmabuf_mr registers with a NIC. p and n must be page aligned.
// The caller owns the descriptor.
func (dev *Device) ExportDMABuf(p uint64, n int64) (int, error) {
	switch {
	case dev.drv.sym.memGetHandleForAddressRange == nil:
		return -1, fmt.Errorf("cuda:%d: the driver (CUDA %s) has no cuMemGetHandleForAddressRange: dmabuf export needs CUDA 11.7 or newer",
			dev.info.Ordinal, dev.drv.Version())
	case !dev.info.DMABuf:
		return -1, fmt.Errorf("%v reports CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED=0: dmabuf export needs NVIDIA's open kernel modules", dev.info)
	}
	var fd C.int = -1
	err := dev.run(func() error {
		return dev.call("cuMemGetHandleForAddressRange(DMA_BUF_FD)",
			C.ferry_dmabufExport(dev.drv.sym.memGetHandleForAddressRange, &fd, C.CUdeviceptr(p), C.size_t(n)))
	})
	return int(fd), err
}

// HostAlloc allocates n bytes of pinned (page-locked) host memory, which
// copies to and from the device run at full speed, and a NIC can register.
func (dev *Device) HostAlloc(n int64) ([]byte, error) {
	var p unsafe.Pointer
	err := dev.run(func() error {
		return dev.call("cuMemHostAlloc", C.ferry_cuMemHostAlloc(dev.drv.sym.memHostAlloc, &p, C.size_t(n)))
	})
	if err != nil {
		return nil, err
	}
	return unsafe.Slice((*byte)(p), n), nil
}

// HostFree frees memory from HostAlloc.
func (dev *Device) HostFree(b []byte) error {
	return dev.run(func() error {
		return dev.call("cuMemFreeHost", C.ferry_cuMemFreeHost(dev.drv.sym.memFreeHost, unsafe.Pointer(unsafe.SliceData(b))))
	})
}

// CopyHtoD copies src to device address dst and returns once it landed.
func (dev *Device) CopyHtoD(dst uint64, src []byte) error {
	if len(src) == 0 {
		return nil
	}
	return dev.run(func() error {
		return dev.call("cuMemcpyHtoD_v2", C.ferry_cuMemcpyHtoD(dev.drv.sym.memcpyHtoD, C.CUdeviceptr(dst), unsafe.Pointer(&src[0]), C.size_t(len(src))))
	})
}

// CopyDtoH copies len(dst) bytes from device address src into dst.
func (dev *Device) CopyDtoH(dst []byte, src uint64) error {
	if len(dst) == 0 {
		return nil
	}
	return dev.run(func() error {
		return dev.call("cuMemcpyDtoH_v2", C.ferry_cuMemcpyDtoH(dev.drv.sym.memcpyDtoH, unsafe.Pointer(&dst[0]), C.CUdeviceptr(src), C.size_t(len(dst))))
	})
}
