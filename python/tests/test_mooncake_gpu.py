"""The receiving half of sglang's and vLLM's Mooncake paths in GPU memory,
on the stand-in CUDA driver (internal/fakecuda/testdata/fakecuda.c, whose
"device memory" is host memory reached only through its calls): the
receiving engine's process allocates with cuMemAlloc_v2, registers
tensors carved from one allocation (as the caching allocator's segments
hold many), and peers write into them at its addresses through a ferryd
with a GPU arena, which opened the allocation by its IPC handle. Every
byte is read back through the driver (cuMemcpyDtoH_v2).

The frameworks' sequences are scripts/gpu/mooncake_replays.py's, run here
with --memory stand-in; make test-gpu runs that script on a GPU with
torch.cuda tensors."""

import hashlib
import json
import os
import random
import shutil
import subprocess
import sys

import pytest

from conftest import REPO, pattern, poll_until
from test_mooncake_receivers import PAGE, digests

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


def test_the_frameworks_sequences_in_gpu_memory(gpu_pair, fakecuda):
    # sglang PD (2,048 scattered pages into per-layer K and V), sglang's
    # encoder and receiver, vLLM's producer and consumer, and reads, each
    # receiving engine an engine of its own with its memory on the GPU.
    txd, rxd = gpu_pair
    script = REPO / "scripts" / "gpu" / "mooncake_replays.py"
    env = dict(os.environ, PYTHONPATH=str(REPO / "python"), **fakecuda)
    run = subprocess.run([sys.executable, str(script), "--memory", "stand-in", txd.socket, rxd.socket],
                         env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and run.stdout.endswith("PASS\n"), run.stdout + run.stderr
    replays = [line.split()[2] for line in run.stdout.splitlines() if line.startswith("== REPLAY ")]
    assert replays == ["sglang-pd", "sglang-encoder", "vllm", "reads"], run.stdout
    assert "pages=2048 " in run.stdout and "4 receiving engines open at once, 4 session ids" in run.stdout, run.stdout
    # They were open at once, ferryd's log says (its lines up to a mark
    # made now hold every open and close), so the ids were told apart
    # between live engines.
    n, live, most = rxd.mark(), 0, 0
    for line in rxd.lines[:n]:
        message = line.get("message", "")
        live += (message == "engine segment opened") - message.startswith("engine segment closed")
        most = max(most, live)
    assert (most, live) == (4, 0), (most, live)
    # Every receiving engine closed: nothing of theirs is left in ferryd.
    assert not [g for g in rxd.client().regions() if g["kind"] == "cuda"]


def test_a_mooncake_peer_writes_and_reads_gpu_memory_and_an_exited_engines_is_dropped(gpu_pair, engine_child, fakecuda,
                                                                                        mcpeer):
    # The other half on Mooncake (test/mcpeer, its TCP wire): its WRITEs
    # land in two tensors of one allocation a ferry engine registered,
    # and its READs are served from them.
    _, rxd = gpu_pair
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
    order = [(t, p) for t in range(2) for p in random.Random(31).sample(range(pages), 32)]
    random.Random(32).shuffle(order)
    peer = mcpeer(1 << 20)
    assert peer.write(session, "gpu", [[ptrs[t] + p * PAGE, PAGE] for t, p in order]) is None
    sent = pattern("gpu", len(order) * PAGE)
    expect = [bytearray(pages * PAGE) for _ in range(2)]
    for i, (t, p) in enumerate(order):
        expect[t][p * PAGE:(p + 1) * PAGE] = sent[i * PAGE:(i + 1) * PAGE]
    # Its OK status means the bytes are in the GPU memory.
    assert rx.run(f"out = [hashlib.sha256(device_bytes(t.p, {pages * PAGE})).hexdigest() for t in kv]") == digests(expect)
    back = list(reversed(order))
    assert peer.read(session, [[ptrs[t] + p * PAGE, PAGE] for t, p in back]) == \
        [hashlib.sha256(expect[t][p * PAGE:(p + 1) * PAGE]).hexdigest() for t, p in back]
    # The page between K and V is not registered: rejected both ways.
    assert "rejected" in peer.read(session, [[ptrs[0] + pages * PAGE, PAGE]])
    assert "rejected" in (peer.write(session, "gap", [[ptrs[0] + pages * PAGE, PAGE]]) or "")
    # The engine's process exits: ferryd drops its segment and both regions.
    client = rxd.client()

    def left():
        segs = [s for s in json.loads(client.request("GET", "/v1/mooncake/segments").body) if s["pid"] == rx.pid]
        return segs + [g for g in client.regions() if g.get("mooncake_addr") in ptrs]

    assert len(left()) == 3
    rx.kill()
    poll_until(lambda: not left(), 30, f"ferryd dropping what the exited engine pid {rx.pid} lent")


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
