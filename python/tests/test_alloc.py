"""ferry's preload allocator (libferry_alloc.so, ferry.alloc): each test runs
a Python child under LD_PRELOAD (python -m ferry.run) that checks from the
inside and prints one JSON line; the child is ended by its PID on a
deadline."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

import ferry.alloc

CHILD_TIMEOUT = 240  # a child's torch import took a minute on a busy host


def run_child(code, preload=True, env=None):
    """Runs code in a fresh interpreter (with the preload unless told not)
    and returns the JSON its last line printed."""
    if preload and not os.path.exists(ferry.alloc.LIBRARY):
        pytest.fail(f"{ferry.alloc.LIBRARY} is missing: make alloc")
    argv = [sys.executable, "-m", "ferry.run", "-c", code] if preload else [sys.executable, "-c", code]
    environ = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "FERRY_ALLOC_MIN")}
    environ.update(env or {})
    proc = subprocess.Popen(argv, env=environ, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        out, err = proc.communicate(timeout=CHILD_TIMEOUT)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        pytest.fail(f"the child pid {proc.pid} ran past {CHILD_TIMEOUT} s")
    if proc.returncode != 0:
        pytest.fail(f"the child exited {proc.returncode}:\n{err.decode(errors='replace')}")
    return json.loads(out.decode().strip().splitlines()[-1])


PRELUDE = textwrap.dedent("""
    import ctypes, json, os, sys, threading
    import ferry.alloc
    w = ferry.alloc.window()
    def inside(addr, n=1):
        return w is not None and w.holds(addr, n)
    libc = ctypes.CDLL(None)   # malloc and its family, as ferry's allocator serves them
    libc.malloc.restype = libc.calloc.restype = libc.realloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = [ctypes.c_size_t]
    libc.calloc.argtypes = [ctypes.c_size_t, ctypes.c_size_t]
    libc.realloc.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
""")


def test_torch_and_numpy_allocations_are_born_in_the_window():
    got = run_child(PRELUDE + textwrap.dedent("""
        import numpy as np, torch
        t = torch.empty((64, 4096), dtype=torch.float32)     # c10: posix_memalign
        z = torch.zeros(1 << 20, dtype=torch.uint8)
        a = np.empty(1 << 20, dtype=np.uint8)                # malloc
        c = np.zeros(1 << 20, dtype=np.uint8)                # calloc
        small = np.empty(16 << 10, dtype=np.uint8)
        print(json.dumps({"window": w is not None, "torch": inside(t.data_ptr(), t.numel() * 4),
                          "zeros": inside(z.data_ptr()) and int(z.sum()) == 0,
                          "numpy": inside(a.ctypes.data, a.nbytes), "calloc": inside(c.ctypes.data) and int(c.sum()) == 0,
                          "small": inside(small.ctypes.data), "threshold": ferry.alloc.stats()[2]}))
    """))
    assert got == {"window": True, "torch": True, "zeros": True, "numpy": True, "calloc": True, "small": False,
                   "threshold": 64 << 10}, got


def test_small_torch_tensors_are_born_in_the_window_and_their_blocks_reused():
    # torch's CPU allocator (posix_memalign) at any size: sglang's
    # per-request metadata buffers are a few KiB or less, and registered as
    # its KV is. Under 2 KiB they share slab pages, each block aligned to
    # its power-of-two size; a freed block is given out again.
    got = run_child(PRELUDE + textwrap.dedent("""
        import torch
        sizes = [1, 7, 64, 65, 1000, 2048, 2049, 4096]
        ts = [torch.full((n,), k, dtype=torch.uint8) for k, n in enumerate(sizes)]
        ptrs = [t.data_ptr() for t in ts]
        intact = all(bool((t == k).all()) for k, t in enumerate(ts))
        freed = ptrs[4]
        del ts[4]
        again = torch.zeros(1000, dtype=torch.uint8).data_ptr()
        def block(n):  # its slab's block size, or a page
            b = 64
            while b < n:
                b <<= 1
            return b if b <= 2048 else 4096
        print(json.dumps({"inside": [inside(p, n) for p, n in zip(ptrs, sizes)], "intact": intact,
                          "aligned": [p % block(n) == 0 for p, n in zip(ptrs, sizes)],
                          "distinct": len(set(ptrs)) == len(ptrs), "reused": again == freed}))
    """))
    assert got == {"inside": [True] * 8, "intact": True, "aligned": [True] * 8, "distinct": True, "reused": True}, got


def test_without_the_preload_there_is_no_window():
    got = run_child("import json, ferry.alloc; print(json.dumps([ferry.alloc.window() is None, ferry.alloc.stats()]))",
                    preload=False)
    assert got == [True, None]


def test_free_returns_the_pages():
    got = run_child(PRELUDE + textwrap.dedent("""
        import numpy as np
        def held():
            return os.fstat(w.fd).st_blocks * 512
        a = np.ones(64 << 20, dtype=np.uint8)   # touched: 64 MiB of pages in the memfd
        during, stats = held(), ferry.alloc.stats()
        del a
        print(json.dumps({"returned": during - held(), "bytes": stats[0] - ferry.alloc.stats()[0]}))
    """))
    assert got["returned"] >= 64 << 20, got    # every page of the array was punched out
    assert got["bytes"] == 64 << 20, got


def test_calloc_of_a_reused_block_reads_zeros():
    # Freed blocks under FERRY_ALLOC_PUNCH keep their pages (and bytes)
    # for the next allocation: calloc zeroes them.
    got = run_child(PRELUDE + textwrap.dedent("""
        seen = []
        for n in (128 << 10, 8 << 20):          # kept, then punched
            p = libc.malloc(n)
            ctypes.memset(p, 0xFF, n)
            libc.free(p)
            q = libc.calloc(1, n)
            seen.append([q == p, ctypes.string_at(q, n) == bytes(n)])
            libc.free(q)
        print(json.dumps(seen))
    """))
    assert [zeros for _, zeros in got] == [True, True], got
    assert got[0][0], "the freed block was not reused: the test proves nothing"


def test_realloc_across_the_threshold_keeps_the_bytes():
    got = run_child(PRELUDE + textwrap.dedent("""
        pattern = bytes(range(256)) * 4
        p = libc.malloc(1024)
        ctypes.memmove(p, pattern, 1024)
        small = inside(p)
        p = libc.realloc(p, 1 << 20)            # up into the window
        up = inside(p) and ctypes.string_at(p, 1024) == pattern
        ctypes.memmove(p + (1 << 20) - 4, b"tail", 4)
        p = libc.realloc(p, 4 << 20)            # grows within the window
        grown = inside(p) and ctypes.string_at(p, 1024) == pattern and ctypes.string_at(p + (1 << 20) - 4, 4) == b"tail"
        p = libc.realloc(p, 100)                # back down to glibc
        down = not inside(p) and ctypes.string_at(p, 100) == pattern[:100]
        libc.free(p)
        print(json.dumps([small, up, grown, down]))
    """))
    assert got == [False, True, True, True]


def test_threads_allocating_at_once_get_blocks_of_their_own():
    got = run_child(PRELUDE + textwrap.dedent("""
        import numpy as np
        bad = []
        def work(i):
            for round in range(60):
                arrays = [np.full((100 << 10) + 4096 * k, (i * 7 + k + round) % 251, dtype=np.uint8) for k in range(4)]
                for k, a in enumerate(arrays):
                    if not inside(a.ctypes.data, a.nbytes) or int(a.min()) != int(a.max()) or int(a[0]) != (i * 7 + k + round) % 251:
                        bad.append((i, round, k))
        threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
        for t in threads: t.start()
        for t in threads: t.join(120)
        print(json.dumps({"bad": bad[:5], "alive": sum(t.is_alive() for t in threads), "left": ferry.alloc.stats()[1]}))
    """))
    assert got == {"bad": [], "alive": 0, "left": got["left"]}, got
    assert got["left"] < 16, got   # every array was freed again (a few blocks belong to the interpreter)


def test_a_fork_child_sees_the_data_and_writes_its_own_copy():
    got = run_child(PRELUDE + textwrap.dedent("""
        import numpy as np
        a = np.full(1 << 20, 7, dtype=np.uint8)
        r, wfd = os.pipe()
        pid = os.fork()
        if pid == 0:
            seen = int(a.min()) == 7 and int(a.max()) == 7
            a[:] = 9                                  # private to the child
            b = np.full(1 << 20, 5, dtype=np.uint8)  # glibc's in the child
            report = json.dumps({"seen": seen, "b_out": not inside(b.ctypes.data), "lend": ferry.alloc.window() is None})
            del b, a                                  # freeing the parent's block: nothing happens to the parent
            os.write(wfd, report.encode())
            os._exit(0)
        os.close(wfd)
        child = json.loads(os.read(r, 4096))
        _, status = os.waitpid(pid, 0)
        child.update(status=status, parent_kept=int(a.min()) == 7 and int(a.max()) == 7, still_lends=ferry.alloc.window() is not None)
        c = np.full(1 << 20, 3, dtype=np.uint8)       # the parent still allocates in its window
        child["parent_allocates"] = inside(c.ctypes.data)
        print(json.dumps(child))
    """))
    assert got == {"seen": True, "b_out": True, "lend": True, "status": 0, "parent_kept": True, "still_lends": True,
                   "parent_allocates": True}, got


def test_the_threshold_comes_from_the_environment():
    got = run_child(PRELUDE + textwrap.dedent("""
        import numpy as np
        a = np.empty(16 << 10, dtype=np.uint8)
        print(json.dumps([ferry.alloc.stats()[2], inside(a.ctypes.data)]))
    """), env={"FERRY_ALLOC_MIN": "16K"})
    assert got == [16 << 10, True]
