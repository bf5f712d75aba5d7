#!/usr/bin/env python3
"""GPU regions through the ferry Python client (make test-gpu).

Two CUDA tensors of this process are lent as regions by their IPC
handles: one to the sending ferryd, one to the receiving ferryd. A batch
of scattered 64 KiB pieces moves from the first into a receive slot over
the second; the tensors are compared on the GPU. Neither arena holds a
byte of it.

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
    print("PASS")


if __name__ == "__main__":
    main()
