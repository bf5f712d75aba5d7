"""bench/engine.py, the figures of bench/README.md's "The Mooncake engine
through Python", runs in both of its modes: briefly, on small requests,
with ferrybench batch beside it, so that the benchmark cannot rot between
the runs quoted there. Its first KV request and first turn of single
calls are verified byte for byte by the script itself; no figure is
judged here (speed is the benchmark's to say, not a test's)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import FERRYD, REPO

pytest.importorskip("torch", reason="Debian's python3-torch (make test-python installs it)")


@pytest.mark.parametrize("into", ["slot", "engine"])
def test_bench_engine_prints_its_rows(into):
    ferrybench = Path(FERRYD).with_name("ferrybench")
    if not os.access(ferrybench, os.X_OK):
        pytest.fail(f"no ferrybench beside {FERRYD}: make build makes both")
    cmd = [sys.executable, "-m", "ferry.run", str(REPO / "bench" / "engine.py"), "--ferryd", FERRYD,
           "--ferrybench", str(ferrybench), "--into", into, "--layers", "2", "--pages", "8", "--rounds", "1",
           "--seconds", "0.2", "--arena", "64MiB"]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    lines = run.stdout.splitlines()

    def row(prefix):
        found = [line for line in lines if line.startswith(prefix)]
        assert len(found) == 1, f"want one line starting {prefix!r}:\n{run.stdout}"
        return found[0]

    assert f"into={into} kv=2x2x8x16384B" in row("# bench/engine.py ")
    assert "pages/s=" in row("kv      pages/request=32 page=16384B requests=")
    assert "us/call(mean)=" in row("single  size=65536B calls=")
    assert "pages/s=" in row("ferrybench batch  items/batch=32 item=16384B ")
    row("ratio kv/batch = ")
