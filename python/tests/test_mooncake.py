"""ferry.mooncake.TransferEngine replaying the calls sglang's encoder and
vLLM's Mooncake connector make, into a ferry receive slot's Mooncake
segment (the receiving ferryd runs --mooncake-listen), and the calls of
their receiving sides in a process without ferry's allocator, which
ferry refuses at registration (test_mooncake_receivers.py: with it)."""

import ctypes
import gc
import json
import logging
import os
import random
import socket
import struct
import threading
import time
import types

import pytest

import ferry
from ferry.mooncake import TransferEngine, TransferOpcode

torch = pytest.importorskip("torch", reason="Debian's python3-torch (make test-python installs it)")


@pytest.fixture
def engine(pair):
    e = TransferEngine(socket_path=pair[0].socket, send_only=True)
    assert e.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    return e


def test_the_encoders_call_sequence_delivers_the_embedding(engine, rx, req_id):
    # sglang's encoder: register the embedding, transfer_sync_write it into
    # the slot the receiver handed out, unregister it, raise on ret < 0.
    emb = torch.randn(16, 4096, dtype=torch.bfloat16)
    ptr, nbytes = emb.data_ptr(), emb.numel() * emb.element_size()
    slot = rx.receive(req_id, nbytes, mooncake=True)
    assert engine.register_memory(ptr, nbytes) == 0
    ret = engine.transfer_sync_write(slot.mooncake_session, ptr, slot.buffer_address, nbytes)
    assert ret == 0, engine.last_failure
    assert engine.unregister_memory(ptr) == 0
    got = rx.wait(req_id, 10)
    assert got == ctypes.string_at(ptr, nbytes)
    rx.free(req_id)


def test_one_piece_of_host_memory_is_one_request(pair, engine, rx, req_id):
    # transfer_sync_write of one host range goes with its bytes inline:
    # one POST /v1/writes to the sending ferryd, nothing staged.
    data = os.urandom(64 << 10)
    src = (ctypes.c_char * len(data)).from_buffer_copy(data)
    base = ctypes.addressof(src)
    assert engine.register_memory(base, len(data)) == 0
    slot = rx.receive(req_id, len(data), mooncake=True)
    tx = pair[0]
    seen = tx.mark()
    assert engine.transfer_sync_write(slot.mooncake_session, base, slot.buffer_address, len(data)) == 0, engine.last_failure
    assert rx.wait(req_id, 10) == data
    asked = tx.requests_between(seen, tx.mark())
    assert asked == [("POST", "/v1/writes")], asked
    assert engine.unregister_memory(base) == 0
    rx.free(req_id)


def test_a_batch_of_scattered_pages_fills_one_slot(engine, rx, req_id):
    # vLLM's and sglang's KV path: registered once, many (src, dst, len)
    # pieces in one batch_transfer_sync_write, in any order.
    rng = random.Random(7)
    sizes = [rng.choice([4096, 16384, 65536]) for _ in range(64)]
    total = sum(sizes)
    src = (ctypes.c_char * total).from_buffer_copy(os.urandom(total))
    base = ctypes.addressof(src)
    assert engine.batch_register_memory([base], [total]) == 0
    slot = rx.receive(req_id, total, mooncake=True)
    offsets = [sum(sizes[:i]) for i in range(len(sizes))]
    order = list(range(len(sizes)))
    rng.shuffle(order)
    ret = engine.batch_transfer_sync_write(slot.mooncake_session, [base + offsets[i] for i in order],
                                           [slot.buffer_address + offsets[i] for i in order], [sizes[i] for i in order])
    assert ret == 0, engine.last_failure
    assert rx.wait(req_id, 10) == bytes(src)
    assert engine.unregister_memory(base) == 0
    rx.free(req_id)


def test_a_busy_ferryd_is_asked_again_within_the_timeout(engine, rx, req_id, monkeypatch):
    # Engines splitting large batches can fill the room ferryd gives
    # running transfers for a moment (409 busy): the engine asks again,
    # pausing, and gives -1 only once its client's timeout ran out.
    # ferryd's busy answers are stood in for beneath the client's seam
    # (one piece goes as one write).
    data = os.urandom(64 << 10)
    src = (ctypes.c_char * len(data)).from_buffer_copy(data)
    base = ctypes.addressof(src)
    assert engine.register_memory(base, len(data)) == 0
    real = ferry.Client.write
    tries = []

    def busy_twice(self, *args, **kw):
        tries.append(1)
        if len(tries) <= 2:
            raise ferry.Busy("running transfers hold all ferryd lets them hold at once")
        return real(self, *args, **kw)

    monkeypatch.setattr(ferry.Client, "write", busy_twice)
    slot = rx.receive(req_id, len(data), mooncake=True)
    assert engine.transfer_sync_write(slot.mooncake_session, base, slot.buffer_address, len(data)) == 0, engine.last_failure
    assert len(tries) == 3
    assert rx.wait(req_id, 10) == data
    rx.free(req_id)

    def always_busy(self, *args, **kw):
        tries.append(1)
        raise ferry.Busy("running transfers hold all ferryd lets them hold at once")

    monkeypatch.setattr(ferry.Client, "write", always_busy)
    monkeypatch.setattr(engine._need_client(), "timeout", 0.05)
    tries.clear()
    assert engine.transfer_sync_write(slot.mooncake_session, base, slot.buffer_address, len(data)) == -1
    assert 2 <= len(tries) < 10, len(tries)
    assert "busy" in str(engine.last_failure).lower() or "hold all" in str(engine.last_failure)


def test_a_batch_past_one_transfer_goes_as_several(engine, rx, req_id, monkeypatch):
    # vLLM's batches can outgrow one transfer (1,048,576 items, a 16 MiB
    # body): the engine splits them. Lowered limits make 64 pieces do.
    import ferry.mooncake as mc
    rng = random.Random(11)
    sizes = [rng.choice([4096, 8192]) for _ in range(64)]
    total = sum(sizes)
    src = (ctypes.c_char * total).from_buffer_copy(os.urandom(total))
    base = ctypes.addressof(src)
    assert engine.register_memory(base, total) == 0
    offsets = [sum(sizes[:i]) for i in range(len(sizes))]
    order = list(range(len(sizes)))
    rng.shuffle(order)
    # Pieces that come adjacent at both ends in this order are one item.
    n = len(mc._merge([(base + offsets[i], offsets[i], sizes[i]) for i in order], [base] * len(order))[0])
    calls = []
    real = ferry.Client.transfer_sync

    def transfer_sync(self, sources, destinations, items, **kw):
        calls.append(items)
        return real(self, sources, destinations, items, **kw)

    monkeypatch.setattr(ferry.Client, "transfer_sync", transfer_sync)
    for limit, value in [("TRANSFER_ITEMS", 8), ("TRANSFER_ITEM_BYTES", 200)]:
        calls.clear()
        with monkeypatch.context() as m:
            m.setattr(mc, limit, value)
            slot = rx.receive(req_id, total, mooncake=True)
            ret = engine.batch_transfer_sync_write(slot.mooncake_session, [base + offsets[i] for i in order],
                                                   [slot.buffer_address + offsets[i] for i in order], [sizes[i] for i in order])
        assert ret == 0, engine.last_failure
        assert rx.wait(req_id, 10) == bytes(src), limit
        rx.free(req_id)
        assert sum(len(items) for items in calls) == n and len(calls) > 1, (limit, [len(c) for c in calls])
        if limit == "TRANSFER_ITEMS":
            assert [len(c) for c in calls] == [8] * (n // 8) + [n % 8] * (n % 8 > 0)
        else:
            bodies = [len(json.dumps([list(it) for it in c], separators=(",", ":"))) - 1 for c in calls]
            assert max(bodies) <= 200, bodies
    # A run that fails ends the call with -1; the runs before it were written.
    calls.clear()
    slot = rx.receive(req_id, 8 * 4096, mooncake=True)
    with monkeypatch.context() as m:
        m.setattr(mc, "TRANSFER_ITEMS", 4)
        bufs = [base + 8192 * i for i in range(9)]  # not adjacent: nine pieces
        dsts = [slot.buffer_address + 4096 * i for i in range(9)]  # the ninth lies past the slot
        assert engine.batch_transfer_sync_write(slot.mooncake_session, bufs, dsts, [4096] * 9) == -1
    # The ninth, a run of one piece, goes as one write (POST /v1/writes).
    assert [len(c) for c in calls] == [4, 4] and engine.last_failure.ret == "rejected"
    assert rx.wait(req_id, 10) == b"".join(ctypes.string_at(b, 4096) for b in bufs[:8])
    rx.free(req_id)
    assert engine.unregister_memory(base) == 0


def test_a_batch_over_several_registered_ranges(engine, rx, req_id):
    # A batch's pages lie in several registered ranges, taken in turns
    # (the engine holds each range once, trying the last one found first);
    # a piece reaching past its range is refused before anything moves,
    # and every range the batch held is let go: unregister_memory, which
    # waits for the batches reading a range, returns at once.
    page, ranges = 4096, 3
    bufs = [(ctypes.c_char * (4 * page)).from_buffer_copy(os.urandom(4 * page)) for _ in range(ranges)]
    bases = [ctypes.addressof(b) for b in bufs]
    assert engine.batch_register_memory(bases, [4 * page] * ranges) == 0
    pieces = [(bases[r] + p * page, (3 - p) * ranges + r) for p in (3, 1, 0, 2) for r in (0, 2, 1)]
    slot = rx.receive(req_id, 4 * ranges * page, mooncake=True)
    dsts = [slot.buffer_address + k * page for _, k in pieces]
    assert engine.batch_transfer_sync_write(slot.mooncake_session, [s for s, _ in pieces], dsts, [page] * len(pieces)) == 0, \
        engine.last_failure
    want = bytearray(4 * ranges * page)
    for src, k in pieces:
        want[k * page:(k + 1) * page] = ctypes.string_at(src, page)
    assert rx.wait(req_id, 10) == bytes(want)
    rx.free(req_id)
    slot = rx.receive(req_id, 4 * page, mooncake=True)
    srcs = [bases[0], bases[1], bases[1] + 3 * page + 1]  # the third runs a byte past its range
    ret = engine.batch_transfer_sync_write(slot.mooncake_session, srcs, [slot.buffer_address + i * page for i in range(3)], [page] * 3)
    assert ret == -1 and f"[{srcs[2]:#x}, +{page}) lies in no registered range" in engine.last_failure.message
    assert not rx.slot_info(req_id).get("arrived")  # nothing moved
    rx.free(req_id)
    done = []
    t = threading.Thread(target=lambda: done.extend(engine.unregister_memory(b) for b in bases), daemon=True)
    t.start()
    t.join(30)
    assert done == [0] * ranges


@pytest.mark.parametrize("order", [(0, 1), (1, 0)])
def test_pieces_adjacent_across_two_registered_ranges_are_not_joined(engine, rx, req_id, order):
    # Two ranges registered side by side, a piece in each, adjacent at
    # both ends: in either order they go as two pieces and land (joined,
    # the piece lay in no range and the batch was -1 in one order only).
    page = 4096
    buf = (ctypes.c_char * (2 * page)).from_buffer_copy(os.urandom(2 * page))
    base = ctypes.addressof(buf)
    assert engine.batch_register_memory([base, base + page], [page, page]) == 0
    slot = rx.receive(req_id, 2 * page, mooncake=True)
    ret = engine.batch_transfer_sync_write(slot.mooncake_session, [base + i * page for i in order],
                                           [slot.buffer_address + i * page for i in order], [page, page])
    assert ret == 0, engine.last_failure
    assert rx.wait(req_id, 10) == bytes(buf)
    rx.free(req_id)
    assert engine.batch_unregister_memory([base, base + page]) == 0


def test_failures_return_minus_one_and_say_why(engine, rx, req_id, caplog):
    buf = ctypes.create_string_buffer(4096)
    ptr = ctypes.addressof(buf)
    slot = rx.receive(req_id, 4096, mooncake=True)
    # Not registered: refused before any transfer, as Mooncake refuses it.
    assert engine.transfer_sync_write(slot.mooncake_session, ptr, slot.buffer_address, 4096) == -1
    assert "register_memory it first" in engine.last_failure.message
    assert engine.register_memory(ptr, 4096) == 0
    assert engine.register_memory(ptr + 100, 10) == -1  # overlaps
    # Outside every Mooncake slot of the receiver: ferryd's transfer_failed,
    # logged and recorded with session, nbytes and ret.
    with caplog.at_level(logging.WARNING, logger="ferry.mooncake"):
        assert engine.transfer_sync_write(slot.mooncake_session, ptr, slot.buffer_address + 8192, 4096) == -1
    f = engine.last_failure
    assert (f.method, f.session, f.nbytes, f.ret) == ("transfer_sync_write", slot.mooncake_session, 4096, "rejected")
    assert "ret=rejected" in caplog.text and slot.mooncake_session in caplog.text
    # The staged copy of the failed write does not linger in ferryd.
    assert not [e for e in engine._need_client().embeddings() if e["req_id"].startswith("mooncake-")]
    # Opt-in: raise instead.
    raising = TransferEngine(raise_on_failure=True, socket_path=engine._need_client().socket_path, send_only=True)
    assert raising.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    assert raising.register_memory(ptr, 4096) == 0
    with pytest.raises(ferry.TransferFailed) as e:
        raising.transfer_sync_write(slot.mooncake_session, ptr, slot.buffer_address + 8192, 4096)
    assert e.value.ret == "rejected" and e.value.nbytes == 4096
    assert engine.unregister_memory(ptr) == 0 and engine.unregister_memory(ptr) == -1
    rx.free(req_id)


def test_an_empty_batch_succeeds_at_once(engine, rx, req_id):
    # vLLM sends one for a request whose blocks the decoder had cached.
    slot = rx.receive(req_id, 4096, mooncake=True)
    assert engine.batch_transfer_sync_write(slot.mooncake_session, [], [], []) == 0
    assert engine.batch_transfer_sync_write(slot.mooncake_session, [1], [slot.buffer_address], [0]) == 0
    assert engine.batch_transfer_sync_write(slot.mooncake_session, [1], [slot.buffer_address], [-1]) < 0
    assert "negative" in engine.last_failure.message
    rx.free(req_id)


def test_two_engines_name_their_staged_entries_apart(pair, rx, req_id):
    # Host pieces go through a staged entry per call (more than one piece:
    # one goes inline); two engines in one process must not give two
    # calls' entries one name.
    engines = [TransferEngine(socket_path=pair[0].socket, send_only=True) for _ in range(2)]
    src = (ctypes.c_char * 4096).from_buffer_copy(os.urandom(4096))
    half = ctypes.addressof(src) + 2048
    for i, e in enumerate(engines):
        assert e.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
        assert e.register_memory(ctypes.addressof(src), 4096) == 0
    slots = [rx.receive(f"{req_id}-{i}", 4096, mooncake=True) for i in range(2)]
    names = []
    real_stage = ferry.Client.stage

    def stage(self, name, data):
        names.append(name)
        return real_stage(self, name, data)

    ferry.Client.stage = stage
    try:
        for e, slot in zip(engines, slots):
            # Swapped halves: not adjacent at both ends, two pieces.
            assert e.batch_transfer_sync_write(slot.mooncake_session, [ctypes.addressof(src), half],
                                               [slot.buffer_address + 2048, slot.buffer_address], [2048, 2048]) == 0, e.last_failure
    finally:
        ferry.Client.stage = real_stage
    assert len(names) == 2 and names[0] != names[1]
    for i in range(2):
        assert rx.wait(f"{req_id}-{i}", 10) == bytes(src)[2048:] + bytes(src)[:2048]
        rx.free(f"{req_id}-{i}")


def test_each_engine_has_a_segment_of_its_own(pair):
    # sglang keys its per-peer state by session id: two engines in one
    # process (or two ranks on one host) must never share one.
    tx, rx = pair
    client = rx.client()
    ferryds = int(client.status()["mooncake"]["segment"].rsplit(":", 1)[1])
    engines = [TransferEngine(socket_path=rx.socket) for _ in range(2)]
    assert engines[0].get_rpc_port() == ferryds  # before initialize: ferryd's own
    for e in engines:
        assert e.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    ports = [e.get_rpc_port() for e in engines]
    assert len({*ports, ferryds}) == 3, ports
    listed = {s["rpc_port"]: s for s in json.loads(client.request("GET", "/v1/mooncake/segments").body)}
    assert set(ports) <= set(listed) and all(listed[p]["pid"] == os.getpid() for p in ports)
    # Each answers Mooncake's handshake on its own port; closing one drops it.
    assert all(e.send_probe(f"127.0.0.1:{p}") == 0 for e, p in zip(engines, ports))
    assert engines[0].close() == 0
    assert engines[1].send_probe(f"127.0.0.1:{ports[0]}") == -1
    assert ports[0] not in {s["rpc_port"] for s in json.loads(client.request("GET", "/v1/mooncake/segments").body)}
    # Collected without close: dropped all the same.
    del engines[1], e  # the last references
    gc.collect()
    assert ports[1] not in {s["rpc_port"] for s in json.loads(client.request("GET", "/v1/mooncake/segments").body)}
    no_segment = TransferEngine(socket_path=tx.socket)
    assert no_segment.get_rpc_port() == -1 and "--mooncake-listen" in no_segment.last_failure.message


def test_an_unreachable_ferryd_fails_initialize(tmp_path):
    engine = TransferEngine(socket_path=str(tmp_path / "none.sock"))
    assert engine.initialize("h", "P2PHANDSHAKE", "tcp", "") == -1
    assert engine.last_failure.ret == "unreachable"


def test_a_receivers_registered_buffer_is_refused_at_registration(pair, monkeypatch, caplog):
    # sglang's multimodal receiver: register_memory of a torch.empty
    # landing buffer, its address published, then the encoder's
    # transfer_sync_write into it. This process was not started with
    # ferry's allocator, so ferryd cannot reach the tensor's pages, and
    # registration says so (-1, the reason logged and kept), never 0
    # followed by refused writes and a receiver reading an uninitialised
    # buffer (test_mooncake_receivers.py has the receiver that works).
    monkeypatch.delenv("FERRY_MOONCAKE_SEND_ONLY", raising=False)
    receiver = TransferEngine(socket_path=pair[1].socket)
    assert receiver.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    landing = torch.empty(16 << 10, dtype=torch.uint8)
    landing.fill_(0xAB)  # what "uninitialised" holds here
    with caplog.at_level(logging.WARNING, logger="ferry.mooncake"):
        assert receiver.register_memory(landing.data_ptr(), landing.numel()) == -1
    f = receiver.last_failure
    assert (f.method, f.ret) == ("register_memory", "not_writable"), f
    assert "not allocated through ferry's allocator" in f.message and "LD_PRELOAD=" in f.message, f.message
    assert "send_only=True" in f.message
    assert "ret=not_writable" in caplog.text
    # vLLM's decode worker and sglang's PD decode register their KV
    # buffers in one batch: refused the same way (vLLM raises on it).
    k, v = torch.empty(4096, dtype=torch.uint8), torch.empty(4096, dtype=torch.uint8)
    assert receiver.batch_register_memory([k.data_ptr(), v.data_ptr()], [4096, 4096]) == -1
    assert receiver.last_failure.ret == "not_writable"
    # Nothing was registered: there is nothing to unregister.
    assert receiver.unregister_memory(landing.data_ptr()) == -1
    # The encoder's write (which sglang does not check) lands nowhere.
    sender = TransferEngine(socket_path=pair[0].socket, send_only=True)
    assert sender.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    emb = torch.randint(0, 255, (16 << 10,), dtype=torch.uint8)
    assert sender.register_memory(emb.data_ptr(), emb.numel()) == 0
    session = f"127.0.0.1:{receiver.get_rpc_port()}"
    assert sender.transfer_sync_write(session, emb.data_ptr(), landing.data_ptr(), emb.numel()) == -1
    assert bytes(landing.numpy()) == b"\xab" * landing.numel()
    assert sender.unregister_memory(emb.data_ptr()) == 0
    # The environment says send-only for a framework that makes the engine.
    monkeypatch.setenv("FERRY_MOONCAKE_SEND_ONLY", "1")
    from_env = TransferEngine(socket_path=pair[0].socket)
    assert from_env.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    assert from_env.register_memory(emb.data_ptr(), emb.numel()) == 0


def test_initialize_honours_its_arguments(pair, monkeypatch):
    tx, rx = pair
    engine = TransferEngine(socket_path=rx.socket)
    with socket.socket() as s:  # a free port to ask for
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    refusals = [
        (("127.0.0.1", "etcd://127.0.0.1:2379", "tcp", ""), "P2PHANDSHAKE"),
        (("127.0.0.1", "P2PHANDSHAKE", "nvmeof", ""), '"tcp" or "rdma"'),
        (("127.0.0.1", "P2PHANDSHAKE", "rdma", ""), "--transport rdma"),   # a tcp ferryd: never silently TCP
    ]
    for args, why in refusals:
        assert engine.initialize(*args) == -1, args
        assert why in engine.last_failure.message, (args, engine.last_failure)
    assert engine.initialize_ext("127.0.0.1", "P2PHANDSHAKE", "tcp", "", "etcd") == -1
    assert "metadata_type 'etcd'" in engine.last_failure.message
    assert engine.initialize_ext(f"127.0.0.1:{port}", "P2PHANDSHAKE", "tcp", "mlx5_0", "p2p") == 0
    assert (engine.local_hostname, engine.protocol, engine.device_name) == ("127.0.0.1", "tcp", "")
    assert engine.get_rpc_port() == port  # the port local_hostname asked for
    assert engine.initialize("127.0.0.1:1", "P2PHANDSHAKE", "tcp", "") == -1
    assert f"RPC port is {port} already" in engine.last_failure.message
    assert engine.close() == 0
    assert engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == -1
    assert "the engine is closed" in engine.last_failure.message
    # No segment: no port to be.
    assert TransferEngine(socket_path=tx.socket).initialize("h:1", "P2PHANDSHAKE", "tcp", "") == -1
    engine = TransferEngine(socket_path=rx.socket)
    # An rdma ferryd (its status stood in for beneath the client):
    # device_name must name NICs it sends over (its rails).
    real = ferry.Client.status

    def rdma_status(self):
        st = real(self)
        st["transport"] = {"name": "rdma", "reason": "--transport rdma", "rdma": {
            "chosen": {"device": "mlx5_0"}, "rails": [{"device": "mlx5_0"}, {"device": "mlx5_1"}]}}
        return st

    monkeypatch.setattr(ferry.Client, "status", rdma_status)
    assert engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == -1
    assert "initialize with 'rdma'" in engine.last_failure.message
    assert engine.initialize("127.0.0.1", "P2PHANDSHAKE", "rdma", "mlx5_0,mlx5_2") == -1
    assert "ferryd sends over mlx5_0, mlx5_1" in engine.last_failure.message
    assert engine.initialize("127.0.0.1", "P2PHANDSHAKE", "rdma", "mlx5_1") == 0 and engine.device_name == "mlx5_1"
    assert engine.initialize("127.0.0.1", "P2PHANDSHAKE", "rdma", "") == 0 and engine.device_name == "mlx5_0,mlx5_1"


def test_initialize_refuses_a_hostname_peers_cannot_reach(pair, start_daemon):
    # The frameworks pass the host's IP (get_ip()) and publish
    # f"{ip}:{rpc_port}": where ferryd's segments do not listen there,
    # peers' connections would be refused; initialize says so instead.
    # pair's receiver listens on 127.0.0.1, which 127.0.0.2 does not reach.
    loopback = TransferEngine(socket_path=pair[1].socket)
    assert loopback.initialize("127.0.0.2", "P2PHANDSHAKE", "tcp", "") == -1
    why = loopback.last_failure.message
    assert "local_hostname '127.0.0.2'" in why and "listen on 127.0.0.1 only (its --mooncake-listen)" in why, why
    assert loopback.initialize("127.0.0.2:0", "P2PHANDSHAKE", "tcp", "") == -1  # with a port alike
    for host in ("localhost", "127.0.0.1"):
        assert loopback.initialize(host, "P2PHANDSHAKE", "tcp", "") == 0, (host, loopback.last_failure)
    assert loopback.close() == 0
    # A wildcard listen takes any address of this host, and no other.
    wild = start_daemon("wild", "--mooncake-listen", "0.0.0.0:0")
    engine = TransferEngine(socket_path=wild.socket)
    assert engine.initialize("203.0.113.7", "P2PHANDSHAKE", "tcp", "") == -1  # TEST-NET-3: no host's
    assert "address of this host, where ferryd's Mooncake segments listen on every address" in \
        engine.last_failure.message, engine.last_failure
    for host in ("127.0.0.2", "localhost", socket.gethostname()):
        assert engine.initialize(host, "P2PHANDSHAKE", "tcp", "") == 0, (host, engine.last_failure)
    assert engine.close() == 0


def test_memory_is_registered_only_between_initialize_and_close(pair):
    # Before initialize, after one that failed, and after close there is
    # no segment of the engine's own to lend memory to: -1 saying so (it
    # was 0, and lent memory landed in ferryd's shared segment). A
    # send_only engine's host memory would otherwise be taken at once.
    buf = ctypes.create_string_buffer(8192)
    addr = ctypes.addressof(buf)
    engine = TransferEngine(socket_path=pair[1].socket, send_only=True)

    def refused(why):
        assert engine.register_memory(addr, 4096) == -1
        assert why in engine.last_failure.message, engine.last_failure
        assert engine.batch_register_memory([addr], [4096]) == -1
        assert engine.last_failure.method == "batch_register_memory" and why in engine.last_failure.message
        assert engine.allocate_managed_buffer(4096) == 0 and why in engine.last_failure.message
        assert engine.unregister_memory(addr) == -1  # nothing was registered

    refused("initialize first")
    assert engine.initialize("127.0.0.1", "etcd://127.0.0.1:2379", "tcp", "") == -1
    refused("initialize first")
    assert engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0, engine.last_failure
    assert engine.register_memory(addr, 4096) == 0, engine.last_failure
    assert engine.batch_register_memory([addr + 4096], [4096]) == 0, engine.last_failure
    assert engine.close() == 0
    refused("the engine is closed")


def test_probe_first_buffer_and_local_buffers(engine, pair):
    rx_status = pair[1].client().status()
    segment = rx_status["mooncake"]["segment"]
    assert engine.send_probe(segment) == 0, engine.last_failure
    # A ferry segment's first buffer is ferryd's arena.
    assert engine.get_first_buffer_address(segment) == rx_status["memory"]["arena_base"]
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        closed = f"127.0.0.1:{s.getsockname()[1]}"
    assert engine.send_probe(closed) == -1
    f = engine.last_failure
    assert (f.method, f.session, f.ret) == ("send_probe", closed, "unreachable") and closed in f.message
    assert engine.get_first_buffer_address(closed) == -1
    assert engine.send_probe("no-port") == -1 and "host:rpc_port" in engine.last_failure.message
    # write_bytes_to_buffer and read_bytes_from_buffer copy in this process.
    buf = ctypes.create_string_buffer(64)
    assert engine.write_bytes_to_buffer(ctypes.addressof(buf), b"hello ferry", 11) == 0
    assert engine.read_bytes_from_buffer(ctypes.addressof(buf), 11) == b"hello ferry"
    assert engine.write_bytes_to_buffer(ctypes.addressof(buf), b"abc", 4) == -1


def test_batch_unregister_and_transfer_sync_write(engine, rx, req_id):
    a, b = (ctypes.c_char * 4096).from_buffer_copy(os.urandom(4096)), (ctypes.c_char * 4096)()
    pa, pb = ctypes.addressof(a), ctypes.addressof(b)
    assert engine.batch_register_memory([pa, pb], [4096, 4096]) == 0
    slot = rx.receive(req_id, 4096, mooncake=True)
    assert engine.transfer_sync(slot.mooncake_session, pa, slot.buffer_address, 4096, TransferOpcode.WRITE) == 0, \
        engine.last_failure
    assert rx.wait(req_id, 10) == bytes(a)
    rx.free(req_id)
    # All are tried; any not registered makes it -1 (sglang's teardown).
    assert engine.batch_unregister_memory([pa, pa + 1, pb]) == -1
    assert "no range is registered" in engine.last_failure.message
    assert engine.batch_unregister_memory([pa, pb]) == -1  # both gone already
    assert engine.batch_unregister_memory([]) == 0


def test_reads_are_cut_to_what_one_request_of_ferryd_takes():
    # ferryd takes at most READ_MAX bytes and READ_PIECES pieces per POST
    # /v1/reads: a batch of more small pieces goes as several requests,
    # every byte in exactly one of them, in order.
    from ferry.mooncake import READ_MAX, READ_PIECES, _read_runs
    small = [(i * 16, (1 << 20) + i * 16, 16) for i in range(READ_PIECES + 5)]
    runs = list(_read_runs(small))
    assert [len(r) for r in runs] == [READ_PIECES, 5]
    assert [p for r in runs for p in r] == small
    big = [(0, 0, READ_MAX + 7)]
    runs = list(_read_runs(big))
    assert [sum(n for _, _, n in r) for r in runs] == [READ_MAX, 7]
    assert runs[1] == [(READ_MAX, READ_MAX, 7)]


@pytest.fixture
def descriptor_server():
    """A Mooncake RPC port on loopback answering every metadata handshake
    with the descriptor in .desc (a hostile peer's, here); its session id
    in .session. Closed when the test ends."""
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(30)
    state = types.SimpleNamespace()
    state.session = "127.0.0.1:%d" % server.getsockname()[1]
    state.desc = {}

    def recv(conn, n):
        out = b""
        while len(out) < n:
            chunk = conn.recv(n - len(out))
            if not chunk:
                raise OSError("closed")
            out += chunk
        return out

    def serve():
        while True:
            try:
                conn, _ = server.accept()
            except OSError:  # closed at the test's end (or its deadline passed)
                return
            with conn:
                conn.settimeout(10)
                try:
                    length, kind = struct.unpack("<QB", recv(conn, 9))
                    recv(conn, length - 1)
                    body = json.dumps(state.desc).encode()
                    conn.sendall(struct.pack("<QB", len(body) + 1, kind) + body)
                except OSError:
                    pass

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    yield state
    server.shutdown(socket.SHUT_RDWR)  # wakes the accept (close alone does not)
    server.close()
    t.join(10)
    assert not t.is_alive(), "the descriptor server's thread outlived its socket"


@pytest.mark.parametrize("field,hostile", [
    ("ferry", "x"),
    ("ferry", {"peer": 5}),
    ("buffers[0]", [{"name": "b", "length": 4096}]),
    ("buffers[0]", [{"name": "b", "addr": "0x1000", "length": 4096}]),
    ("buffers", "all of them"),
    ("tcp_data_port", "80"),
    ("tcp_proto_version", [2]),
])
def test_a_malformed_descriptor_fails_the_read_naming_the_field(engine, descriptor_server, field, hostile):
    # A peer's descriptor is input: a field of the wrong type makes the
    # read -1 with last_failure naming it and the segment, never an
    # exception escaping into the framework.
    session = descriptor_server.session
    descriptor_server.desc = {"name": session, "protocol": "tcp", "tcp_data_port": 1, "tcp_proto_version": 2,
                              "buffers": [{"name": "b", "addr": 4096, "length": 4096}]}
    descriptor_server.desc[field.split("[")[0]] = hostile
    dst = (ctypes.c_char * 4096)()
    base = ctypes.addressof(dst)
    assert engine.register_memory(base, 4096) == 0
    assert engine.transfer_sync_read(session, base, 4096, 16) == -1
    f = engine.last_failure
    assert f.ret == "transfer_failed" and f"segment {session}'s descriptor has {field} " in f.message, f
    assert engine.batch_transfer_sync_read(session, [base, base + 16], [4096, 4112], [16, 16]) == -1
    assert f"{field} " in engine.last_failure.message
    assert engine.get_first_buffer_address(session) == -1
    assert f"{field} " in engine.last_failure.message
    assert engine.unregister_memory(base) == 0
