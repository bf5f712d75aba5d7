"""python -m ferry.run [python args...]: runs Python with ferry's allocator
preloaded (ferry.alloc), so that tensors are born in memory ferryd can
reach and a ferry.mooncake engine can register them as write targets::

    python -m ferry.run -m sglang.launch_server ...
    python -m ferry.run serve.py --port 8000

It execs this same interpreter with LD_PRELOAD naming libferry_alloc.so
(ahead of what LD_PRELOAD held), and the rest of the command line.
"""

import os
import sys

from .alloc import LIBRARY


def main(argv):
    if not os.path.exists(LIBRARY):
        sys.exit(f"ferry.run: {LIBRARY} is missing: build it (make alloc in ferry's checkout, or "
                 f"gcc -O2 -fPIC -shared -o {LIBRARY} {os.path.join(os.path.dirname(LIBRARY), 'ferry_alloc.c')} -ldl -lpthread)")
    if not argv:
        sys.exit("usage: python -m ferry.run [python arguments]: runs python with ferry's allocator preloaded")
    env = dict(os.environ)
    env["LD_PRELOAD"] = " ".join([LIBRARY] + [p for p in env.get("LD_PRELOAD", "").split() if p != LIBRARY])
    os.execve(sys.executable, [sys.executable, *argv], env)


if __name__ == "__main__":
    main(sys.argv[1:])
