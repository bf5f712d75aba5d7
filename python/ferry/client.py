"""The client of ferryd's control API (docs/api.md), mirroring the Go
client (client/client.go): every route, errors as exceptions by code, and
the zero-copy helpers over a mapping of the arena."""

import base64
import contextlib
import dataclasses
import json
import os
import struct
from typing import Optional
from urllib.parse import quote, urlencode

from . import dtypes
from ._http import Transport
from .arena import map_arena
from .cuda import CUDARegion, device_ordinal, ipc_handle
from .regions import Region, new_memfd, register_fd
from .errors import BadRequest, FerryError, GPUArenaNotSupported, Timeout, error_for, from_answer

DEFAULT_SOCKET = "/run/ferry/ferryd.sock"


# A write frame's bytes after its length, less its names (docs/api.md).
_FRAME_FIXED = 4 * 8 + 3 * 2


@dataclasses.dataclass(frozen=True)
class Slot:
    """Where a sender writes: what the receiver's ``Client.receive`` returns
    and hands to the sender out of band (``to_dict`` / ``Slot.from_dict``
    for JSON). ``key`` is the slot's capability, an opaque string: pass it
    on unchanged. A send into a Mooncake segment
    (``session="mooncake://ip:port"``) has no key."""

    session: str
    buffer_address: int
    key: Optional[str] = None
    nbytes: Optional[int] = None
    req_id: Optional[str] = None
    mooncake_session: Optional[str] = None
    device: Optional[str] = None  # the device whose arena holds the slot

    @classmethod
    def from_dict(cls, d):
        missing = [k for k in ("session", "buffer_address") if k not in d]
        if missing:
            raise ValueError(f"a receive slot needs {' and '.join(missing)} (as POST /v1/receives answers), got {sorted(d)}")
        return cls(**{f.name: d[f.name] for f in dataclasses.fields(cls) if f.name in d})

    def to_dict(self):
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}


class Reservation:
    """A reserved arena slice being filled in place (``Client.staging``):
    write ``memory`` (or ``tensor()``) before the with-block ends."""

    def __init__(self, req_id, offset, memory, shape, dtype):
        self.req_id = req_id
        self.offset = offset
        self.memory = memory
        self.nbytes = memory.nbytes
        self.shape = shape
        self.dtype = dtype
        self.entry = None  # the committed entry, once the with-block ended

    def tensor(self):
        """A torch tensor over the slice (no copy): write into it, e.g. ``.copy_(src)``."""
        return dtypes.tensor_over(self.memory, self.shape, self.dtype)


@dataclasses.dataclass(frozen=True)
class Response:
    """A successful answer to ``Client.request``: status, headers, the body's bytes."""

    status: int
    headers: object
    body: bytes


def _decode(method, path, resp):
    """The JSON of a successful answer (None for 204 No Content)."""
    if resp.status == 204:
        return None
    try:
        return json.loads(resp.body)
    except ValueError as e:
        raise FerryError(f"decoding ferryd's answer to {method} {path}: {e}", resp.status) from None


def _source(s):
    """A transfer source as the API takes it: a req_id, a Region, or the dict."""
    if isinstance(s, str):
        return {"req_id": s}
    if isinstance(s, (Region, CUDARegion)):
        return {"region": s.name}
    return dict(s)


def _id(req_id):
    if not isinstance(req_id, str):
        raise TypeError(f"req_id must be a str, not {type(req_id).__name__}")
    return quote(req_id, safe="")


class Client:
    """Talks to one ferryd over its Unix socket: ``socket_path``, else
    $FERRY_SOCKET, else /run/ferry/ferryd.sock. Safe to share between
    threads; connections are kept open between calls (``close`` ends them).

    ``timeout`` bounds the wait for each answer, in seconds; ``wait`` and
    ``send(wait_ms=...)`` add the wait they ask for. ``dial``, when given,
    opens the connection instead (a callable returning a connected socket).
    """

    def __init__(self, socket_path=None, timeout=120.0, dial=None):
        self.socket_path = socket_path or os.environ.get("FERRY_SOCKET") or DEFAULT_SOCKET
        self.timeout = timeout
        self._transport = Transport(self.socket_path, dial)
        self._devices = None  # ferryd's arenas' devices, read once (_arena_for)

    def close(self):
        """Closes the connections kept open between calls."""
        self._transport.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self):
        return f"<ferry.Client {self.socket_path}>"

    # --- plumbing

    def request(self, method, path, body=None, content_type=None, timeout=None):
        """One request on any route (the escape hatch): a Response, or the
        error class of ferryd's answer."""
        headers = {"Content-Type": content_type} if content_type else {}
        status, hdrs, data = self._transport.round_trip(method, path, body, headers, timeout or self.timeout)
        if status >= 300:
            raise from_answer(status, data)
        return Response(status, hdrs, data)

    def _json(self, method, path, payload=None, timeout=None):
        body = None if payload is None else json.dumps(payload).encode()
        resp = self.request(method, path, body, "application/json" if body is not None else None, timeout)
        return _decode(method, path, resp)

    # --- the daemon

    def status(self):
        """GET /v1/status: memory, registration, transport, sessions, settings."""
        return self._json("GET", "/v1/status")

    def metrics(self):
        """GET /metrics: Prometheus text."""
        return self.request("GET", "/metrics").body.decode()

    # --- sending side

    def stage(self, req_id, data, shape=None, dtype=None, device=None):
        """Stages data for req_id by upload (PUT /v1/embeddings/{req_id}).

        data is a torch tensor (its shape and dtype go with it) or any
        contiguous buffer (bytes, bytearray, memoryview, a numpy array):
        give its shape and dtype, or neither to stage it as u8 of its
        length. A list of buffers is staged as their bytes one after
        another, u8, each sent from where it lies (no copy into one
        first). ``device`` ("cuda:1", "cpu", a torch.device or a tensor)
        names the arena it goes in; a tensor's own device is taken where
        ferryd has an arena on it, else ferryd's first. Returns the staged
        entry."""
        if isinstance(data, list):
            parts = [memoryview(b) for b in data]
            if not all(p.c_contiguous for p in parts):
                raise ValueError("a buffer to stage is not contiguous: pass a contiguous copy (bytes(data))")
            if shape is not None or dtype is not None:
                raise ValueError("a list of buffers is staged as u8 of their length: pass neither shape nor dtype")
            query = {"shape": str(sum(p.nbytes for p in parts)), "dtype": "u8"}
            if device is not None:
                query["device"] = dtypes.device_name(device)
            path = f"/v1/embeddings/{_id(req_id)}?{urlencode(query)}"
            status, body = self._transport.send_buffers("PUT", path, parts, {"Content-Type": "application/octet-stream"}, self.timeout)
            if status >= 300:
                raise from_answer(status, body)
            return json.loads(body)
        if device is None and dtypes.is_tensor(data):
            device = self._arena_for(data)
        if dtypes.is_tensor(data):
            if shape is not None or dtype is not None:
                raise ValueError("a tensor carries its own shape and dtype: pass neither with it")
            shape, dtype, body = tuple(data.shape), dtypes.canonical(data.dtype), dtypes.tensor_bytes(data)
        else:
            try:
                body = memoryview(data)
            except TypeError:
                raise TypeError(f"stage takes a torch tensor or a buffer (bytes, bytearray, memoryview), "
                                f"not {type(data).__name__}") from None
            if not body.c_contiguous:
                raise ValueError("the buffer to stage is not contiguous: pass a contiguous copy (bytes(data))")
            body = body.cast("B") if body.ndim != 1 or body.format != "B" else body
            if shape is None and dtype is None:
                shape, dtype = (body.nbytes,), "u8"
            elif shape is None or dtype is None:
                raise ValueError("give both shape and dtype, or neither (the bytes are then staged as u8 of their length)")
        query = {"shape": ",".join(map(str, dtypes.shape_of(shape))), "dtype": dtypes.canonical(dtype)}
        if device is not None:
            query["device"] = dtypes.device_name(device)
        path = f"/v1/embeddings/{_id(req_id)}?{urlencode(query)}"
        return _decode("PUT", path, self.request("PUT", path, body, "application/octet-stream"))

    def slice(self, req_id, shape=None, dtype=None, nbytes=None):
        """Reserves an arena slice for zero-copy staging (shape and dtype,
        or nbytes alone): {req_id, arena_file, offset, nbytes}. ``staging``
        does this, the write and the commit in one."""
        payload = {}
        if shape is not None or dtype is not None:
            payload = {"shape": list(dtypes.shape_of(shape if shape is not None else ())), "dtype": dtypes.canonical(dtype or "")}
        if nbytes is not None:
            payload["nbytes"] = nbytes
        return self._json("POST", f"/v1/embeddings/{_id(req_id)}/slice", payload)

    def commit(self, req_id, shape, dtype):
        """Seals a reserved slice with its shape and dtype: the entry."""
        return self._json("POST", f"/v1/embeddings/{_id(req_id)}/commit",
                          {"shape": list(dtypes.shape_of(shape)), "dtype": dtypes.canonical(dtype)})

    def _arena_for(self, tensor):
        """The tensor's device where ferryd has an arena on it, else None
        (ferryd's first): a client of a ferryd with one arena stages as
        it always did."""
        if self._devices is None:
            self._devices = [a["device"] for a in self.status().get("arenas") or []]
        name = dtypes.device_name(tensor)
        return name if name in self._devices else None

    def embedding(self, req_id):
        """Describes a staged (or reserved) entry."""
        return self._json("GET", f"/v1/embeddings/{_id(req_id)}")

    def embeddings(self):
        """Lists the staged and reserved entries."""
        return self._json("GET", "/v1/embeddings")

    def send(self, req_id, slot, wait_ms=0):
        """Writes req_id's staged data into a peer's receive slot (a Slot,
        or a dict with session, buffer_address and key as the receiver's
        ``receive`` gave them). wait_ms waits that long for a stage that
        races the send. On success the entry is freed; on failure it stays
        staged for a retry. Returns the send's figures."""
        if not isinstance(slot, Slot):
            if not hasattr(slot, "keys"):
                raise TypeError(f"send takes a Slot or a dict with session, buffer_address and key, not {type(slot).__name__}")
            slot = Slot.from_dict(slot)
        if not isinstance(slot.buffer_address, int) or isinstance(slot.buffer_address, bool):
            raise TypeError(f"buffer_address must be an int, not {type(slot.buffer_address).__name__}")
        if slot.key is not None and not isinstance(slot.key, str):
            raise TypeError(f"key must be the slot's key string as the receiver got it, not {type(slot.key).__name__}")
        if not isinstance(wait_ms, int) or wait_ms < 0:
            raise ValueError(f"wait_ms must be a non-negative int, not {wait_ms!r}")
        payload = {"session": slot.session, "buffer_address": slot.buffer_address}
        if slot.key is not None:
            payload["key"] = slot.key
        if slot.nbytes is not None:
            payload["nbytes"] = slot.nbytes
        if wait_ms:
            payload["wait_ms"] = wait_ms
        return self._json("POST", f"/v1/embeddings/{_id(req_id)}/send", payload, self.timeout + wait_ms / 1000)

    def write(self, slot, data):
        """Writes data (a contiguous buffer: bytes, a memoryview, a numpy
        array) at the start of a peer's receive slot, or at a
        ``buffer_address`` inside it, with one request (POST /v1/writes):
        the bytes go with the request, straight from where they lie, and
        the answer comes once they are in the receiver's slot, as a send's
        does. Nothing is staged, nor kept after a failure: write again.
        Returns the write's figures (``nbytes``, ``ms``, ``attempts``,
        ...)."""
        slot = slot if isinstance(slot, Slot) else Slot.from_dict(self._slot_dict(slot))
        if not isinstance(slot.buffer_address, int) or isinstance(slot.buffer_address, bool):
            raise TypeError(f"buffer_address must be an int, not {type(slot.buffer_address).__name__}")
        body = memoryview(data)
        if not body.c_contiguous:
            raise ValueError("the buffer to write is not contiguous: pass a contiguous copy (bytes(data))")
        q = {"session": slot.session, "buffer_address": slot.buffer_address}
        if slot.nbytes is not None:
            q["nbytes"] = slot.nbytes
        path = f"/v1/writes?{urlencode(q)}"
        headers = {"Content-Type": "application/octet-stream"}
        if slot.key is not None:
            headers["Ferry-Key"] = slot.key
        status, data = self._transport.send_buffers("POST", path, [body], headers, self.timeout)
        if status >= 300:
            raise from_answer(status, data)
        return json.loads(data)

    def write_region(self, slot, region, offset, nbytes):
        """Writes nbytes at offset of a region this ferryd holds (lent to
        it: register_fd, register_cuda) at the start of a peer's receive
        slot, or at a ``buffer_address`` inside it, and returns once they
        are in the receiver's memory; nothing is kept after a failure:
        write again. The request is a binary frame on a write stream (an
        upgraded connection kept between calls, docs/api.md): no HTTP
        request per call and no bytes through the socket, the fast path
        of one small write at a time."""
        slot = slot if isinstance(slot, Slot) else Slot.from_dict(self._slot_dict(slot))
        session, name = slot.session.encode(), region.encode()
        key = (slot.key or "").encode()
        frame = struct.pack("<IQQQQHHH", _FRAME_FIXED + len(session) + len(name) + len(key), offset, nbytes,
                            slot.buffer_address, slot.nbytes or 0, len(session), len(name), len(key))
        status, data = self._transport.write_frame(frame + session + name + key, self.timeout)
        if status >= 300:
            raise from_answer(status, data)

    def delete(self, req_id):
        """Drops a staged (or reserved) entry."""
        self._json("DELETE", f"/v1/embeddings/{_id(req_id)}")

    # --- receiving side

    def receive(self, req_id, nbytes, mooncake=False, region=None, region_offset=0, device=None):
        """Makes a receive slot of nbytes for req_id (``ferry.nbytes(shape,
        dtype)`` counts them) and returns it, to hand to the sender.
        ``mooncake=True`` opens it to Mooncake senders too (ferryd with
        --mooncake-listen); the slot then carries ``mooncake_session``.
        ``region`` (a Region or its name) places the slot at
        ``region_offset`` of a registered region: the bytes land there.
        ``device`` ("cuda:3", "cpu", a torch.device, or a tensor: the
        device it is on) places it in that device's arena, one of
        ferryd's --device (default: the first)."""
        payload = {"req_id": req_id, "nbytes": nbytes}
        if device is not None:
            payload["device"] = dtypes.device_name(device)
        if mooncake:
            payload["mooncake"] = True
        if region is not None:
            payload["region"] = region if isinstance(region, str) else region.name
            if region_offset:
                payload["region_offset"] = int(region_offset)
        return Slot.from_dict(self._json("POST", "/v1/receives", payload))

    def receives(self):
        """Lists the receive slots."""
        return self._json("GET", "/v1/receives")

    @staticmethod
    def _wait_query(timeout):
        if timeout < 0:
            raise ValueError(f"timeout must be >= 0 seconds, not {timeout!r}")
        return f"{round(timeout * 1000)}ms"

    def wait(self, req_id, timeout):
        """Waits up to timeout seconds for req_id's data and returns its bytes
        (the slot stays until ``free``); ferry.Timeout when none arrived."""
        q = urlencode({"wait": self._wait_query(timeout)})
        return self.request("GET", f"/v1/receives/{_id(req_id)}?{q}", timeout=self.timeout + timeout).body

    def slot_info(self, req_id, timeout=0):
        """Describes req_id's slot (arrived, received, offset, ...), waiting
        up to timeout seconds for it to arrive (0: at once, arrived or not)."""
        q = urlencode({"format": "json", "wait": self._wait_query(timeout)})
        return self._json("GET", f"/v1/receives/{_id(req_id)}?{q}", timeout=self.timeout + timeout)

    def free(self, req_id):
        """Frees a receive slot."""
        self._json("DELETE", f"/v1/receives/{_id(req_id)}")

    def complete(self, req_id):
        """Tells ferryd that the slot of req_id, made with mooncake=True,
        holds its data: a Mooncake sender's one-sided RDMA writes without a
        notify (transfer_sync_write) raise no event ferryd can see. Returns
        the slot's description."""
        return self._json("POST", f"/v1/receives/{_id(req_id)}/complete")

    # --- batches and events

    @staticmethod
    def _slot_dict(slot):
        if isinstance(slot, Slot):
            return slot.to_dict()
        if not hasattr(slot, "keys"):
            raise TypeError(f"a destination is a Slot or a dict as the receiver's receive gave it, not {type(slot).__name__}")
        return Slot.from_dict(slot).to_dict()

    def transfer(self, sources, destinations, items, keep_sources=False, _wait=None):
        """Starts a batch transfer (POST /v1/transfers) and returns at once
        with its description: ``transfer_id``, ``writes`` (items adjacent
        at both ends are merged), ``state`` "running".

        sources are staged req_ids or Regions; destinations are receive slots (Slot
        or dict) as their receivers' ``receive`` gave them; each item is
        ``(source index, source offset, destination index, destination
        offset, nbytes)``. Once every piece arrived the sources are freed
        (unless keep_sources); on a failure they stay staged.
        ``wait_transfer`` waits for the end, ``events`` hears of it."""
        payload = {
            "sources": [_source(s) for s in sources],
            "destinations": [self._slot_dict(d) for d in destinations],
            "items": [it if isinstance(it, (list, tuple)) else list(it) for it in items],
        }
        if keep_sources:
            payload["keep_sources"] = True
        # separators: a batch of thousands of items is mostly this body.
        body = json.dumps(payload, separators=(",", ":")).encode()
        path, timeout = "/v1/transfers", None
        if _wait is not None:
            path, timeout = f"/v1/transfers?{urlencode({'wait': self._wait_query(_wait)})}", self.timeout + _wait
        return _decode("POST", path, self.request("POST", path, body, "application/json", timeout))

    def transfer_status(self, transfer_id):
        """A batch transfer's description now: state, writes_done, ..."""
        return self._json("GET", f"/v1/transfers/{_id(transfer_id)}")

    def wait_transfer(self, transfer_id, timeout):
        """Waits up to timeout seconds for a batch transfer to end and
        returns its description when it delivered every piece. A failed
        transfer raises its error's class (TransferFailed, Refused, ...)
        with ``.transfer`` set to the description; ferry.Timeout when it
        is still running."""
        q = urlencode({"wait": self._wait_query(timeout)})
        return self._ended(self._json("GET", f"/v1/transfers/{_id(transfer_id)}?{q}", timeout=self.timeout + timeout))

    @staticmethod
    def _ended(t):
        """An ended transfer's description, or its failure raised; Timeout
        for one still running (a wait of 0, or under half a millisecond,
        answers at once)."""
        if t.get("state") == "running":
            exc = Timeout(f"transfer {t.get('transfer_id')} is still running ({t.get('writes_done', 0)} of its "
                          f"{t.get('writes', 0)} writes done): wait_transfer it again, or ask transfer_status for its progress")
            exc.transfer = t
            raise exc
        if t.get("state") == "failed":
            err = t.get("error") or {}
            exc = error_for(err.get("code", "internal"), err.get("message", f"transfer {t.get('transfer_id')} failed"))
            exc.transfer = t
            raise exc
        return t

    def transfer_sync(self, sources, destinations, items, timeout=120.0, keep_sources=False):
        """``transfer`` and ``wait_transfer`` in one: the ended transfer's description."""
        return self._ended(self.transfer(sources, destinations, items, keep_sources, _wait=timeout))

    def events(self, after=0, timeout=0):
        """The daemon's events past seq ``after`` (arrivals, batch endings),
        waiting up to timeout seconds for the first: {events, next, missed}.
        Pass ``next`` as the following call's ``after``."""
        q = urlencode({"after": int(after), "wait": self._wait_query(timeout)})
        answer = self._json("GET", f"/v1/events?{q}", timeout=self.timeout + timeout)
        answer.setdefault("missed", 0)  # ferryd leaves it out when none were
        return answer

    # --- regions

    def register_region(self, name, nbytes):
        """Makes nbytes of memory this process owns (a memfd sealed against
        shrinking, mapped here) and lends it to ferryd as region ``name``:
        a Region, to fill and read in place, send from and receive into.
        ``Region.close`` takes it back."""
        fd = new_memfd(name, nbytes)
        try:
            region = Region(self, name, fd, nbytes)
            self.register_fd(name, fd, nbytes)
        except BaseException:
            os.close(fd)
            raise
        region.registered = True
        return region

    def register_cuda_region(self, name, tensor):
        """Lends ferryd the GPU memory of a contiguous CUDA tensor as region
        ``name`` (by the IPC handle of the allocation holding it): a
        CUDARegion. ferryd must have an arena on the tensor's GPU (--device lists it)."""
        dtypes.require_torch()
        if not tensor.is_cuda or not tensor.is_contiguous():
            raise ValueError("register_cuda_region takes a contiguous CUDA tensor")
        nbytes = tensor.numel() * tensor.element_size()
        self.register_cuda(name, tensor.data_ptr(), nbytes, device=tensor.device.index)
        return CUDARegion(self, name, nbytes, tensor)

    def register_cuda(self, name, ptr, nbytes, device=None, mooncake_addr=0, mooncake_segment=""):
        """Lends ferryd nbytes of GPU memory at device address ptr of this
        process as region ``name``, by the IPC handle of the allocation
        holding it and ptr's offset there (so several ranges of one
        allocation are several regions): its description. device is the
        GPU's ordinal (default: the one the driver says holds ptr).
        mooncake_addr and mooncake_segment as for register_fd. ValueError
        for memory with no IPC handle (cudaMallocAsync pools, cuMemCreate)."""
        if device is None:
            device = device_ordinal(ptr)
            if device is None:
                raise ValueError(f"{ptr:#x} is not CUDA device memory the driver knows in this process")
        handle, offset = ipc_handle(ptr)
        req = {"name": name, "nbytes": int(nbytes), "cuda": {
            "device": f"cuda:{device}", "ipc_handle": base64.b64encode(handle).decode(), "offset": offset}}
        if mooncake_addr:
            req["mooncake_addr"] = int(mooncake_addr)
        if mooncake_segment:
            req["mooncake_segment"] = mooncake_segment
        return self._json("POST", "/v1/regions", req)

    def register_fd(self, name, fd, nbytes, mooncake_addr=0, offset=0, mooncake_segment=""):
        """Lends ferryd nbytes from offset of a memfd this process made
        (MFD_ALLOW_SEALING, sized, then sealed with F_SEAL_SHRINK) as
        region ``name``: its description. mooncake_addr, if not 0, is where
        this process maps that byte: Mooncake peers' writes there land in it,
        listed in engine segment mooncake_segment if given (docs/api.md)."""
        return register_fd(self._transport, self.timeout, name, fd, nbytes, mooncake_addr, offset, mooncake_segment)

    def regions(self):
        """Lists the registered regions (slots, uses, closing)."""
        return self._json("GET", "/v1/regions")

    def unregister_region(self, name, timeout=30.0):
        """Takes a region back: returns once no transfer or write uses it and
        ferryd unmapped it; ferry.Timeout if they outlast timeout (it is
        then closing, and unmapped when they end), ferry.Busy while receive
        slots lie in it, ferry.Internal if the NIC would not drop its
        registration (it stays registered: call again to retry)."""
        q = urlencode({"wait": self._wait_query(timeout)})
        self._json("DELETE", f"/v1/regions/{_id(name)}?{q}", timeout=self.timeout + timeout)

    # --- sessions

    def sessions(self):
        """Lists the sessions to peer daemons."""
        return self._json("GET", "/v1/sessions")

    def teardown(self, session_id):
        """Closes and forgets a session (the next send re-dials)."""
        self._json("DELETE", f"/v1/sessions/{_id(session_id)}")

    # --- zero copy

    def map_arena(self):
        """Maps ferryd's host-memory arena into this process (GET /v1/arena,
        the descriptor passed over the socket): an ArenaMapping. A GPU arena
        raises GPUArenaNotSupported."""
        try:
            return map_arena(self._transport, self.timeout)
        except BadRequest as e:
            memory = self.status().get("memory", {})
            if memory.get("kind") != "cuda":
                raise
            raise GPUArenaNotSupported(
                f"ferryd at {self.socket_path} keeps its arena in GPU memory ({memory.get('device')}), which this "
                "package cannot map yet: that takes the arena's CUDA IPC handle, opened with cuIpcOpenMemHandle "
                "through the CUDA driver (planned; scripts/gpu/torch_ipc.py shows the calls). Meanwhile stage by "
                "upload (Client.stage) and read with Client.wait", e.status, e.code) from e

    @contextlib.contextmanager
    def staging(self, req_id, shape, dtype, arena=None):
        """Zero-copy staging: reserves a slice of shape and dtype for req_id
        and yields a Reservation to write in place (``.memory``, or
        ``.tensor()`` with torch); commits it when the block ends, and
        deletes the reservation when the block raises (or the commit fails).
        ``arena`` is a mapping to reuse (else one is made for this call)."""
        shape, dtype = dtypes.shape_of(shape), dtypes.canonical(dtype)
        # Mapped before reserving: a GPU arena refuses here, with nothing to undo.
        arena = arena or self.map_arena()
        sl = self.slice(req_id, shape, dtype)
        try:
            res = Reservation(req_id, sl["offset"], arena.view(sl["offset"], sl["nbytes"]), shape, dtype)
            yield res
            res.entry = self.commit(req_id, shape, dtype)
        except BaseException:
            # What failed is what the caller needs; a reservation the delete
            # cannot remove is swept by ferryd's stage TTL.
            with contextlib.suppress(FerryError):
                self.delete(req_id)
            raise

    def staged_tensor(self, req_id, arena=None):
        """A torch tensor over req_id's staged (or reserved) entry in the
        arena, with its shape and dtype (no copy)."""
        e = self.embedding(req_id)
        if not e.get("shape") or not e.get("dtype"):
            raise ValueError(f"req_id {req_id}'s entry has no shape and dtype (reserved by nbytes): "
                             "view it with ArenaMapping.view(offset, nbytes)")
        return (arena or self.map_arena()).tensor(e["offset"], e["shape"], e["dtype"])

    def received_view(self, req_id, timeout=0, arena=None, region=None):
        """A memoryview of req_id's arrived data where it landed (no copy),
        in the arena, or in ``region`` (a Region) for a slot made in one,
        waiting up to timeout seconds for it. It is valid until the slot is
        freed: copy what must outlive ``free``."""
        info = self.slot_info(req_id, timeout)
        if not info.get("arrived"):
            raise Timeout(f"req_id {req_id}: no data has arrived in its receive slot yet: pass timeout= to wait for it")
        lies_in = info.get("region")
        if lies_in:
            if region is None or region.name != lies_in:
                raise ValueError(f"req_id {req_id}: its slot lies in region {lies_in!r}, not in the arena: "
                                 f"pass region= that Region (or read it with Region.view({info['offset']}, {info['received']}))")
            return region.view(info["offset"], info["received"])
        return (arena or self.map_arena()).view(info["offset"], info["received"])

    def received_tensor(self, req_id, shape=None, dtype="u8", timeout=0, arena=None, region=None):
        """A torch tensor over req_id's arrived data in place (no copy), of
        shape and dtype (default: 1-D, as many elements as arrived). Valid
        until the slot is freed: ``.clone()`` what must outlive ``free``."""
        dtypes.require_torch()
        memory = self.received_view(req_id, timeout, arena, region)
        if shape is None:
            size = dtypes.itemsize(dtype)
            if memory.nbytes % size:
                raise ValueError(f"req_id {req_id}: {memory.nbytes} bytes arrived, not a whole number of {dtypes.canonical(dtype)} elements")
            shape = (memory.nbytes // size,)
        return dtypes.tensor_over(memory, shape, dtype)
