"""The replays of test_mooncake_receivers.py with a Mooncake-protocol peer
as either half: test/mcpeer (package mooncaketest's Peer, speaking
Mooncake's handshake and TCP data port v2 on loopback) against a ferry
engine through a real ferryd. Where the peer receives, it digests what
landed in its own registered buffer; where it sends, its bytes are the
seed's stream (conftest.pattern) and land in the ferry engine's own torch
tensors, digested there."""

import hashlib
import random

import pytest

from conftest import pattern
from test_mooncake_receivers import RECEIVER, digests, register_held, register_kv, sender, source

pytest.importorskip("torch", reason="Debian's python3-torch (make test-python installs it)")

PAGE = 16 << 10  # sglang's and vLLM's page (block) size here
ROWS = PAGE // 4096  # register_kv's tensors have rows of 4096 bytes


def sha(b):
    return hashlib.sha256(b).hexdigest()


def scattered(count, slots, seed):
    """count distinct destination slots out of slots, shuffled: a KV
    transfer's pages."""
    return random.Random(seed).sample(range(slots), count)


def test_sglang_pd_a_ferry_prefill_writes_2048_scattered_pages_into_a_mooncake_decode(pair, mcpeer):
    # The decode side is the Mooncake peer (its registered buffer the KV
    # pool); the ferry prefill's one batch_transfer_sync_write of every page.
    pages = 2048
    peer = mcpeer(2 * pages * PAGE)
    dst = scattered(pages, 2 * pages, 20)
    src, base = source(pages * PAGE, 21)
    tx = sender(pair)
    assert tx.batch_register_memory([base], [len(src)]) == 0
    assert tx.batch_transfer_sync_write(peer.session, [base + i * PAGE for i in range(pages)],
                                        [peer.base + d * PAGE for d in dst], [PAGE] * pages) == 0, tx.last_failure
    # 0: every page is in the peer's buffer, where it was sent.
    assert peer.digest([[peer.base + d * PAGE, PAGE] for d in dst]) == \
        [sha(bytes(src[i * PAGE:(i + 1) * PAGE])) for i in range(pages)]
    # ferryd reached the peer over Mooncake's wire.
    with pair[0].client() as c:
        assert {s["transport"] for s in c.sessions() if peer.session in s["peer"]} == {"mooncake-tcp"}
    assert tx.batch_unregister_memory([base]) == 0


def test_sglang_pd_a_mooncake_prefill_writes_2048_scattered_pages_into_a_ferry_decodes_kv(pair, engine_child, mcpeer):
    # The decode side is a ferry engine: per layer K and V torch tensors,
    # allocated first, registered in one batch_register_memory; the
    # Mooncake prefill writes every page, scattered, on one pooled
    # connection to the segment's data port.
    tensors, per_tensor = 32, 64
    rx = engine_child(pair[1].socket)
    session = rx.run(RECEIVER)
    ptrs = register_kv(rx, tensors, per_tensor * ROWS)
    order = [(t, p) for t in range(tensors) for p in range(per_tensor)]
    random.Random(22).shuffle(order)
    peer = mcpeer(1 << 20)
    assert peer.write(session, "pd", [[ptrs[t] + p * PAGE, PAGE] for t, p in order]) is None
    sent = pattern("pd", len(order) * PAGE)
    expect = [bytearray(per_tensor * PAGE) for _ in range(tensors)]
    for i, (t, p) in enumerate(order):
        expect[t][p * PAGE:(p + 1) * PAGE] = sent[i * PAGE:(i + 1) * PAGE]
    # The peer's OK status means the bytes are in the engine's tensors.
    assert rx.run("out = digest(kv)") == digests(expect)
    assert rx.run("out = engine.batch_unregister_memory(ptrs)") == 0


LANDING = 16 * 4096 * 2  # torch.empty((16, 4096), dtype=torch.bfloat16)


def test_sglang_encoder_a_ferry_encoder_writes_into_a_mooncake_receivers_buffer(pair, mcpeer):
    # The encoder's register_memory, transfer_sync_write, unregister_memory
    # of one embedding into the receiver's landing buffer.
    peer = mcpeer(LANDING)
    emb, src = source(LANDING, 23)
    tx = sender(pair)
    assert tx.register_memory(src, LANDING) == 0
    assert tx.transfer_sync_write(peer.session, src, peer.base, LANDING) == 0, tx.last_failure
    assert tx.unregister_memory(src) == 0
    assert peer.digest([[peer.base, LANDING]]) == [sha(bytes(emb))]
    # Past the landing buffer's end: -1, nothing written past it.
    assert tx.register_memory(src, LANDING) == 0
    assert tx.transfer_sync_write(peer.session, src, peer.base + 8, LANDING) == -1
    assert tx.last_failure.ret == "refused" and "lies in none of the buffers of Mooncake segment" in \
        tx.last_failure.message, tx.last_failure
    assert peer.digest([[peer.base, LANDING]]) == [sha(bytes(emb))]
    assert tx.unregister_memory(src) == 0


def test_sglang_encoder_a_mooncake_encoder_writes_into_a_ferry_receivers_torch_empty(pair, engine_child, mcpeer):
    rx = engine_child(pair[1].socket)
    session = rx.run(RECEIVER)
    ptr = rx.run(f"""
        landing = torch.empty((16, 4096), dtype=torch.bfloat16)
        assert landing.numel() * landing.element_size() == {LANDING}
        assert engine.register_memory(landing.data_ptr(), {LANDING}) == 0, engine.last_failure
        out = landing.data_ptr()
    """)
    peer = mcpeer(1 << 20)
    assert peer.write(session, "emb", [[ptr, LANDING]]) is None
    assert rx.run("out = digest([landing.view(torch.uint8)])") == [sha(pattern("emb", LANDING))]
    assert rx.run("out = engine.unregister_memory(landing.data_ptr())") == 0
    # Unregistered: the peer's write is rejected (v2 status), not landed.
    assert "rejected" in peer.write(session, "late", [[ptr, PAGE]])


CACHES, BLOCKS = 4, 64


def vllm_requests(seed):
    """vLLM's producer's three requests, each 8 blocks of every cache
    (cache, block), and a fourth whose blocks the consumer had cached:
    an empty batch."""
    rng = random.Random(seed)
    return [[(c, b) for c in range(CACHES) for b in rng.sample(range(BLOCKS), 8)] for _ in range(3)] + [[]]


def test_vllm_a_ferry_producer_and_a_mooncake_consumer(pair, mcpeer):
    # The consumer's KV caches lie back to back in the peer's buffer.
    peer = mcpeer(CACHES * BLOCKS * PAGE)
    src, base = source(CACHES * BLOCKS * PAGE, 24)
    tx = sender(pair)
    assert tx.batch_register_memory([base], [len(src)]) == 0
    landed = {}
    for moves in vllm_requests(25):
        offs = [(c * BLOCKS + b) * PAGE for c, b in moves]
        assert tx.batch_transfer_sync_write(peer.session, [base + o for o in offs], [peer.base + o for o in offs],
                                            [PAGE] * len(offs)) == 0, tx.last_failure
        landed.update((o, sha(bytes(src[o:o + PAGE]))) for o in offs)
    assert peer.digest([[peer.base + o, PAGE] for o in landed]) == list(landed.values())
    assert tx.batch_unregister_memory([base]) == 0


def test_vllm_a_mooncake_producer_and_a_ferry_consumer(pair, engine_child, mcpeer):
    rx = engine_child(pair[1].socket)
    session = rx.run(RECEIVER)
    ptrs = rx.run(f"""
        caches = [torch.zeros(({BLOCKS}, {PAGE}), dtype=torch.uint8) for _ in range({CACHES})]
        ptrs = [c.data_ptr() for c in caches]
        assert engine.batch_register_memory(ptrs, [c.numel() for c in caches]) == 0, engine.last_failure
        out = ptrs
    """)
    peer = mcpeer(1 << 20)
    expect = [bytearray(BLOCKS * PAGE) for _ in range(CACHES)]
    for i, moves in enumerate(vllm_requests(26)):
        if not moves:
            continue  # nothing to send: a Mooncake producer sends nothing
        assert peer.write(session, f"req{i}", [[ptrs[c] + b * PAGE, PAGE] for c, b in moves]) is None
        sent = pattern(f"req{i}", len(moves) * PAGE)
        for j, (c, b) in enumerate(moves):
            expect[c][b * PAGE:(b + 1) * PAGE] = sent[j * PAGE:(j + 1) * PAGE]
    assert rx.run("out = digest(caches)") == digests(expect)
    assert rx.run("out = engine.batch_unregister_memory(ptrs)") == 0


def test_a_ferry_engine_reads_from_a_mooncake_peers_buffer(pair, mcpeer):
    # sglang's expert backup against a Mooncake segment: one
    # transfer_sync_read, then a batch of the other pages, shuffled.
    pages = 64
    peer = mcpeer(pages * PAGE)
    assert peer.write(peer.session, "held", [[peer.base, pages * PAGE]]) is None
    want = pattern("held", pages * PAGE)
    reader = sender(pair)
    dst, base = source(pages * PAGE, 27)
    assert reader.register_memory(base, len(dst)) == 0
    assert reader.transfer_sync_read(peer.session, base, peer.base, PAGE) == 0, reader.last_failure
    assert bytes(dst[:PAGE]) == want[:PAGE]
    order = list(range(1, pages))
    random.Random(28).shuffle(order)
    assert reader.batch_transfer_sync_read(peer.session, [base + i * PAGE for i in order],
                                           [peer.base + i * PAGE for i in order], [PAGE] * len(order)) == 0, \
        reader.last_failure
    assert bytes(dst) == want
    # Past the peer's buffer: refused before anything is read, naming why.
    assert reader.transfer_sync_read(peer.session, base, peer.base + pages * PAGE - 8, 16) == -1
    assert reader.last_failure.ret == "refused" and "lies in none of the segment's buffers" in \
        reader.last_failure.message, reader.last_failure
    assert bytes(dst) == want
    assert reader.unregister_memory(base) == 0


def test_a_mooncake_peer_reads_a_ferry_engines_registered_memory(pair, engine_child, mcpeer):
    pages = 64
    rx = engine_child(pair[1].socket)
    session = rx.run(RECEIVER)
    ptr, want = register_held(rx, pages, 29)  # register_held's pages are 4 KiB
    order = list(range(pages))
    random.Random(30).shuffle(order)
    peer = mcpeer(1 << 20)
    assert peer.read(session, [[ptr + i * 4096, 4096] for i in order]) == \
        [sha(want[i * 4096:(i + 1) * 4096]) for i in order]
    # Past what the engine registered: the segment rejects the READ.
    assert "rejected" in peer.read(session, [[ptr + pages * 4096 - 8, 16]])
    assert rx.run("out = engine.unregister_memory(held.data_ptr())") == 0
