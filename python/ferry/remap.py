"""Host memory this process already has (torch's or numpy's) turned into a
memfd in place, so ferryd can map the very pages: the page range is
copied into a memfd sealed against shrinking, which is then mapped over
it (MAP_SHARED | MAP_FIXED), same addresses, contents kept. ferry.mooncake
lends the memfd to ferryd so that peers' writes at the caller's own
addresses land in memory the caller reads in place.

Limits (docs/python.md): only anonymous private read-write memory (what
malloc, torch's and numpy's host allocators give; not a file's mapping,
huge pages of hugetlbfs, or the stack); the range grows to whole pages,
so bytes that share its first and last pages go along (they stay where
they are, with their contents, and peers may write them too); a thread writing into the pages while
they are copied loses that write; while registered, a child after fork
shares the pages instead of copying them; CUDA pinned memory
(cudaHostRegister) would no longer be what CUDA pinned. Once ferryd
gives a range back, anonymous private memory is mapped over it again,
contents kept (one more copy), so the allocator's memory behaves as
before. Pages a registration in this process lent already are not lent
again: registrations sharing pages (tensors the allocator placed side
by side) hold them together, as adjacent regions, which ferryd's
segment lists as one buffer.
"""

import ctypes
import mmap
import os
import threading

from .regions import new_memfd

PAGE = mmap.PAGESIZE

# How the memfds remap makes begin their names (/proc/self/maps shows
# them), and the regions ferry.mooncake lends.
MEMFD_PREFIX = "mooncake-"

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_MAP_FAILED = ctypes.c_void_p(-1).value
_MAP_FIXED = 0x10  # <sys/mman.h>; Python's mmap module does not export it

# The page ranges remapped in this process and lent to ferryd, (start,
# end) -> [registrations holding it, region name, the call that takes
# it back from ferryd]. A registration lends only the pages no other
# holds (framework tensors share pages), so one range may serve several.
_lent = {}
_lent_lock = threading.Lock()


def pages(ptr, length):
    """The whole pages [start, end) holding [ptr, ptr+length)."""
    return ptr - ptr % PAGE, -(-(ptr + length) // PAGE) * PAGE


def _mappings():
    """(start, end, perms, inode, path) of each mapping of this process."""
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split(None, 5)
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            yield lo, hi, fields[1], fields[4], fields[5].strip() if len(fields) > 5 else ""


def check_anonymous(start, end):
    """Raises ValueError unless every page of [start, end) is anonymous
    private read-write memory (the heap or an anonymous mapping)."""
    at = start
    for lo, hi, perms, inode, path in _mappings():
        if hi <= at or lo >= end:
            continue
        if lo > at:
            break
        if perms != "rw-p" or inode != "0" or path not in ("", "[heap]"):
            raise ValueError(f"[{at:#x}, {min(hi, end):#x}) is not anonymous private read-write memory "
                             f"(it is {perms} {path or 'anonymous'}): only memory malloc, torch's or numpy's host "
                             "allocators gave can be made a write target in place")
        at = hi
        if at >= end:
            return
    raise ValueError(f"[{at:#x}, {end:#x}) is not mapped in this process")


def _remap(start, end, name):
    """Copies the pages [start, end) into a new memfd and maps it over
    them in place: the memfd's descriptor, which the caller closes (the
    mapping keeps the memory). ValueError or OSError saying why not; the
    memory is untouched then."""
    check_anonymous(start, end)
    size = end - start
    fd = new_memfd(name, size)
    try:
        copy = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        try:
            window = ctypes.c_char.from_buffer(copy)
            ctypes.memmove(ctypes.addressof(window), start, size)
            del window
        finally:
            copy.close()
        got = _libc.mmap(start, size, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED | _MAP_FIXED, fd, 0)
        if got in (None, _MAP_FAILED) or got != start:
            e = ctypes.get_errno()
            raise OSError(e, f"mapping the memfd over [{start:#x}, {end:#x}): {os.strerror(e)}")
    except BaseException:
        os.close(fd)
        raise
    return fd


def acquire(ptr, length, lend):
    """Makes the pages holding [ptr, ptr+length) memfds lent to ferryd:
    those no registration holds yet are remapped, one range per gap, and
    each passed to lend(start, end, name, fd), which lends it and returns
    the call that takes it back. Returns the ranges held, for release.
    Raises what lend raised, or ValueError/OSError; what this call lent
    is taken back then."""
    start, end = pages(ptr, length)
    with _lent_lock:
        gaps, at = [], start
        for lo, hi in sorted(k for k in _lent if k[0] < end and start < k[1]):
            if lo > at:
                gaps.append((at, lo))
            at = max(at, hi)
        if at < end:
            gaps.append((at, end))
        for lo, hi in gaps:
            check_anonymous(lo, hi)  # all checked before any is remapped
        made = []
        try:
            for lo, hi in gaps:
                name = f"{MEMFD_PREFIX}{os.getpid()}-{lo:x}"
                fd = _remap(lo, hi, name)
                try:
                    _lent[(lo, hi)] = [0, name, lend(lo, hi, name, fd)]
                finally:
                    os.close(fd)
                made.append((lo, hi))
        except BaseException:
            for key in made:
                _lent.pop(key)[2]()
            raise
        held = [k for k in _lent if k[0] < end and start < k[1]]
        for k in held:
            _lent[k][0] += 1
        return held


def _restore(start, end):
    """Maps anonymous private memory over the pages [start, end) again,
    their contents kept: the memory is as the allocator gave it (fork
    copies it, a freed page reads as zeros) once ferryd has let it go."""
    size = end - start
    saved = ctypes.create_string_buffer(size)
    ctypes.memmove(saved, start, size)
    got = _libc.mmap(start, size, mmap.PROT_READ | mmap.PROT_WRITE,
                     mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_FIXED, -1, 0)
    if got in (None, _MAP_FAILED) or got != start:
        e = ctypes.get_errno()
        raise OSError(e, f"mapping anonymous memory over [{start:#x}, {end:#x}) again: {os.strerror(e)}")
    ctypes.memmove(start, saved, size)


def release(held):
    """Drops a registration's hold on its ranges; those no other holds
    are taken back from ferryd (which waits for writes into them) and
    made anonymous private memory again, contents kept (a range ferryd
    did not give back stays on its memfd). Raises what taking one back
    raised (the rest are taken back all the same)."""
    with _lent_lock:
        failed = None
        for k in held:
            entry = _lent[k]
            entry[0] -= 1
            if entry[0] == 0:
                del _lent[k]
                try:
                    entry[2]()
                    _restore(*k)
                except Exception as e:  # noqa: BLE001 - the first is raised once all are tried
                    failed = failed or e
        if failed is not None:
            raise failed
