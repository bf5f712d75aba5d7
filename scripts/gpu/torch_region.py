#!/usr/bin/env python3
"""GPU regions through the ferry Python client (make test-gpu).

Two CUDA tensors of this process are lent as regions by their IPC
handles: one to the sending ferryd, one to the receiving ferryd. A batch
of scattered 64 KiB pieces moves from the first into a receive slot over
the second; the tensors are compared on the GPU. Neither arena holds a
byte of it. Then ferry.mooncake.TransferEngine sends a tensor the same
way (register_memory lends it as a region) into a slot the receiver
opened to Mooncake senders.

usage: torch_region.py SENDER_SOCKET RECEIVER_SOCKET
"""
import sys

import torch

import ferry


def main():
    tx, rx = ferry.Client(sys.argv[1]), ferry.Client(sys.argv[2])
    n, page = 16 << 20, 64 << 10
    src = torch.randint(0, 256, (n,), dtype=torch.uint8, device="cuda:0")
    dst = torch.zeros(n, dtype=torch.uint8, device="cuda:0")
    torch.cuda.synchronize()
    with tx.register_cuda_region("torch-src", src) as s, rx.register_cuda_region("torch-dst", dst) as d:
        slot = rx.receive("torch-region", n, region=d)
        pages = n // page
        items = [(0, i * page, 0, (pages - 1 - i) * page, page) for i in range(pages)]
        t = tx.transfer_sync([s], [slot], items, timeout=60)
        print(f"transfer {t['transfer_id']}: {t['items']} items, {t['writes']} writes, {t['ms']:.1f} ms")
        want = src.view(pages, page).flip(0).reshape(-1)
        if not torch.equal(dst, want):
            sys.exit("FAIL: the receiver's tensor differs from the pieces sent")
        used = (tx.status()["memory"]["used"], rx.status()["memory"]["used"])
        if used != (0, 0):
            sys.exit(f"FAIL: the arenas hold {used} bytes: a region transfer went through them")
        rx.free("torch-region")

    # The Mooncake engine's calls on GPU memory: register_memory lends the
    # tensor as a region, transfer_sync_write sends it with no copy into a
    # slot the receiver opened to Mooncake senders.
    from ferry.mooncake import TransferEngine
    engine = TransferEngine(raise_on_failure=True, socket_path=sys.argv[1], send_only=True)
    engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "")
    src2 = torch.randint(0, 256, (n,), dtype=torch.uint8, device="cuda:0")
    torch.cuda.synchronize()
    assert engine.register_memory(src2.data_ptr(), n) == 0
    slot = rx.receive("torch-mooncake", n, mooncake=True)
    assert engine.transfer_sync_write(slot.mooncake_session, src2.data_ptr(), slot.buffer_address, n) == 0
    got = torch.frombuffer(bytearray(rx.wait("torch-mooncake", 30)), dtype=torch.uint8).to("cuda:0")
    if not torch.equal(got, src2):
        sys.exit("FAIL: the Mooncake engine's write from GPU memory arrived different")
    if tx.status()["memory"]["used"] != 0:
        sys.exit("FAIL: the Mooncake engine's GPU write went through the sender's arena")
    assert engine.unregister_memory(src2.data_ptr()) == 0
    rx.free("torch-mooncake")
    print("PASS")


if __name__ == "__main__":
    main()
