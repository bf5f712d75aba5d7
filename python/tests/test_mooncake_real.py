"""ferry.mooncake.TransferEngine against a real Mooncake Transfer Engine
(Mooncake's own Python module, built from its sources), over TCP, both
ways: a real engine writes into and reads from memory a ferry engine
registered, and a ferry engine writes into and reads from memory a real
engine registered, and each one's notify reaches the other's
get_notifies(). Every byte is checked where it landed.

Opt-in: a real Mooncake build is a 15-minute compile that CI does not
carry. `make test-mooncake-real MOONCAKE_PY=dir` runs it, dir holding
mooncake/engine.cpython-*.so (and libasio.so) as
scripts/mooncake-build.sh leaves them; without MOONCAKE_PY these tests
skip, and that target refuses to run.

The same tests run over RDMA in the soft-RoCE VM (`make
test-mooncake-real-rdma MOONCAKE_PY=dir`: test/rxevm/run.sh with
RXEVM_MOONCAKE_PY), FERRY_TEST_MOONCAKE_PROTOCOL=rdma: the real engines
on rxe0 (Mooncake's RDMA transport: its engine installs RDMA wherever it
finds a device, whatever the protocol argument says), ferryd on
--transport rdma over rxe1."""

import hashlib
import os
import random
import re

import pytest

from test_mooncake_api import MOONCAKE_SIGNATURES, ferry_params, same_params, split
import ferry.mooncake as mc

MOONCAKE_PY = os.environ.get("FERRY_TEST_MOONCAKE_PY")
pytestmark = pytest.mark.skipif(not MOONCAKE_PY, reason="no real Mooncake build: make test-mooncake-real MOONCAKE_PY=dir")

PROTOCOL = os.environ.get("FERRY_TEST_MOONCAKE_PROTOCOL", "tcp")
REAL_NIC, FERRY_NIC = ("rxe0", "rxe1") if PROTOCOL == "rdma" else ("", "")

PAGE = 16 << 10
PAGES = 64

# A process running Mooncake's own engine: plain Python, Mooncake's module
# first on the path, nothing of ferry's preloaded.
REAL = """
    import ctypes, hashlib, random
    from mooncake.engine import TransferEngine
    engine = TransferEngine()
    assert engine.initialize("127.0.0.1", "P2PHANDSHAKE", {protocol!r}, {nic!r}) == 0
    session = f"127.0.0.1:{{engine.get_rpc_port()}}"
    out = session
""".format(protocol=PROTOCOL, nic=REAL_NIC)

# A process running ferry's engine under ferry's allocator.
FERRY = """
    import ctypes, hashlib, random
    from ferry.mooncake import TransferEngine
    engine = TransferEngine()
    assert engine.initialize("127.0.0.1", "P2PHANDSHAKE", {protocol!r}, {nic!r}) == 0, engine.last_failure
    session = f"127.0.0.1:{{engine.get_rpc_port()}}"
    out = session
""".format(protocol=PROTOCOL, nic=FERRY_NIC)

# Both kinds: nbytes in a ctypes buffer named name, registered; its address.
BUFFER = """
    {name} = (ctypes.c_char * {nbytes}).from_buffer_copy(random.Random({seed}).randbytes({nbytes}))
    assert engine.register_memory(ctypes.addressof({name}), {nbytes}) == 0
    out = ctypes.addressof({name})
"""

DIGEST = "out = hashlib.sha256(bytes({name})).hexdigest()"


if PROTOCOL == "rdma":
    from conftest import Daemon

    @pytest.fixture(scope="module")
    def pair(tmp_path_factory):
        """conftest's pair on ferryd's rdma transport. Only the receiver
        serves these tests (the real engines reach no ferryd): both."""
        # A 16 MiB arena (a slot here takes 1 MiB): ferryd starts sooner
        # under the VM's emulation.
        rx = Daemon(tmp_path_factory.mktemp("pair"), "rx", "--mooncake-listen", "127.0.0.1:0",
                    "--transport", "rdma", "--rdma-device", FERRY_NIC, "--arena-size", "16MiB")
        yield rx, rx
        rx.stop()


def engines(pair, engine_child):
    """A real Mooncake engine's process and a ferry engine's (on the
    receiving ferryd), each with its session id."""
    real = engine_child(pair[0].socket, preload=False, env={"PYTHONPATH": MOONCAKE_PY})
    ferry = engine_child(pair[1].socket)
    return real, real.run(REAL), ferry, ferry.run(FERRY)


def scattered(seed):
    """PAGES page moves: (source page, destination page), the destination
    order shuffled, as a KV transfer's pages are."""
    dst = list(range(PAGES))
    random.Random(seed).shuffle(dst)
    return list(enumerate(dst))


def expected(src_seed, dst_seed, moves):
    """The destination buffer after moves of pages from src into dst."""
    src = random.Random(src_seed).randbytes(PAGES * PAGE)
    dst = bytearray(random.Random(dst_seed).randbytes(PAGES * PAGE))
    for s, d in moves:
        dst[d * PAGE:(d + 1) * PAGE] = src[s * PAGE:(s + 1) * PAGE]
    return hashlib.sha256(bytes(dst)).hexdigest()


def move(initiator, remote_session, local_addr, remote_addr, moves, op):
    """The initiator's one batch of page moves against remote_session:
    write (local pages into remote ones) or read (remote into local)."""
    locals_ = [local_addr + s * PAGE for s, _ in moves]
    remotes = [remote_addr + d * PAGE for _, d in moves]
    return initiator.run(f"out = engine.batch_transfer_sync_{op}({remote_session!r}, {locals_!r}, {remotes!r}, {[PAGE] * len(moves)!r})")


@pytest.mark.parametrize("writer", ["real", "ferry"])
def test_writes_between_a_real_mooncake_engine_and_a_ferry_engine(pair, engine_child, writer):
    real, real_session, ferry, ferry_session = engines(pair, engine_child)
    src, dst = (real, ferry) if writer == "real" else (ferry, real)
    dst_session = ferry_session if writer == "real" else real_session
    src_addr = src.run(BUFFER.format(name="src", nbytes=PAGES * PAGE, seed=1))
    dst_addr = dst.run(BUFFER.format(name="dst", nbytes=PAGES * PAGE, seed=2))
    moves = scattered(3)
    assert move(src, dst_session, src_addr, dst_addr, moves, "write") == 0
    # The initiator's 0 means every byte is in the receiver's memory.
    assert dst.run(DIGEST.format(name="dst")) == expected(1, 2, moves)
    if writer == "ferry":
        # ferryd reached the real engine over Mooncake's wire on the
        # protocol asked for.
        with pair[1].client() as c:
            assert {s["transport"] for s in c.sessions() if real_session in s["peer"]} == {f"mooncake-{PROTOCOL}"}


@pytest.mark.parametrize("reader", ["real", "ferry"])
def test_reads_between_a_real_mooncake_engine_and_a_ferry_engine(pair, engine_child, reader):
    real, real_session, ferry, ferry_session = engines(pair, engine_child)
    local, remote = (real, ferry) if reader == "real" else (ferry, real)
    remote_session = ferry_session if reader == "real" else real_session
    local_addr = local.run(BUFFER.format(name="buf", nbytes=PAGES * PAGE, seed=4))
    remote_addr = remote.run(BUFFER.format(name="buf", nbytes=PAGES * PAGE, seed=5))
    moves = scattered(6)  # local page s takes remote page d
    assert move(local, remote_session, local_addr, remote_addr, moves, "read") == 0
    want = bytearray(random.Random(4).randbytes(PAGES * PAGE))
    theirs = random.Random(5).randbytes(PAGES * PAGE)
    for s, d in moves:
        want[s * PAGE:(s + 1) * PAGE] = theirs[d * PAGE:(d + 1) * PAGE]
    assert local.run(DIGEST.format(name="buf")) == hashlib.sha256(bytes(want)).hexdigest()
    assert remote.run(DIGEST.format(name="buf")) == hashlib.sha256(random.Random(5).randbytes(PAGES * PAGE)).hexdigest()
    if reader == "ferry":
        # A piece running past the real engine's buffer is refused before
        # anything is read, naming why.
        ret, code, why = local.run(f"""
            ret = engine.transfer_sync_read({remote_session!r}, {local_addr}, {remote_addr + PAGES * PAGE - 8}, 16)
            out = [ret, engine.last_failure.ret, engine.last_failure.message]
        """)
        assert (ret, code) == (-1, "refused") and "lies in none of" in why, why
    if reader == "ferry" and PROTOCOL == "rdma":
        # ferry's engine on rdma read the real engine through its ferryd,
        # by RDMA READs on ferryd's Mooncake endpoint (over tcp it reads
        # from its own process over the real engine's TCP data port).
        with pair[1].client() as c:
            assert {s["transport"] for s in c.sessions() if real_session in s["peer"]} == {"mooncake-rdma"}


def test_a_real_engine_writing_outside_a_ferry_engines_memory_is_refused(pair, engine_child):
    real, _, ferry, ferry_session = engines(pair, engine_child)
    src_addr = real.run(BUFFER.format(name="src", nbytes=PAGES * PAGE, seed=7))
    dst_addr = ferry.run(BUFFER.format(name="dst", nbytes=PAGES * PAGE, seed=8))
    # A page whose second half lies past the registered buffer's end.
    rc = real.run(f"out = engine.transfer_sync_write({ferry_session!r}, {src_addr}, {dst_addr + PAGES * PAGE - PAGE // 2}, {PAGE})")
    assert rc != 0
    want = bytearray(random.Random(8).randbytes(PAGES * PAGE))
    if PROTOCOL == "rdma":
        # Mooncake's RDMA transport cuts a write at the end of the target's
        # buffer (rdma_transport.cpp, SliceLengthCalculator): the half
        # inside is a write of its own, into registered memory, and lands;
        # the rest lies in no buffer and fails at the initiator.
        want[-(PAGE // 2):] = random.Random(7).randbytes(PAGES * PAGE)[:PAGE // 2]
    assert ferry.run(DIGEST.format(name="dst")) == hashlib.sha256(bytes(want)).hexdigest()


def test_a_real_engine_writes_into_a_ferry_receive_slot(pair, engine_child, rx, req_id):
    # A slot made for Mooncake peers on the ferryd that serves a segment
    # (--mooncake-listen): a real engine's pages, covering it, make it
    # arrive, byte-exact.
    real = engine_child(pair[0].socket, preload=False, env={"PYTHONPATH": MOONCAKE_PY})
    real.run(REAL)
    slot = rx.receive(req_id, PAGES * PAGE, mooncake=True)
    src = real.run(BUFFER.format(name="src", nbytes=PAGES * PAGE, seed=9))
    moves = scattered(10)  # every page of the slot, in shuffled order
    session = slot.mooncake_session.removeprefix("mooncake://")
    assert move(real, session, src, slot.buffer_address, moves, "write") == 0
    if PROTOCOL == "rdma":
        # One-sided writes raise no event at the receiver: its client
        # says they are in, as a framework's "done" message would.
        rx.complete(req_id)
    assert hashlib.sha256(rx.wait(req_id, 30)).hexdigest() == expected(9, 0, moves)
    rx.free(req_id)


@pytest.mark.parametrize("sender", ["real", "ferry"])
def test_notifies_between_a_real_mooncake_engine_and_a_ferry_engine(pair, engine_child, sender):
    # Mooncake's batch_transfer_sync with a notify, either way: the notify
    # reaches the receiving engine's get_notifies() once the bytes are in,
    # each once, in Mooncake's shape (TransferNotify: name, msg).
    real, real_session, ferry, ferry_session = engines(pair, engine_child)
    src, dst = (real, ferry) if sender == "real" else (ferry, real)
    dst_session = ferry_session if sender == "real" else real_session
    module = "mooncake.engine" if sender == "real" else "ferry.mooncake"
    opcode = "TransferOpcode.Write"  # Mooncake's spelling, ferry's too
    src_addr = src.run(BUFFER.format(name="src", nbytes=PAGES * PAGE, seed=11))
    dst_addr = dst.run(BUFFER.format(name="dst", nbytes=PAGES * PAGE, seed=12))
    moves = scattered(13)
    locals_ = [src_addr + s * PAGE for s, _ in moves]
    remotes = [dst_addr + d * PAGE for _, d in moves]
    for i, msg in enumerate(["req-1 done", "req-2 done"]):
        part = slice(i * PAGES // 2, (i + 1) * PAGES // 2)
        assert src.run(f"""
            from {module} import TransferNotify, TransferOpcode
            out = engine.batch_transfer_sync({dst_session!r}, {locals_[part]!r}, {remotes[part]!r}, {[PAGE] * (PAGES // 2)!r},
                                             {opcode}, TransferNotify({sender!r}, {msg!r}))
        """) == 0
    assert dst.run(DIGEST.format(name="dst")) == expected(11, 12, moves)
    notifies = "out = [[n.name, n.msg] for n in engine.get_notifies()]"
    assert dst.run(notifies) == [[sender, "req-1 done"], [sender, "req-2 done"]]
    assert dst.run(notifies) == []
    assert src.run(notifies) == []


def test_a_real_engine_writing_into_a_slot_not_open_to_mooncake_is_refused(pair, engine_child, rx, req_id):
    # ferryd's own segment lists its arena, but only slots made with
    # mooncake=True take a Mooncake peer's writes: one aimed at a slot made
    # without fails, and the slot never arrives (over rdma the write is
    # one-sided: a 0 would mean its bytes were placed in the arena).
    real = engine_child(pair[0].socket, preload=False, env={"PYTHONPATH": MOONCAKE_PY})
    real.run(REAL)
    session = rx.receive(req_id + "-mc", PAGE, mooncake=True).mooncake_session.removeprefix("mooncake://")
    slot = rx.receive(req_id, PAGES * PAGE)
    src = real.run(BUFFER.format(name="src", nbytes=PAGES * PAGE, seed=11))
    assert move(real, session, src, slot.buffer_address, scattered(12), "write") != 0
    assert not rx.slot_info(req_id)["arrived"]
    rx.free(req_id)
    rx.free(req_id + "-mc")


# What Mooncake's module says of itself: each method's signature line
# (pybind's docstring), its opcodes and the names it exports.
SURFACE = """
    import ctypes
    import mooncake.engine as m
    out = {
        "methods": {n: getattr(m.TransferEngine, n).__doc__.split("\\n")[0] for n in dir(m.TransferEngine)
                    if not n.startswith("_") and n != "TransferOpcode"},
        "opcodes": {n: int(v) for n, v in m.TransferOpcode.__members__.items()},
        "module": {n: int(getattr(m, n)) for n in ("Read", "Write")},
        "nested": m.TransferEngine.TransferOpcode is m.TransferOpcode,
    }
    try:
        m.TransferEngine().read_bytes_from_buffer(ctypes.addressof(ctypes.create_string_buffer(8)), -1)
    except Exception as e:
        out["negative_read"] = type(e).__name__
"""


def pybind_params(line):
    """A pybind signature line's parameters, self left out, in
    MOONCAKE_SIGNATURES' form ("_" for an unnamed argN)."""
    inner = line[line.index("(") + 1:line.rindex(") -> ")]
    params, depth, cur = [], 0, ""
    for ch in inner + ",":
        if ch == "," and depth == 0:
            params.append(cur.strip())
            cur = ""
            continue
        depth += (ch == "[") - (ch == "]")
        cur += ch
    out = []
    for p in params[1:]:
        name, _, rest = p.partition(": ")
        default = rest.partition(" = ")[2]
        out.append("_" if re.fullmatch(r"arg\d+", name) else f"{name}={default}" if default else name)
    return out


def test_ferrys_surface_is_a_real_builds(pair, engine_child):
    # Every method of the real build is in the list the always-run test
    # checks ferry against (test_mooncake_api.py), with the parameters
    # the build states, and ferry's are the same; the opcodes and their
    # names are Mooncake's.
    real = engine_child(pair[0].socket, preload=False, env={"PYTHONPATH": MOONCAKE_PY})
    got = real.run(SURFACE)
    for name, line in got["methods"].items():
        assert name in MOONCAKE_SIGNATURES, f"the real build has {line}, which the list lacks"
        assert pybind_params(line) == split(MOONCAKE_SIGNATURES[name]), line
        if name not in mc._NOT_IMPLEMENTED:
            assert same_params(name, ferry_params(name), pybind_params(line)), (line, ferry_params(name))
    assert got["opcodes"] == {"Read": 0, "Write": 1} == {n: int(mc.TransferOpcode[n]) for n in ("Read", "Write")}
    assert got["module"] == {"Read": 0, "Write": 1} == {"Read": int(mc.Read), "Write": int(mc.Write)}
    assert got["nested"] and mc.TransferEngine.TransferOpcode is mc.TransferOpcode
    # A negative length: TypeError from both (test_mooncake_api.py).
    assert got.get("negative_read") == "TypeError", got


def test_a_ferry_engine_takes_mooncakes_own_opcodes(pair, engine_child):
    # A framework that still imports Mooncake's enum passes its values:
    # ferry's engine takes them as its own (an unregistered buffer is what
    # fails), and a positional transport_hint too.
    both = os.pathsep.join(p for p in (MOONCAKE_PY, os.environ.get("PYTHONPATH")) if p)
    child = engine_child(pair[1].socket, preload=False, env={"PYTHONPATH": both})
    got = child.run("""
        import mooncake.engine as m
        from ferry.mooncake import TransferEngine
        engine = TransferEngine()
        out = []
        for op in (m.TransferOpcode.Write, m.TransferOpcode.Read, m.Write, m.Read):
            out.append([engine.transfer_sync("127.0.0.1:1", 1, 2, 3, op, None, ""), engine.last_failure.message])
            bid = engine.batch_transfer_async("127.0.0.1:1", [1], [2], [3], op, "")
            out.append([engine.get_batch_transfer_status([bid]) if bid else 0, engine.last_failure.message])
    """)
    assert len(got) == 8 and all(ret == -1 and "register_memory it first" in why for ret, why in got), got
