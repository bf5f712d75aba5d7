#!/usr/bin/env python3
"""The receiving half of sglang's and vLLM's Mooncake paths in GPU memory:
the sequences python/tests/test_mooncake_receivers.py replays in host
memory, here with the receiving engine's memory on a GPU.

  sglang PD      the decode engine's per-layer K and V buffers, allocated
                 before it registers them in one batch_register_memory;
                 the prefill engine's one batch_transfer_sync_write of
                 2,048 scattered 16 KiB pages; batch_unregister_memory.
  sglang encoder the receiver's register_memory of a torch.empty landing
                 buffer; the encoder's register_memory,
                 transfer_sync_write, unregister_memory.
  vLLM           the consumer's KV caches, views of one allocation,
                 registered in one batch; three requests' blocks and an
                 empty batch from the producer; batch_unregister_memory.
  reads          transfer_sync_read, batch_transfer_sync_read and
                 transfer_sync(READ) from memory the peer registered;
                 past its end refused.

Every receiving engine is an engine of its own (its own session id) on
the second ferryd, all of them open until the end, so their session ids
are told apart between live engines; the sending engine (send_only, host
memory) is on the first. A 0 return means the bytes are in the GPU memory: it is read back
with no wait, and must equal what was sent, byte for byte. Memory
unregistered takes no write, and says why.

--memory torch (make test-gpu): torch.cuda tensors on cuda:0.
--memory stand-in (make test): the CUDA driver's calls through ctypes on
whatever libcuda.so.1 the loader finds, as the tests' stand-in driver
gives one (internal/fakecuda); torch is not needed.

usage: mooncake_replays.py [--memory torch|stand-in] SENDER_SOCKET RECEIVER_SOCKET
"""
import argparse
import ctypes
import hashlib
import random
import sys

from ferry.mooncake import TransferEngine, TransferOpcode

PAGE = 16 << 10  # sglang's page and vLLM's block here
SEGMENT = 20 << 20  # torch's caching allocator's segment for tensors of 1-10 MiB


class Torch:
    """torch.cuda tensors, made as the frameworks make theirs."""

    name = "torch.cuda"

    def __init__(self):
        import torch
        self.torch = torch

    def zeros(self, nbytes):
        t = self.torch.zeros(nbytes, dtype=self.torch.uint8, device="cuda:0")
        # The zeroing kernel runs on the stream: done before ferryd (another
        # process) writes into the memory, else it could zero what arrived.
        self.torch.cuda.synchronize()
        return TorchMemory(t)

    def landing(self, rows, cols):
        """sglang's receiver's buffer: torch.empty, bfloat16, never written first."""
        t = self.torch.empty((rows, cols), dtype=self.torch.bfloat16, device="cuda:0")
        return TorchMemory(t.view(self.torch.uint8).reshape(-1))


class TorchMemory:
    def __init__(self, t):
        self.t, self.ptr, self.nbytes = t, t.data_ptr(), t.numel()

    def view(self, off, nbytes):
        return TorchMemory(self.t[off:off + nbytes])

    def fill(self, data):
        import torch
        self.t.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        torch.cuda.synchronize()  # in place before ferryd reads it

    def read(self):
        return self.t.cpu().numpy().tobytes()


class StandIn:
    """Device memory through the driver's own calls, carved as torch's
    caching allocator carves it: tensors of one size class share a
    segment (one cuMemAlloc), so one allocation holds several registered
    ranges."""

    name = "stand-in CUDA driver"

    def __init__(self):
        cu = ctypes.CDLL("libcuda.so.1")
        ctx = ctypes.c_void_p()
        for what, r in (("cuInit", cu.cuInit(0)), ("cuDevicePrimaryCtxRetain", cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), 0)),
                        ("cuCtxSetCurrent", cu.cuCtxSetCurrent(ctx))):
            if r != 0:
                sys.exit(f"FAIL: {what}: CUresult {r}")
        self.cu, self.segment, self.used = cu, None, 0

    def call(self, what, *args):
        if (r := getattr(self.cu, what)(*args)) != 0:
            raise RuntimeError(f"{what}: CUresult {r}")

    def alloc(self, nbytes):
        p = ctypes.c_uint64()
        self.call("cuMemAlloc_v2", ctypes.byref(p), ctypes.c_size_t(nbytes))
        # Copies into it are synchronous, as ferryd asks of its arena.
        self.call("cuPointerSetAttribute", ctypes.byref(ctypes.c_uint(1)), 6, p)
        return StandInMemory(self, p.value, nbytes)

    def zeros(self, nbytes):
        if self.segment is None or self.used + nbytes > SEGMENT:
            self.segment, self.used = self.alloc(SEGMENT), 0
        self.used += nbytes
        return self.segment.view(self.used - nbytes, nbytes)

    def landing(self, rows, cols):
        # A small tensor, past others in its segment: its address is not
        # the allocation's.
        self.zeros(512)
        return self.zeros(rows * cols * 2)


class StandInMemory:
    def __init__(self, gpu, ptr, nbytes):
        self.gpu, self.ptr, self.nbytes = gpu, ptr, nbytes

    def view(self, off, nbytes):
        return StandInMemory(self.gpu, self.ptr + off, nbytes)

    def fill(self, data):
        self.gpu.call("cuMemcpyHtoD_v2", ctypes.c_uint64(self.ptr), bytes(data), ctypes.c_size_t(self.nbytes))

    def read(self):
        out = ctypes.create_string_buffer(self.nbytes)
        self.gpu.call("cuMemcpyDtoH_v2", out, ctypes.c_uint64(self.ptr), ctypes.c_size_t(self.nbytes))
        return out.raw


def source(nbytes, seed):
    """nbytes of seeded random bytes in host memory, and their address."""
    buf = (ctypes.c_char * nbytes).from_buffer_copy(random.Random(seed).randbytes(nbytes))
    return buf, ctypes.addressof(buf)


def ok(ret, engine, what):
    if ret != 0:
        raise AssertionError(f"{what} returned {ret}: {engine.last_failure}")


def same(memories, images, what):
    got = [hashlib.sha256(m.read()).hexdigest() for m in memories]
    want = [hashlib.sha256(bytes(b)).hexdigest() for b in images]
    bad = [i for i, (g, w) in enumerate(zip(got, want)) if g != w]
    if bad:
        raise AssertionError(f"{what}: {len(bad)} of {len(want)} GPU buffers differ from what was sent (first: {bad[0]})")


def refused(tx, session, src, dst):
    """A write into memory no longer registered: -1, naming why."""
    if tx.transfer_sync_write(session, src, dst, PAGE) != -1:
        raise AssertionError(f"a write into unregistered GPU memory at {dst:#x} returned 0")
    f = tx.last_failure
    if f.ret != "refused" or "does not fit the memory registered" not in f.message:
        raise AssertionError(f"a write into unregistered GPU memory failed for another reason: {f}")


class Replays:
    def __init__(self, gpu, tx_socket, rx_socket):
        self.gpu, self.rx_socket, self.sessions, self.receivers = gpu, rx_socket, [], []
        self.tx = TransferEngine(socket_path=tx_socket, send_only=True)
        ok(self.tx.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", ""), self.tx, "the sender's initialize")

    def receiver(self):
        """A receiving engine of its own, and its session id; it stays open
        until close_receivers, so the ids compared are live engines'."""
        rx = TransferEngine(socket_path=self.rx_socket)
        ok(rx.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", ""), rx, "the receiver's initialize")
        session = f"127.0.0.1:{rx.get_rpc_port()}"
        if session in self.sessions:
            raise AssertionError(f"two open engines were given one session id, {session}")
        self.sessions.append(session)
        self.receivers.append(rx)
        return rx, session

    def close_receivers(self):
        for rx in self.receivers:
            ok(rx.close(), rx, "a receiver's close")

    def sglang_pd(self):
        layers, pages, per_tensor = 16, 128, 64
        rx, session = self.receiver()
        kv = [self.gpu.zeros(pages * PAGE) for _ in range(2 * layers)]
        ok(rx.batch_register_memory([t.ptr for t in kv], [t.nbytes for t in kv]), rx, "batch_register_memory of K and V")
        rng = random.Random(30)
        src, base = source(2 * layers * per_tensor * PAGE, 1)
        expect = [bytearray(pages * PAGE) for _ in kv]
        pieces = []
        for t in range(2 * layers):
            for k, page in enumerate(rng.sample(range(pages), per_tensor)):
                off = (t * per_tensor + k) * PAGE
                pieces.append((base + off, kv[t].ptr + page * PAGE))
                expect[t][page * PAGE:(page + 1) * PAGE] = src[off:off + PAGE]
        rng.shuffle(pieces)
        ok(self.tx.register_memory(base, len(src)), self.tx, "the prefill's register_memory")
        ok(self.tx.batch_transfer_sync_write(session, [s for s, _ in pieces], [d for _, d in pieces], [PAGE] * len(pieces)),
           self.tx, "the prefill's batch_transfer_sync_write")
        same(kv, expect, "sglang PD")
        ok(rx.batch_unregister_memory([t.ptr for t in kv]), rx, "batch_unregister_memory of K and V")
        refused(self.tx, session, base, kv[0].ptr)
        ok(self.tx.unregister_memory(base), self.tx, "the prefill's unregister_memory")
        return f"sglang-pd tensors={len(kv)} pages={len(pieces)} page={PAGE} one_batch=true"

    def sglang_encoder(self):
        rx, session = self.receiver()
        landing = self.gpu.landing(16, 4096)
        ok(rx.register_memory(landing.ptr, landing.nbytes), rx, "the receiver's register_memory")
        emb, src = source(landing.nbytes, 2)
        ok(self.tx.register_memory(src, len(emb)), self.tx, "the encoder's register_memory")
        ok(self.tx.transfer_sync_write(session, src, landing.ptr, len(emb)), self.tx, "the encoder's transfer_sync_write")
        ok(self.tx.unregister_memory(src), self.tx, "the encoder's unregister_memory")
        same([landing], [emb], "sglang encoder")
        ok(rx.unregister_memory(landing.ptr), rx, "the receiver's unregister_memory")
        ok(self.tx.register_memory(src, len(emb)), self.tx, "register_memory")
        refused(self.tx, session, src, landing.ptr)
        ok(self.tx.unregister_memory(src), self.tx, "unregister_memory")
        return f"sglang-encoder nbytes={len(emb)} landing=torch.empty"

    def vllm(self):
        rx, session = self.receiver()
        blocks = 64
        pool = self.gpu.zeros(4 * blocks * PAGE)
        caches = [pool.view(c * blocks * PAGE, blocks * PAGE) for c in range(4)]
        ok(rx.batch_register_memory([c.ptr for c in caches], [c.nbytes for c in caches]), rx, "register_kv_caches")
        src, base = source(4 * blocks * PAGE, 3)
        ok(self.tx.batch_register_memory([base], [len(src)]), self.tx, "the producer's batch_register_memory")
        expect = [bytearray(blocks * PAGE) for _ in caches]
        rng = random.Random(4)
        sent = 0
        for _ in range(3):
            ids = rng.sample(range(blocks), 8)
            s, d = [], []
            for c in range(4):
                for b in ids:
                    off = (c * blocks + b) * PAGE
                    s.append(base + off)
                    d.append(caches[c].ptr + b * PAGE)
                    expect[c][b * PAGE:(b + 1) * PAGE] = src[off:off + PAGE]
            ok(self.tx.batch_transfer_sync_write(session, s, d, [PAGE] * len(s)), self.tx, "a request's blocks")
            sent += len(s)
        ok(self.tx.batch_transfer_sync_write(session, [], [], []), self.tx, "the empty batch")
        same(caches, expect, "vLLM")
        ok(rx.batch_unregister_memory([c.ptr for c in caches]), rx, "batch_unregister_memory")
        ok(self.tx.batch_unregister_memory([base]), self.tx, "the producer's batch_unregister_memory")
        return f"vllm caches=4 requests=3 blocks={sent} block={PAGE} empty_batch=0"

    def reads(self):
        rx, session = self.receiver()
        pages = 64
        want = random.Random(5).randbytes(pages * PAGE)
        held = self.gpu.zeros(pages * PAGE)
        held.fill(want)
        ok(rx.register_memory(held.ptr, held.nbytes), rx, "register_memory of the held pages")
        dst, base = source(pages * PAGE, 6)
        ok(self.tx.register_memory(base, len(dst)), self.tx, "the reader's register_memory")
        ok(self.tx.transfer_sync_read(session, base, held.ptr, PAGE), self.tx, "transfer_sync_read")
        order = list(range(1, pages))
        random.Random(7).shuffle(order)
        ok(self.tx.batch_transfer_sync_read(session, [base + i * PAGE for i in order], [held.ptr + i * PAGE for i in order],
                                            [PAGE] * len(order)), self.tx, "batch_transfer_sync_read")
        ok(self.tx.transfer_sync(session, base, held.ptr, PAGE, TransferOpcode.READ), self.tx, "transfer_sync(READ)")
        if bytes(dst) != want:
            raise AssertionError("reads: the pages read differ from the GPU memory they were read from")
        if self.tx.transfer_sync_read(session, base, held.ptr + held.nbytes - 8, 16) != -1:
            raise AssertionError("a read running past the registered GPU memory returned 0")
        ok(self.tx.unregister_memory(base), self.tx, "the reader's unregister_memory")
        ok(rx.unregister_memory(held.ptr), rx, "unregister_memory of the held pages")
        return f"reads pages={pages} page={PAGE} past_the_end=refused"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--memory", choices=("torch", "stand-in"), default="torch")
    ap.add_argument("sender_socket")
    ap.add_argument("receiver_socket")
    args = ap.parse_args()
    gpu = Torch() if args.memory == "torch" else StandIn()
    replays = Replays(gpu, args.sender_socket, args.receiver_socket)
    for run in (replays.sglang_pd, replays.sglang_encoder, replays.vllm, replays.reads):
        print(f"== REPLAY {run()} memory={gpu.name} byte_exact=true", flush=True)
    print(f"{len(replays.sessions)} receiving engines open at once, {len(set(replays.sessions))} session ids")
    replays.close_receivers()
    ok(replays.tx.close(), replays.tx, "the sender's close")
    print("PASS")


if __name__ == "__main__":
    main()
