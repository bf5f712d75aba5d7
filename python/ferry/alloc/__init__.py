"""ferry's allocator: where tensors are born so that ferryd can reach them.

``libferry_alloc.so`` (ferry_alloc.c beside this file; ``make alloc``
builds it here) is loaded with LD_PRELOAD, by ``python -m ferry.run`` or
by hand::

    LD_PRELOAD=$(python -c 'import ferry.alloc; print(ferry.alloc.LIBRARY)') python serve.py

Allocations of FERRY_ALLOC_MIN bytes or more (default 64 KiB) then come
from one memfd of the process, mapped MAP_SHARED over a window of address
space; ferry.mooncake lends that memfd to ferryd, which writes peers'
bytes into the very pages a registered tensor lies in.
"""

import ctypes
import os

__all__ = ["LIBRARY", "Window", "preloaded", "window", "stats", "buffer", "free"]

# Where make alloc builds the library: beside this file.
LIBRARY = os.path.join(os.path.dirname(os.path.abspath(__file__)), "libferry_alloc.so")


class Window:
    """This process's window: the memfd and the addresses it is mapped at."""

    def __init__(self, fd, base, length):
        self.fd, self.base, self.length = fd, base, length

    def holds(self, addr, nbytes):
        """Whether [addr, addr+nbytes) lies in the window."""
        return self.base <= addr and addr + nbytes <= self.base + self.length

    def __repr__(self):
        return f"Window(fd={self.fd}, base={self.base:#x}, length={self.length})"


def _lib():
    """The preloaded library's symbols, or None when it is not loaded."""
    here = ctypes.CDLL(None)
    if not hasattr(here, "ferry_alloc_window"):
        return None
    return here


def preloaded():
    """Whether the library is loaded in this process (with or without a
    window to lend: a fork child has none)."""
    return _lib() is not None


def window():
    """The Window of this process, or None: started without the preload
    (or the library failed to make one), or a fork child, whose window is
    private to it."""
    lib = _lib()
    if lib is None:
        return None
    fd, base, length = ctypes.c_int(), ctypes.c_uint64(), ctypes.c_uint64()
    if lib.ferry_alloc_window(ctypes.byref(fd), ctypes.byref(base), ctypes.byref(length)) != 0:
        return None
    return Window(fd.value, base.value, length.value)


def buffer(nbytes):
    """The address of nbytes from the window, whatever their size (free it
    with free()); 0 without the preload or room in the window."""
    lib = _lib()
    if lib is None or lib.ferry_alloc_window(ctypes.byref(ctypes.c_int()), ctypes.byref(ctypes.c_uint64()),
                                             ctypes.byref(ctypes.c_uint64())) != 0:
        return 0
    lib.ferry_alloc_buffer.restype = ctypes.c_void_p
    lib.ferry_alloc_buffer.argtypes = [ctypes.c_size_t]
    return lib.ferry_alloc_buffer(nbytes) or 0


def free(addr):
    """Frees what buffer() gave."""
    lib = ctypes.CDLL(None)
    lib.free.argtypes = [ctypes.c_void_p]
    lib.free(addr)


def stats():
    """(bytes, blocks, threshold): what the window holds now and the least
    an allocation must ask to be placed there; None without the preload."""
    lib = _lib()
    if lib is None:
        return None
    b, n, t = ctypes.c_uint64(), ctypes.c_uint64(), ctypes.c_uint64()
    lib.ferry_alloc_stats(ctypes.byref(b), ctypes.byref(n), ctypes.byref(t))
    return b.value, n.value, t.value


def preload_hint():
    """How to start a process so that its tensors are born in the window."""
    if not os.path.exists(LIBRARY):
        return f"build {LIBRARY} first (make alloc in ferry's checkout), then start the process with python -m ferry.run"
    return f"start the process with LD_PRELOAD={LIBRARY} (or python -m ferry.run ...)"
