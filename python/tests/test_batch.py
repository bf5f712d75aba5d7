"""Batch transfers between two real ferryd: many pieces in one call,
completing once, heard of through the event stream."""

import dataclasses
import os
import random
import socket

import pytest

import ferry


def _scatter(nbytes, pieces, seed):
    """Cuts nbytes into `pieces` pieces of 4..64 KiB and lays them into the
    destination in a shuffled order: the items, and where each source
    byte ends up (as the destination's bytes, given the source)."""
    rng = random.Random(seed)
    sizes = [rng.randint(4 << 10, 64 << 10) for _ in range(pieces)]
    offsets, off = [], 0
    for n in sizes:
        offsets.append(off)
        off += n
    assert off <= nbytes
    order = list(range(pieces))
    rng.shuffle(order)
    items, dst = [], 0
    for i in order:
        items.append((0, offsets[i], 0, dst, sizes[i]))
        dst += sizes[i]
    return items, dst


def test_a_thousand_pieces_scattered_into_one_slot_arrive_once(tx, rx, req_id):
    src = os.urandom(40 << 20)
    items, total = _scatter(len(src), 1000, seed=5)
    want = b"".join(src[so:so + n] for _, so, _, _, n in items)
    after = rx.events()["next"]
    tx.stage(req_id, src)
    slot = rx.receive(req_id, total)
    started = tx.transfer([req_id], [slot], items)
    assert started["state"] in ("running", "done") and started["items"] == 1000
    assert started["nbytes"] == total and started["writes"] <= 1000
    done = tx.wait_transfer(started["transfer_id"], 60)
    assert done["state"] == "done" and done["writes_done"] == started["writes"]
    assert rx.wait(req_id, 10) == want
    # The receiver heard of the slot once, whatever number of pieces filled it.
    ev = rx.events(after, timeout=5)
    assert [(e["kind"], e["req_id"], e["nbytes"]) for e in ev["events"]] == [("arrived", req_id, total)]
    # The source is freed once every piece arrived.
    assert req_id not in [e["req_id"] for e in tx.embeddings()]
    rx.free(req_id)


def test_a_failed_batch_raises_its_class_and_keeps_the_source(tx, rx, req_id):
    tx.stage(req_id, b"s" * 8192)
    slot = rx.receive(req_id, 4096).to_dict()
    del slot["nbytes"]  # only the receiver can refuse, then
    started = tx.transfer([req_id], [slot], [(0, 4096, 0, 0, 4096), (0, 0, 0, 4096, 4096)])
    with pytest.raises(ferry.Refused) as e:
        tx.wait_transfer(started["transfer_id"], 30)
    assert e.value.transfer["state"] == "failed" and e.value.transfer["item"] == 1
    assert started["transfer_id"] in str(e.value) and "item 1" in str(e.value)
    assert tx.embedding(req_id)["state"] == "staged"
    tx.delete(req_id)
    rx.free(req_id)


def test_a_bad_item_is_refused_before_anything_moves(tx, rx, req_id):
    tx.stage(req_id, b"x" * 4096)
    slot = rx.receive(req_id, 4096)
    with pytest.raises(ferry.BadRequest, match="item 1"):
        tx.transfer([req_id], [slot], [(0, 0, 0, 0, 2048), (0, 2048, 0, 2048, 4096)])
    assert tx.embedding(req_id)["state"] == "staged"
    done = tx.transfer_sync([req_id], [slot], [(0, 0, 0, 0, 2048), (0, 2048, 0, 2048, 2048)], timeout=30)
    assert done["writes"] == 1  # adjacent at both ends: merged
    assert rx.wait(req_id, 10) == b"x" * 4096
    rx.free(req_id)


def test_the_sender_hears_of_the_batch_ending(tx, rx, req_id):
    after = tx.events()["next"]
    tx.stage(req_id, b"e" * 4096)
    t = tx.transfer([req_id], [rx.receive(req_id, 4096)], [(0, 0, 0, 0, 4096)])
    ev = tx.events(after, timeout=30)
    assert [(e["kind"], e["transfer_id"]) for e in ev["events"]] == [("transfer_done", t["transfer_id"])]
    assert tx.transfer_status(t["transfer_id"])["state"] == "done"
    rx.free(req_id)


def test_a_memfd_region_sends_and_receives_without_a_copy(tx, rx, req_id):
    n = 4 << 20
    with tx.register_region(req_id + "-src", n) as src, rx.register_region(req_id + "-dst", n) as dst:
        src.view()[:] = os.urandom(n)
        slot = rx.receive(req_id, n // 2, region=dst, region_offset=n // 4)
        # Every other 64 KiB page of the source's first 4 MiB, packed into the slot.
        page = 64 << 10
        items = [(0, 2 * i * page, 0, i * page, page) for i in range(n // 2 // page)]
        done = tx.transfer_sync([src], [slot], items, timeout=60)
        assert done["state"] == "done" and done["writes"] == len(items)
        info = rx.slot_info(req_id, timeout=10)
        assert info["arrived"] and info["region"] == dst.name and info["offset"] == n // 4
        # In place, in the region: not the arena's bytes at that offset.
        with pytest.raises(ValueError, match=dst.name):
            rx.received_view(req_id)
        view = rx.received_view(req_id, region=dst)
        assert view == dst.view(n // 4, n // 2)
        del view
        for i in range(len(items)):
            got = dst.view(n // 4 + i * page, page)
            assert got == src.view(2 * i * page, page), f"page {i}"
        # Neither arena held the bytes: they went from one process's memory to the other's.
        assert tx.status()["memory"]["used"] == 0 and rx.status()["memory"]["used"] == 0
        with pytest.raises(ferry.Busy, match=req_id):
            rx.unregister_region(dst.name)
        rx.free(req_id)
        del got
    assert dst.name not in [g["name"] for g in rx.regions()]


def test_an_unsealed_memfd_is_refused(tx):
    fd = os.memfd_create("unsealed", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, 4096)
        with pytest.raises(ferry.BadRequest, match="F_SEAL_SHRINK"):
            tx.register_fd("unsealed", fd, 4096)
    finally:
        os.close(fd)


def test_a_transfer_still_running_is_not_reported_done(tx, rx, req_id):
    # A wait of 0 answers at once: a transfer that has not ended is a
    # Timeout, never a description taken for success. This one's peer
    # takes the connection and never answers its hello, so it runs until
    # ferryd's I/O timeout.
    mute = socket.socket()
    mute.bind(("127.0.0.1", 0))
    mute.listen()
    try:
        real = rx.receive(req_id, 4096)
        slot = dataclasses.replace(real, session="%s:%d" % mute.getsockname())
        sources = [req_id, req_id + "-2"]
        for name in sources:
            tx.stage(name, b"r" * 4096)
        t = tx.transfer([sources[0]], [slot], [(0, 0, 0, 0, 4096)], keep_sources=True)
        with pytest.raises(ferry.Timeout, match="still running"):
            tx.wait_transfer(t["transfer_id"], 0)
        with pytest.raises(ferry.Timeout, match="still running") as running:
            tx.transfer_sync([sources[1]], [slot], [(0, 0, 0, 0, 4096)], timeout=0, keep_sources=True)
    finally:
        mute.close()
    # Both fail once the peer is gone; the staged entry stays for a retry.
    for transfer_id in (t["transfer_id"], running.value.transfer["transfer_id"]):
        with pytest.raises(ferry.FerryError) as failed:
            tx.wait_transfer(transfer_id, 60)
        assert not isinstance(failed.value, ferry.Timeout)
    for name in sources:
        tx.delete(name)
    rx.free(req_id)


def test_events_always_say_how_many_were_missed(rx):
    assert rx.events()["missed"] == 0
