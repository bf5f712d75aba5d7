"""Both halves of sglang's and vLLM's Mooncake paths on ferry: the
receiving side is a real process started with ferry's allocator (python -m
ferry.run, as docs/python.md says to start a framework), whose torch
tensors, allocated before any engine exists, are registered with
ferry.mooncake.TransferEngine and written by a ferry engine through two
real ferryd; every byte is checked where it landed, in the receiver's own
tensors."""

import ctypes
import hashlib
import json
import os
import random
import socket
import struct

import pytest

from conftest import poll_until
from ferry.mooncake import TransferEngine, TransferOpcode

torch = pytest.importorskip("torch", reason="Debian's python3-torch (make test-python installs it)")

PAGE = 4096


def sender(pair):
    e = TransferEngine(socket_path=pair[0].socket, send_only=True)
    assert e.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    return e


def source(nbytes, seed):
    """nbytes of seeded random bytes in this process, and their address."""
    buf = (ctypes.c_char * nbytes).from_buffer_copy(random.Random(seed).randbytes(nbytes))
    return buf, ctypes.addressof(buf)


def digests(images):
    return [hashlib.sha256(bytes(b)).hexdigest() for b in images]


RECEIVER = """
    import hashlib, torch
    from ferry.mooncake import TransferEngine, TransferOpcode
    engine = TransferEngine()
    assert engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0, engine.last_failure
    session = f"127.0.0.1:{engine.get_rpc_port()}"
    def digest(ts):
        return [hashlib.sha256(t.numpy().tobytes()).hexdigest() for t in ts]
    out = session
"""


def register_kv(rx, tensors, pages):
    """The decode side's KV pool in the engine process rx: tensors torch CPU
    tensors of pages pages each, allocated first, then registered in one
    batch_register_memory; their addresses."""
    return rx.run(f"""
        kv = [torch.zeros(({pages}, {PAGE}), dtype=torch.uint8) for _ in range({tensors})]
        ptrs = [t.data_ptr() for t in kv]
        assert engine.batch_register_memory(ptrs, [t.numel() for t in kv]) == 0, engine.last_failure
        out = ptrs
    """)


def register_held(rx, pages, seed):
    """pages pages of seeded random bytes in a tensor `held` of the engine
    process rx, registered: its address, and the bytes."""
    ptr = rx.run(f"""
        import random
        held = torch.frombuffer(bytearray(random.Random({seed}).randbytes({pages} * {PAGE})), dtype=torch.uint8).clone()
        assert engine.register_memory(held.data_ptr(), held.numel()) == 0, engine.last_failure
        out = held.data_ptr()
    """)
    return ptr, random.Random(seed).randbytes(pages * PAGE)


def test_sglang_pd_decode_registers_its_kv_and_prefill_writes_2048_scattered_pages(pair, engine_child):
    # sglang PD: the decode worker's KV pool (per layer a K and a V buffer,
    # torch CPU tensors allocated before the engine), registered in one
    # batch_register_memory; the prefill worker's one
    # batch_transfer_sync_write of every page it sends, scattered.
    layers, pages = 16, 128
    rx = engine_child(pair[1].socket)
    session = rx.run(RECEIVER)
    got = rx.run(f"""
        kv = [torch.zeros(({pages}, {PAGE}), dtype=torch.uint8) for _ in range({2 * layers})]
        ptrs, lens = [t.data_ptr() for t in kv], [t.numel() for t in kv]
        out = [engine.batch_register_memory(ptrs, lens), ptrs, lens, engine.last_failure and engine.last_failure.message]
    """)
    ret, ptrs, lens, why = got
    assert ret == 0, why
    # The receiver's ferryd lent the pages, at the receiver's addresses.
    regions = [g for g in pair[1].client().regions() if g.get("mooncake_addr") in ptrs]
    assert len(regions) == 2 * layers, regions
    rng = random.Random(30)
    per_tensor = 64
    src, base = source(2 * layers * per_tensor * PAGE, 1)
    expect = [bytearray(pages * PAGE) for _ in range(2 * layers)]
    srcs, dsts, sizes = [], [], []
    for t in range(2 * layers):
        for k, page in enumerate(rng.sample(range(pages), per_tensor)):
            off = (t * per_tensor + k) * PAGE
            srcs.append(base + off)
            dsts.append(ptrs[t] + page * PAGE)
            sizes.append(PAGE)
            expect[t][page * PAGE:(page + 1) * PAGE] = bytes(src[off:off + PAGE])
    order = list(range(len(srcs)))
    rng.shuffle(order)
    assert len(order) >= 2000
    tx = sender(pair)
    assert tx.register_memory(base, len(src)) == 0
    ret = tx.batch_transfer_sync_write(session, [srcs[i] for i in order], [dsts[i] for i in order],
                                       [sizes[i] for i in order])
    assert ret == 0, tx.last_failure
    # 0 means the bytes are in the receiver's memory: no slot, no wait.
    assert rx.run("out = digest(kv)") == digests(expect)
    # Between two ferryd the engine's memory is written over ferry's own
    # peer protocol (the segment's descriptor names the peer port), not
    # Mooncake's wire.
    used = {s["transport"] for s in pair[0].client().sessions() if session in s["id"] or session in s["peer"]}
    assert used == {"tcp"}, pair[0].client().sessions()
    # sglang's metadata (aux) buffers: small CPU tensors, registered too;
    # the prefill writes one request's row of each. Torch allocates them
    # in the window whatever their size (cached_tokens is 1 KiB here).
    aux_rows = 256
    aux = rx.run(f"""
        aux = [torch.zeros(({aux_rows}, w), dtype=d) for w, d in
               ((16, torch.int32), (1, torch.int32), (16, torch.float32), (8, torch.int64))]
        aux_ptrs = [t.data_ptr() for t in aux]
        aux_rows = [t[0].numel() * t.element_size() for t in aux]
        assert engine.batch_register_memory(aux_ptrs, [t.numel() * t.element_size() for t in aux]) == 0, \\
            engine.last_failure
        out = [aux_ptrs, aux_rows]
    """)
    row, (aux_ptrs, aux_lens) = 37, aux
    meta, meta_base = source(sum(aux_lens), 8)
    assert tx.register_memory(meta_base, len(meta)) == 0
    offs = [sum(aux_lens[:i]) for i in range(len(aux_lens))]
    assert tx.batch_transfer_sync_write(session, [meta_base + o for o in offs],
                                        [p + row * n for p, n in zip(aux_ptrs, aux_lens)], aux_lens) == 0, tx.last_failure
    want = [bytearray(aux_rows * n) for n in aux_lens]
    for w, o, n in zip(want, offs, aux_lens):
        w[row * n:(row + 1) * n] = meta[o:o + n]
    assert rx.run("out = digest([t.view(torch.uint8) for t in aux])") == digests(want)
    assert rx.run("out = engine.batch_unregister_memory(ptrs + aux_ptrs)") == 0
    assert not [g for g in pair[1].client().regions() if g.get("mooncake_addr") in ptrs + aux_ptrs]
    assert tx.batch_unregister_memory([base, meta_base]) == 0


def test_sglang_encoder_writes_into_the_receivers_torch_empty(pair, engine_child):
    # sglang's multimodal receiver: register_memory of a torch.empty
    # landing buffer; the encoder's register, transfer_sync_write,
    # unregister; the receiver reads its buffer on the encoder's "done".
    rx = engine_child(pair[1].socket)
    session = rx.run(RECEIVER)
    ptr, nbytes = rx.run("""
        landing = torch.empty((16, 4096), dtype=torch.bfloat16)
        ptr, nbytes = landing.data_ptr(), landing.numel() * landing.element_size()
        assert engine.register_memory(ptr, nbytes) == 0, engine.last_failure
        out = [ptr, nbytes]
    """)
    tx = sender(pair)
    emb, src = source(nbytes, 2)
    assert tx.register_memory(src, nbytes) == 0
    assert tx.transfer_sync_write(session, src, ptr, nbytes) == 0, tx.last_failure
    assert tx.unregister_memory(src) == 0
    assert rx.run("out = digest([landing.view(torch.uint8)])") == digests([bytes(emb)])
    assert rx.run("out = engine.unregister_memory(ptr)") == 0
    # Unregistered: a late write lands nowhere, and says so.
    assert tx.register_memory(src, nbytes) == 0
    assert tx.transfer_sync_write(session, src, ptr, nbytes) == -1
    assert tx.last_failure.ret == "refused" and "does not fit the memory registered" in tx.last_failure.message, tx.last_failure


def test_vllm_producer_and_consumer(pair, engine_child):
    # vLLM's Mooncake connector: the consumer (decode) registers its KV
    # caches (register_kv_caches: batch_register_memory), the producer
    # sends each request's blocks with batch_transfer_sync_write, an
    # empty batch for a request whose blocks the consumer had cached, and
    # tears down with batch_unregister_memory.
    rx = engine_child(pair[1].socket)
    session = rx.run(RECEIVER)
    blocks, block = 64, 16 << 10
    ptrs = rx.run(f"""
        caches = [torch.zeros(({blocks}, {block}), dtype=torch.uint8) for _ in range(4)]
        ptrs = [c.data_ptr() for c in caches]
        assert engine.batch_register_memory(ptrs, [c.numel() for c in caches]) == 0, engine.last_failure
        out = ptrs
    """)
    tx = sender(pair)
    src, base = source(4 * blocks * block, 3)
    assert tx.batch_register_memory([base], [len(src)]) == 0
    expect = [bytearray(blocks * block) for _ in range(4)]
    rng = random.Random(4)
    for request in range(3):
        ids = rng.sample(range(blocks), 8)
        s, d, n = [], [], []
        for c in range(4):
            for b in ids:
                off = (c * blocks + b) * block
                s.append(base + off)
                d.append(ptrs[c] + b * block)
                n.append(block)
                expect[c][b * block:(b + 1) * block] = bytes(src[off:off + block])
        assert tx.batch_transfer_sync_write(session, s, d, n) == 0, tx.last_failure
    assert tx.batch_transfer_sync_write(session, [], [], []) == 0
    assert rx.run("out = digest(caches)") == digests(expect)
    assert rx.run("out = engine.batch_unregister_memory(ptrs)") == 0
    assert tx.batch_unregister_memory([base]) == 0


def test_memory_outside_the_window_is_refused_with_the_fix(pair, engine_child):
    # In a process with the allocator: a small malloc (glibc's: under
    # FERRY_ALLOC_MIN, and not an aligned allocation as torch's tensors
    # are) cannot be lent; without the allocator nothing can
    # (test_mooncake.py).
    rx = engine_child(pair[1].socket)
    rx.run(RECEIVER)
    ret, f = rx.run("""
        import ctypes
        small = ctypes.create_string_buffer(1024)
        ret = engine.register_memory(ctypes.addressof(small), 1024)
        f = engine.last_failure
        out = [ret, [f.method, f.ret, f.message]]
    """)
    assert ret == -1
    assert f[:2] == ["register_memory", "not_writable"], f
    assert "outside ferry's allocator window" in f[2] and "LD_PRELOAD=" in f[2], f
    # A managed buffer is born in the window whatever its size.
    ptr, ret = rx.run("""
        ptr = engine.allocate_managed_buffer(4096)
        out = [ptr, engine.free_managed_buffer(ptr, 4096)]
    """)
    assert ptr != 0 and ret == 0


def test_a_fork_child_is_told_to_start_its_workers_with_spawn(pair, engine_child):
    # vLLM may fork its workers: a fork child's window is private to it,
    # so its host memory cannot be lent, and the refusal says what to do.
    rx = engine_child(pair[1].socket)
    rx.run(RECEIVER)
    ret, why = rx.run("""
        import json, os
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            child = TransferEngine()
            ok = child.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
            t = torch.zeros(1 << 16, dtype=torch.uint8)
            got = [child.register_memory(t.data_ptr(), t.numel()), child.last_failure and child.last_failure.message]
            os.write(w, json.dumps(got if ok else [None, "initialize failed"]).encode())
            os._exit(0)
        os.close(w)
        with os.fdopen(r, "rb") as f:
            data = f.read()
        os.waitpid(pid, 0)
        out = json.loads(data)
    """)
    assert ret == -1, why
    assert "fork child" in why and "spawn" in why and "VLLM_WORKER_MULTIPROC_METHOD=spawn" in why, why


def test_a_receiver_reopened_on_its_rpc_port_takes_writes_again(pair, engine_child):
    # A decode worker restarted on the port it had (its session id the
    # same host:port): the sender's ferryd held the old segment's key, and
    # fetches the new one's on the first refusal, as a Mooncake peer
    # fetches a restarted segment afresh.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    session = f"127.0.0.1:{port}"
    opened = f"""
        import hashlib, torch
        from ferry.mooncake import TransferEngine
        engine = TransferEngine()
        assert engine.initialize("{session}", "P2PHANDSHAKE", "tcp", "") == 0, engine.last_failure
        buf = torch.zeros(1 << 16, dtype=torch.uint8)
        assert engine.register_memory(buf.data_ptr(), buf.numel()) == 0, engine.last_failure
        out = buf.data_ptr()
    """
    tx = sender(pair)
    src, at = source(4096, 13)
    assert tx.register_memory(at, 4096) == 0
    first = engine_child(pair[1].socket)
    assert tx.transfer_sync_write(session, at, first.run(opened), 4096) == 0, tx.last_failure
    first.kill()
    poll_until(lambda: not accepts(session), 30, f"the killed engine's RPC port {session} closing")
    again = engine_child(pair[1].socket)
    ptr = again.run(opened)
    assert tx.transfer_sync_write(session, at, ptr, 4096) == 0, tx.last_failure
    assert again.run("out = hashlib.sha256(buf[:4096].numpy().tobytes()).hexdigest()") == digests([bytes(src)])[0]
    assert tx.unregister_memory(at) == 0


def ferryd_holds(daemon):
    """What ferryd holds for lent memory: its open fds, its mappings of the
    allocator's memfd (ferry_alloc.c names it), and the region byte gauge."""
    fds = len(os.listdir(f"/proc/{daemon.pid}/fd"))
    with open(f"/proc/{daemon.pid}/maps") as f:
        maps = sum(1 for line in f if "memfd:ferry-alloc" in line)
    with daemon.client() as c:
        gauge = next(line for line in c.metrics().splitlines() if line.startswith("ferry_region_host_bytes "))
    return {"fds": fds, "memfd mappings": maps, "ferry_region_host_bytes": float(gauge.split()[1])}


def accepts(session):
    """Whether the session's RPC port accepts a connection."""
    host, port = session.rsplit(":", 1)
    try:
        socket.create_connection((host, int(port)), 5).close()
        return True
    except ConnectionRefusedError:
        return False


def test_a_killed_engines_registrations_are_dropped(start_daemon, engine_child):
    # The process that lent the memory dies (SIGKILL: no teardown): its
    # addresses mean nothing now, and ferryd unregisters what it lent,
    # unmaps it, closes its fds and its RPC port: nothing leaks. A ferryd
    # of its own, so no other test's engine comes or goes meanwhile.
    daemon = start_daemon("kill", "--mooncake-listen", "127.0.0.1:0")
    client = daemon.client()  # its connection is open throughout: in before too
    client.status()
    before = ferryd_holds(daemon)
    rx = engine_child(daemon.socket)
    session = rx.run(RECEIVER)
    ptrs = register_kv(rx, 4, 256)

    def lent():
        return [g for g in client.regions() if g.get("mooncake_addr") in ptrs]

    def segments():
        return [s for s in json.loads(client.request("GET", "/v1/mooncake/segments").body) if s["pid"] == rx.pid]

    assert len(lent()) == 4 and [s["regions"] for s in segments()] == [4]
    held = ferryd_holds(daemon)
    assert held["memfd mappings"] > before["memfd mappings"] and \
        held["ferry_region_host_bytes"] >= before["ferry_region_host_bytes"] + 4 * 256 * PAGE, (before, held)
    assert accepts(session)
    rx.kill()
    poll_until(lambda: not lent() and not segments(), 30, f"ferryd dropping what the killed engine pid {rx.pid} lent")
    assert client.status()["mooncake"]["engines"] == 0
    daemon.wait_log(lambda line: line.get("message") == "engine segment closed: the process that opened it exited"
                    and line.get("pid") == rx.pid and line.get("regions") == 4, 10, "the dropped segment's line")
    poll_until(lambda: ferryd_holds(daemon) == before, 30,
               f"ferryd's fds, memfd mappings and region bytes returning to {before} (now {ferryd_holds(daemon)})")
    poll_until(lambda: not accepts(session), 30, f"the killed engine's RPC port {session} closing")


def reads_through(daemon):
    """How many POST /v1/reads daemon answered."""
    return sum(1 for line in daemon.lines if line.get("message") == "request" and line.get("path") == "/v1/reads")


def test_a_read_sequence_from_the_peers_registered_memory(pair, engine_child):
    # sglang's expert backup and Mooncake's READ: the reader pulls pages
    # from memory a peer engine registered, into its own registered
    # memory; memory the peer did not register (ferryd's arena, its
    # slots) is never served.
    rx = engine_child(pair[1].socket)
    session = rx.run(RECEIVER)
    pages = 64
    ptr, want = register_held(rx, pages, 5)
    before = reads_through(pair[0])
    reader = sender(pair)
    dst, base = source(pages * PAGE, 6)
    assert reader.register_memory(base, len(dst)) == 0
    assert reader.transfer_sync_read(session, base, ptr, PAGE) == 0, reader.last_failure
    assert bytes(dst[:PAGE]) == want[:PAGE]
    order = list(range(1, pages))
    random.Random(7).shuffle(order)
    assert reader.batch_transfer_sync_read(session, [base + i * PAGE for i in order], [ptr + i * PAGE for i in order],
                                           [PAGE] * len(order)) == 0, reader.last_failure
    assert bytes(dst) == want
    assert reader.transfer_sync(session, base, ptr, PAGE, TransferOpcode.READ) == 0
    # Between two ferryd the reads went over ferry's peer protocol, through
    # the reader's ferryd, not over the peer's Mooncake data port.
    poll_until(lambda: reads_through(pair[0]) == before + 3, 10,
               "the reads going through the reader's ferryd (its log's POST /v1/reads lines)")
    # Outside what the peer registered (past it, and straddling its end):
    # refused by the peer's ferryd, naming why; nothing read.
    for at, n in ((ptr + pages * PAGE, PAGE), (ptr + pages * PAGE - 8, 16)):
        assert reader.transfer_sync_read(session, base, at, n) == -1
        assert reader.last_failure.ret == "refused" and "does not fit the memory registered in engine segment" in \
            reader.last_failure.message, reader.last_failure
    assert bytes(dst) == want
    own = pair[1].client().status()["mooncake"]["segment"]  # ferryd's own segment: its arena
    assert reader.transfer_sync_read(own, base, reader.get_first_buffer_address(own), PAGE) == -1, "the arena was read"
    # An engine that asked for rdma never reads a Mooncake segment over
    # TCP: one speaking tcp is -1 naming its protocol. (These ferryd run
    # tcp, which initialize("rdma") refuses: the engine's protocol is set
    # as such an initialize would leave it.)
    reader.protocol = "rdma"
    assert reader.transfer_sync_read(own, base, reader.get_first_buffer_address(own), PAGE) == -1
    assert "the segment speaks 'tcp'" in reader.last_failure.message and "never silently over TCP" in \
        reader.last_failure.message, reader.last_failure
    reader.protocol = "tcp"
    assert reader.unregister_memory(base) == 0
    assert rx.run("out = engine.unregister_memory(held.data_ptr())") == 0


def test_a_reader_started_with_the_allocator_reads_into_its_lent_memory(pair, start_daemon, engine_child):
    # The reading engine's registered memory is lent to its ferryd: the
    # pieces land in its region there (POST /v1/reads with a region; by
    # the NIC itself on the rdma transport), none through the answer.
    rxd = start_daemon("rdm", "--mooncake-listen", "127.0.0.1:0")
    rx = engine_child(pair[1].socket)
    session = rx.run(RECEIVER)
    pages = 64
    ptr, want = register_held(rx, pages, 12)
    reader = engine_child(rxd.socket)
    ret, why, lent, got = reader.run(f"""
        import hashlib, random, torch
        from ferry.mooncake import TransferEngine
        engine = TransferEngine()
        assert engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0, engine.last_failure
        dst = torch.zeros({pages} * {PAGE}, dtype=torch.uint8)
        assert engine.register_memory(dst.data_ptr(), dst.numel()) == 0, engine.last_failure
        order = list(range({pages}))
        random.Random(13).shuffle(order)
        ret = engine.batch_transfer_sync_read({session!r}, [dst.data_ptr() + i * {PAGE} for i in order],
                                              [{ptr} + i * {PAGE} for i in order], [{PAGE}] * {pages})
        out = [ret, engine.last_failure and engine.last_failure.message, len(engine._lent),
               hashlib.sha256(dst.numpy().tobytes()).hexdigest()]
    """)
    assert ret == 0, why
    assert lent == 1, "the reader's registered memory is not lent to its ferryd"
    assert got == hashlib.sha256(want).hexdigest()
    poll_until(lambda: reads_through(rxd) == 1, 10, "the read going through the reader's ferryd")
    assert reader.run("out = engine.close()") == 0


def test_both_halves_started_with_the_allocator(pair, start_daemon, engine_child):
    # The deployment docs/python.md describes: prefill and decode both
    # started with python -m ferry.run. The prefill's registered KV is
    # lent to its ferryd too, so its pages are sent from where they lie:
    # no upload of them through the control socket.
    txd = start_daemon("txm", "--mooncake-listen", "127.0.0.1:0")
    rx = engine_child(pair[1].socket)
    session = rx.run(RECEIVER)
    ptrs = register_kv(rx, 8, 64)
    tx = engine_child(txd.socket)
    sent = tx.run(f"""
        import hashlib, random
        import numpy as np
        from ferry.mooncake import TransferEngine
        engine = TransferEngine()
        assert engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0, engine.last_failure
        src = np.frombuffer(random.Random(9).randbytes(8 * 64 * 4096), dtype=np.uint8).copy()
        assert engine.register_memory(src.ctypes.data, src.nbytes) == 0, engine.last_failure
        rng = random.Random(10)
        pieces = [(t, p) for t in range(8) for p in rng.sample(range(64), 32)]
        ret = engine.batch_transfer_sync_write({session!r}, [src.ctypes.data + (t * 64 + p) * 4096 for t, p in pieces],
                                               [{ptrs!r}[t] + p * 4096 for t, p in pieces], [4096] * len(pieces))
        expect = [bytearray(64 * 4096) for _ in range(8)]
        for t, p in pieces:
            expect[t][p * 4096:(p + 1) * 4096] = src[(t * 64 + p) * 4096:(t * 64 + p + 1) * 4096].tobytes()
        out = [ret, engine.last_failure and engine.last_failure.message, [hashlib.sha256(e).hexdigest() for e in expect]]
    """)
    ret, why, expect = sent
    assert ret == 0, why
    assert rx.run("out = digest(kv)") == expect
    uploads = [line for line in txd.lines if line.get("message") == "request" and line.get("method") == "PUT"]
    assert not uploads, f"the sender's pages went up the control socket: {uploads[:2]}"
    assert tx.run("out = engine.close()") == 0 and rx.run("out = engine.close()") == 0


def mooncake_write(session, pieces):
    """Writes (addr, bytes) pieces into the segment session as a Mooncake
    initiator does (its TCP transport, protocol v2: mooncake/data.go), one
    connection; the status of each write."""
    from ferry.mooncake import _METADATA, _handshake
    desc = _handshake(session, _METADATA, {"name": "mooncake-initiator", "protocol": "tcp", "buffers": []})
    assert desc["protocol"] == "tcp" and desc["tcp_proto_version"] >= 2, desc
    statuses = []
    with socket.create_connection(("127.0.0.1", desc["tcp_data_port"]), 10) as conn:
        conn.settimeout(10)
        for addr, data in pieces:
            conn.sendall(struct.pack("<QQB7x", len(data), addr, 0x81) + data)
            word = b""
            while len(word) < 8:
                chunk = conn.recv(8 - len(word))
                assert chunk, "the data port closed the connection"
                word += chunk
            status = struct.unpack("<Q", word)[0]
            assert status >> 32 == 0x4D435456, hex(status)
            statuses.append(status & 0xFFFFFFFF)
    return statuses


def test_a_mooncake_initiator_writes_into_a_ferry_engines_memory(pair, engine_child):
    # The other half on Mooncake: an initiator speaking Mooncake's TCP
    # wire (what a Mooncake prefill's engine sends) writes scattered pages
    # into the tensors a ferry engine registered, at their addresses; its
    # status says OK once they are in memory, rejected outside them.
    rx = engine_child(pair[1].socket)
    session = rx.run(RECEIVER)
    ptrs = register_kv(rx, 4, 32)
    rng = random.Random(11)
    expect = [bytearray(32 * PAGE) for _ in range(4)]
    pieces = []
    for t in range(4):
        for p in rng.sample(range(32), 16):
            data = rng.randbytes(PAGE)
            expect[t][p * PAGE:(p + 1) * PAGE] = data
            pieces.append((ptrs[t] + p * PAGE, data))
    assert mooncake_write(session, pieces) == [0] * len(pieces)
    assert rx.run("out = digest(kv)") == digests(expect)
    # Running past the highest registered tensor's end: rejected, nothing written.
    assert mooncake_write(session, [(max(ptrs) + 32 * PAGE - 10, b"x" * 20)]) == [1]
    assert rx.run("out = digest(kv)") == digests(expect)
