"""Regions: memory this process owns and lends ferryd once (docs/api.md,
"Regions"). A memfd sealed against shrinking, mapped here and passed to
ferryd beside the request (SCM_RIGHTS): transfers read from it and
receive slots land in it, with no copy through the arena."""

import fcntl
import json
import mmap
import os

from . import dtypes
from .arena import exchange_with_rights


def new_memfd(name, nbytes):
    """A memfd of nbytes sealed against shrinking, as ferryd requires: a
    file cut short under its mapping would kill it on the next touch."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, nbytes)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK)
    except BaseException:
        os.close(fd)
        raise
    return fd


def register_fd(transport, timeout, name, fd, nbytes, mooncake_addr=0, offset=0, mooncake_segment=""):
    """POST /v1/regions with fd beside the request: the region's
    description. The region is nbytes of the memfd from offset.
    mooncake_addr, if not 0, opens it to Mooncake peers' writes at that
    address, in the engine segment mooncake_segment if given (docs/api.md,
    "Regions")."""
    req = {"name": name, "nbytes": int(nbytes)}
    if offset:
        req["fd_offset"] = int(offset)
    if mooncake_addr:
        req["mooncake_addr"] = int(mooncake_addr)
    if mooncake_segment:
        req["mooncake_segment"] = mooncake_segment
    body = json.dumps(req).encode()
    request = (b"POST /v1/regions HTTP/1.1\r\nHost: ferryd\r\nContent-Type: application/json\r\n"
               b"Content-Length: %d\r\nConnection: close\r\n\r\n" % len(body)) + body
    info, fds = exchange_with_rights(transport, timeout, request, "POST /v1/regions", pass_fd=fd)
    for extra in fds:
        os.close(extra)
    return info


class Region:
    """A region this process lent ferryd (``Client.register_region``):
    ``view``/``tensor`` read and write it in place; a transfer source
    ``{"region": name}`` sends from it, ``Client.receive(...,
    region=name, region_offset=...)`` places a slot in it. ``close``
    takes it back from ferryd (waiting for the writes using it) and
    unmaps it here."""

    def __init__(self, client, name, fd, nbytes):
        self.name = name
        self.nbytes = nbytes
        self._client = client
        self._fd = fd
        self._mm = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        self.registered = False

    def view(self, offset=0, nbytes=None):
        """A writable memoryview of nbytes at offset (default: all of it)."""
        offset = int(offset)
        nbytes = self.nbytes - offset if nbytes is None else int(nbytes)
        if offset < 0 or nbytes < 0 or offset + nbytes > self.nbytes:
            raise ValueError(f"range [{offset}, +{nbytes}) is outside region {self.name} ({self.nbytes} bytes)")
        return memoryview(self._mm)[offset:offset + nbytes]

    def tensor(self, offset, shape, dtype):
        """A torch tensor of shape and dtype over the region at offset (no copy)."""
        return dtypes.tensor_over(self.view(offset, dtypes.nbytes(shape, dtype)), shape, dtype)

    def unregister(self, timeout=30.0):
        """Takes the region back from ferryd: returns once no transfer or
        write uses it and ferryd unmapped it (ferry.Timeout if they
        outlast timeout; ferry.Busy while receive slots lie in it)."""
        if self.registered:
            self._client.unregister_region(self.name, timeout)
            self.registered = False

    def close(self, timeout=30.0):
        """unregister, then unmap and close the memfd here. Memoryviews and
        tensors made from it must be gone."""
        self.unregister(timeout)
        if self._fd is not None:
            self._mm.close()
            os.close(self._fd)
            self._fd = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self):
        return f"<ferry.Region {self.name} {self.nbytes} bytes>"
