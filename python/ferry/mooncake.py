"""A drop-in for Mooncake's Python ``TransferEngine``, backed by ferryd.

sglang (PD disaggregation, the multimodal encoder) and vLLM's Mooncake
connector call the engine on both sides; this class has every method of
Mooncake's, with Mooncake's return conventions (0 on success, a negative
int on failure), so that moving a framework to ferry is one import::

    from ferry.mooncake import TransferEngine      # was: from mooncake.engine import TransferEngine

The receiving side works for host memory born in ferry's allocator: start
the process with ``python -m ferry.run`` (LD_PRELOAD=libferry_alloc.so,
ferry.alloc), and ``register_memory`` lends the tensor's own pages to
ferryd, which lands peers' writes there at the caller's addresses. GPU
memory (a torch.cuda tensor, a sub-range of the caching allocator's
segments included) is lent by the IPC handle of its allocation, and
peers' writes land in it through ferryd's copies, or, on ferryd's rdma
transport where the NIC reaches GPU memory, by the NIC itself at the
tensor's addresses (docs/python.md). Other memory is refused
at registration (-1, the fix in ``last_failure``), unless the engine was
told it only sends from it:
``TransferEngine(send_only=True)`` or ``FERRY_MOONCAKE_SEND_ONLY=1``.
``initialize`` opens the engine's own Mooncake segment in ferryd (its
session id, ``get_rpc_port()``), closed by ``close()``, by collection or
when the process exits.

Transfers go through the local ferryd (the socket from ``FERRY_SOCKET``,
else /run/ferry/ferryd.sock): into a ferry engine's memory over ferry's
peer protocol, into a Mooncake segment (or a ferry receive slot made with
``mooncake=True``) over Mooncake's wire; 0 means every byte is in the
receiver's memory. Reads of a ferry engine's memory, and on rdma of a
Mooncake engine's, go through ferryd too (RDMA READs where it can);
on tcp a Mooncake engine's go from this process over Mooncake's TCP READ.
On failure a method returns -1 as Mooncake's does, logs the failure with
its session, nbytes and ``ret``, and keeps it in ``last_failure``;
``TransferEngine(raise_on_failure=True)`` raises instead.

Each write call is one batch transfer (one completion), however many
pieces it carries, up to what one transfer may carry (1,048,576 items in
a body of 16 MiB: docs/api.md); a larger batch goes as several, one
after another. Memory in the allocator's window and CUDA device memory
(lent by its IPC handle) are sent from where they lie; other host memory of a send_only engine is copied into
one staged entry per transfer. docs/python.md has the rest.
"""

import bisect
import collections
import ctypes
import enum
import ipaddress
import itertools
import json
import logging
import operator
import os
import socket
import struct
import threading
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass

from .client import Client, Slot
from .cuda import device_ordinal
from .alloc import buffer as alloc_buffer
from .alloc import free as alloc_free
from .alloc import preload_hint, preloaded, window
from .errors import BadRequest, Busy, FerryError, NotFound

__all__ = ["TransferEngine", "TransferOpcode", "Read", "Write", "TransferNotify", "Failure"]

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

# The asynchronous calls run the synchronous ones on a pool of this many
# threads per engine (each transfer already overlaps its pieces in ferryd).
ASYNC_WORKERS = 4
# At most this many batches submitted and not yet finished: past it a
# submit fails (0), asking the caller to collect some.
ASYNC_IN_FLIGHT = 1024
# The finished batches whose status nobody read kept for a later read:
# past this many the oldest is dropped (its id then reads as unknown).
ASYNC_KEPT = 4096
# Batch ids number the batches of every engine in this process from 1: 0
# is Mooncake's failed submit.
_batch_ids = itertools.count(1)


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


class TransferOpcode(enum.IntEnum):
    """Mooncake's opcodes for transfer_sync, batch_transfer_sync and
    batch_transfer_async, spelt as Mooncake's (Read 0, Write 1); READ and
    WRITE are ferry's older names of the same two. The methods take
    Mooncake's own enum (mooncake.engine.TransferOpcode) too, or its int."""
    Read = 0
    Write = 1
    READ = 0
    WRITE = 1


# Mooncake's module exports its enum's members at module level as well.
Read, Write = TransferOpcode.Read, TransferOpcode.Write


def _opcode(opcode):
    """The TransferOpcode of opcode (ferry's, Mooncake's pybind enum, whose
    int() is the same, or that int), or None."""
    if isinstance(opcode, bool):
        return None
    try:
        return TransferOpcode(operator.index(opcode))
    except (TypeError, ValueError):
        return None


@dataclass
class TransferNotify:
    """Mooncake's TransferNotify: what transfer_sync and
    batch_transfer_sync send to the target engine once the transfer
    completed, and what get_notifies returns. name is the sender's choice
    (its own name, by convention), msg the message."""
    name: str = ""
    msg: str = ""


@dataclass
class Failure:
    """The last failed call: what Mooncake's -1 does not say."""
    method: str
    session: str
    nbytes: int
    ret: str      # ferryd's ret (an errno name, a verbs status, "rejected", ...) or why no transfer was tried
    message: str  # the whole sentence


# The largest single piece of host memory not lent to ferryd (a
# send_only engine's) a write sends inline with its request
# (Client.write) rather than staged for a transfer.
INLINE_MAX = 1 << 20


class TransferEngine:
    """Mooncake's TransferEngine on ferry: every method of Mooncake's
    Python engine is here, with its parameter names, order and defaults;
    those ferry does not have raise NotImplementedError saying why
    (_NOT_IMPLEMENTED)."""

    TransferOpcode = TransferOpcode  # as Mooncake's: TransferEngine.TransferOpcode.Write

    def __init__(self, raise_on_failure=False, socket_path=None, send_only=None):
        self.raise_on_failure = raise_on_failure
        # Registered memory is a source only, which the caller says it
        # knows: else register_memory refuses it, since no peer's write
        # can land there (a receiver would read what was there before).
        if send_only is None:
            send_only = os.environ.get("FERRY_MOONCAKE_SEND_ONLY", "").lower() in ("1", "true", "yes")
        self.send_only = send_only
        self.last_failure = None
        self._client = None
        self._socket_path = socket_path
        self._lock = threading.Condition()
        self._regions = []     # sorted (start, end)
        self._in_flight = {}   # region start -> transfers reading it now
        self._lent = {}        # start of a range -> the ferryd region lent for it (GPU or window memory)
        self._on_gpu = set()   # starts of the ranges in GPU memory (of _lent)
        # What initialize recorded: the host part of local_hostname, the
        # protocol, the NIC ferryd sends over ("" over tcp).
        self.local_hostname, self.protocol, self.device_name = "", "", ""
        # This engine's own Mooncake segment (initialize opens it) and what
        # closes it when the engine is closed or collected.
        self._segment, self._closer = None, None
        self._initialized = False  # set by the first initialize that returned 0
        # The asynchronous calls: their pool (made at the first), batch id
        # -> _Batch in submission order, and whether close has begun.
        self._pool, self._batches, self._closing, self._dropped = None, collections.OrderedDict(), False, 0
        self._tls = threading.local()  # a pool thread's last failure, for its batch

    # --- set-up

    def initialize(self, local_hostname, metadata_server, protocol, device_name):
        """Connects to the local ferryd and checks that it gives what the
        arguments ask: metadata_server "P2PHANDSHAKE" (session ids are
        "host:rpc_port"; no etcd, redis or http metadata servers),
        protocol ferryd's transport ("rdma" or "tcp": ferryd cannot
        change its transport per engine), device_name "" or the NIC
        ferryd uses (over rdma; Mooncake's tcp ignores it), and a port in
        local_hostname, if any, that of ferryd's Mooncake segment.
        Returns 0, or -1 saying which argument ferryd cannot honour (or
        that it cannot be reached)."""
        return self._initialize("initialize", local_hostname, metadata_server, protocol, device_name)

    def initialize_ext(self, local_hostname, metadata_server, protocol, device_name, metadata_type):
        """initialize, with Mooncake's metadata_type: "p2p" (or "") only,
        as ferry speaks only the P2P handshake."""
        if str(metadata_type).lower() not in ("", "p2p", "p2phandshake"):
            return self._refuse("initialize_ext", 0, f"metadata_type {metadata_type!r}: ferry speaks Mooncake's P2P "
                                                     "handshake only: pass \"p2p\" and metadata_server \"P2PHANDSHAKE\"")
        return self._initialize("initialize_ext", local_hostname, metadata_server, protocol, device_name)

    def _initialize(self, method, local_hostname, metadata_server, protocol, device_name):
        if self._closing:
            return self._refuse(method, 0, f"{method}: the engine is closed: make a new TransferEngine and initialize it")
        if metadata_server != "P2PHANDSHAKE":
            return self._refuse(method, 0, f"metadata_server {metadata_server!r}: ferry speaks Mooncake's P2P handshake "
                                           "only (session ids are \"host:rpc_port\"): pass \"P2PHANDSHAKE\"; etcd, "
                                           "redis and http metadata servers are not supported")
        if protocol not in ("tcp", "rdma"):
            return self._refuse(method, 0, f"protocol {protocol!r}: ferry moves Mooncake transfers over \"tcp\" or \"rdma\"")
        try:
            status = self._need_client().status()
        except FerryError as e:
            return self._fail(method, "", 0, e)
        transport = status["transport"]
        if protocol != transport["name"]:
            return self._refuse(method, 0, f"protocol {protocol!r}: ferryd runs the {transport['name']} transport "
                                           f"({transport.get('reason', '')}), and it reaches Mooncake segments over that: "
                                           f"initialize with {transport['name']!r}, or use a ferryd started with "
                                           f"--transport {protocol}")
        rdma = transport.get("rdma") or {}
        nics = [r.get("device", "") for r in rdma.get("rails") or [rdma.get("chosen") or {}]]
        names = [n.strip() for n in (device_name or "").split(",") if n.strip()]
        if protocol == "rdma" and any(n not in nics for n in names):
            return self._refuse(method, 0, f"device_name {device_name!r}: ferryd sends over {', '.join(nics)} (its "
                                           "--rdma-device, or its own choice: GET /v1/status transport.rdma.rails): "
                                           "name those, or pass \"\" for ferryd's choice")
        host, port = _split_host_port(str(local_hostname))
        # Peers dial f"{host}:{rpc_port}" (the frameworks publish that): it
        # must reach the ports ferryd opens for the engine, which listen
        # where its own segment does.
        mooncake = status.get("mooncake")
        unreachable = mooncake and _unreachable(host, _split_host_port(mooncake["rpc"])[0])
        if unreachable:
            return self._refuse(method, 0, f"local_hostname {local_hostname!r}: {unreachable}")
        if not mooncake:
            if port:
                return self._refuse(method, 0, f"local_hostname {local_hostname!r}: a port asks for this engine's own "
                                               "RPC port, and ferryd serves no Mooncake segment to open it beside: "
                                               "start ferryd with --mooncake-listen, or pass the host alone")
        elif self._segment is None:
            # This engine's own segment: its session id, listing exactly
            # the memory it registers, dropped when it closes or its
            # process exits.
            try:
                body = json.dumps({"port": int(port)} if port.isdigit() else {}).encode()
                self._segment = json.loads(self._need_client().request(
                    "POST", "/v1/mooncake/segments", body, "application/json").body)
            except (FerryError, ValueError) as e:
                return self._fail(method, "", 0, e if isinstance(e, FerryError) else BadRequest(str(e)))
            self._closer = weakref.finalize(self, _close_segment, self._need_client(), self._segment["id"])
        elif port and int(port) != self._segment["rpc_port"]:
            return self._refuse(method, 0, f"local_hostname {local_hostname!r}: this engine's RPC port is "
                                           f"{self._segment['rpc_port']} already: pass that port, or the host alone")
        self.local_hostname, self.protocol = host, protocol
        self.device_name = ",".join(names or nics) if protocol == "rdma" else ""
        self._initialized = True
        return 0

    def get_rpc_port(self):
        """This engine's RPC port: peers write into the memory it
        registered at session f"{hostname}:{port}". Before initialize (or
        from a ferryd that could not open one) the port of ferryd's own
        segment (--mooncake-listen); -1 when ferryd serves none."""
        if self._segment is not None:
            return self._segment["rpc_port"]
        try:
            seg = self._need_client().status().get("mooncake")
        except FerryError as e:
            return self._fail("get_rpc_port", "", 0, e)
        if not seg:
            return self._fail("get_rpc_port", "", 0, BadRequest(
                "ferryd serves no Mooncake segment: start it with --mooncake-listen HOST:PORT", code="bad_request"))
        return int(seg["segment"].rsplit(":", 1)[1])

    # --- memory

    def register_memory(self, buffer_addr, capacity, location="*"):
        """Registers [buffer_addr, +capacity) of this process's memory: where
        peers write (and a source of this engine's transfers). Host memory
        born in ferry's allocator window (a process started with
        ``python -m ferry.run`` or LD_PRELOAD=libferry_alloc.so) is lent to
        ferryd by the window's memfd, so peers' writes land in these very
        pages at these addresses, and transfers send from them with no copy.
        GPU memory is lent by the IPC handle of the allocation holding it
        (each registered range a region of its own, several per
        allocation as a caching allocator's segment holds many tensors):
        peers' writes land in it at these addresses, copied in by ferryd,
        or over RDMA placed by the NIC (where it reaches GPU memory; where
        it does not and ferryd's Mooncake segments speak rdma, ferryd
        refuses the range).
        buffer_addr may be an address or a tensor (its data_ptr()).
        location is Mooncake's ("cpu:0", "cuda:0", "*" to have it found),
        taken and ignored: ferry asks the CUDA driver where the memory lies.
        Returns 0, or -1 with the reason in last_failure: memory peers
        cannot write (allocated outside the window, GPU memory with no IPC
        handle), a range overlapping one registered before, or a ferryd
        that refused it. An engine made with send_only also registers host
        memory outside the window, as a source only (its pieces are then
        copied per transfer). Before initialize (or after one that
        failed) and after close it is -1 saying so, with nothing lent:
        the memory is lent to the engine's own segment, which initialize
        opens and close closes. (Mooncake's engine, before initialize,
        has no engine to register with: the process crashes, SIGSEGV.)"""
        return self._register(buffer_addr, capacity)

    def _unready(self, method):
        """Why this engine registers no memory now, or None."""
        if self._closing:
            return f"{method}: the engine is closed: make a new TransferEngine and initialize it"
        if not self._initialized:
            return (f"{method}: initialize first: memory is lent to the engine's own segment, which initialize "
                    "opens, and this engine was not initialized (or its initialize returned -1)")
        return None

    def _register(self, ptr, length):
        is_cuda, ptr = bool(getattr(ptr, "is_cuda", False)), _address(ptr)
        if not isinstance(ptr, int) or not isinstance(length, int) or ptr <= 0 or length <= 0:
            return self._refuse("register_memory", 0, f"register_memory({ptr!r}, {length!r}): want a positive address and length")
        with self._lock:
            # Under the lock: close marks the engine closed under it too.
            unready = self._unready("register_memory")
            if unready is not None:
                return self._refuse("register_memory", length, unready)
            i = bisect.bisect_left(self._regions, (ptr, ptr + length))
            near = self._regions[max(i - 1, 0):i + 1]
            if any(s < ptr + length and ptr < e for s, e in near):
                return self._refuse("register_memory", length,
                                    f"register_memory({ptr:#x}, {length}): overlaps a registered range: unregister it first")
            try:
                name = self._lend(ptr, length, is_cuda)
            except (FerryError, ValueError, ImportError) as e:
                code = getattr(e, "code", None) or "bad_request"
                err = e if isinstance(e, FerryError) else BadRequest(f"register_memory({ptr:#x}, {length}): {e}", code=code)
                return self._fail("register_memory", "", length, err)
            if name is not None:
                self._lent[ptr] = name
            self._regions.insert(i, (ptr, ptr + length))
        return 0

    def _lend(self, ptr, length, is_cuda=False):
        """Lends [ptr, +length) to ferryd as a region and returns its name,
        or None for host memory an engine made with send_only keeps (its
        pieces are copied per transfer); raises what refused it."""
        name = f"mooncake-{os.getpid()}-{id(self):x}-{ptr:x}"
        # No segment: initialize found a ferryd serving no Mooncake segment
        # (_unready saw to the rest), so no peer reaches this memory.
        segment = self._segment["id"] if self._segment is not None else ""
        ordinal = device_ordinal(ptr)
        if ordinal is not None:
            # GPU memory is lent to ferryd as a region: sent from with no
            # copy, written into (unless send_only) at ptr.
            try:
                self._need_client().register_cuda(name, ptr, length, device=ordinal,
                                                  mooncake_addr=0 if self.send_only else ptr, mooncake_segment=segment)
            except ValueError as e:
                raise _NotWritable(f"register_memory({ptr:#x}, {length}): GPU memory (cuda:{ordinal}) ferryd cannot "
                                   f"open: {e}; register memory from cudaMalloc (torch's default caching allocator, "
                                   "not PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync) (docs/python.md)") from e
            self._on_gpu.add(ptr)
            return name
        if is_cuda:
            raise _NotWritable(f"register_memory({ptr:#x}, {length}): a CUDA tensor, but the CUDA driver "
                               "(libcuda.so.1) of this process does not know its address as device memory")
        w = window()
        if w is None or not w.holds(ptr, length):
            if self.send_only:
                return None
            if w is None and preloaded():
                raise _NotWritable(f"register_memory({ptr:#x}, {length}): this process is a fork child of one started "
                                   "with ferry's allocator, and a child's window is private to it, so ferryd cannot "
                                   "reach its pages: start workers that register host memory with spawn, not fork "
                                   "(vLLM: VLLM_WORKER_MULTIPROC_METHOD=spawn), or register GPU memory (docs/python.md)")
            where = "outside ferry's allocator window" if w is not None else "in a process started without ferry's allocator"
            raise _NotWritable(f"register_memory({ptr:#x}, {length}): the memory at {ptr:#x} was not allocated through "
                               f"ferry's allocator ({where}), so ferryd cannot reach its pages and no peer's write could "
                               f"land there; {preload_hint()} so tensors are born where ferryd can reach them (torch's "
                               "tensors at any size; other allocations from FERRY_ALLOC_MIN up), or allocate with "
                               "allocate_managed_buffer. An engine that only sends from this memory says so: "
                               "TransferEngine(send_only=True) or FERRY_MOONCAKE_SEND_ONLY=1 (docs/python.md)")
        # The window's memfd, the range's own pages: peers write at ptr.
        self._need_client().register_fd(name, w.fd, length, mooncake_addr=0 if self.send_only else ptr,
                                        offset=ptr - w.base, mooncake_segment=segment)
        return name

    def batch_register_memory(self, buffer_addresses, capacities, location="*"):
        """register_memory for each pair; 0, or -1 at the first refusal
        (the ranges registered before it stay registered, as in Mooncake);
        -1 before initialize and after close, as register_memory."""
        unready = self._unready("batch_register_memory")
        if unready is not None:
            return self._refuse("batch_register_memory", 0, unready)
        if len(buffer_addresses) != len(capacities):
            return self._refuse("batch_register_memory", 0,
                                f"{len(buffer_addresses)} addresses but {len(capacities)} capacities")
        for p, n in zip(buffer_addresses, capacities):
            if self._register(p, n) != 0:
                return FAILED
        return 0

    def unregister_memory(self, ptr):
        """Forgets the range registered at ptr, once no transfer reads it.
        Returns 0, or -1 when nothing is registered there."""
        ptr = _address(ptr)
        with self._lock:
            i = bisect.bisect_left(self._regions, (ptr, 0))
            if i == len(self._regions) or self._regions[i][0] != ptr:
                return self._refuse("unregister_memory", 0, f"unregister_memory({ptr:#x}): no range is registered there")
            self._lock.wait_for(lambda: not self._in_flight.get(ptr))
            del self._regions[i]
            name = self._lent.pop(ptr, None)
            self._on_gpu.discard(ptr)
        if name is not None:
            try:
                self._need_client().unregister_region(name)
            except FerryError as e:
                return self._fail("unregister_memory", "", 0, e)
        return 0

    def batch_unregister_memory(self, ptrs):
        """unregister_memory for each address, all of them tried (a
        teardown frees what it can); 0, or -1 when any failed
        (last_failure: the last)."""
        failed = [p for p in [_address(p) for p in ptrs] if self.unregister_memory(p) != 0]
        return FAILED if failed else 0

    def allocate_managed_buffer(self, length):
        """length bytes from ferry's allocator window, registered (peers
        write into them): their address, or 0 with the reason in
        last_failure (the process was started without the allocator;
        before initialize or after close, as register_memory)."""
        if not isinstance(length, int) or length <= 0:
            self._refuse("allocate_managed_buffer", 0, f"allocate_managed_buffer({length!r}): want a positive length")
            return 0
        unready = self._unready("allocate_managed_buffer")
        if unready is not None:
            self._refuse("allocate_managed_buffer", length, unready)
            return 0
        ptr = alloc_buffer(length)
        if not ptr:
            self._fail("allocate_managed_buffer", "", length, _NotWritable(
                f"allocate_managed_buffer({length}): no room from ferry's allocator: {preload_hint()}"))
            return 0
        if self._register(ptr, length) != 0:
            alloc_free(ptr)
            return 0
        return ptr

    def free_managed_buffer(self, buffer, length):
        """Unregisters and frees what allocate_managed_buffer gave: 0, or -1."""
        if self.unregister_memory(buffer) != 0:
            return FAILED
        alloc_free(buffer)
        return 0

    def write_bytes_to_buffer(self, dest_address, src, length):
        """Copies length bytes of src (bytes) to dest_address in this
        process, as Mooncake's does (a local memcpy); 0, or -1 when src is
        shorter than length."""
        if not isinstance(length, int) or length < 0 or length > len(src):
            return self._refuse("write_bytes_to_buffer", 0, f"write_bytes_to_buffer: length {length!r} for "
                                                            f"{len(src)} bytes: want 0 to {len(src)}")
        ctypes.memmove(dest_address, bytes(src[:length]), length)
        return 0

    def read_bytes_from_buffer(self, source_address, length):
        """The length bytes at source_address in this process (a local
        copy). A length that is not a whole number of bytes, 0 or more,
        raises TypeError, as Mooncake's does (its binding takes a size_t);
        ctypes would read a negative one as "up to the first NUL byte"."""
        if isinstance(length, bool) or not isinstance(length, int) or length < 0:
            raise TypeError(f"read_bytes_from_buffer({source_address!r}, {length!r}): length {length!r}: want a "
                            "whole number of bytes, 0 or more (Mooncake's engine raises TypeError too)")
        return ctypes.string_at(source_address, length)

    # --- peers

    def send_probe(self, peer_server_name):
        """Mooncake's liveness probe: a probe message to the RPC port of
        the segment peer_server_name ("host:rpc_port"), 0 once it answers
        success, else -1 with the reason (sglang clears a failed session
        on 0). It goes from this process, as Mooncake's does."""
        try:
            reply = _handshake(peer_server_name, _PROBE, {})
            if reply.get("status") != "success":
                raise ValueError(f"it answered {reply!r}, not status \"success\"")
        except (OSError, ValueError) as e:
            return self._fail("send_probe", peer_server_name, 0, FerryError(
                f"send_probe({peer_server_name!r}): {e}", code="unreachable"))
        return 0

    def get_first_buffer_address(self, segment_name):
        """The address of the first buffer the segment segment_name
        ("host:rpc_port") lists in its descriptor, fetched over the
        metadata handshake; -1 on failure. A ferry segment lists ferryd's
        arena, whose only write targets are its Mooncake receive slots."""
        try:
            buffers = self._descriptor(segment_name).get("buffers") or []
            if not buffers:
                raise ValueError("its descriptor lists no buffer")
            return buffers[0]["addr"]
        except (OSError, ValueError) as e:
            return self._fail("get_first_buffer_address", segment_name, 0, FerryError(
                f"get_first_buffer_address({segment_name!r}): {e}", code="unreachable"))

    def _descriptor(self, segment):
        """The segment's descriptor over the metadata handshake, its fields
        checked (_check_descriptor)."""
        desc = _handshake(segment, _METADATA, {"name": self.local_hostname, "protocol": self.protocol or "tcp",
                                               "buffers": []})
        _check_descriptor(segment, desc)
        return desc

    def close(self):
        """Closes this engine's segment: ferryd stops listing and serving
        the memory it registered (waiting for writes landing in it) and
        closes its ports; 0, or -1. Collecting the engine does the same.
        Asynchronous batches in flight finish first (each within its
        transfer's deadline), their status still readable; later submits
        fail (0)."""
        with self._lock:
            self._closing, pool = True, self._pool
        if pool is not None:
            pool.shutdown(wait=True)
        with self._lock:
            self._lock.wait_for(lambda: not any(self._in_flight.values()))
            closer, self._closer, self._segment = self._closer, None, None
            lent, self._lent, self._regions, self._on_gpu = self._lent, {}, [], set()
        failed = None
        detached = closer.detach() if closer is not None else None
        if detached is not None:
            try:
                _close_segment(*detached[2], raise_errors=True)
            except FerryError as e:
                failed = e
        for name in lent.values():
            try:
                self._need_client().unregister_region(name)
            except NotFound:
                pass  # it was in the segment, gone with it
            except FerryError as e:
                failed = e
        if failed is not None:
            return self._fail("close", "", 0, failed)
        return 0

    def get_local_topology(self, device_name=None):
        """Mooncake's topology matrix as a JSON string, from what ferryd's
        GET /v1/status knows: {"cuda:N": [[nearest NICs], [every NIC]],
        "cpu:M": [[the NICs on NUMA node M], [every NIC]]}, where every NIC
        is each rail ferryd drives (transport.rdma.rails) and a GPU's
        nearest are its row of the affinity table that ferryd drives.
        device_name ("mlx5_0,mlx5_1") keeps only those NICs. "{}" over
        TCP, or with no NIC left; "{}" and the reason in last_failure when
        ferryd cannot be asked."""
        try:
            status = self._need_client().status()
        except FerryError as e:
            self._fail("get_local_topology", "", 0, e)
            return "{}"
        return json.dumps(_topology(status, device_name), indent=3)

    def get_engine(self):
        """Mooncake's gives its C++ engine; ferry's engine is this object."""
        return self

    # --- transfers

    def transfer_sync(self, target_hostname, buffer, peer_buffer_address, length, opcode, notify=None,
                      transport_hint=""):
        """transfer_sync_write for TransferOpcode.Write, transfer_sync_read
        for Read, then the notify, if any (batch_transfer_sync)."""
        return self._sync("transfer_sync", target_hostname, [buffer], [peer_buffer_address], [length], opcode, notify)

    def batch_transfer_sync(self, target_hostname, buffers, peer_buffer_addresses, lengths, opcode, notify=None,
                            transport_hint=""):
        """batch_transfer_sync_write for TransferOpcode.Write (ferry's,
        Mooncake's own enum, or 1), batch_transfer_sync_read for Read (0).
        transport_hint, as on every transfer call, is taken and ignored:
        ferryd moves the bytes over its one transport (Mooncake's build
        without TENT ignores it too). With notify (a TransferNotify:
        name, msg; ferry's or Mooncake's), once the transfer returned 0
        (an empty batch too), ferryd sends it to the RPC port of
        target_hostname's segment, as Mooncake sends it once a transfer
        completed, and that engine's get_notifies() returns it. 0 once
        its receiver kept it; -1 when it was not delivered (refused, or
        unreachable), though the transfer's bytes are in place (Mooncake
        returns 0 then and logs the failure)."""
        return self._sync("batch_transfer_sync", target_hostname, buffers, peer_buffer_addresses, lengths, opcode, notify)

    def _sync(self, method, target_hostname, buffers, peer_buffer_addresses, lengths, opcode, notify):
        if notify is not None and not (isinstance(getattr(notify, "name", None), str)
                                       and isinstance(getattr(notify, "msg", None), str)):
            return self._refuse(method, 0, f"{method}: notify {notify!r}: want a TransferNotify(name, msg) with str "
                                           "name and msg (ferry.mooncake's, or Mooncake's), or None")
        op = _opcode(opcode)
        if op is None:
            return self._refuse(method, 0, f"{method}: opcode {opcode!r}: want TransferOpcode.Write (1) or Read (0)")
        move = self._read_batch if op == TransferOpcode.Read else self._write_batch
        ret = move(method, target_hostname, buffers, peer_buffer_addresses, lengths)
        if ret != 0 or notify is None:
            return ret
        return self._notify(method, target_hostname, notify)

    def _notify(self, method, session_id, notify):
        """Has ferryd send notify to the segment session_id: 0 once its
        receiver kept it, else -1 saying why."""
        session = session_id.removeprefix("mooncake://")
        body = json.dumps({"session": session, "name": notify.name, "notify_msg": notify.msg}).encode()
        try:
            self._need_client().request("POST", "/v1/mooncake/notifies", body, "application/json")
        except FerryError as e:
            e.message = f"{method} with {session_id}: the transfer completed, but its notify was not delivered: {e.message}"
            return self._fail(method, session_id, 0, e)
        return 0

    def get_notifies(self):
        """The notifies this engine's segment received since the last
        call (Mooncake engines' and ferry engines' transfers with a
        notify), oldest first, as Mooncake returns them: a list of
        TransferNotify (name, msg); each is returned once. [] before
        initialize (or from a ferryd serving no segment); on failure []
        and last_failure, as Mooncake logs and returns []. A segment keeps
        at most 1024 unread notifies (256 KiB of them) and refuses more:
        call it as often as notifies come."""
        segment = self._segment
        if segment is None:
            return []
        try:
            got = json.loads(self._need_client().request(
                "POST", f"/v1/mooncake/segments/{segment['id']}/notifies/drain").body)
        except FerryError as e:
            self._fail("get_notifies", "", 0, e)
            return []
        return [TransferNotify(n["name"], n["notify_msg"]) for n in got["notifies"]]


    def transfer_sync_write(self, target_hostname, buffer, peer_buffer_address, length, transport_hint=""):
        """Writes length bytes at buffer (inside a registered range) to
        peer_buffer_address in the segment target_hostname ("ip:rpcport"),
        and returns once they are there: 0, or -1."""
        return self._write_batch("transfer_sync_write", target_hostname, [buffer], [peer_buffer_address], [length])

    def batch_transfer_sync_write(self, target_hostname, buffers, peer_buffer_addresses, lengths, transport_hint=""):
        """Writes every (buffer, peer address, length) piece, pieces that
        are adjacent at both ends in one registered range merged into one
        write. Returns 0 once all are there (at once when there are none,
        or none has a byte: vLLM sends an empty batch for a request whose
        blocks the decoder has cached), or -1 at the first that fails (the
        pieces written before it stay written). A batch larger than one
        transfer carries goes as several, one after another."""
        return self._write_batch("batch_transfer_sync_write", target_hostname, buffers, peer_buffer_addresses, lengths)

    def _write_batch(self, method, session_id, buffers, peer_buffer_addresses, lengths):
        session = session_id if session_id.startswith("mooncake://") else "mooncake://" + session_id

        def write(pieces, held):
            for lo, hi in self._runs(pieces, held):
                self._write(session, pieces[lo:hi], held[lo:hi])
        return self._batch(method, session_id, buffers, peer_buffer_addresses, lengths, write)

    def _batch(self, method, session_id, buffers, peer_buffer_addresses, lengths, move):
        """Checks a batch's lists, holds the registered ranges its pieces'
        local ends lie in (so unregister_memory waits), merges pieces
        adjacent at both ends in one range and calls move(pieces, held):
        0, at once when no piece has a byte, or -1 with the failure."""
        wrong = _wrong_lists(method, session_id, buffers, peer_buffer_addresses, lengths)
        if wrong:
            return self._refuse(method, 0, wrong)
        pieces = [p for p in zip(buffers, peer_buffer_addresses, lengths) if p[2] != 0]
        if not pieces:
            return 0
        held = set()
        try:
            starts, outside = self._hold(pieces, held)
            if outside is not None:
                local, _, n = outside
                return self._refuse(method, n, f"{method} with {session_id}: [{local:#x}, +{n}) lies in no registered "
                                               "range: register_memory it first")
            move(*_merge(pieces, starts))
        except FerryError as e:
            return self._fail(method, session_id, sum(n for _, _, n in pieces), e)
        finally:
            self._release(held)
        return 0

    def transfer_sync_read(self, target_hostname, buffer, peer_buffer_address, length, transport_hint=""):
        """Reads length bytes at peer_buffer_address of the segment
        target_hostname into buffer (inside a registered range): 0, or -1."""
        return self._read_batch("transfer_sync_read", target_hostname, [buffer], [peer_buffer_address], [length])

    def batch_transfer_sync_read(self, target_hostname, buffers, peer_buffer_addresses, lengths, transport_hint=""):
        """Reads every (peer address, length) piece into (buffer): 0 once
        all are in this process's memory, or -1 at the first that fails.
        Only memory an engine registered is read: a ferry engine's segment
        serves reads from the memory its engine registered (ferryd's own
        segment, its arena and slots, serves none); a Mooncake engine's
        from its buffers. From a ferry engine's segment (its descriptor
        names its ferryd's peer port, on the host dialed), through this
        engine's ferryd over ferry's peer protocol under the segment's key
        (POST /v1/reads; authenticated by the peer secret where the
        daemons hold one; on ferryd's rdma transport by RDMA READ, into
        this engine's memory lent to ferryd itself). From a Mooncake
        engine's segment on an rdma engine: through ferryd too, by plain
        RDMA READs from the segment's buffers under the rkeys its
        descriptor lists (over the endpoint ferryd's writes to it take);
        a segment that speaks no rdma fails, naming its protocol, rather
        than going over TCP. On a tcp engine: from this process over the
        segment's TCP data port (Mooncake's READ, protocol v2 where the
        segment says so), straight into the registered memory."""
        return self._read_batch("batch_transfer_sync_read", target_hostname, buffers, peer_buffer_addresses, lengths)

    def _read_batch(self, method, session_id, buffers, peer_buffer_addresses, lengths):
        def read(pieces, held):
            on_gpu = [local for (local, _, _), st in zip(pieces, held) if st in self._on_gpu]
            if on_gpu:
                raise BadRequest(f"{method} from {session_id}: [{on_gpu[0]:#x}, ...) is GPU memory, and reads land "
                                 "in host memory of this process only so far: read into registered host memory, "
                                 "then copy", code="bad_request")
            try:
                desc = self._descriptor(session_id)
                if _ferry_peer(session_id, desc):
                    self._read_via_ferryd(session_id, pieces, held)
                elif self.protocol == "rdma":
                    if desc.get("protocol") != "rdma":
                        raise ValueError(f"this engine was initialized with protocol \"rdma\", and the segment speaks "
                                         f"{desc.get('protocol')!r}: an rdma engine reads a Mooncake segment by RDMA READ "
                                         "only, never silently over TCP: start that engine on rdma, or read from an "
                                         "engine whose ferryd runs tcp")
                    self._read_via_ferryd(session_id, pieces, held)
                else:
                    _read_pieces(session_id, desc, pieces)
            except (OSError, ValueError) as e:
                raise FerryError(f"{method} from {session_id}: {e}",
                                 code="refused" if isinstance(e, _ReadRefused) else "transfer_failed") from e
        return self._batch(method, session_id, buffers, peer_buffer_addresses, lengths, read)

    # --- asynchronous: the synchronous calls on the engine's pool

    def batch_transfer_async_write(self, target_hostname, buffers, peer_buffer_addresses, lengths, transport_hint=""):
        """batch_transfer_sync_write on the engine's pool: its batch id (an
        int > 0) at once, or 0 when it cannot be submitted (the reason
        logged and in last_failure). get_batch_transfer_status or
        transfer_check_status tell how it ended."""
        return self._submit("batch_transfer_async_write", self._write_batch,
                            target_hostname, buffers, peer_buffer_addresses, lengths)

    def batch_transfer_async_read(self, target_hostname, buffers, peer_buffer_addresses, lengths, transport_hint=""):
        """batch_transfer_sync_read on the engine's pool: a batch id, or 0."""
        return self._submit("batch_transfer_async_read", self._read_batch,
                            target_hostname, buffers, peer_buffer_addresses, lengths)

    def batch_transfer_async(self, target_hostname, buffers, peer_buffer_addresses, lengths, opcode, transport_hint=""):
        """batch_transfer_async_write for TransferOpcode.Write,
        batch_transfer_async_read for Read (either enum, or its int): a
        batch id, or 0."""
        op = _opcode(opcode)
        if op is None:
            self._refuse("batch_transfer_async", 0, f"batch_transfer_async: opcode {opcode!r}: want TransferOpcode.Write "
                                                    "(1) or Read (0)")
            return 0
        return self._submit(f"batch_transfer_async_{op.name.lower()}",
                            self._read_batch if op == TransferOpcode.Read else self._write_batch,
                            target_hostname, buffers, peer_buffer_addresses, lengths)

    def transfer_submit_write(self, target_hostname, buffer, peer_buffer_address, length, transport_hint=""):
        """transfer_sync_write on the engine's pool: a batch id for
        transfer_check_status, or 0."""
        return self._submit("transfer_submit_write", self._write_batch,
                            target_hostname, [buffer], [peer_buffer_address], [length])

    def transfer_check_status(self, batch_id):
        """Mooncake's: 0 while the batch runs; 1 when every byte is there
        (a write: in the receiver's memory), -1 when it failed (the reason
        in last_failure) or batch_id is unknown; a finished batch's id is
        forgotten once read."""
        with self._lock:
            rec = self._batches.get(batch_id)
            if rec is not None and rec.future.done():
                del self._batches[batch_id]
        if rec is None:
            return self._unknown_batch("transfer_check_status", batch_id)
        if not rec.future.done():
            return 0
        return 1 if self._outcome(rec) == 0 else FAILED

    def get_batch_transfer_status(self, batch_ids):
        """Mooncake's: waits for every batch in batch_ids to finish; 0 when
        all moved every byte, -1 at the first that failed (the reason in
        last_failure; the others' ids are forgotten too, as Mooncake frees
        them) or when one is unknown (then no id is forgotten). Each wait
        is bounded: a batch still running after its transfers' deadline
        (twice ferryd's answer timeout, as busy answers are retried) is a
        failure."""
        ids = list(batch_ids)
        with self._lock:
            unknown = [b for b in ids if b not in self._batches]
            recs = [self._batches[b] for b in ids if b in self._batches]
        if unknown:
            return self._unknown_batch("get_batch_transfer_status", unknown[0])
        ret = 0
        for rec in recs:
            wait = 2 * self._need_client().timeout + 10
            try:
                rec.future.result(timeout=wait)
            except FutureTimeout:
                self._fail(rec.method, rec.session, rec.nbytes, FerryError(
                    f"{rec.method} (batch {rec.batch_id}) with {rec.session} still running after {wait:.0f} s",
                    code="timeout"))
                ret = FAILED
                break
            except Exception:
                pass  # raise_on_failure: _outcome raises it
            if self._outcome(rec) != 0:
                ret = FAILED
                break
        with self._lock:
            for b in ids:
                if ret != 0 or (b in self._batches and self._batches[b].future.done()):
                    self._batches.pop(b, None)
        return ret

    def _submit(self, method, call, session_id, buffers, peer_buffer_addresses, lengths):
        """Runs call(method, session_id, ...lists) on the pool: its batch
        id, or 0 (Mooncake's failed submit) with the reason."""
        wrong = _wrong_lists(method, session_id, buffers, peer_buffer_addresses, lengths)
        with self._lock:
            if wrong is None and self._closing:
                wrong = f"{method}: the engine is closed: submit to an open engine"
            elif wrong is None and sum(not r.future.done() for r in self._batches.values()) >= ASYNC_IN_FLIGHT:
                wrong = (f"{method}: {ASYNC_IN_FLIGHT} batches of this engine are in flight already: read their "
                         "status (get_batch_transfer_status) before submitting more")
            if wrong is None:
                self._need_client()  # made once, here, not by racing pool threads
                if self._pool is None:
                    self._pool = ThreadPoolExecutor(ASYNC_WORKERS, thread_name_prefix="ferry-mooncake-async")
                rec = _Batch(next(_batch_ids), method, session_id, sum(lengths), None)
                rec.future = self._pool.submit(self._run_batch, call, method, session_id, list(buffers),
                                               list(peer_buffer_addresses), list(lengths))
                self._batches[rec.batch_id] = rec
                self._drop_unread()
        if wrong is not None:
            self._refuse(method, sum(n for n in lengths if isinstance(n, int)), wrong)
            return 0
        return rec.batch_id

    def _run_batch(self, call, *args):
        """In a pool thread: the synchronous call's return, and the failure
        it recorded (last_failure is the engine's, shared by its threads)."""
        self._tls.failure = None
        ret = call(*args)
        return ret, self._tls.failure if ret != 0 else None

    def _outcome(self, rec):
        """A finished batch's return (0 or -1); a failure becomes
        last_failure again, for the caller who reads its status; raised
        with raise_on_failure."""
        err = rec.future.exception()
        if err is not None:
            raise err  # only with raise_on_failure: the synchronous call raised it
        ret, failure = rec.future.result()
        if failure is not None:
            self.last_failure = failure
        return ret

    def _drop_unread(self):
        """Keeps at most ASYNC_KEPT finished batches nobody read, dropping
        the oldest (called with the lock held)."""
        done = [b for b, r in self._batches.items() if r.future.done()]
        for b in done[:max(0, len(done) - ASYNC_KEPT)]:
            del self._batches[b]
            self._dropped += 1
            if self._dropped == 1 or self._dropped % 1024 == 0:
                log.warning("ferry.mooncake: %d finished batches dropped unread (batch %d the latest): more than %d "
                            "finished batches were never read: call get_batch_transfer_status or "
                            "transfer_check_status for each", self._dropped, b, ASYNC_KEPT)

    def _unknown_batch(self, method, batch_id):
        return self._refuse(method, 0, f"{method}: batch id {batch_id!r} is unknown to this engine, or its status was read "
                                       f"already (a finished batch's id is forgotten once read; past {ASYNC_KEPT} "
                                       "unread finished batches the oldest are dropped): pass an id this engine's "
                                       "asynchronous calls returned")

    def _write(self, session, pieces, starts):
        """Writes the pieces with one batch transfer (one completion): those
        in GPU ranges straight from their regions, the host ones staged
        as one entry first (one upload, sent from where they lie). One
        piece of lent host memory goes as a reference to its region on a
        write stream (Client.write_region); one of other host memory up
        to INLINE_MAX bytes inline (Client.write). starts are the
        registered ranges the pieces lie in."""
        client = self._need_client()
        if len(pieces) == 1 and starts[0] in self._lent and starts[0] not in self._on_gpu:
            # One piece of lent host memory: a reference to it (region,
            # offset, length) on a write stream, ferryd sending from the
            # region (bench/README.md, "One write at a time").
            (src, dst, n), = pieces
            _when_room(lambda: client.write_region(Slot(session=session, buffer_address=dst), self._lent[starts[0]],
                                                   src - starts[0], n), client.timeout)
            return
        if len(pieces) == 1 and starts[0] not in self._on_gpu and pieces[0][2] <= INLINE_MAX:
            # One piece of host memory ferryd cannot reach (a send_only
            # engine's): its bytes go with the request (POST /v1/writes),
            # one round trip, no staged entry.
            (src, dst, n), = pieces
            body = (ctypes.c_char * n).from_address(src)
            _when_room(lambda: client.write(Slot(session=session, buffer_address=dst), body), client.timeout)
            return
        base = min(dst for _, dst, _ in pieces)
        lent = self._lent
        sources, items = [], []
        host = [(src, dst, n) for (src, dst, n), st in zip(pieces, starts) if st not in lent]
        req_id = None
        if host:
            req_id = f"mooncake-{os.getpid()}-{next(_entry_ids)}"
            sources.append(req_id)
            # Staged from where the pieces lie, one after another.
            staged = [(ctypes.c_char * n).from_address(src) for src, _, n in host]
            items = [(0, off, 0, dst - base, n)
                     for off, (_, dst, n) in zip(itertools.accumulate((n for _, _, n in host), initial=0), host)]
        by_region = {}
        for st in dict.fromkeys(st for st in starts if st in lent):
            by_region[st] = len(sources)
            sources.append({"region": lent[st]})
        if by_region:
            items += [(by_region[st], src - st, 0, dst - base, n) for (src, dst, n), st in zip(pieces, starts) if st in lent]
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

    def _read_via_ferryd(self, session_id, pieces, starts):
        """Reads the pieces from a ferry engine's segment through ferryd
        (POST /v1/reads), READ_MAX bytes a request at most: those in a
        range lent to ferryd (starts: the registered ranges they lie in)
        land in its region there, by the NIC on ferryd's rdma transport;
        the others come in the answer, copied to where they go."""
        client = self._need_client()
        by_region = {}
        for piece, st in zip(pieces, starts):
            by_region.setdefault(self._lent.get(st), []).append((piece, st))
        for region, group in by_region.items():
            for run in _read_runs([p for p, _ in group]):
                body = {"session": session_id, "pieces": [[remote, n] for _, remote, n in run]}
                if region is not None:
                    st = group[0][1]
                    body.update(region=region, region_offsets=[local - st for local, _, _ in run])
                data = json.dumps(body).encode()
                got = _when_room(lambda: client.request("POST", "/v1/reads", data, "application/json"), client.timeout).body
                if region is not None:
                    continue
                at = 0
                for local, _, n in run:
                    ctypes.memmove(local, got[at:at + n], n)
                    at += n

    def _runs(self, pieces, starts):
        """Cuts the pieces into runs (lo, hi) that one transfer each
        carries: at most TRANSFER_ITEMS items, whose JSON is at most
        TRANSFER_ITEM_BYTES. An item's length is bounded from above as the
        whole batch would write it (a run's offsets are no larger)."""
        base = min(dst for _, dst, _ in pieces)
        index = len(str(len(self._lent)))  # the most digits a source's index has
        # Every item is at most as long as one of the largest fields: a
        # source offset below the batch's bytes (staged) or the span of
        # its local ends (lent), a destination offset below the span of
        # its peer ends. Most batches fit whole by that bound.
        total = sum(n for _, _, n in pieces)
        widest = (8 + index + len(str(max(total, max(src for src, _, _ in pieces) - min(starts))))
                  + len(str(max(dst for _, dst, _ in pieces) - base)) + len(str(max(n for _, _, n in pieces))))
        if len(pieces) <= TRANSFER_ITEMS and len(pieces) * widest <= TRANSFER_ITEM_BYTES:
            yield 0, len(pieces)
            return
        lo, size, host = 0, 0, 0
        for i, ((src, dst, n), st) in enumerate(zip(pieces, starts)):
            if st in self._lent:
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

    def _hold(self, pieces, held):
        """The start of the registered range each piece's local end lies
        in, those ranges counted as read until _release(held) (held: the
        starts counted, each once); and the first piece that lies in none
        (None when all do). Under one lock: a batch's pages lie in a few
        ranges, the last one found is tried first."""
        starts = []
        lo = hi = 0
        with self._lock:
            for src, dst, n in pieces:
                if not (lo <= src and src + n <= hi):
                    i = bisect.bisect_right(self._regions, (src, float("inf"))) - 1
                    if i < 0 or not (self._regions[i][0] <= src and src + n <= self._regions[i][1]):
                        return starts, (src, dst, n)
                    lo, hi = self._regions[i]
                    if lo not in held:
                        held.add(lo)
                        self._in_flight[lo] = self._in_flight.get(lo, 0) + 1
                starts.append(lo)
        return starts, None

    def _release(self, held):
        if held:
            with self._lock:
                for start in held:
                    self._in_flight[start] -= 1
                self._lock.notify_all()

    def _need_client(self):
        if self._client is None:
            self._client = Client(self._socket_path)
        return self._client

    # --- failures, Mooncake's way (-1) or raised

    def _fail(self, method, session, nbytes, err):
        ret = getattr(err, "ret", None) or err.code or type(err).__name__
        self.last_failure = self._tls.failure = Failure(method, session, nbytes, ret, str(err))
        log.warning("ferry.mooncake: %s failed (session=%s, nbytes=%d, ret=%s): %s", method, session, nbytes, ret, err)
        if self.raise_on_failure:
            raise err
        return FAILED

    def _refuse(self, method, nbytes, message):
        return self._fail(method, "", nbytes, BadRequest(message, code="bad_request"))


def _close_segment(client, segment_id, raise_errors=False):
    """DELETE an engine's segment (at close, or when the engine is
    collected: then errors are dropped, as ferryd also drops it when the
    process exits)."""
    try:
        client.request("DELETE", f"/v1/mooncake/segments/{segment_id}")
    except FerryError:
        if raise_errors:
            raise


def _topology(status, device_name):
    """Mooncake's topology matrix (storage type -> [preferred NICs, NICs])
    of ferryd's GET /v1/status (get_local_topology)."""
    rails = [r["device"] for r in ((status["transport"].get("rdma") or {}).get("rails") or [])]
    keep = [n.strip() for n in (device_name or "").split(",") if n.strip()]
    rails = [r for r in rails if not keep or r in keep]
    if not rails:
        return {}
    matrix, numa = {}, {}
    for row in (status.get("affinity") or {}).get("devices") or []:
        near = [n["name"] for n in row.get("nics") or [] if n["name"] in rails]
        matrix[row["device"]] = [near, rails]
        for n in row.get("nics") or []:
            if n["name"] in rails and n.get("numa_node", -1) >= 0:
                numa.setdefault(n["numa_node"], []).append(n["name"])
    for node, nics in sorted(numa.items()):
        matrix[f"cpu:{node}"] = [list(dict.fromkeys(nics)), rails]
    return matrix


def _wrong_lists(method, session_id, buffers, peer_buffer_addresses, lengths):
    """What is wrong with a batch's lists, or None."""
    if not (len(buffers) == len(peer_buffer_addresses) == len(lengths)):
        return f"{method}: {len(buffers)} buffers, {len(peer_buffer_addresses)} peer addresses and {len(lengths)} lengths"
    if any(not isinstance(n, int) or n < 0 for n in lengths):
        return f"{method} with {session_id}: lengths {lengths!r}: want whole numbers of bytes, none negative"
    return None


@dataclass
class _Batch:
    """An asynchronous batch: its id, what submitted it, its bytes, and the
    pool's future of (return, failure)."""
    batch_id: int
    method: str
    session: str
    nbytes: int
    future: object


class _NotWritable(BadRequest):
    """Memory register_memory refuses: no peer's write could land there."""

    def __init__(self, message):
        super().__init__(message, code="not_writable")


# Why the Mooncake methods ferry does not have are not there; each raises
# NotImplementedError naming itself and this (docs/python.md lists them).
_NO_CUDA_STREAM = ("ferry's transfers are not ordered on a CUDA stream: synchronise the stream, then call the "
                   "synchronous ones")
_NOT_IMPLEMENTED = {
    "transfer_write_on_cuda": _NO_CUDA_STREAM,
    "transfer_read_on_cuda": _NO_CUDA_STREAM,
    "batch_transfer_write_on_cuda": _NO_CUDA_STREAM,
    "batch_transfer_read_on_cuda": _NO_CUDA_STREAM,
    "get_engine_ptr": "there is no C++ engine in this process: transfers run in ferryd (get_engine gives this object)",
    "warmup_efa_segment": "ferry has no EFA transport",
}


def _not_implemented(name, why):
    def method(self, *args, **kwargs):
        raise NotImplementedError(f"ferry.mooncake.TransferEngine.{name}: {why} (docs/python.md)")
    method.__name__ = method.__qualname__ = name
    method.__doc__ = f"Not on ferry: raises NotImplementedError ({why})."
    return method


for _name, _why in _NOT_IMPLEMENTED.items():
    setattr(TransferEngine, _name, _not_implemented(_name, _why))


# Mooncake's handshake messages (mooncake/frame.go): a u64 little-endian
# length (type byte and JSON), the type, the JSON; one request and one
# reply per connection, each at most 1 MiB.
_METADATA, _PROBE = 1, 3
_HANDSHAKE_MAX = 1 << 20
_HANDSHAKE_TIMEOUT = 5.0  # as ferryd's (and Mooncake's server's receive timeout)


def _split_host_port(name):
    """("host", "port") of "host:port" or "[v6]:port"; ("name", "") without a port."""
    if name.startswith("[") and "]:" in name:
        host, _, port = name[1:].partition("]:")
        return host, port
    if name.count(":") == 1:
        host, _, port = name.partition(":")
        return host, port
    return name, ""


def _unreachable(host, listen):
    """Why peers dialing host reach no port listening on listen (the host
    of ferryd's --mooncake-listen, an IP), or None: a wildcard takes any
    address of this host (one a socket binds to; 0.0.0.0 an IPv4 one), an
    address only itself."""
    try:
        addrs = {ipaddress.ip_address(ai[4][0].partition("%")[0])
                 for ai in socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)}
    except (OSError, UnicodeError, ValueError) as e:
        return (f"{host!r} resolves to no address ({e}); peers dial this engine at it: pass this host's IP (the host "
                "of ferryd's --mooncake-listen)")
    at = ipaddress.ip_address(listen)
    shown = ", ".join(sorted(map(str, addrs)))
    if not at.is_unspecified:
        if at in addrs:
            return None
        return (f"peers dial this engine at {host} ({shown}), and ferryd's Mooncake segments listen on {listen} only "
                f"(its --mooncake-listen): pass {listen}, or start ferryd with --mooncake-listen on this address "
                "(or 0.0.0.0:PORT, every address of this host)")
    if any(_local(a) for a in addrs if at.version == 6 or a.version == 4):
        return None
    return (f"peers dial this engine at {host} ({shown}), which is no {'IPv4 ' if at.version == 4 else ''}address "
            f"of this host, where ferryd's Mooncake segments listen on every address ({listen}, its "
            "--mooncake-listen): pass one of this host's addresses")


def _local(addr):
    """Whether addr is an address of this host: a socket binds to it."""
    try:
        with socket.socket(socket.AF_INET6 if addr.version == 6 else socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((str(addr), 0))
        return True
    except OSError:
        return False


def _handshake(segment, kind, body):
    """Sends one handshake message of type kind to the RPC port of the
    segment "host:port" and returns the JSON reply; OSError or ValueError
    saying what went wrong, within _HANDSHAKE_TIMEOUT."""
    host, port = _split_host_port(segment)
    if not port.isdigit():
        raise ValueError("want a session id \"host:rpc_port\"")
    deadline = time.monotonic() + _HANDSHAKE_TIMEOUT
    payload = json.dumps(body).encode() + b"\n"
    with socket.create_connection((host, int(port)), _HANDSHAKE_TIMEOUT) as conn:
        def recv(n):
            out = bytearray()
            while len(out) < n:
                conn.settimeout(max(deadline - time.monotonic(), 0.001))
                chunk = conn.recv(n - len(out))
                if not chunk:
                    raise ValueError("the peer closed the connection without a reply: is it a Mooncake RPC port?")
                out += chunk
            return bytes(out)
        conn.sendall(struct.pack("<QB", len(payload) + 1, kind) + payload)
        length, got = struct.unpack("<QB", recv(9))
        if got != kind or not 1 <= length <= _HANDSHAKE_MAX:
            raise ValueError(f"the reply (type {got}, {length} bytes) is not a Mooncake handshake reply of type {kind}")
        reply = json.loads(recv(length - 1))
        if not isinstance(reply, dict):
            raise ValueError(f"the reply {reply!r} is not a JSON object")
        return reply


def _check_descriptor(segment, desc):
    """Raises ValueError naming the field when a field of desc, segment's
    descriptor, that this module reads has the wrong type: a peer's
    answer is input, and a malformed one fails the call (-1), not the
    caller."""
    def bad(field, value, want):
        raise ValueError(f"segment {segment}'s descriptor has {field} {repr(value)[:100]}, want {want}: "
                         "is that RPC port a Mooncake engine's?")

    def uint(value):
        return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 1 << 64

    for field in ("protocol", "name"):
        if desc.get(field) is not None and not isinstance(desc[field], str):
            bad(field, desc[field], "a string")
    for field, top in (("tcp_data_port", 65535), ("tcp_proto_version", 1 << 32)):
        value = desc.get(field)
        if value is not None and not (uint(value) and value <= top):
            bad(field, value, f"an integer from 0 to {top}")
    ferry = desc.get("ferry")
    if ferry is not None and not (isinstance(ferry, dict) and isinstance(ferry.get("peer", ""), str)):
        bad("ferry", ferry, "an object whose peer is \"host:port\"")
    buffers = desc.get("buffers")
    if buffers is not None and not isinstance(buffers, list):
        bad("buffers", buffers, "a list")
    for i, b in enumerate(buffers or []):
        if not (isinstance(b, dict) and uint(b.get("addr")) and uint(b.get("length"))):
            bad(f"buffers[{i}]", b, "an object with an addr and a length, integers >= 0")


class _ReadRefused(ValueError):
    """The peer refused a READ: the range lies in none of its buffers."""


_IO_TIMEOUT = 10.0  # per recv or send, as ferryd's io_timeout
_STATUS_MAGIC = 0x4D435456  # "MCTV", the high half of a v2 status word


def _ferry_peer(segment, desc):
    """Whether desc, segment's descriptor, is a ferry engine's whose
    ferryd's peer port lies on the host dialed (ferryd follows no other:
    mooncake/session.go's sameHost)."""
    peer = (desc.get("ferry") or {}).get("peer")
    return bool(peer) and _split_host_port(peer)[0] == _split_host_port(segment)[0]


# READ_MAX and READ_PIECES are the most one POST /v1/reads carries
# (ferryd's maxReadBytes and maxReadPieces).
READ_MAX = 64 << 20
READ_PIECES = 1 << 16


def _read_runs(pieces):
    """The pieces in runs of at most READ_MAX bytes and READ_PIECES
    pieces, a longer piece cut."""
    run, size = [], 0
    for local, remote, n in pieces:
        while n:
            take = min(n, READ_MAX - size)
            run.append((local, remote, take))
            size += take
            local, remote, n = local + take, remote + take, n - take
            if size == READ_MAX or len(run) == READ_PIECES:
                yield run
                run, size = [], 0
    if run:
        yield run


def _read_pieces(segment, desc, pieces):
    """Reads each (local, remote, n) piece from the segment, whose
    descriptor is desc (_check_descriptor passed it), over its TCP data
    port (mooncake/data.go has the wire), into local memory in place;
    raises OSError or ValueError saying what failed."""
    if desc.get("protocol") != "tcp" or not desc.get("tcp_data_port"):
        raise ValueError(f"the segment speaks {desc.get('protocol')!r}: reads from a Mooncake engine go over its tcp "
                         "transport only so far")
    buffers = desc.get("buffers") or []
    for _, remote, n in pieces:
        if not any(b["addr"] <= remote and remote + n <= b["addr"] + b["length"] for b in buffers):
            listed = "; ".join(f"[{b['addr']:#x}, +{b['length']})" for b in buffers) or "none"
            raise _ReadRefused(f"[{remote:#x}, +{n}) lies in none of the segment's buffers ({listed}): read memory "
                               "its engine registered")
    v2 = (desc.get("tcp_proto_version") or 1) >= 2
    host, _ = _split_host_port(segment)
    with socket.create_connection((host, desc["tcp_data_port"]), _IO_TIMEOUT) as conn:
        conn.settimeout(_IO_TIMEOUT)
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for local, remote, n in pieces:
            conn.sendall(struct.pack("<QQB7x", n, remote, 0x80 if v2 else 0))
            if v2:
                word = _recv_exactly(conn, memoryview(bytearray(8)))
                status = struct.unpack("<Q", word)[0]
                if status >> 32 != _STATUS_MAGIC:
                    raise ValueError(f"status word {status:#018x} lacks the MCTV magic: not Mooncake's TCP protocol v2")
                if status & 0xFFFFFFFF != 0:
                    raise _ReadRefused(f"the segment rejected the read of {n} bytes at {remote:#x}")
            _recv_exactly(conn, memoryview((ctypes.c_char * n).from_address(local)).cast("B"))


def _recv_exactly(conn, view):
    """Fills view from conn; the bytes as a bytes object when view is small."""
    got = 0
    while got < len(view):
        k = conn.recv_into(view[got:])
        if k == 0:
            raise ValueError(f"the segment closed the connection after {got} of {len(view)} bytes (a rejected v1 read?)")
        got += k
    return bytes(view) if len(view) <= 8 else None


def _address(x):
    """An address as an int: x itself, or a tensor's data_ptr() (a
    torch.cuda tensor's is a device address)."""
    data_ptr = getattr(x, "data_ptr", None)
    return int(data_ptr()) if callable(data_ptr) and not isinstance(x, int) else x


def _merge(pieces, starts):
    """Joins pieces adjacent at both ends that lie in one registered range
    (starts: the start of each one's), in the order given: the pieces and
    their starts. Two adjacent ranges are two regions (or one lent, one
    not): a piece across them would lie in neither."""
    out, at = [], []
    for (src, dst, n), st in zip(pieces, starts):
        if out and at[-1] == st and out[-1][0] + out[-1][2] == src and out[-1][1] + out[-1][2] == dst:
            out[-1] = (out[-1][0], out[-1][1], out[-1][2] + n)
        else:
            out.append((src, dst, n))
            at.append(st)
    return out, at
