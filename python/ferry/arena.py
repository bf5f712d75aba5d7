"""A client's own mapping of ferryd's host-memory arena.

The arena is ferryd's alone (a sealed memfd, with no path); ferryd passes its
descriptor with the answer to GET /v1/arena (SCM_RIGHTS) to callers its
allow-lists admit, and closes that connection after it. So the request
goes out on a connection of its own, read with recvmsg to take the
descriptor, and the answer is parsed here rather than by http.client.
"""

import http.client
import io
import json
import mmap
import os
import socket

from . import dtypes
from .errors import FerryError, NoAnswer, from_answer

_REQUEST = b"GET /v1/arena HTTP/1.1\r\nHost: ferryd\r\nConnection: close\r\n\r\n"
# The answer is a short JSON object.
_MAX_ANSWER = 64 << 10


class ArenaMapping:
    """ferryd's arena mapped into this process, read-write and MAP_SHARED:
    staged entries and receive slots are at their ``offset`` in it.

    Memoryviews and tensors made from it share its memory; it stays
    mapped while any of them is alive, and ``close`` refuses until they
    are gone.
    """

    def __init__(self, mm, info):
        self._mm = mm
        self.size = info["size"]
        self.arena_file = info.get("arena_file", "")
        self.huge_pages = bool(info.get("huge_pages"))

    def view(self, offset, nbytes):
        """A writable memoryview of the nbytes at offset, as a slice or a
        receive slot's description names them."""
        offset, nbytes = int(offset), int(nbytes)
        if offset < 0 or nbytes < 0 or offset + nbytes > self.size:
            raise ValueError(f"range [{offset}, +{nbytes}) is outside ferryd's arena ({self.size} bytes)")
        return memoryview(self._mm)[offset:offset + nbytes]

    def tensor(self, offset, shape, dtype):
        """A torch tensor of shape and dtype over the arena at offset (no copy)."""
        return dtypes.tensor_over(self.view(offset, dtypes.nbytes(shape, dtype)), shape, dtype)

    def close(self):
        """Unmaps the arena; views and tensors made from it must be gone."""
        try:
            self._mm.close()
        except BufferError:
            raise BufferError("cannot unmap ferryd's arena: memoryviews or tensors made from this mapping "
                              "are still alive; drop them (del) first, or leave the mapping to be unmapped "
                              "when the last of them goes") from None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self):
        return f"<ferry.ArenaMapping {self.arena_file or '?'} {self.size} bytes>"


class _Recorded:
    """What http.client.HTTPResponse reads from: the answer already read."""

    def __init__(self, raw):
        self._raw = raw

    def makefile(self, mode):
        return io.BytesIO(self._raw)


def _read_with_rights(sock, what):
    """Reads sock to its end, with the descriptors that came beside the bytes."""
    raw, fds = bytearray(), []
    try:
        while True:
            data, got, flags, _ = socket.recv_fds(sock, 4096, 4, socket.MSG_CMSG_CLOEXEC)
            fds.extend(got)
            if flags & socket.MSG_CTRUNC:
                raise FerryError(f"ferryd's answer to {what} carried more descriptors than expected")
            if not data:
                return bytes(raw), fds
            raw += data
            if len(raw) > _MAX_ANSWER:
                raise FerryError(f"ferryd's answer to {what} is over {_MAX_ANSWER} bytes")
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise


def exchange_with_rights(transport, timeout, request, what, pass_fd=None):
    """One request on a connection of its own that may pass a descriptor
    (pass_fd, beside the request's bytes) or take some back (in the
    answer): the answer's JSON and the descriptors it carried, which the
    caller closes. An error answer raises its class."""
    sock = transport.dial()
    fds = []
    try:
        if sock.family != socket.AF_UNIX:
            raise ValueError(f"{what} takes a Unix socket connection, which carries a descriptor; "
                             f"this client's dial opened a {sock.family!r} socket")
        sock.settimeout(timeout)
        try:
            if pass_fd is None:
                sock.sendall(request)
            else:
                socket.send_fds(sock, [request], [pass_fd])
            raw, fds = _read_with_rights(sock, what)
        except socket.timeout:
            raise NoAnswer(f"no answer from ferryd at {transport.socket_path} to {what} within {timeout:g} s") from None
        except OSError as e:
            raise NoAnswer(f"ferryd at {transport.socket_path} closed the connection before answering {what} ({e!r})") from e
        resp = http.client.HTTPResponse(_Recorded(raw))
        try:
            resp.begin()
            body = resp.read()
        except http.client.HTTPException as e:
            raise FerryError(f"ferryd's answer to {what} is not HTTP ({e!r}): {raw[:200]!r}") from None
        if resp.status >= 300:
            raise from_answer(resp.status, body)
        try:
            info = json.loads(body)
        except ValueError as e:
            raise FerryError(f"decoding ferryd's answer to {what}: {e!r}: {body[:200]!r}") from None
        out, fds = (info, fds), []
        return out
    finally:
        sock.close()
        for fd in fds:
            os.close(fd)


def map_arena(transport, timeout):
    """Asks ferryd for its arena's descriptor and maps it (see Client.map_arena)."""
    info, fds = exchange_with_rights(transport, timeout, _REQUEST, "GET /v1/arena")
    try:
        try:
            size = int(info["size"])
        except (KeyError, TypeError, ValueError) as e:
            raise FerryError(f"decoding ferryd's answer to GET /v1/arena: {e!r}: {info!r}") from None
        if len(fds) != 1:
            raise FerryError(f"ferryd's answer to GET /v1/arena carried {len(fds)} file descriptors, not the arena's one")
        try:
            # mmap keeps a descriptor of its own; ours is closed below.
            mm = mmap.mmap(fds[0], size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError as e:
            raise OSError(e.errno, f"mapping ferryd's arena ({info.get('arena_file', '?')}, {size} bytes): {e.strerror}") from None
        return ArenaMapping(mm, info)
    finally:
        for fd in fds:
            os.close(fd)
