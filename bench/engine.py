#!/usr/bin/env python3
"""Times ferry.mooncake.TransferEngine, the Mooncake drop-in, as sglang and
vLLM drive it, beside `ferrybench batch` on the same two ferryd, taking
turns (A B A B) so that a noisy machine's drift falls on all of them:

- kv: an sglang-shaped KV transfer per request: LAYERS x (K, V) x PAGES
  pages of PAGE bytes, scattered (each layer's K and V its own registered
  tensor, the pages picked at random and landing in reverse order in the
  receiver's slot, so that none merge), one batch_transfer_sync_write per
  request: pages/s and GB/s.
- single: SINGLE bytes transfer_sync_write one call at a time, each to
  the next place of a receive slot: µs per call and GB/s.
- ferrybench batch with the same page size and pages per request (the Go
  client, ferry's own batch transfer of a staged source): the yardstick
  of the kv figure (`ratio kv/batch`).
- with --mooncake-py DIR, Mooncake's own engine (`mooncake.engine` from
  DIR, a build of Mooncake's Python package) doing the single calls
  between two plain python3 processes on loopback TCP, nothing of
  ferry's loaded: the yardstick of the single figure (`ratio single
  ferry/mooncake`).

The engine sends as sglang's prefill does: into receive slots made with
mooncake=True on the receiving ferryd (its --mooncake-listen segment),
registered host memory on the sending side. Receive slots are made and
freed untimed. Before timing, the receiving arena is written through
once: a long-running ferryd's arena pages have all been touched, while
a fresh one's first write to a page pays its allocation (the slots lie
at random places in the arena). For the same reason one KV request goes
untimed first (the one verified): a running engine's registered memory
has been sent from and written into before, while the first request
after register_memory pays both ferryd's first touch of its pages, as
`ferrybench batch` pays its source's while staging it, untimed.

  python3 bench/engine.py --ferryd bin/ferryd --ferrybench bin/ferrybench
"""

import argparse
import ctypes
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import ferry
from ferry.mooncake import TransferEngine


def size(text):
    units = {"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}
    for u, m in units.items():
        if text.endswith(u):
            return int(text[:-len(u)]) * m
    return int(text)


class Daemon:
    """One ferryd, started and waited for ("ready"), stopped by its PID."""

    def __init__(self, ferryd, directory, name, arena, *extra):
        self.socket = os.path.join(directory, name + ".sock")
        env = {k: v for k, v in _unpreloaded().items() if not k.startswith("FERRY_")}
        env["FERRY_CONFIG"] = os.devnull
        self.proc = subprocess.Popen(
            [ferryd, "--socket", self.socket, "--listen", "127.0.0.1:0", "--arena-size", arena, "--device", "cpu",
             "--transport", "tcp", "--log-format", "json", "--log-level", "warn", *extra],
            env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + 60
        # --log-level warn logs no "ready": the socket answering is the sign.
        while True:
            try:
                ferry.Client(self.socket, timeout=5).status()
                break
            except ferry.FerryError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise SystemExit(f"ferryd {name} did not start: {self.proc.stderr.read().decode()[-2000:]}")
                time.sleep(0.05)
        threading.Thread(target=self.proc.stderr.read, daemon=True).start()

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def buffer(n, seed):
    b = (ctypes.c_char * n).from_buffer_copy(random.Random(seed).randbytes(n))
    return b, ctypes.addressof(b)


class KV:
    """LAYERS x (K, V) registered tensors of PAGES_TOTAL pages each; a
    request sends PAGES pages of every one of them."""

    def __init__(self, engine, layers, pages, page, total_pages, seed):
        self.engine, self.page, self.pages = engine, page, pages
        self.tensors = [buffer(total_pages * page, seed + i) for i in range(2 * layers)]
        for _, base in self.tensors:
            assert engine.register_memory(base, total_pages * page) == 0, engine.last_failure
        rng = random.Random(seed)
        self.picked = [rng.sample(range(total_pages), pages) for _ in self.tensors]
        self.nbytes = len(self.tensors) * pages * page

    def request(self, into, name, verify):
        session, base = into.open(name, self.nbytes)
        srcs, dsts, lens = [], [], []
        k = len(self.tensors) * self.pages
        for (_, src_base), picked in zip(self.tensors, self.picked):
            for p in picked:
                k -= 1  # in reverse: no two pages adjacent at both ends
                srcs.append(src_base + p * self.page)
                dsts.append(base + k * self.page)
                lens.append(self.page)
        t0 = time.perf_counter()
        ret = self.engine.batch_transfer_sync_write(session, srcs, dsts, lens)
        took = time.perf_counter() - t0
        if ret != 0:
            raise SystemExit(f"kv: batch_transfer_sync_write returned {ret}: {self.engine.last_failure}")
        if verify:
            want = b"".join(ctypes.string_at(src, self.page) for _, src in sorted(zip(dsts, srcs)))
            if into.read(name) != want:
                raise SystemExit(f"kv: the receiving {into.kind} does not hold the pages sent")
        into.close(name)
        return took


class IntoSlots:
    """Writes land in receive slots made with mooncake=True on the
    receiving ferryd (its own Mooncake segment)."""
    kind = "slot"

    def __init__(self, rx):
        self.rx = rx

    def open(self, name, n):
        slot = self.rx.receive(name, n, mooncake=True)
        return slot.mooncake_session, slot.buffer_address

    def read(self, name):
        return self.rx.wait(name, 10)

    def close(self, name):
        self.rx.free(name)


class IntoEngine:
    """Writes land in memory a receiving TransferEngine registered (the
    decode side of sglang PD): one buffer, born in ferry's allocator
    window (this process runs under python -m ferry.run), registered once
    and reused by every request; the sender's ferryd writes it over ferry's
    peer protocol."""
    kind = "engine"

    def __init__(self, rx_socket, n):
        self.engine = TransferEngine(socket_path=rx_socket)
        assert self.engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0, self.engine.last_failure
        self.session = f"127.0.0.1:{self.engine.get_rpc_port()}"
        self.buf, self.base = buffer(n, 5)
        if self.engine.register_memory(self.base, n) != 0:
            raise SystemExit(f"--into engine: {self.engine.last_failure.message}")
        self.n = {}

    def open(self, name, n):
        self.n[name] = n
        return self.session, self.base

    def read(self, name):
        return ctypes.string_at(self.base, self.n[name])

    def close(self, name):
        del self.n[name]


def single_calls(engine, into, src, n, per_slot, seconds, tag, verify):
    """transfer_sync_write of n bytes, one call at a time, for seconds:
    each call's time."""
    out, spent, k = [], 0.0, 0
    while spent < seconds:
        name = f"single-{tag}-{k}"
        session, base = into.open(name, n * per_slot)
        for i in range(per_slot):
            t0 = time.perf_counter()
            ret = engine.transfer_sync_write(session, src, base + i * n, n)
            took = time.perf_counter() - t0
            if ret != 0:
                raise SystemExit(f"single: transfer_sync_write returned {ret}: {engine.last_failure}")
            out.append(took)
            spent += took
        if verify and k == 0:
            if into.read(name) != ctypes.string_at(src, n) * per_slot:
                raise SystemExit(f"single: the receiving {into.kind} does not hold the bytes sent")
        into.close(name)
        k += 1
    return out


# A Mooncake engine of its own in a plain python3 (bench_mooncake):
# "target" registers a buffer and prints its session and address;
# "initiator SESSION ADDRESS" answers each "SECONDS" line read with the
# times of single transfer_sync_write calls into that buffer for that
# long (a JSON list), until its stdin ends.
MOONCAKE_CHILD = r"""
import ctypes, json, sys, time
from mooncake.engine import TransferEngine
role, n, slots = sys.argv[1], int(sys.argv[2]), 256
e = TransferEngine()
assert e.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0, "initialize"
buf = (ctypes.c_char * (n * slots))()
assert e.register_memory(ctypes.addressof(buf), n * slots) == 0, "register_memory"
if role == "target":
    print(f"127.0.0.1:{e.get_rpc_port()} {ctypes.addressof(buf)}", flush=True)
    sys.stdin.read()
    sys.exit(0)
session, base = sys.argv[3], int(sys.argv[4])
src = ctypes.addressof(buf)
ctypes.memmove(src, bytes(range(256)) * (n // 256), n)
for line in sys.stdin:
    out, i, end = [], 0, time.perf_counter() + float(line)
    while time.perf_counter() < end:
        t0 = time.perf_counter()
        ret = e.transfer_sync_write(session, src, base + (i % slots) * n, n)
        out.append(time.perf_counter() - t0)
        assert ret == 0, f"transfer_sync_write returned {ret}"
        i += 1
    print(json.dumps(out), flush=True)
"""


class MooncakePair:
    """A real Mooncake engine pair (two python3 processes with DIR on
    PYTHONPATH and LD_LIBRARY_PATH, no LD_PRELOAD), the initiator timing
    single calls when asked; stopped by their PIDs."""

    def __init__(self, directory, n):
        env = {k: v for k, v in _unpreloaded().items() if not k.startswith("FERRY_")}
        env["PYTHONPATH"] = env["LD_LIBRARY_PATH"] = directory
        env.setdefault("MC_LOG_LEVEL", "WARNING")  # its INFO lines, a few per engine, say nothing here
        pipe = dict(env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.procs = [subprocess.Popen([sys.executable, "-c", MOONCAKE_CHILD, "target", str(n)], **pipe)]
        try:
            line = self.procs[0].stdout.readline().split()
            if len(line) != 2:
                raise SystemExit(f"--mooncake-py {directory}: the target engine did not start (exit {self.procs[0].wait(30)})")
            self.procs.append(subprocess.Popen([sys.executable, "-c", MOONCAKE_CHILD, "initiator", str(n), *line], **pipe))
        except BaseException:
            self.stop()
            raise

    def single_calls(self, seconds):
        init = self.procs[1]
        init.stdin.write(f"{seconds}\n")
        init.stdin.flush()
        line = init.stdout.readline()
        if not line:
            raise SystemExit(f"mooncake: the initiator engine stopped (exit {init.wait(30)})")
        return json.loads(line)

    def stop(self):
        for p in reversed(self.procs):
            p.stdin.close()
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def ferrybench_batch(ferrybench, tx, rx, page, pages, seconds):
    """One `ferrybench batch` point against the same daemons: (its output line, items/s, GB/s)."""
    cmd = [ferrybench, "batch", "--from", tx.socket, "--to", rx.socket, "--item-size", str(page),
           "--batches", str(pages), "--duration", f"{seconds * 2}s", "--json"]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=600, env=_unpreloaded()).stdout
    rows = [r for r in json.loads(out)["rows"] if r["op"] == "batch"]
    return rows[0]


def _unpreloaded():
    """This process's environment without LD_PRELOAD: under python -m
    ferry.run the engine's process has ferry's allocator, and ferryd and
    ferrybench, as in a deployment, do not."""
    return {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}


def pct(xs, p):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p * len(xs)))]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ferryd", default="bin/ferryd")
    ap.add_argument("--ferrybench", default="bin/ferrybench", help="'' to leave ferrybench batch out")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--pages", type=int, default=64, help="pages per request per layer's K or V")
    ap.add_argument("--page", type=size, default=16 << 10)
    ap.add_argument("--single", type=size, default=64 << 10)
    ap.add_argument("--rounds", type=int, default=2, help="turns of each (A B A B)")
    ap.add_argument("--seconds", type=float, default=2.0, help="per turn")
    ap.add_argument("--arena", default="512MiB")
    ap.add_argument("--into", choices=["slot", "engine"], default="slot",
                    help="where writes land: receive slots made with mooncake=True, or memory a receiving "
                         "engine registered (run under python -m ferry.run)")
    ap.add_argument("--mooncake-py", default="", metavar="DIR",
                    help="a build of Mooncake's Python package (mooncake/engine.py and its libraries): its own "
                         "engine pair's single calls, in turns with ferry's, for `ratio single ferry/mooncake`")
    a = ap.parse_args()

    directory = tempfile.mkdtemp(prefix="ferry-engine-bench-")
    tx = Daemon(a.ferryd, directory, "tx", a.arena)
    try:
        rx = Daemon(a.ferryd, directory, "rx", a.arena, "--mooncake-listen", "127.0.0.1:0")
    except BaseException:
        tx.stop()
        raise
    mc = None
    try:
        if a.mooncake_py:
            mc = MooncakePair(a.mooncake_py, a.single)
        run(a, tx, rx, mc)
    finally:
        if mc is not None:
            mc.stop()
        rx.stop()
        tx.stop()


def run(a, tx, rx, mc):
    rxc = ferry.Client(rx.socket)
    # The prefill side only sends from its registered memory (send_only);
    # under ferry's allocator (python -m ferry.run) that memory is lent to
    # the sending ferryd and sent from in place, else staged per request.
    engine = TransferEngine(socket_path=tx.socket, send_only=True)
    assert engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0, engine.last_failure
    kv = KV(engine, a.layers, a.pages, a.page, 4 * a.pages, seed=1)
    single, single_base = buffer(a.single, 99)
    assert engine.register_memory(single_base, a.single) == 0, engine.last_failure
    pages = 2 * a.layers * a.pages
    into = IntoSlots(rxc) if a.into == "slot" else IntoEngine(rx.socket, max(pages * a.page, 256 * a.single))

    # Touch the receiving arena once, as a running ferryd's has been.
    total = size(a.arena)
    slot = rxc.receive("warm", total - (1 << 20), mooncake=True)
    chunk, chunk_base = buffer(16 << 20, 7)
    assert engine.register_memory(chunk_base, 16 << 20) == 0
    for off in range(0, slot.nbytes, 16 << 20):
        n = min(16 << 20, slot.nbytes - off)
        assert engine.transfer_sync_write(slot.mooncake_session, chunk_base, slot.buffer_address + off, n) == 0, engine.last_failure
    rxc.free("warm")
    kv.request(into, "kv-warm", verify=True)

    print(f"# bench/engine.py  {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}  cpus={os.cpu_count()} "
          f"ferryd={a.ferryd} transport=tcp (loopback) into={a.into} kv={a.layers}x2x{a.pages}x{a.page}B single={a.single}B "
          f"{a.rounds} rounds x {a.seconds}s", flush=True)
    kv_times, single_times, mc_times, fb = [], [], [], []
    for r in range(a.rounds):
        spent, i = 0.0, 0
        while spent < a.seconds or i < 2:
            took = kv.request(into, f"kv-{r}-{i}", verify=False)
            kv_times.append(took)
            spent += took
            i += 1
        single_times += single_calls(engine, into, single_base, a.single, 256, a.seconds, r, verify=(r == 0))
        if mc is not None:
            mc_times += mc.single_calls(a.seconds)
        if a.ferrybench:
            fb.append(ferrybench_batch(a.ferrybench, tx, rx, a.page, 2 * a.layers * a.pages, a.seconds))

    kv_mean = statistics.mean(kv_times)
    print(f"kv      pages/request={pages} page={a.page}B requests={len(kv_times)} "
          f"pages/s={pages / kv_mean:.0f} GB/s={kv.nbytes / kv_mean / 1e9:.3f} "
          f"p50_ms={pct(kv_times, 0.5) * 1e3:.2f} p90_ms={pct(kv_times, 0.9) * 1e3:.2f}")
    for name, times in (("single", single_times), ("mooncake single", mc_times)):
        if times:
            mean = statistics.mean(times)
            print(f"{name:7} size={a.single}B calls={len(times)} us/call(mean)={mean * 1e6:.1f} "
                  f"p50_us={pct(times, 0.5) * 1e6:.1f} p90_us={pct(times, 0.9) * 1e6:.1f} "
                  f"p99_us={pct(times, 0.99) * 1e6:.1f} GB/s={a.single / mean / 1e9:.3f}")
    if mc_times:
        # Above 1: ferry's rate is the higher (GB/s), its median call the shorter (p50).
        print(f"ratio single ferry/mooncake = {statistics.mean(mc_times) / statistics.mean(single_times):.2f} (GB/s), "
              f"{pct(mc_times, 0.5) / pct(single_times, 0.5):.2f} (by p50)")
    if fb:
        items = sum(f["ops_per_s"] for f in fb) / len(fb)
        gbps = sum(f["gb_per_s"] for f in fb) / len(fb)
        print(f"ferrybench batch  items/batch={pages} item={a.page}B pages/s={items:.0f} GB/s={gbps:.3f} "
              f"p50_ms={statistics.mean(f['latency']['p50_us'] for f in fb) / 1e3:.2f}")
        print(f"ratio kv/batch = {(pages / kv_mean) / items:.2f}")


if __name__ == "__main__":
    sys.exit(main())
