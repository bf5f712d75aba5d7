"""Two real Mooncake engines (Mooncake's own Python module) over
soft-RoCE, in the VM (run.sh with RXEVM_MOONCAKE_PY): one on rxe0 writes
scattered pages into the other's registered memory on rxe1 and reads them
back, byte-exact. Mooncake's RDMA on rxe with nothing of ferry's in the
path, so that a failure of ferry's tests against it after this one is
ferry's.

python3 mooncake_pair.py: the writer, which starts the target (this
file, argument "target") and ends it; prints one "== MOONCAKE" line."""

import ctypes
import hashlib
import json
import os
import random
import subprocess
import sys

# run.sh puts this file beside ferry's python/tests (/opt/python).
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "tests"))
from test_mooncake_real import PAGE, PAGES, expected, scattered  # noqa: E402

from mooncake.engine import TransferEngine  # noqa: E402


def engine(nic, seed):
    """A real engine on nic (P2P handshake, Mooncake's RDMA transport) and
    a registered buffer of seeded random pages."""
    e = TransferEngine()
    if e.initialize("127.0.0.1", "P2PHANDSHAKE", "rdma", nic) != 0:
        sys.exit(f"a real Mooncake engine on {nic}: initialize failed (its log is above)")
    buf = (ctypes.c_char * (PAGES * PAGE)).from_buffer_copy(random.Random(seed).randbytes(PAGES * PAGE))
    if e.register_memory(ctypes.addressof(buf), PAGES * PAGE) != 0:
        sys.exit(f"a real Mooncake engine on {nic}: register_memory failed")
    return e, buf


def digest(buf):
    return hashlib.sha256(bytes(buf)).hexdigest()


if sys.argv[1:] == ["target"]:
    e, buf = engine("rxe1", 2)
    print(json.dumps({"session": f"127.0.0.1:{e.get_rpc_port()}", "addr": ctypes.addressof(buf)}), flush=True)
    # Each line the writer sends asks for the buffer's digest; its end
    # (the writer gone, by design or killed) ends this process.
    for _ in sys.stdin:
        print(digest(buf), flush=True)
    sys.exit(0)

target = subprocess.Popen([sys.executable, os.path.abspath(__file__), "target"],
                          stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
try:
    line = target.stdout.readline()
    if not line:
        sys.exit(f"the target engine (pid {target.pid}) exited ({target.wait()}) before its session")
    peer = json.loads(line)
    e, src = engine("rxe0", 1)
    base = ctypes.addressof(src)
    moves = scattered(3)
    rc = e.batch_transfer_sync_write(peer["session"], [base + s * PAGE for s, _ in moves],
                                     [peer["addr"] + d * PAGE for _, d in moves], [PAGE] * PAGES)
    target.stdin.write("digest\n")
    target.stdin.flush()
    written = rc == 0 and target.stdout.readline().strip() == expected(1, 2, moves)
    # Read each page back from where it went, into a zeroed buffer
    # registered beside src: it must equal src.
    back = (ctypes.c_char * (PAGES * PAGE))()
    assert e.register_memory(ctypes.addressof(back), PAGES * PAGE) == 0
    rc_read = e.batch_transfer_sync_read(peer["session"], [ctypes.addressof(back) + s * PAGE for s, _ in moves],
                                         [peer["addr"] + d * PAGE for _, d in moves], [PAGE] * PAGES)
    read = rc_read == 0 and digest(back) == digest(src)
    print(f"== MOONCAKE real rdma real-to-real write={'byte-exact' if written else f'FAILED (rc {rc})'} "
          f"read={'byte-exact' if read else f'FAILED (rc {rc_read})'} ({PAGES} scattered {PAGE >> 10} KiB pages, "
          "a real engine on rxe0 into another's registered memory on rxe1 and back)", flush=True)
    sys.exit(0 if written and read else 1)
finally:
    target.stdin.close()
    target.wait(30)
