#!/usr/bin/env python3
"""The receiving half of sglang's and vLLM's Mooncake paths in GPU memory
(make test-gpu).

The decode side's engine registers two torch.cuda tensors that are views
of one allocation (as the caching allocator's segments hold many
tensors), one by one; a prefill-side engine writes scattered pages of
host memory into them with one batch_transfer_sync_write, between the
two ferryd over ferry's peer protocol, and reads pages back with
batch_transfer_sync_read. A 0 return means the bytes are in the
tensors: they are compared on the GPU with no wait. Unregistered, the
memory takes no write.

usage: torch_mooncake.py SENDER_SOCKET RECEIVER_SOCKET
"""
import random
import sys

import torch

from ferry.mooncake import TransferEngine


def main():
    page, pages = 16 << 10, 256
    pool = torch.zeros(2 * pages * page + page, dtype=torch.uint8, device="cuda:0")
    k, v = pool[:pages * page], pool[(pages + 1) * page:]
    torch.cuda.synchronize()
    rx = TransferEngine(socket_path=sys.argv[2])
    assert rx.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0, rx.last_failure
    session = f"127.0.0.1:{rx.get_rpc_port()}"
    assert rx.batch_register_memory([k.data_ptr(), v.data_ptr()], [k.numel(), v.numel()]) == 0, rx.last_failure

    tx = TransferEngine(socket_path=sys.argv[1], send_only=True)
    assert tx.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0, tx.last_failure
    src = torch.randint(0, 256, (2 * pages * page,), dtype=torch.uint8)
    assert tx.register_memory(src.data_ptr(), src.numel()) == 0, tx.last_failure
    rng = random.Random(30)
    want = [torch.zeros_like(k), torch.zeros_like(v)]
    pieces = []
    for t, dst in enumerate((k, v)):
        for i, p in enumerate(rng.sample(range(pages), pages // 2)):
            off = (t * pages + i) * page
            pieces.append((src.data_ptr() + off, dst.data_ptr() + p * page))
            want[t][p * page:(p + 1) * page] = src[off:off + page].to("cuda:0")
    rng.shuffle(pieces)
    ret = tx.batch_transfer_sync_write(session, [s for s, _ in pieces], [d for _, d in pieces], [page] * len(pieces))
    assert ret == 0, tx.last_failure
    if not (torch.equal(k, want[0]) and torch.equal(v, want[1])):
        sys.exit("FAIL: the registered tensors differ from the pages written into them")
    print(f"{len(pieces)} scattered pages of {page} bytes landed in two tensors of one allocation")

    back = torch.zeros(pages * page, dtype=torch.uint8)
    assert tx.register_memory(back.data_ptr(), back.numel()) == 0, tx.last_failure
    order = list(range(pages))
    rng.shuffle(order)
    ret = tx.batch_transfer_sync_read(session, [back.data_ptr() + i * page for i in order],
                                      [v.data_ptr() + i * page for i in order], [page] * pages)
    assert ret == 0, tx.last_failure
    if not torch.equal(back, v.cpu()):
        sys.exit("FAIL: the pages read from the registered tensor differ from it")

    assert rx.batch_unregister_memory([k.data_ptr(), v.data_ptr()]) == 0, rx.last_failure
    if tx.transfer_sync_write(session, src.data_ptr(), k.data_ptr(), page) != -1:
        sys.exit("FAIL: a write into unregistered GPU memory returned 0")
    assert tx.close() == 0 and rx.close() == 0
    print("PASS")


if __name__ == "__main__":
    main()
