"""ferry.mooncake.TransferEngine replaying the calls sglang's encoder and
vLLM's Mooncake connector make, into a ferry receive slot's Mooncake
segment (the receiving ferryd runs --mooncake-listen)."""

import ctypes
import json
import logging
import os
import random
import time

import pytest

import ferry
from ferry.mooncake import TransferEngine

torch = pytest.importorskip("torch", reason="Debian's python3-torch (make test-python installs it)")


@pytest.fixture
def engine(pair):
    e = TransferEngine(socket_path=pair[0].socket)
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
    with tx._cond:
        seen = len(tx.lines)
    assert engine.transfer_sync_write(slot.mooncake_session, base, slot.buffer_address, len(data)) == 0, engine.last_failure
    assert rx.wait(req_id, 10) == data
    # ferryd logs each request (DEBUG) once it answered it.
    deadline = time.monotonic() + 10
    with tx._cond:
        while True:
            asked = [(line["method"], line["path"]) for line in tx.lines[seen:] if line.get("message") == "request"]
            if ("POST", "/v1/writes") in asked or time.monotonic() > deadline:
                break
            tx._cond.wait(max(deadline - time.monotonic(), 0.001))
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
    n = len(mc._merge([(base + offsets[i], offsets[i], sizes[i]) for i in order]))
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
    raising = TransferEngine(raise_on_failure=True, socket_path=engine._need_client().socket_path)
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
    engines = [TransferEngine(socket_path=pair[0].socket) for _ in range(2)]
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


def test_rpc_port_is_the_segments(pair):
    tx, rx = pair
    engine = TransferEngine(socket_path=rx.socket)
    assert engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    segment = rx.client().status()["mooncake"]["segment"]
    assert engine.get_rpc_port() == int(segment.rsplit(":", 1)[1])
    no_segment = TransferEngine(socket_path=tx.socket)
    assert no_segment.get_rpc_port() == -1 and "--mooncake-listen" in no_segment.last_failure.message


def test_an_unreachable_ferryd_fails_initialize(tmp_path):
    engine = TransferEngine(socket_path=str(tmp_path / "none.sock"))
    assert engine.initialize("h", "P2PHANDSHAKE", "tcp", "") == -1
    assert engine.last_failure.ret == "unreachable"
