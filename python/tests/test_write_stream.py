"""Writes of a region's range on a write stream (Client.write_region,
POST /v1/writes/stream) between two real ferryd, the engine's single
transfer_sync_write of lent memory going that way, and a stream's bad
frames refused with the daemon serving on."""

import random
import socket
import struct
import time

import pytest

import ferry
from ferry.client import Slot


def _upgrade(socket_path):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(30)
    s.connect(socket_path)
    s.sendall(b"POST /v1/writes/stream HTTP/1.1\r\nHost: ferryd\r\nContent-Length: 0\r\n"
              b"Connection: Upgrade\r\nUpgrade: ferry-writes/1\r\n\r\n")
    head = b""
    while not head.endswith(b"\r\n\r\n"):
        head += s.recv(1)
    assert head.startswith(b"HTTP/1.1 101 "), head
    return s


def _answer(s):
    head = b""
    while len(head) < 6:
        got = s.recv(6 - len(head))
        if not got:
            return None, b""
        head += got
    status, n = struct.unpack("<HI", head)
    body = b""
    while len(body) < n:
        body += s.recv(n - len(body))
    return status, body


def test_write_region_lands_byte_exact_and_keeps_one_stream(tx, rx, req_id):
    region = tx.register_region(f"ws-{req_id}", 256 << 10)
    data = random.Random(5).randbytes(256 << 10)
    region.view()[:] = data
    try:
        slot = rx.receive(req_id, 128 << 10)
        tx.write_region(slot, region.name, 64 << 10, 128 << 10)
        assert rx.wait(req_id, 10) == data[64 << 10:192 << 10]
        rx.free(req_id)

        mc = rx.receive(req_id + "-mc", 256 << 10, mooncake=True)
        for at in range(0, 256 << 10, 64 << 10):  # one call at a time, each at its own place
            tx.write_region(Slot(session="mooncake://" + mc.mooncake_session, buffer_address=mc.buffer_address + at),
                            region.name, at, 64 << 10)
        assert rx.wait(req_id + "-mc", 10) == data
        rx.free(req_id + "-mc")
        assert len(tx._transport._streams) == 1  # kept, and reused

        # A well-formed frame's error is raised; the stream goes on.
        slot = rx.receive(req_id, 64 << 10)
        with pytest.raises(ferry.NotFound, match="no region named nope"):
            tx.write_region(slot, "nope", 0, 64 << 10)
        with pytest.raises(ferry.BadRequest, match="passes its end"):
            tx.write_region(slot, region.name, 200 << 10, 64 << 10)
        tx.write_region(slot, region.name, 0, 64 << 10)
        assert rx.wait(req_id, 10) == data[:64 << 10]
        rx.free(req_id)
    finally:
        region.unregister()


def test_a_kept_stream_ferryd_closed_is_replaced_unseen(tx, rx, req_id):
    # A stream ferryd has closed (here after a malformed frame), taken
    # again from the pool within _FRESH, unlooked-at: the frame finds it
    # closed with no byte of answer, and goes again on a fresh stream.
    closed = _upgrade(tx.socket_path)
    closed.sendall(struct.pack("<I", 3) + b"abc")
    assert _answer(closed)[0] == 400 and closed.recv(1) == b""
    region = tx.register_region(f"ws-{req_id}", 64 << 10)
    try:
        slot = rx.receive(req_id, 64 << 10)
        tx._transport._streams.append((closed, time.monotonic()))
        tx.write_region(slot, region.name, 0, 64 << 10)
        assert rx.wait(req_id, 10) == bytes(64 << 10)
        rx.free(req_id)
    finally:
        region.unregister()


@pytest.mark.parametrize("frame", [
    struct.pack("<I", 1 << 30),                                  # a length past any frame
    struct.pack("<I", 3) + b"abc",                               # shorter than a frame's fixed part
    struct.pack("<IQQQQHHH", 38 + 4, 0, 1, 1, 0, 999, 0, 0) + b"abcd",  # names that do not fill it
], ids=["too-long", "too-short", "names"])
def test_a_malformed_frame_is_refused_and_the_stream_closed(tx, frame):
    s = _upgrade(tx.socket_path)
    try:
        s.sendall(frame)
        status, body = _answer(s)
        assert status == 400, (status, body)
        assert b'"bad_request"' in body and b"the stream is closed: open another" in body
        assert s.recv(1) == b""  # closed after the answer
    finally:
        s.close()
    assert tx.status()["transport"]  # ferryd serves on


def test_bytes_before_the_upgrade_answer_are_refused(tx):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(30)
    s.connect(tx.socket_path)
    try:
        s.sendall(b"POST /v1/writes/stream HTTP/1.1\r\nHost: ferryd\r\nContent-Length: 0\r\n"
                  b"Connection: Upgrade\r\nUpgrade: ferry-writes/1\r\n\r\n" + struct.pack("<I", 40))
        got = b""
        while (b := s.recv(4096)):
            got += b
        assert got.startswith(b"HTTP/1.1 400 "), got
    finally:
        s.close()
    with pytest.raises(ferry.BadRequest, match="Upgrade: ferry-writes/1"):
        tx.request("POST", "/v1/writes/stream")


def test_an_engines_single_write_of_lent_memory_goes_on_a_stream(pair, engine_child):
    # Both engines under ferry's allocator (python -m ferry.run): the
    # sender's registered memory is lent, so its transfer_sync_write is a
    # frame on a write stream; every byte lands in the receiver's memory.
    rx = engine_child(pair[1].socket)
    session, ptr = rx.run("""
        import ctypes
        from ferry.mooncake import TransferEngine
        engine = TransferEngine()
        assert engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0, engine.last_failure
        landing = ctypes.create_string_buffer(1 << 20)
        assert engine.register_memory(ctypes.addressof(landing), 1 << 20) == 0, engine.last_failure
        out = [f"127.0.0.1:{engine.get_rpc_port()}", ctypes.addressof(landing)]
    """)
    snd = engine_child(pair[0].socket)
    digest = snd.run(f"""
        import ctypes, hashlib, random
        from ferry.mooncake import TransferEngine
        engine = TransferEngine(send_only=True)  # its ferryd serves no Mooncake segment: lent as a source only
        assert engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0, engine.last_failure
        data = random.Random(9).randbytes(1 << 20)
        src = ctypes.create_string_buffer(data, 1 << 20)
        assert engine.register_memory(ctypes.addressof(src), 1 << 20) == 0, engine.last_failure
        for at in range(0, 1 << 20, 64 << 10):
            assert engine.transfer_sync_write({session!r}, ctypes.addressof(src) + at, {ptr} + at, 64 << 10) == 0, engine.last_failure
        assert len(engine._client._transport._streams) == 1, "not on a write stream"
        # A write past the receiver's memory fails with -1 and says why.
        assert engine.transfer_sync_write({session!r}, ctypes.addressof(src), {ptr} + (1 << 20), 64 << 10) == -1
        out = [hashlib.sha256(data).hexdigest(), engine.last_failure.ret, engine.last_failure.message]
    """)
    assert rx.run("import hashlib; out = hashlib.sha256(landing.raw).hexdigest()") == digest[0]
    assert digest[1] == "refused", digest
