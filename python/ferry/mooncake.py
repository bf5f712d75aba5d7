"""A drop-in for Mooncake's Python ``TransferEngine``, backed by ferryd.

sglang's encoder and vLLM's Mooncake connector call a handful of the
engine's methods; this class has them, with Mooncake's return
conventions (0 on success, a negative int on failure), so that moving a
sender to ferry is one import (a receiving engine's registered buffers
take no peer's writes: receivers hand out ferry receive slots instead;
docs/python.md says how)::

    from ferry.mooncake import TransferEngine      # was: from mooncake.engine import TransferEngine

Transfers go through the local ferryd (the socket from ``FERRY_SOCKET``,
else /run/ferry/ferryd.sock), which writes them into the peer's segment
over Mooncake's wire: a ferry receive slot made with ``mooncake=True``
(its ``mooncake_session`` and ``buffer_address``), or a real Mooncake
segment. On failure the method returns -1 as Mooncake's does, logs the
failure with its session, nbytes and ferryd's ``ret``, and keeps it in
``last_failure``; ``TransferEngine(raise_on_failure=True)`` raises
``ferry.TransferFailed`` (or the error ferryd answered with) instead.

Each call is one batch transfer (one completion), however many pieces it
carries, up to what one transfer may carry (1,048,576 items in a body of
16 MiB: docs/api.md); a larger batch goes as several transfers, one after
another, and the call returns 0 once all are done. CUDA device memory given to ``register_memory`` is lent to ferryd
as a region by its IPC handle (ferryd must run on that GPU) and sent with
no copy; host memory is the caller's anonymous memory, which ferryd cannot
map, so its pieces are copied into one staged entry per transfer (one
upload).
The GPU path has not yet run on a GPU (make test-gpu has its test).
"""

import base64
import bisect
import ctypes
import itertools
import json
import logging
import os
import threading
import time
from dataclasses import dataclass

from .client import Client, Slot
from .cuda import device_ordinal, ipc_handle
from .errors import BadRequest, Busy, FerryError

__all__ = ["TransferEngine", "Failure"]

log = logging.getLogger("ferry.mooncake")

# What Mooncake's engine returns for a failure; sglang and vLLM test < 0.
FAILED = -1

# The most one transfer carries (ferryd refuses more, 413 too_large): its
# items (api.MaxTransferItems), and their bytes in the body, the rest of
# api.MaxTransferBody (16 MiB) left for its sources and destination. A
# batch past either goes as several transfers.
TRANSFER_ITEMS = 1 << 20
TRANSFER_ITEM_BYTES = (16 << 20) - (64 << 10)

# Numbers the staged entries of every engine in this process: two engines
# (or one made again) never name two entries alike.
_entry_ids = itertools.count()

# The longest pause between tries of a transfer ferryd answered busy.
_BUSY_PAUSE_MAX = 0.2


def _when_room(start, timeout):
    """start(), tried again while ferryd answers busy (the transfers running
    hold all it lets them, or its staging memory is lent out), pausing
    twice as long each time, for up to timeout seconds: engines splitting
    large batches can fill ferryd's room for a moment, and a Mooncake
    caller gets -1, not a wait. A busy transfer wrote nothing or pieces
    that the next try writes again, the same bytes."""
    deadline = time.monotonic() + timeout
    pause = 0.005
    while True:
        try:
            return start()
        except Busy:
            if time.monotonic() + pause > deadline:
                raise
            time.sleep(pause)
            pause = min(2 * pause, _BUSY_PAUSE_MAX)


@dataclass
class Failure:
    """The last failed call: what Mooncake's -1 does not say."""
    method: str
    session: str
    nbytes: int
    ret: str      # ferryd's ret (an errno name, a verbs status, "rejected", ...) or why no transfer was tried
    message: str  # the whole sentence


class TransferEngine:
    """The Mooncake TransferEngine methods sglang and vLLM call, on ferry."""

    def __init__(self, raise_on_failure=False, socket_path=None):
        self.raise_on_failure = raise_on_failure
        self.last_failure = None
        self._client = None
        self._socket_path = socket_path
        self._lock = threading.Condition()
        self._regions = []     # sorted (start, end)
        self._in_flight = {}   # region start -> transfers reading it now
        self._gpu = {}         # start of a GPU range -> the ferryd region lent for it

    # --- set-up

    def initialize(self, local_hostname, metadata_server, protocol, device_name):
        """Connects to the local ferryd. The arguments are Mooncake's
        (sglang passes "P2PHANDSHAKE" and "rdma" or "tcp"); ferryd's own
        configuration decides the transport. Returns 0, or -1 when ferryd
        cannot be reached."""
        try:
            self._need_client().status()
        except FerryError as e:
            return self._fail("initialize", "", 0, e)
        return 0

    def get_rpc_port(self):
        """The RPC port of ferryd's Mooncake segment (--mooncake-listen):
        peers write into this host at f"{hostname}:{port}". -1 when ferryd
        serves no segment."""
        try:
            seg = self._need_client().status().get("mooncake")
        except FerryError as e:
            return self._fail("get_rpc_port", "", 0, e)
        if not seg:
            return self._fail("get_rpc_port", "", 0, BadRequest(
                "ferryd serves no Mooncake segment: start it with --mooncake-listen HOST:PORT", code="bad_request"))
        return int(seg["segment"].rsplit(":", 1)[1])

    # --- memory

    def register_memory(self, ptr, length):
        """Registers [ptr, ptr+length) of this process's memory as a source
        of transfers: host memory, or CUDA device memory (lent to ferryd as
        a region by its IPC handle). Returns 0, or -1 for a range that
        overlaps one registered before or device memory ferryd could not
        take."""
        if not isinstance(ptr, int) or not isinstance(length, int) or ptr <= 0 or length <= 0:
            return self._refuse("register_memory", 0, f"register_memory({ptr!r}, {length!r}): want a positive address and length")
        with self._lock:
            i = bisect.bisect_left(self._regions, (ptr, ptr + length))
            near = self._regions[max(i - 1, 0):i + 1]
            if any(s < ptr + length and ptr < e for s, e in near):
                return self._refuse("register_memory", length,
                                    f"register_memory({ptr:#x}, {length}): overlaps a registered range: unregister it first")
            ordinal = device_ordinal(ptr)
            if ordinal is not None:
                # GPU memory is lent to ferryd as a region: sent with no copy.
                name = f"mooncake-{os.getpid()}-{ptr:x}"
                try:
                    handle, offset = ipc_handle(ptr)
                    self._need_client().request("POST", "/v1/regions", json.dumps({
                        "name": name, "nbytes": length, "cuda": {
                            "device": f"cuda:{ordinal}", "ipc_handle": base64.b64encode(handle).decode(), "offset": offset}}).encode(),
                        "application/json")
                except (FerryError, ValueError, ImportError) as e:
                    err = e if isinstance(e, FerryError) else BadRequest(f"register_memory({ptr:#x}, {length}): {e}", code="bad_request")
                    return self._fail("register_memory", "", length, err)
                self._gpu[ptr] = name
            self._regions.insert(i, (ptr, ptr + length))
        return 0

    def batch_register_memory(self, ptrs, lengths):
        """register_memory for each pair; 0, or -1 at the first refusal
        (the ranges registered before it stay registered, as in Mooncake)."""
        if len(ptrs) != len(lengths):
            return self._refuse("batch_register_memory", 0, f"{len(ptrs)} addresses but {len(lengths)} lengths")
        for p, n in zip(ptrs, lengths):
            if self.register_memory(p, n) != 0:
                return FAILED
        return 0

    def unregister_memory(self, ptr):
        """Forgets the range registered at ptr, once no transfer reads it.
        Returns 0, or -1 when nothing is registered there."""
        with self._lock:
            i = bisect.bisect_left(self._regions, (ptr, 0))
            if i == len(self._regions) or self._regions[i][0] != ptr:
                return self._refuse("unregister_memory", 0, f"unregister_memory({ptr:#x}): no range is registered there")
            self._lock.wait_for(lambda: not self._in_flight.get(ptr))
            del self._regions[i]
            name = self._gpu.pop(ptr, None)
        if name is not None:
            try:
                self._need_client().unregister_region(name)
            except FerryError as e:
                return self._fail("unregister_memory", "", 0, e)
        return 0

    # --- transfers

    def transfer_sync_write(self, session_id, buffer, peer_buffer_address, length):
        """Writes length bytes at buffer (inside a registered range) to
        peer_buffer_address in the segment session_id ("ip:rpcport"), and
        returns once they are there: 0, or -1."""
        return self.batch_transfer_sync_write(session_id, [buffer], [peer_buffer_address], [length],
                                              method="transfer_sync_write")

    def batch_transfer_sync_write(self, session_id, buffers, peer_buffer_addresses, lengths,
                                  method="batch_transfer_sync_write"):
        """Writes every (buffer, peer address, length) piece, pieces that
        are adjacent at both ends merged into one write. Returns 0 once all
        are there (at once when there are none, or none has a byte: vLLM
        sends an empty batch for a request whose blocks the decoder has
        cached), or -1 at the first that fails (the pieces written before
        it stay written). A batch larger than one transfer carries goes as
        several, one after another."""
        if not (len(buffers) == len(peer_buffer_addresses) == len(lengths)):
            return self._refuse(method, sum(lengths),
                                f"{len(buffers)} buffers, {len(peer_buffer_addresses)} peer addresses and {len(lengths)} lengths")
        if any(not isinstance(n, int) or n < 0 for n in lengths):
            return self._refuse(method, 0, f"{method} to {session_id}: lengths {lengths!r}: want whole numbers of bytes, none negative")
        pieces = _merge([p for p in zip(buffers, peer_buffer_addresses, lengths) if p[2] != 0])
        if not pieces:
            return 0
        session = session_id if session_id.startswith("mooncake://") else "mooncake://" + session_id
        held = []
        try:
            for src, dst, n in pieces:
                region = self._hold(src, n)
                if region is None:
                    return self._refuse(method, n, f"{method} to {session_id}: [{src:#x}, +{n}) lies in no registered "
                                                   "range: register_memory it first")
                held.append(region)
            for lo, hi in self._runs(pieces, held):
                self._write(session, pieces[lo:hi], held[lo:hi])
        except FerryError as e:
            return self._fail(method, session_id, sum(n for _, _, n in pieces), e)
        finally:
            for region in held:
                self._release(region)
        return 0

    def _write(self, session, pieces, starts):
        """Writes the pieces with one batch transfer (one completion): those
        in GPU ranges straight from their regions, the host ones staged
        as one entry first (one upload, sent from where they lie); one
        piece of host memory goes inline instead (Client.write). starts
        are the registered ranges the pieces lie in."""
        client = self._need_client()
        if len(pieces) == 1 and starts[0] not in self._gpu:
            # One piece of host memory: its bytes go with the request
            # (POST /v1/writes), one round trip, no staged entry.
            (src, dst, n), = pieces
            body = (ctypes.c_char * n).from_address(src)
            _when_room(lambda: client.write(Slot(session=session, buffer_address=dst), body), client.timeout)
            return
        base = min(dst for _, dst, _ in pieces)
        sources, items, staged, by_region = [], [], [], {}
        host = [(src, dst, n) for (src, dst, n), st in zip(pieces, starts) if st not in self._gpu]
        req_id = None
        if host:
            req_id = f"mooncake-{os.getpid()}-{next(_entry_ids)}"
            sources.append(req_id)
            off = 0
            for src, dst, n in host:
                # Staged from where the pieces lie, one after another.
                staged.append((ctypes.c_char * n).from_address(src))
                items.append((0, off, 0, dst - base, n))
                off += n
        for (src, dst, n), st in zip(pieces, starts):
            if st in self._gpu:
                if st not in by_region:
                    by_region[st] = len(sources)
                    sources.append({"region": self._gpu[st]})
                items.append((by_region[st], src - st, 0, dst - base, n))
        if req_id is not None:
            client.stage(req_id, staged)
        try:
            _when_room(lambda: client.transfer_sync(sources, [Slot(session=session, buffer_address=base)], items, timeout=client.timeout),
                       client.timeout)
        except FerryError:
            # A failed transfer keeps its source for a retry; this engine
            # does not retry, so it goes (the failure is the transfer's to tell).
            if req_id is not None:
                try:
                    client.delete(req_id)
                except FerryError:
                    pass
            raise

    def _runs(self, pieces, starts):
        """Cuts the pieces into runs (lo, hi) that one transfer each
        carries: at most TRANSFER_ITEMS items, whose JSON is at most
        TRANSFER_ITEM_BYTES. An item's length is bounded from above as the
        whole batch would write it (a run's offsets are no larger)."""
        base = min(dst for _, dst, _ in pieces)
        index = len(str(len(self._gpu)))  # the most digits a source's index has
        lo, size, host = 0, 0, 0
        for i, ((src, dst, n), st) in enumerate(zip(pieces, starts)):
            if st in self._gpu:
                off = src - st
            else:
                off, host = host, host + n
            # [source,offset,0,offset,n], with its comma
            item = 8 + index + len(str(off)) + len(str(dst - base)) + len(str(n))
            if i > lo and (i - lo == TRANSFER_ITEMS or size + item > TRANSFER_ITEM_BYTES):
                yield lo, i
                lo, size = i, 0
            size += item
        yield lo, len(pieces)

    def _hold(self, src, n):
        """The start of the registered range holding [src, src+n), counted
        as read until _release; None when there is none."""
        with self._lock:
            i = bisect.bisect_right(self._regions, (src, float("inf"))) - 1
            if i < 0 or not (self._regions[i][0] <= src and src + n <= self._regions[i][1]):
                return None
            start = self._regions[i][0]
            self._in_flight[start] = self._in_flight.get(start, 0) + 1
            return start

    def _release(self, start):
        with self._lock:
            self._in_flight[start] -= 1
            self._lock.notify_all()

    def _need_client(self):
        if self._client is None:
            self._client = Client(self._socket_path)
        return self._client

    # --- failures, Mooncake's way (-1) or raised

    def _fail(self, method, session, nbytes, err):
        ret = getattr(err, "ret", None) or err.code or type(err).__name__
        self.last_failure = Failure(method, session, nbytes, ret, str(err))
        log.warning("ferry.mooncake: %s failed (session=%s, nbytes=%d, ret=%s): %s", method, session, nbytes, ret, err)
        if self.raise_on_failure:
            raise err
        return FAILED

    def _refuse(self, method, nbytes, message):
        return self._fail(method, "", nbytes, BadRequest(message, code="bad_request"))


def _merge(pieces):
    """Joins pieces adjacent at both ends, in the order given."""
    out = []
    for src, dst, n in pieces:
        if out and out[-1][0] + out[-1][2] == src and out[-1][1] + out[-1][2] == dst:
            out[-1] = (out[-1][0], out[-1][1], out[-1][2] + n)
        else:
            out.append((src, dst, n))
    return out
