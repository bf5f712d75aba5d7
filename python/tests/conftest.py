"""Real ferryd processes for the tests: each on a socket in a temp dir,
peer port on 127.0.0.1, host memory, TCP, JSON logs; started by waiting
for its "ready" log line, stopped by PID with SIGTERM and a deadline.

FERRYD names the binary (make test-python builds it); else bin/ferryd of
this checkout. MCPEER likewise names test/mcpeer's binary, a Mooncake-
protocol peer (the mcpeer fixture).
"""

import contextlib
import hashlib
import json
import os
import signal
import socket
import queue
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from pathlib import Path

import pytest

import ferry

REPO = Path(__file__).resolve().parents[2]
FERRYD = os.environ.get("FERRYD") or str(REPO / "bin" / "ferryd")
MCPEER = os.environ.get("MCPEER") or str(REPO / "bin" / "mcpeer")

def pytest_report_header():
    return f"ferry {ferry.__version__} from {os.path.dirname(ferry.__file__)}; ferryd {FERRYD}"


# Every ferryd a test started, so none outlives the session whatever failed.
_running = []


class Daemon:
    """One ferryd process and the JSON lines it logs."""

    def __init__(self, directory, name, *extra, env=None):
        if not os.access(FERRYD, os.X_OK):
            pytest.fail(f"no ferryd at {FERRYD}: build it first (make build), or name it with FERRYD=...")
        self.dir = str(directory)
        self.socket = os.path.join(self.dir, name + ".sock")
        args = [FERRYD, "--socket", self.socket, "--listen", "127.0.0.1:0", "--arena-size", "64MiB",
                "--device", "cpu", "--transport", "tcp", "--log-format", "json", "--log-level", "debug", *extra]
        # Only what the test gives configures it: no file, no FERRY_* of ours.
        environ = {k: v for k, v in os.environ.items() if not k.startswith("FERRY_")}
        environ.update(FERRY_CONFIG=os.devnull, **(env or {}))
        self.lines = []
        self._cond = threading.Condition()
        self._eof = False
        # setpriv: the kernel stops ferryd if this test process dies first.
        self.proc = subprocess.Popen(["setpriv", "--pdeathsig", "TERM", "--", *args], env=environ,
                                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        _running.append(self)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        try:
            # A deadline against a hang, not a speed bound: in the soft-RoCE
            # VM on a busy host ferryd's rdma start took 10-16 s and more.
            ready = self.wait_log(lambda line: line.get("message") == "ready", 60, 'the "ready" line')
        except BaseException:
            self.stop()
            raise
        self.advertise = ready["advertise"]
        self.pid = self.proc.pid

    def _read(self):
        for raw in self.proc.stderr:
            text = raw.decode("utf-8", "replace").rstrip("\n")
            try:
                line = json.loads(text)
            except ValueError:
                line = {"raw": text}
            with self._cond:
                self.lines.append(line if isinstance(line, dict) else {"raw": text})
                self._cond.notify_all()
        with self._cond:
            self._eof = True
            self._cond.notify_all()

    def log(self):
        with self._cond:  # an RLock: callable while waiting on it
            return "\n".join(json.dumps(line) for line in self.lines)

    def wait_log(self, match, timeout, what):
        """The first log line match accepts; fails the test when none comes
        within timeout seconds or ferryd exits first."""
        deadline = time.monotonic() + timeout
        seen = 0
        with self._cond:
            while True:
                for line in self.lines[seen:]:
                    if match(line):
                        return line
                seen = len(self.lines)
                if self._eof:
                    pytest.fail(f"ferryd exited before logging {what}; its log:\n{self.log()}")
                left = deadline - time.monotonic()
                if left <= 0:
                    pytest.fail(f"ferryd logged no {what} within {timeout} s; its log:\n{self.log()}")
                self._cond.wait(left)

    def mark(self, timeout=10):
        """The number of log lines up to a marker request of its own: ferryd
        logs a request before answering it and logs one stream in order, so
        every request answered before mark() was called lies before it."""
        marker = f"mark-{uuid.uuid4().hex}"
        with self.client() as c:
            with pytest.raises(ferry.FerryError):
                c.embedding(marker)
        self.wait_log(lambda line: line.get("req_id") == marker, timeout, f"the marker request {marker}")
        with self._cond:
            return next(i + 1 for i, line in enumerate(self.lines) if line.get("req_id") == marker)

    def requests_between(self, start, end):
        """(method, path) of the requests logged between two marks, the
        second mark's own line left out."""
        with self._cond:
            return [(line["method"], line["path"]) for line in self.lines[start:end - 1]
                    if line.get("message") == "request"]

    def wait_exit(self, timeout):
        """Waits for ferryd to exit by itself and returns its exit code."""
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"ferryd pid {self.proc.pid} still running after {timeout} s; its log:\n{self.log()}")
        self._reader.join(10)
        return code

    def stop(self):
        """SIGTERM by PID, then SIGKILL if it outstays 10 s (and the test fails)."""
        if self in _running:
            _running.remove(self)
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
                pytest.fail(f"ferryd pid {self.proc.pid} ignored SIGTERM for 10 s and was killed")
        self._reader.join(10)

    def client(self, **kw):
        return ferry.Client(self.socket, **kw)


@pytest.fixture(scope="session", autouse=True)
def _stop_every_ferryd():
    yield
    for d in list(_running):
        d.stop()


@pytest.fixture
def start_daemon(tmp_path):
    """Starts ferryd processes for one test; each is stopped when it ends."""
    started = []

    def start(name, *extra, directory=None, env=None):
        d = Daemon(directory or tmp_path, name, *extra, env=env)
        started.append(d)
        return d

    yield start
    for d in started:
        d.stop()


@pytest.fixture(scope="session")
def pair(tmp_path_factory):
    """A sender and a receiver ferryd shared by the tests (each test cleans
    up what it made). The receiver also serves a Mooncake segment."""
    directory = tmp_path_factory.mktemp("pair")
    sender = Daemon(directory, "tx")
    try:
        receiver = Daemon(directory, "rx", "--mooncake-listen", "127.0.0.1:0")
    except BaseException:
        sender.stop()
        raise
    yield sender, receiver
    receiver.stop()
    sender.stop()


@pytest.fixture
def tx(pair):
    with pair[0].client() as c:
        yield c


@pytest.fixture
def rx(pair):
    with pair[1].client() as c:
        yield c


@pytest.fixture
def req_id():
    return "py-" + uuid.uuid4().hex


class CountingDial:
    """A client's dial that counts the connections it opens."""

    def __init__(self, path):
        self.path = path
        self.count = 0
        self._lock = threading.Lock()

    def __call__(self):
        with self._lock:
            self.count += 1
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(self.path)
        except BaseException:
            sock.close()
            raise
        return sock


def poll_until(cond, timeout, what):
    """Polls cond until it holds, for state ferryd raises no event about;
    fails the test after timeout seconds."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            pytest.fail(f"{what} did not happen within {timeout} s")
        time.sleep(0.005)


@contextlib.contextmanager
def stalled_upload(socket_path, req_id, nbytes):
    """A PUT of nbytes for req_id whose body stops after its first byte: the
    entry stays "uploading" (and the request in flight) until the caller
    finishes it (yielded socket) or the block ends and closes it."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(10)
    try:
        sock.connect(socket_path)
        head = (f"PUT /v1/embeddings/{req_id}?shape={nbytes}&dtype=u8 HTTP/1.1\r\n"
                f"Host: ferryd\r\nContent-Length: {nbytes}\r\n\r\n")
        sock.sendall(head.encode() + b"\0")
        yield sock
    finally:
        sock.close()


class LineChild:
    """A child process driven by JSON lines: one line in on stdin, one line
    of answer on stdout, each answer awaited with a deadline (what names
    the process in failures). Ended by its PID (kill)."""

    def __init__(self, argv, what, timeout, env=None):
        self.proc = subprocess.Popen(argv, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE)
        self.pid = self.proc.pid
        self.what = f"{what} pid {self.pid}"
        self.timeout = timeout
        self._lines = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for raw in self.proc.stdout:
            self._lines.put(raw)
        self._lines.put(None)

    def ask(self, line, timeout=None):
        """Sends line (a JSON value) and returns the decoded answer."""
        if line is not None:
            self.proc.stdin.write((json.dumps(line) + "\n").encode())
            self.proc.stdin.flush()
        timeout = timeout or self.timeout
        try:
            raw = self._lines.get(timeout=timeout)
        except queue.Empty:
            pytest.fail(f"the {self.what} answered nothing within {timeout} s")
        if raw is None:
            self.proc.wait(10)
            pytest.fail(f"the {self.what} exited ({self.proc.returncode}): "
                        f"{self.proc.stderr.read().decode(errors='replace')}")
        return json.loads(raw)

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)


class EngineChild(LineChild):
    """A Python process started with ferry's allocator preloaded (python -m
    ferry.run), as a framework's would be: run(code) executes code there
    and returns the value it left in `out`. Ended by its PID."""

    def __init__(self, socket_path, preload=True, timeout=240, env=None):
        here = os.path.dirname(os.path.abspath(__file__))
        argv = ["-m", "ferry.run"] if preload else []
        environ = {k: v for k, v in os.environ.items() if not k.startswith("FERRY_") and k != "LD_PRELOAD"}
        environ.update(env or {}, FERRY_SOCKET=socket_path)
        super().__init__([sys.executable, *argv, os.path.join(here, "engine_child.py")], "engine process",
                         timeout, environ)

    def run(self, code, timeout=None):
        answer = self.ask(textwrap.dedent(code), timeout)
        if "error" in answer:
            pytest.fail(f"in the engine process: {answer['error']}")
        return answer["out"]


@pytest.fixture
def engine_child():
    """Starts engine processes (EngineChild) for one test; each is ended when it ends."""
    started = []

    def start(socket_path, **kw):
        c = EngineChild(socket_path, **kw)
        started.append(c)
        return c

    yield start
    for c in started:
        c.kill()


class McPeer(LineChild):
    """A Mooncake-protocol peer (test/mcpeer: package mooncaketest's Peer on
    loopback TCP, one registered buffer): session, base and size name its
    segment; write, read and digest are its commands, each answered within
    timeout seconds. It exits when its stdin closes; kill() also ends it by
    PID."""

    def __init__(self, buffer_size, timeout=120):
        if not os.access(MCPEER, os.X_OK):
            pytest.fail(f"no mcpeer at {MCPEER}: make test-python builds it, or name it with MCPEER=...")
        super().__init__(["setpriv", "--pdeathsig", "TERM", "--", MCPEER, "-buffer-size", str(buffer_size)],
                         "mcpeer", timeout)
        try:
            hello = self.ask(None, 30)
        except BaseException:
            self.kill()
            raise
        self.session, self.base, self.size = hello["session"], hello["base"], hello["size"]

    def call(self, **command):
        """The peer's answer to command; {"error": ...} when it failed."""
        return self.ask(command)

    def write(self, session, seed, pieces):
        """WRITEs pieces [(addr, n)] of the seed's stream (pattern) into
        session as a Mooncake initiator; None, or the peer's error."""
        return self.call(op="write", session=session, seed=seed, pieces=pieces).get("error")

    def read(self, session, pieces):
        """READs pieces from session: their sha256 hex digests (or the error)."""
        got = self.call(op="read", session=session, pieces=pieces)
        return got.get("digests", got.get("error"))

    def digest(self, pieces):
        """The sha256 hex digests of pieces of its own buffer."""
        got = self.call(op="digest", pieces=pieces)
        assert "digests" in got, got
        return got["digests"]



def pattern(seed, n):
    """The first n bytes of the seed's stream, as mcpeer's write cuts it."""
    return hashlib.shake_128(seed.encode()).digest(n)


@pytest.fixture
def mcpeer():
    """Starts Mooncake-protocol peers (McPeer) for one test; each is killed by PID when it ends."""
    started = []

    def start(buffer_size=16 << 20):
        p = McPeer(buffer_size)
        started.append(p)
        return p

    yield start
    for p in started:
        p.kill()
