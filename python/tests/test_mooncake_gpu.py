"""The receiving half of sglang's and vLLM's Mooncake paths in GPU memory,
on the stand-in CUDA driver (internal/fakecuda/testdata/fakecuda.c, whose
"device memory" is host memory reached only through its calls): the
receiving engine's process allocates with cuMemAlloc_v2, registers two
tensors of one allocation (as the caching allocator's segments hold many),
and peers write into them at its addresses through a ferryd with a GPU
arena, which opened the allocation by its IPC handle. Every byte is read
back through the driver (cuMemcpyDtoH_v2). make test-gpu runs the same
on a GPU with torch.cuda tensors (scripts/gpu/torch_mooncake.py)."""

import json
import random
import shutil
import subprocess

import pytest

from conftest import REPO, poll_until
from test_mooncake_receivers import PAGE, digests, mooncake_write, sender, source

pytestmark = pytest.mark.skipif(shutil.which("gcc") is None, reason="gcc builds the stand-in CUDA driver (make deps installs it)")


@pytest.fixture(scope="module")
def fakecuda(tmp_path_factory):
    """The directory of the stand-in libcuda.so.1."""
    lib = tmp_path_factory.mktemp("fakecuda")
    subprocess.run(["gcc", "-shared", "-fPIC", "-Wl,-soname,libcuda.so.1", "-o", str(lib / "libcuda.so.1"),
                    str(REPO / "internal" / "fakecuda" / "testdata" / "fakecuda.c")], check=True, timeout=120)
    return {"LD_LIBRARY_PATH": str(lib)}


@pytest.fixture
def gpu_pair(pair, start_daemon, fakecuda):
    """pair's sender ferryd, and a receiving ferryd with its arena on the
    stand-in GPU and a Mooncake segment."""
    rxd = start_daemon("gpurx", "--device", "cuda:0", "--bounce-size", "1MiB", "--mooncake-listen", "127.0.0.1:0",
                       env=fakecuda)
    assert rxd.client().status()["memory"]["kind"] == "cuda"
    return pair[0], rxd


# The receiving engine's process: its GPU memory through the driver, and
# a tensor as torch.cuda would give one (data_ptr, is_cuda).
GPU_RECEIVER = """
    import ctypes, hashlib
    from ferry.mooncake import TransferEngine
    cu = ctypes.CDLL("libcuda.so.1")
    assert cu.cuInit(0) == 0
    ctx = ctypes.c_void_p()
    assert cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), 0) == 0 and cu.cuCtxSetCurrent(ctx) == 0
    def alloc(n, how="cuMemAlloc_v2"):
        p = ctypes.c_uint64()
        args = (ctypes.byref(p), ctypes.c_size_t(n)) + ((ctypes.c_void_p(),) if how == "cuMemAllocAsync" else ())
        assert getattr(cu, how)(*args) == 0
        return p.value
    def device_bytes(p, n):
        out = ctypes.create_string_buffer(n)
        assert cu.cuMemcpyDtoH_v2(out, ctypes.c_uint64(p), ctypes.c_size_t(n)) == 0
        return out.raw
    class CudaTensor:
        is_cuda = True
        def __init__(self, p, n):
            self.p, self.n = p, n
        def data_ptr(self):
            return self.p
    engine = TransferEngine()
    assert engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0, engine.last_failure
    out = f"127.0.0.1:{engine.get_rpc_port()}"
"""


def test_gpu_memory_an_engine_registers_is_where_peers_write(gpu_pair, engine_child, fakecuda):
    txd, rxd = gpu_pair
    pages = 64
    rx = engine_child(rxd.socket, preload=False, env=fakecuda)
    session = rx.run(GPU_RECEIVER)
    # K and V: two tensors of one allocation, a page apart, registered in
    # one batch_register_memory as torch.cuda tensors.
    ptrs = rx.run(f"""
        base = alloc({2 * pages + 1} * {PAGE})
        kv = [CudaTensor(base, {pages * PAGE}), CudaTensor(base + {(pages + 1) * PAGE}, {pages * PAGE})]
        assert engine.batch_register_memory(kv, [t.n for t in kv]) == 0, engine.last_failure
        out = [t.p for t in kv]
    """)
    lent = [g for g in rxd.client().regions() if g.get("mooncake_addr") in ptrs]
    assert sorted(g["mooncake_addr"] for g in lent) == ptrs and {g["kind"] for g in lent} == {"cuda"}, lent
    # The prefill side's one batch of scattered pages, over ferry's peer
    # protocol between the two ferryd.
    rng = random.Random(31)
    src, at = source(2 * pages * PAGE, 32)
    expect = [bytearray(pages * PAGE) for _ in range(2)]
    srcs, dsts = [], []
    for t in range(2):
        for k, page in enumerate(rng.sample(range(pages), pages // 2)):
            off = (t * pages + k) * PAGE
            srcs.append(at + off)
            dsts.append(ptrs[t] + page * PAGE)
            expect[t][page * PAGE:(page + 1) * PAGE] = bytes(src[off:off + PAGE])
    order = list(range(len(srcs)))
    rng.shuffle(order)
    tx = sender((txd,))
    assert tx.register_memory(at, len(src)) == 0
    assert tx.batch_transfer_sync_write(session, [srcs[i] for i in order], [dsts[i] for i in order],
                                        [PAGE] * len(order)) == 0, tx.last_failure
    # 0: the bytes are in the receiver's GPU memory.
    assert rx.run(f"out = [hashlib.sha256(device_bytes(t.p, {pages * PAGE})).hexdigest() for t in kv]") == digests(expect)
    # A Mooncake initiator (its TCP wire) writes into V too.
    pieces = []
    for page in rng.sample(range(pages), 8):
        data = rng.randbytes(PAGE)
        expect[1][page * PAGE:(page + 1) * PAGE] = data
        pieces.append((ptrs[1] + page * PAGE, data))
    assert mooncake_write(session, pieces) == [0] * len(pieces)
    assert rx.run(f"out = [hashlib.sha256(device_bytes(t.p, {pages * PAGE})).hexdigest() for t in kv]") == digests(expect)
    # Reads are served from the GPU memory.
    dst, dat = source(pages * PAGE, 33)
    assert tx.register_memory(dat, len(dst)) == 0
    order = list(range(pages))
    rng.shuffle(order)
    assert tx.batch_transfer_sync_read(session, [dat + i * PAGE for i in order], [ptrs[0] + i * PAGE for i in order],
                                       [PAGE] * pages) == 0, tx.last_failure
    assert bytes(dst) == bytes(expect[0])
    # K unregistered: a write into it lands nowhere, and says so; V still takes them.
    assert rx.run("out = engine.unregister_memory(kv[0])") == 0
    assert tx.transfer_sync_write(session, at, ptrs[0], PAGE) == -1
    assert tx.last_failure.ret == "refused" and "does not fit the memory registered" in tx.last_failure.message, tx.last_failure
    assert tx.transfer_sync_write(session, at, ptrs[1], PAGE) == 0, tx.last_failure
    # The engine's process exits: ferryd drops its segment and V's region.
    client = rxd.client()

    def left():
        segs = [s for s in json.loads(client.request("GET", "/v1/mooncake/segments").body) if s["pid"] == rx.pid]
        return segs + [g for g in client.regions() if g.get("mooncake_addr") in ptrs]

    assert len(left()) == 2
    rx.kill()
    poll_until(lambda: not left(), 30, f"ferryd dropping what the exited engine pid {rx.pid} lent")
    assert tx.batch_unregister_memory([at, dat]) == 0


def test_gpu_memory_with_no_ipc_handle_is_refused_with_the_reason(gpu_pair, engine_child, fakecuda):
    _, rxd = gpu_pair
    rx = engine_child(rxd.socket, preload=False, env=fakecuda)
    rx.run(GPU_RECEIVER)
    ret, f = rx.run("""
        p = alloc(1 << 20, "cuMemAllocAsync")
        ret = engine.register_memory(p, 1 << 20)
        f = engine.last_failure
        out = [ret, [f.method, f.ret, f.message]]
    """)
    assert ret == -1
    assert f[:2] == ["register_memory", "not_writable"], f
    assert "cuIpcGetMemHandle" in f[2] and "cudaMallocAsync" in f[2], f
    assert not [g for g in rxd.client().regions() if g["kind"] == "cuda"]
