"""Mooncake's asynchronous calls on ferry (batch_transfer_async_write and
_read, batch_transfer_async, transfer_submit_write, transfer_check_status,
get_batch_transfer_status) and get_local_topology: a sending engine in
this process, the receiver a real process started with ferry's allocator,
two real ferryd; every byte checked where it landed. Status is read by the
status calls themselves: get_batch_transfer_status waits (bounded), and
transfer_check_status is polled with a deadline."""

import json
import random
import socket
import threading

import pytest

import ferry.mooncake as mc
from conftest import poll_until
from ferry.mooncake import TransferEngine, TransferOpcode
from test_mooncake_receivers import PAGE, RECEIVER, digests, register_held, register_kv, sender, source

torch = pytest.importorskip("torch", reason="Debian's python3-torch (make test-python installs it)")


def finished(engine, batch_id, timeout=60):
    """transfer_check_status polled until the batch is no longer pending (0)."""
    got = []
    poll_until(lambda: got.append(engine.transfer_check_status(batch_id)) or got[-1] != 0, timeout,
               f"batch {batch_id} finishing")
    return got[-1]


def engines(pair, engine_child, tensors, pages, nbytes, seed):
    """A receiving engine process with tensors KV tensors of pages pages
    registered (rx, its session, their addresses), and a sending engine
    here with nbytes of seeded bytes registered (tx, the bytes, their address)."""
    rx = engine_child(pair[1].socket)
    session = rx.run(RECEIVER)
    ptrs = register_kv(rx, tensors, pages)
    tx = sender(pair)
    data, base = source(nbytes, seed)
    assert tx.register_memory(base, len(data)) == 0
    return rx, session, ptrs, tx, data, base


def kv_images(rx, n):
    return rx.run(f"out = digest([t.view(-1) for t in kv[:{n}]])")


def test_async_writes_land_scattered_pages_byte_exact(pair, engine_child):
    # sglang PD's prefill side, asynchronously: one batch per layer's K and
    # V buffer of scattered pages, submitted together, then one
    # get_batch_transfer_status; a page by transfer_submit_write, polled.
    tensors, pages = 8, 64
    rx, session, ptrs, tx, data, base = engines(pair, engine_child, tensors, pages, tensors * pages * PAGE, 11)
    ids = []
    for t in range(tensors):
        order = list(range(pages))
        random.Random(t).shuffle(order)
        ids.append(tx.batch_transfer_async_write(session, [base + (t * pages + p) * PAGE for p in order],
                                                 [ptrs[t] + p * PAGE for p in order], [PAGE] * pages))
    assert all(i > 0 for i in ids) and len(set(ids)) == tensors, ids
    assert tx.get_batch_transfer_status(ids) == 0, tx.last_failure
    want = [bytes(data[t * pages * PAGE:(t + 1) * pages * PAGE]) for t in range(tensors)]
    assert kv_images(rx, tensors) == digests(want)
    # Read once: forgotten, and a second read says so.
    assert tx.get_batch_transfer_status(ids[:1]) == -1
    assert "unknown to this engine, or its status was read already" in tx.last_failure.message
    # One page by transfer_submit_write, its status polled: 1 once there.
    one, one_base = source(PAGE, 12)
    assert tx.register_memory(one_base, PAGE) == 0
    bid = tx.transfer_submit_write(session, one_base, ptrs[0] + 5 * PAGE, PAGE)
    assert bid > 0
    assert finished(tx, bid) == 1, tx.last_failure
    assert rx.run("out = digest([kv[0][5]])") == digests([bytes(one)])
    assert tx.transfer_check_status(bid) == -1, "a read status was not forgotten"
    # batch_transfer_async with WRITE is the async write.
    bid = tx.batch_transfer_async(session, [base], [ptrs[1]], [PAGE], TransferOpcode.WRITE)
    assert tx.get_batch_transfer_status([bid]) == 0
    assert rx.run("out = digest([kv[1][0]])") == digests([bytes(data[:PAGE])])
    assert tx.close() == 0


def test_an_async_read_pulls_the_peers_registered_pages(pair, engine_child):
    pages = 32
    rx = engine_child(pair[1].socket)
    session = rx.run(RECEIVER)
    ptr, want = register_held(rx, pages, 21)
    reader = sender(pair)
    dst, base = source(pages * PAGE, 22)
    assert reader.register_memory(base, len(dst)) == 0
    order = list(range(1, pages))
    random.Random(23).shuffle(order)
    a = reader.batch_transfer_async_read(session, [base + i * PAGE for i in order], [ptr + i * PAGE for i in order],
                                         [PAGE] * len(order))
    b = reader.batch_transfer_async(session, [base], [ptr], [PAGE], TransferOpcode.READ)
    assert a > 0 and b > 0
    assert finished(reader, a) == 1, reader.last_failure
    assert reader.get_batch_transfer_status([b]) == 0, reader.last_failure
    assert bytes(dst) == want
    assert reader.close() == 0


def test_a_failing_async_write_is_reported_by_the_status_calls(pair, engine_child):
    # Outside the peer's registered memory: the submit succeeds (an id),
    # the status says -1, and last_failure says why, as the synchronous
    # call's would; a good batch beside it in one status call is forgotten too.
    rx, session, ptrs, tx, data, base = engines(pair, engine_child, 1, 64, 4 * PAGE, 31)
    bad = tx.transfer_submit_write(session, base, ptrs[0] + 64 * PAGE, PAGE)
    assert bad > 0
    tx.last_failure = None
    assert finished(tx, bad) == -1
    assert tx.last_failure.ret == "refused" and "does not fit the memory registered" in tx.last_failure.message, \
        tx.last_failure
    # The failure names the call the caller made.
    assert tx.last_failure.method == "transfer_submit_write" and tx.last_failure.nbytes == PAGE
    good = tx.batch_transfer_async_write(session, [base], [ptrs[0]], [PAGE])
    bad = tx.batch_transfer_async_write(session, [base], [ptrs[0] + 65 * PAGE], [PAGE])
    tx.last_failure = None
    assert tx.get_batch_transfer_status([good, bad]) == -1
    assert tx.last_failure.ret == "refused", tx.last_failure
    assert tx.transfer_check_status(good) == -1 and "unknown" in tx.last_failure.message
    assert rx.run("out = digest([kv[0][0]])") == digests([bytes(data[:PAGE])])
    assert tx.close() == 0


def test_unknown_batch_ids_and_refused_submits(pair):
    tx = sender(pair)
    assert tx.transfer_check_status(123456789) == -1
    assert "batch id 123456789 is unknown to this engine" in tx.last_failure.message
    assert tx.get_batch_transfer_status([987654321]) == -1
    assert "batch id 987654321 is unknown" in tx.last_failure.message
    assert tx.get_batch_transfer_status([]) == 0
    # Mooncake's failed submit is 0: lists that disagree, a bad opcode.
    assert tx.batch_transfer_async_write("127.0.0.1:1", [1, 2], [3], [4]) == 0
    assert "2 buffers, 1 peer addresses and 1 lengths" in tx.last_failure.message
    assert tx.batch_transfer_async("127.0.0.1:1", [1], [2], [3], 7) == 0
    assert "opcode 7" in tx.last_failure.message
    # A memory range not registered is the transfer's failure, told by its status.
    bid = tx.transfer_submit_write("127.0.0.1:1", 1, 2, 3)
    assert bid > 0 and tx.get_batch_transfer_status([bid]) == -1
    assert "register_memory it first" in tx.last_failure.message
    assert tx.close() == 0


def test_close_waits_for_the_batches_in_flight(pair, engine_child):
    # Peers that accept and do not answer hold every worker of the pool, so
    # the real batches wait in its queue, not started. close() (in a
    # thread) returns only once every batch has finished, each status
    # still readable; the silent peers hang up once close has begun (ferryd
    # tries again, and gives up at its 5 s handshake deadline). A submit
    # after close is refused.
    tensors, pages = 2 * mc.ASYNC_WORKERS, 64
    rx, session, ptrs, tx, data, base = engines(pair, engine_child, tensors, pages, tensors * pages * PAGE, 41)
    silent, conns, closed = [], [], []
    try:
        for _ in range(mc.ASYNC_WORKERS):
            peer = socket.socket()
            silent.append(peer)
            peer.bind(("127.0.0.1", 0))
            peer.listen(4)
            peer.settimeout(30)
        stuck = [tx.transfer_submit_write(f"127.0.0.1:{peer.getsockname()[1]}", base, 4096, PAGE) for peer in silent]
        ids = [tx.batch_transfer_async_write(session, [base + (t * pages + p) * PAGE for p in range(pages)],
                                             [ptrs[t] + p * PAGE for p in range(pages)], [PAGE] * pages)
               for t in range(tensors)]
        conns = [peer.accept()[0] for peer in silent]  # ferryd is connected: every worker waits on a peer
        assert [tx.transfer_check_status(b) for b in stuck + ids] == [0] * len(stuck + ids), "not in flight"
        closing = threading.Thread(target=lambda: closed.append(tx.close()))
        closing.start()
        poll_until(lambda: tx._closing, 30, "close beginning")
        for conn in conns:
            conn.close()
        closing.join(60)
        assert closed == [0], "close did not return within 60 s"
        assert [tx.transfer_check_status(b) for b in stuck] == [-1] * len(stuck), "close returned with a batch in flight"
        assert [tx.transfer_check_status(b) for b in ids] == [1] * len(ids), tx.last_failure
    finally:
        for s in conns + silent:
            s.close()
    want = [bytes(data[t * pages * PAGE:(t + 1) * pages * PAGE]) for t in range(tensors)]
    assert kv_images(rx, tensors) == digests(want)
    assert tx.batch_transfer_async_write(session, [base], [ptrs[0]], [PAGE]) == 0
    assert "the engine is closed" in tx.last_failure.message


def test_finished_batches_never_read_are_capped(pair, engine_child, monkeypatch, caplog):
    monkeypatch.setattr(mc, "ASYNC_KEPT", 3)
    rx, session, ptrs, tx, data, base = engines(pair, engine_child, 1, 64, 64 * PAGE, 51)
    ids = []
    for p in range(8):
        ids.append(tx.transfer_submit_write(session, base + p * PAGE, ptrs[0] + p * PAGE, PAGE))
        poll_until(lambda: tx._batches[ids[-1]].future.done(), 60, f"batch {ids[-1]} finishing")
    # Each submit dropped the oldest finished ones past 3: the last 3 are kept (and the newest).
    assert sorted(tx._batches) == ids[-4:]
    assert tx.transfer_check_status(ids[0]) == -1 and "unknown" in tx.last_failure.message
    assert "finished batches dropped unread" in caplog.text
    assert tx.get_batch_transfer_status(ids[-4:]) == 0
    assert rx.run("out = digest([kv[0][:8].reshape(-1)])") == digests([bytes(data[:8 * PAGE])])
    assert tx.close() == 0


def test_local_topology(pair):
    # Over TCP ferryd drives no NIC: Mooncake's empty matrix.
    tx = sender(pair)
    assert json.loads(tx.get_local_topology()) == {}
    assert json.loads(tx.get_local_topology("mlx5_0")) == {}
    # The matrix of what an RDMA ferryd's status says: its rails and its affinity table.
    status = {
        "transport": {"name": "rdma", "rdma": {"rails": [{"device": "mlx5_0"}, {"device": "mlx5_1"}, {"device": "mlx5_2"}]}},
        "affinity": {"devices": [
            {"device": "cuda:0", "nics": [{"name": "mlx5_1", "numa_node": 0}, {"name": "mlx5_0", "numa_node": 0}]},
            {"device": "cuda:1", "nics": [{"name": "mlx5_2", "numa_node": 1}, {"name": "mlx5_9", "numa_node": 1}]},
        ]},
    }
    rails = ["mlx5_0", "mlx5_1", "mlx5_2"]
    assert mc._topology(status, None) == {
        "cuda:0": [["mlx5_1", "mlx5_0"], rails], "cuda:1": [["mlx5_2"], rails],
        "cpu:0": [["mlx5_1", "mlx5_0"], rails], "cpu:1": [["mlx5_2"], rails]}
    assert mc._topology(status, "mlx5_2") == {
        "cuda:0": [[], ["mlx5_2"]], "cuda:1": [["mlx5_2"], ["mlx5_2"]], "cpu:1": [["mlx5_2"], ["mlx5_2"]]}
    assert mc._topology(status, "mlx5_7") == {}
