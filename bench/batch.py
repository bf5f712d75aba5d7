#!/usr/bin/env python3
"""Times batch transfers through the Python client, for ferrybench batch
--python: the same scattered items, the same daemons and source as its Go
turns, printed as {"samples_us": [...]} (one per batch: the transfer and
its wait; the receive slot is made and freed untimed, as in Go)."""

import argparse
import json
import os
import time

import ferry


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--from", dest="src_socket", required=True)
    ap.add_argument("--to", dest="dst_socket", required=True)
    ap.add_argument("--source", required=True, help="the staged req_id the items read")
    ap.add_argument("--item-size", type=int, required=True)
    ap.add_argument("--batch", type=int, required=True)
    ap.add_argument("--seconds", type=float, default=1.0)
    ap.add_argument("--iterations", type=int, default=0)
    a = ap.parse_args()
    tx, rx = ferry.Client(a.src_socket), ferry.Client(a.dst_socket)
    n, sz = a.batch, a.item_size
    items = [(0, i * sz, 0, (n - 1 - i) * sz, sz) for i in range(n)]
    samples, spent, i = [], 0.0, 0
    while (a.iterations and i < a.iterations) or (not a.iterations and spent < a.seconds):
        req_id = f"fbpy{os.getpid()}-{n}-{i}"
        slot = rx.receive(req_id, n * sz)
        t0 = time.perf_counter()
        t = tx.transfer_sync([a.source], [slot], items, timeout=60, keep_sources=True)
        took = time.perf_counter() - t0
        if t["writes"] != n:
            raise SystemExit(f"batch.py: {n} scattered items became {t['writes']} writes")
        rx.free(req_id)
        samples.append(took * 1e6)
        spent += took
        i += 1
    print(json.dumps({"samples_us": samples}))


if __name__ == "__main__":
    main()
