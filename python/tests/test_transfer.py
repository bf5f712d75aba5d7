"""Transfers between two real ferryd: bytes by upload, torch tensors by
upload and zero copy, read back as bytes and in place."""

import json
import os
import re
import threading

import pytest

import ferry

torch = pytest.importorskip("torch", reason="Debian's python3-torch (make test-python installs it)")


@pytest.mark.parametrize("kind", ["bytes", "bytearray", "memoryview"])
def test_bytes_staged_by_upload_arrive_equal(tx, rx, req_id, kind):
    data = os.urandom(1 << 20)
    payload = {"bytes": data, "bytearray": bytearray(data), "memoryview": memoryview(data)}[kind]
    slot = rx.receive(req_id, len(data))
    assert re.fullmatch(r"[0-9a-f]{40}", slot.key) and slot.nbytes == len(data) and slot.req_id == req_id
    entry = tx.stage(req_id, payload)
    assert (entry["state"], entry["shape"], entry["dtype"], entry["nbytes"]) == ("staged", [len(data)], "u8", len(data))
    res = tx.send(req_id, slot)
    assert (res["nbytes"], res["transport"], res["attempts"]) == (len(data), "tcp", 1)
    assert rx.wait(req_id, 10) == data
    info = rx.slot_info(req_id)
    assert info["arrived"] and info["received"] == len(data)
    rx.free(req_id)
    # A successful send frees the staged entry.
    assert req_id not in [e["req_id"] for e in tx.embeddings()]
    assert req_id not in [r["req_id"] for r in rx.receives()]


def test_a_buffer_takes_shape_and_dtype(tx, rx, req_id):
    data = os.urandom(256 * 64 * 4)
    slot = rx.receive(req_id, ferry.nbytes((256, 64), "f32"))
    entry = tx.stage(req_id, data, shape=(256, 64), dtype="float32")
    assert (entry["shape"], entry["dtype"]) == ([256, 64], "f32")
    assert tx.embedding(req_id)["nbytes"] == len(data)
    tx.send(req_id, slot)
    assert rx.wait(req_id, 10) == data
    rx.free(req_id)


def test_the_slot_travels_as_json(tx, rx, req_id):
    # What the receiver hands the sender out of band: JSON in between.
    wire = json.dumps(rx.receive(req_id, 4096).to_dict())
    tx.stage(req_id, b"j" * 4096)
    tx.send(req_id, json.loads(wire))
    assert rx.wait(req_id, 10) == b"j" * 4096
    rx.free(req_id)


DTYPES = [torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32,
          torch.int16, torch.int8, torch.uint8, torch.bool]


def _random(shape, dtype):
    if dtype.is_floating_point:
        return torch.randn(shape, dtype=torch.float32).to(dtype)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape).bool()
    return torch.randint(-100 if dtype != torch.uint8 else 0, 100, shape).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_tensors_staged_by_upload_arrive_in_place(tx, rx, req_id, dtype):
    t = _random((8, 3, 5), dtype)
    slot = rx.receive(req_id, ferry.nbytes(t.shape, t.dtype))
    entry = tx.stage(req_id, t)
    assert entry["shape"] == [8, 3, 5] and entry["nbytes"] == t.numel() * t.element_size()
    tx.send(req_id, slot)
    got = rx.received_tensor(req_id, t.shape, t.dtype, timeout=10)
    assert got.dtype == dtype and torch.equal(got, t)
    del got
    rx.free(req_id)


def test_a_non_contiguous_tensor_is_staged_in_row_major_order(tx, rx, req_id):
    t = _random((64, 32), torch.float32).t()
    assert not t.is_contiguous()
    slot = rx.receive(req_id, ferry.nbytes(t.shape, t.dtype))
    tx.stage(req_id, t)
    tx.send(req_id, slot)
    assert torch.equal(torch.frombuffer(bytearray(rx.wait(req_id, 10)), dtype=torch.float32).view(32, 64), t)
    rx.free(req_id)


def test_tensors_staged_zero_copy_arrive_in_place(tx, rx, req_id):
    t = _random((16, 4096), torch.bfloat16)
    slot = rx.receive(req_id, ferry.nbytes(t.shape, t.dtype))
    arena = tx.map_arena()
    with tx.staging(req_id, t.shape, t.dtype, arena=arena) as r:
        assert r.nbytes == t.numel() * 2 and r.memory.readonly is False
        r.tensor().copy_(t)
    assert (r.entry["state"], r.entry["shape"], r.entry["dtype"]) == ("staged", [16, 4096], "bf16")
    # The entry is the bytes written, seen through a second mapping.
    staged = tx.staged_tensor(req_id)
    assert torch.equal(staged, t)
    del staged, r
    tx.send(req_id, slot)

    got = rx.received_tensor(req_id, t.shape, t.dtype, timeout=10)
    assert torch.equal(got, t)
    # In place: the tensor is the arena's memory where the slot is.
    info = rx.slot_info(req_id)
    with rx.map_arena() as mapping:
        assert bytes(mapping.view(info["offset"], 8)) == bytes(got.view(torch.uint8)[0, :8].numpy())
    kept = got.clone()
    del got
    rx.free(req_id)
    assert torch.equal(kept, t)
    arena.close()


def test_received_view_and_default_tensor_shape(tx, rx, req_id):
    slot = rx.receive(req_id, 1001)
    tx.stage(req_id, bytes(range(250)) * 4 + b"!")
    tx.send(req_id, slot)
    view = rx.received_view(req_id, timeout=10)
    assert view.nbytes == 1001 and bytes(view[:3]) == b"\x00\x01\x02"
    flat = rx.received_tensor(req_id)
    assert flat.shape == (1001,) and flat.dtype == torch.uint8 and int(flat[251]) == 1
    with pytest.raises(ValueError, match="not a whole number of f32 elements"):
        rx.received_tensor(req_id, dtype="f32")
    del view, flat
    rx.free(req_id)


def test_a_send_with_wait_ms_takes_a_stage_made_meanwhile(tx, rx, req_id):
    # Whether the stage lands before the send reaches ferryd or during its
    # wait, the send delivers it (and runs beside the stage, on its own
    # connection of the shared client).
    slot = rx.receive(req_id, 64)
    result = {}
    sender = threading.Thread(target=lambda: result.update(tx.send(req_id, slot, wait_ms=20000)))
    sender.start()
    tx.stage(req_id, b"r" * 64)
    sender.join(30)
    assert result.get("nbytes") == 64, result
    assert rx.wait(req_id, 10) == b"r" * 64
    rx.free(req_id)


def test_mooncake_slots_name_the_segment(pair, tx, rx, req_id):
    slot = rx.receive(req_id, 128, mooncake=True)
    segment = rx.status()["mooncake"]["segment"]
    assert slot.mooncake_session == segment and slot.to_dict()["mooncake_session"] == segment
    assert rx.slot_info(req_id)["mooncake"] is True
    rx.free(req_id)
    plain = rx.receive(req_id, 128)
    assert plain.mooncake_session is None and "mooncake_session" not in plain.to_dict()
    rx.free(req_id)
    with pytest.raises(ferry.BadRequest, match="--mooncake-listen"):
        tx.receive(req_id, 128, mooncake=True)


def test_sessions_are_listed_and_torn_down(pair, tx, rx, req_id):
    slot = rx.receive(req_id, 32)
    tx.stage(req_id, b"s" * 32)
    tx.send(req_id, slot)
    rx.free(req_id)
    sessions = {s["id"]: s for s in tx.sessions()}
    assert pair[1].advertise in sessions and sessions[pair[1].advertise]["transport"] == "tcp"
    tx.teardown(pair[1].advertise)
    assert pair[1].advertise not in [s["id"] for s in tx.sessions()]


def test_status_and_metrics(pair, tx):
    st = tx.status()
    assert st["pid"] == pair[0].pid and st["memory"]["kind"] == "host" and st["memory"]["size"] == 64 << 20
    assert st["transport"]["advertise"] == pair[0].advertise
    assert "ferry_transfers_total" in tx.metrics()


def test_complete_a_mooncake_slot_on_the_clients_word(rx, req_id):
    # A Mooncake sender's one-sided RDMA writes without a notify raise no
    # event: the receiving client, told by its framework, completes the slot.
    rx.receive(req_id, 4096, mooncake=True)
    assert rx.slot_info(req_id)["arrived"] is False
    info = rx.complete(req_id)
    assert info["arrived"] is True and info["received"] == 4096
    assert len(rx.wait(req_id, 0)) == 4096
    with pytest.raises(ferry.Exists):
        rx.complete(req_id)
    rx.free(req_id)
    rx.receive(req_id, 4096)
    with pytest.raises(ferry.BadRequest, match='only a slot made with "mooncake": true'):
        rx.complete(req_id)
    rx.free(req_id)
    with pytest.raises(ferry.NotFound):
        rx.complete(req_id)
