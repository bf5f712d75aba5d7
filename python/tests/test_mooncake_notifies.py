"""Mooncake notifies between ferry engines: a transfer_sync or
batch_transfer_sync with a notify sends it once its bytes are in, through
two real ferryd, to the receiving engine's segment, whose get_notifies()
returns it once, in Mooncake's shape; a segment that keeps no more
refuses it, and the sender's call says so."""

import ctypes
import hashlib
import random

import pytest

from ferry.mooncake import TransferEngine, TransferNotify, TransferOpcode, _handshake

NBYTES = 1 << 20

RECEIVER = f"""
    import ctypes, hashlib, random
    from ferry.mooncake import TransferEngine
    engine = TransferEngine()
    assert engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0, engine.last_failure
    buf = (ctypes.c_char * {NBYTES}).from_buffer_copy(random.Random(2).randbytes({NBYTES}))
    assert engine.register_memory(ctypes.addressof(buf), {NBYTES}) == 0, engine.last_failure
    out = [f"127.0.0.1:{{engine.get_rpc_port()}}", ctypes.addressof(buf)]
"""

NOTIFIES = "out = [[n.name, n.msg] for n in engine.get_notifies()]"


@pytest.fixture
def peers(pair, engine_child):
    """A sending engine in this process (on the sender ferryd) with a
    registered source, and a receiving engine's process (on the receiver
    ferryd) with registered memory: (engine, source address, receiver,
    its session, its buffer's address)."""
    engine = TransferEngine(socket_path=pair[0].socket, send_only=True)
    assert engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0, engine.last_failure
    src = (ctypes.c_char * NBYTES).from_buffer_copy(random.Random(1).randbytes(NBYTES))
    assert engine.register_memory(ctypes.addressof(src), NBYTES) == 0, engine.last_failure
    rx = engine_child(pair[1].socket)
    session, dst = rx.run(RECEIVER)
    yield engine, ctypes.addressof(src), rx, session, dst
    engine.close()


def test_a_transfers_notify_reaches_the_receivers_get_notifies(peers):
    engine, src, rx, session, dst = peers
    half = NBYTES // 2
    assert engine.transfer_sync(session, src, dst, half, TransferOpcode.WRITE, TransferNotify("prefill-0", "req-1")) == 0
    # The bytes are in when the notify is: the receiver sees both.
    want = random.Random(1).randbytes(half) + random.Random(2).randbytes(NBYTES)[half:]
    assert rx.run("out = hashlib.sha256(bytes(buf)).hexdigest()") == hashlib.sha256(want).hexdigest()
    assert engine.batch_transfer_sync(session, [src + half], [dst + half], [half], TransferOpcode.WRITE,
                                      notify=TransferNotify("prefill-0", "req-2")) == 0
    # A read's notify goes to the segment read from; an empty batch's too.
    assert engine.batch_transfer_sync(session, [src], [dst], [4096], TransferOpcode.READ,
                                      notify=TransferNotify("prefill-0", "read")) == 0
    assert engine.batch_transfer_sync(session, [], [], [], TransferOpcode.WRITE, notify=TransferNotify("x", "")) == 0
    assert rx.run(NOTIFIES) == [["prefill-0", "req-1"], ["prefill-0", "req-2"], ["prefill-0", "read"], ["x", ""]]
    assert rx.run(NOTIFIES) == []  # taken once
    # Without a notify nothing is sent; the sender's own segment got none.
    assert engine.transfer_sync(session, src, dst, 4096, TransferOpcode.WRITE) == 0
    assert rx.run(NOTIFIES) == [] and engine.get_notifies() == []


def test_a_full_segment_refuses_a_notify_and_the_sender_says_so(peers):
    engine, src, rx, session, dst = peers
    # 1024 notifies unread (Mooncake's handshake, from this process), the
    # most a segment keeps.
    for i in range(1024):
        assert _handshake(session, 2, {"name": "filler", "notify_msg": str(i)}) == {"name": "", "notify_msg": "success"}
    reply = _handshake(session, 2, {"name": "filler", "notify_msg": "one more"})
    assert reply["notify_msg"] == "" and "keeps at most 1024" in reply["error"]
    assert engine.transfer_sync(session, src, dst, 4096, TransferOpcode.WRITE, TransferNotify("prefill-0", "late")) == -1
    failure = engine.last_failure
    assert failure.ret == "refused" and "the transfer completed, but its notify was not delivered" in failure.message
    assert "keeps at most 1024" in failure.message
    got = rx.run(NOTIFIES)
    assert len(got) == 1024 and got[0] == ["filler", "0"] and got[-1] == ["filler", "1023"]
    # Drained, it keeps notifies again.
    assert engine.transfer_sync(session, src, dst, 4096, TransferOpcode.WRITE, TransferNotify("prefill-0", "again")) == 0
    assert rx.run(NOTIFIES) == [["prefill-0", "again"]]


def test_bad_notifies_are_refused_before_any_byte_moves(peers):
    engine, src, rx, session, dst = peers
    assert engine.transfer_sync(session, src, dst, 4096, TransferOpcode.WRITE, ("name", "msg")) == -1
    assert "want a TransferNotify(name, msg)" in engine.last_failure.message
    assert rx.run("out = hashlib.sha256(bytes(buf)).hexdigest()") == hashlib.sha256(random.Random(2).randbytes(NBYTES)).hexdigest()
    # Past what one notify may carry: the bytes go, the notify does not.
    assert engine.transfer_sync(session, src, dst, 4096, TransferOpcode.WRITE, TransferNotify("n", "m" * (16 << 10))) == -1
    assert engine.last_failure.ret == "too_large" and "a notify may have" in engine.last_failure.message
    assert rx.run(NOTIFIES) == []
    # A port that is no Mooncake segment's: not delivered.
    assert engine.batch_transfer_sync("127.0.0.1:1", [], [], [], TransferOpcode.WRITE, TransferNotify("n", "m")) == -1
    assert engine.last_failure.ret == "transfer_failed"


def test_get_notifies_before_initialize_is_empty(pair):
    assert TransferEngine(socket_path=pair[1].socket).get_notifies() == []
