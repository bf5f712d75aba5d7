#!/usr/bin/env python3
"""torch's host<->device copy bandwidth, the reference for ferry's copies.

Same sizes and the same method as ferry's BenchmarkCopy: pinned host memory
to and from device memory, one synchronous copy at a time, for about a
second per size and direction. Prints lines the test-gpu script reads:
    torch HtoD 4MiB 24.31 GB/s
"""
import time

import torch

MiB = 1 << 20
SIZES = [4, 64, 256]


def bandwidth(copy, n):
    copy()  # warm up
    torch.cuda.synchronize()
    iters, elapsed = 0, 0.0
    start = time.perf_counter()
    while elapsed < 1.0:
        copy()
        torch.cuda.synchronize()
        iters += 1
        elapsed = time.perf_counter() - start
    return n * iters / elapsed / 1e9


def main():
    dev = torch.device("cuda:0")
    for size in SIZES:
        n = size * MiB
        host = torch.empty(n, dtype=torch.uint8, pin_memory=True)
        devbuf = torch.empty(n, dtype=torch.uint8, device=dev)
        print(f"torch HtoD {size}MiB {bandwidth(lambda: devbuf.copy_(host), n):.2f} GB/s", flush=True)
        print(f"torch DtoH {size}MiB {bandwidth(lambda: host.copy_(devbuf), n):.2f} GB/s", flush=True)


if __name__ == "__main__":
    main()
