"""GPU memory a client lends ferryd as a region (docs/python.md,
"Regions"): the CUDA IPC handle of the allocation holding a tensor, and
the tensor's offset in it, read through the CUDA driver with ctypes."""

import ctypes


class _IpcMemHandle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_ubyte * 64)]


_lib = None

_CU_POINTER_ATTRIBUTE_MEMORY_TYPE = 2
_CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL = 9
_CU_MEMORYTYPE_DEVICE = 2


def driver():
    """libcuda.so.1, initialised and its calls typed, or None without one."""
    global _lib
    if _lib is None:
        try:
            lib = ctypes.CDLL("libcuda.so.1")
        except OSError:
            lib = None
        if lib is not None and lib.cuInit(0) == 0:
            lib.cuMemGetAddressRange_v2.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_size_t), ctypes.c_uint64]
            lib.cuIpcGetMemHandle.argtypes = [ctypes.POINTER(_IpcMemHandle), ctypes.c_uint64]
            _lib = lib
        else:
            _lib = False
    return _lib or None


def device_ordinal(ptr):
    """The GPU holding ptr when the CUDA driver knows it as device memory,
    else None (also without a driver). Reading such a pointer from the
    host would crash the process."""
    lib = driver()
    if lib is None:
        return None
    kind, ordinal = ctypes.c_uint(0), ctypes.c_int(-1)
    if lib.cuPointerGetAttribute(ctypes.byref(kind), _CU_POINTER_ATTRIBUTE_MEMORY_TYPE, ctypes.c_uint64(ptr)) != 0:
        return None
    if kind.value != _CU_MEMORYTYPE_DEVICE:
        return None
    if lib.cuPointerGetAttribute(ctypes.byref(ordinal), _CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, ctypes.c_uint64(ptr)) != 0:
        return None
    return ordinal.value


def ipc_handle(ptr):
    """(the 64-byte IPC handle of the allocation holding device address
    ptr, ptr's offset in that allocation). The calling thread must have
    the device's context current (torch makes it so for its tensors)."""
    lib = driver()
    if lib is None:
        raise ImportError("GPU regions need the CUDA driver (libcuda.so.1), and it is not here or sees no GPU")
    base, size = ctypes.c_uint64(0), ctypes.c_size_t(0)
    if (r := lib.cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), ctypes.c_uint64(ptr))) != 0:
        raise ValueError(f"{ptr:#x} is not CUDA device memory this process can see (cuMemGetAddressRange: CUresult {r})")
    h = _IpcMemHandle()
    if (r := lib.cuIpcGetMemHandle(ctypes.byref(h), base)) != 0:
        raise ValueError(f"cuIpcGetMemHandle of the allocation at {base.value:#x}: CUresult {r} "
                         "(memory from cudaMallocAsync pools or cuMemCreate has no IPC handle of this kind)")
    return bytes(h.reserved), ptr - base.value


class CUDARegion:
    """A tensor's GPU memory lent to ferryd (``Client.register_cuda_region``):
    a transfer source, or the place of receive slots (``receive(...,
    region=...)``). The tensor is the view of it; ``close`` takes it back
    (keep the tensor alive until then)."""

    def __init__(self, client, name, nbytes, tensor):
        self.name = name
        self.nbytes = nbytes
        self._client = client
        self._tensor = tensor  # the memory must outlive the region
        self.registered = True

    def close(self, timeout=30.0):
        """Takes the region back from ferryd once no transfer or write uses it."""
        if self.registered:
            self._client.unregister_region(self.name, timeout)
            self.registered = False
            self._tensor = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self):
        return f"<ferry.CUDARegion {self.name} {self.nbytes} bytes>"
