"""Arenas per device: slots and staging name their device (a name, a
torch.device, or a tensor's), the slot says where it is, a device ferryd
has no arena on is refused naming those it has, and a tensor's device is
taken only where ferryd has an arena on it."""

from types import SimpleNamespace

import pytest

import ferry
from ferry import dtypes


def on(kind, index=None):
    """A stand-in for a tensor on a device (torch is not needed to name one)."""
    return SimpleNamespace(device=SimpleNamespace(type=kind, index=index))


def test_device_names():
    assert dtypes.device_name(None) is None
    assert dtypes.device_name("cuda:3") == "cuda:3"
    assert dtypes.device_name(on("cuda", 3)) == "cuda:3"
    assert dtypes.device_name(on("cpu")) == "cpu"
    assert dtypes.device_name(SimpleNamespace(type="cuda", index=1)) == "cuda:1"
    with pytest.raises(ValueError, match=r"not a device ferryd keeps an arena on"):
        dtypes.device_name(on("mps", 0))


def test_a_slot_and_an_entry_name_their_device(tx, rx, req_id):
    slot = rx.receive(req_id, 1000, device="cpu")
    assert slot.device == "cpu" and slot.to_dict()["device"] == "cpu"
    entry = tx.stage(req_id, b"d" * 1000, device=on("cpu"))
    assert entry["device"] == "cpu"
    tx.send(req_id, slot)
    assert rx.wait(req_id, 10) == b"d" * 1000
    assert rx.slot_info(req_id)["device"] == "cpu"
    rx.free(req_id)
    # Default: the first (here the only) device.
    assert rx.receive(req_id, 10).device == "cpu"
    rx.free(req_id)


def test_a_device_without_an_arena_is_refused(tx, rx, req_id):
    for call in (lambda: rx.receive(req_id, 10, device="cuda:3"),
                 lambda: tx.stage(req_id, b"x", device=on("cuda", 3))):
        with pytest.raises(ferry.BadRequest, match=r'device "cuda:3": this ferryd has arenas on cpu only'):
            call()
    assert rx.receives() == [] and tx.embeddings() == []


def test_a_tensors_device_is_taken_where_ferryd_has_an_arena(tx):
    assert tx._arena_for(on("cpu")) == "cpu"
    # A ferryd with no arena on that GPU takes the bytes in its first, as
    # one with a single arena always did.
    assert tx._arena_for(on("cuda", 5)) is None
