"""HTTP/1.1 over ferryd's Unix socket, on kept-alive connections.

A small pool of http.client connections, each used by one thread at a
time. A request goes out on an idle connection when there is one; when
ferryd closed that connection meanwhile (an idle timeout, a restart), the
request is sent again on a fresh one only if it cannot have been acted
on: it never reached ferryd, or it is a GET or DELETE. A DELETE sent again
that finds nothing to delete answers as done: the first one may have
deleted it, and either way what was asked holds.
"""

import http.client
import os
import select
import socket
import struct
import threading
import time

from .errors import NoAnswer, Unreachable, from_answer

# Connections kept open between requests; more threads than this still
# work, their extra connections are closed after use.
MAX_IDLE = 8

_IDEMPOTENT = frozenset({"GET", "DELETE"})


class _NotSent(Exception):
    """The request's bytes did not reach ferryd: it cannot have been acted on."""


class UnixHTTPConnection(http.client.HTTPConnection):
    """An http.client connection whose socket comes from ``dial``."""

    def __init__(self, dial, timeout):
        super().__init__("ferryd", timeout=timeout)
        self._dial = dial

    def connect(self):
        self.sock = self._dial()
        self.sock.settimeout(self.timeout)


def _idle_and_open(sock):
    """Whether a kept-alive connection is still usable: nothing to read on
    it (a readable idle connection is closed, or out of step)."""
    p = select.poll()
    p.register(sock, select.POLLIN)
    return not p.poll(0)


class Transport:
    """Requests to one ferryd over its Unix socket (or what ``dial`` opens)."""

    def __init__(self, socket_path, dial=None):
        self.socket_path = socket_path
        self._dial_fn = dial or self._dial_unix
        self._lock = threading.Lock()
        self._idle = []
        self._streams = []  # idle write streams (write_frame)
        self._pid = os.getpid()

    def _after_fork(self):
        """In a process forked since the connections were kept: they are
        the parent's too, and a request on one would cross the parent's
        answers, so the child closes its copies; the lock may have been
        held by a thread the child does not have, so it gets its own."""
        if self._pid == os.getpid():
            return
        self._pid, self._lock = os.getpid(), threading.Lock()
        idle, self._idle = self._idle, []
        streams, self._streams = self._streams, []
        for conn in idle + [sock for sock, _ in streams]:
            conn.close()  # the child's descriptor only: the parent's stays open

    def _dial_unix(self):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(self.socket_path)
        except BaseException:
            sock.close()
            raise
        return sock

    def dial(self):
        """A new connection to ferryd, or Unreachable saying why not."""
        try:
            return self._dial_fn()
        except OSError as e:
            raise self._unreachable(e) from e

    def _unreachable(self, e):
        hint = "is ferryd running, and is that its control socket? name the socket with Client(socket_path=...) or FERRY_SOCKET"
        if isinstance(e, FileNotFoundError):
            why = "no such socket"
        elif isinstance(e, ConnectionRefusedError):
            why = "nothing listens on it (a socket file left behind by a ferryd that stopped?)"
        elif isinstance(e, PermissionError):
            why = "permission denied"
            hint = "this user may not open the socket: it needs to be in the socket's group (ferryd's socket_group)"
        else:
            why = e.strerror or str(e) or type(e).__name__
        return Unreachable(f"cannot reach ferryd at {self.socket_path}: {why} ({hint})", self.socket_path)

    def _take(self, timeout, fresh):
        self._after_fork()
        if not fresh:
            while True:
                with self._lock:
                    conn = self._idle.pop() if self._idle else None
                if conn is None:
                    break
                if _idle_and_open(conn.sock):
                    conn.sock.settimeout(timeout)
                    return conn, True
                conn.close()
        conn = UnixHTTPConnection(self.dial, timeout)
        conn.connect()
        return conn, False

    def _put(self, conn):
        with self._lock:
            if len(self._idle) < MAX_IDLE:
                self._idle.append(conn)
                return
        conn.close()

    def close(self):
        """Closes the connections kept open between requests."""
        with self._lock:
            idle, self._idle = self._idle, []
            streams, self._streams = self._streams, []
        for conn in idle + [sock for sock, _ in streams]:
            conn.close()

    def round_trip(self, method, path, body=None, headers=None, timeout=None):
        """Sends one request and reads its whole answer: (status, headers, body)."""
        maybe_acted = False
        for fresh in (False, True):
            conn, reused = self._take(timeout, fresh)
            try:
                resp = _exchange(conn, method, path, body, headers or {})
                data = resp.read()
            except _NotSent:
                conn.close()
                if reused:
                    continue  # ferryd had closed the idle connection; nothing reached it
                raise NoAnswer(f"ferryd at {self.socket_path} closed a new connection before {method} {path} was sent") from None
            except socket.timeout:
                conn.close()
                raise NoAnswer(
                    f"no answer from ferryd at {self.socket_path} to {method} {path} within {timeout:g} s (the client's timeout); "
                    "the connection was closed, and what was asked may still be carried out: look before repeating it, "
                    "or raise Client(timeout=...)") from None
            except (OSError, http.client.HTTPException) as e:
                conn.close()
                if reused and method in _IDEMPOTENT:
                    maybe_acted = True
                    continue  # closed by ferryd as the request went out; a read or delete may be asked again
                raise NoAnswer(
                    f"ferryd at {self.socket_path} closed the connection before answering {method} {path} ({e!r}); "
                    "what was asked may have been carried out: look before repeating it") from e
            if resp.will_close or conn.sock is None:
                conn.close()
            else:
                self._put(conn)
            if maybe_acted and method == "DELETE" and resp.status == 404:
                return 204, http.client.HTTPMessage(), b""
            return resp.status, resp.headers, data


    def send_buffers(self, method, path, parts, headers=None, timeout=None):
        """Sends the buffers in parts, one after another, as the body of a
        POST or PUT, and reads the whole answer: (status, body). The lean
        path of one request per call (Client.write, a staged batch of
        pages): the head is written by hand and
        goes out with the buffers in one sendmsg, straight from where
        they lie, and the answer is read without http.client's parsing,
        which costs more than the request on a small write. A kept
        connection ferryd closed meanwhile is found before the request
        goes out (as round_trip's are); a request cut off after its first
        byte raises NoAnswer, as it may have been acted on."""
        parts = [memoryview(b).cast("B") for b in parts]
        n = sum(p.nbytes for p in parts)
        head = [f"{method} {path} HTTP/1.1\r\nHost: ferryd\r\nContent-Length: {n}\r\n"]
        head += [f"{k}: {v}\r\n" for k, v in (headers or {}).items()]
        head.append("\r\n")
        out = [memoryview("".join(head).encode())] + parts
        conn, reused = self._take(timeout, False)
        sent = 0
        try:
            if n > _SNDBUF:
                _grow_sndbuf(conn.sock)
            sent = _send_all(conn.sock, out)
            status, close, data = _read_answer(conn.sock)
        except BaseException as e:
            conn.close()
            sent = getattr(e, "sent", sent)
            if isinstance(e, socket.timeout):
                raise NoAnswer(
                    f"no answer from ferryd at {self.socket_path} to {method} {path} within {timeout:g} s (the client's timeout); "
                    "the connection was closed, and what was asked may still be carried out: look before repeating it, "
                    "or raise Client(timeout=...)") from None
            if not isinstance(e, (OSError, http.client.HTTPException)):
                raise
            if reused and not sent and isinstance(e, OSError):
                return self.send_buffers(method, path, parts, headers, timeout)  # nothing reached ferryd
            raise NoAnswer(
                f"ferryd at {self.socket_path} closed the connection before answering {method} {path} ({e!r}); "
                "what was asked may have been carried out: look before repeating it") from e
        if close:
            conn.close()
        else:
            self._put(conn)
        return status, data


    def write_frame(self, frame, timeout):
        """One write frame on a write stream (POST /v1/writes/stream, an
        HTTP Upgrade of a connection to binary frames) and its answer:
        (status, body). A stream is kept between calls, one per thread at
        a time; a kept one ferryd closed meanwhile (idle, restarted) is
        found before the frame goes, or when the frame went and no byte
        of answer came back, then the frame goes on a fresh stream: an
        answer never begun leaves a write that went nowhere."""
        fresh = False
        while True:
            sock, reused = self._take_stream(timeout, fresh)
            head = None
            try:
                sock.sendall(frame)
                head = _recv_exact(sock, 6)
                status, n = struct.unpack("<HI", head)
                body = _recv_exact(sock, n)
            except socket.timeout:
                sock.close()
                raise NoAnswer(f"no answer from ferryd at {self.socket_path} to a write within {timeout:g} s (the client's "
                               "timeout); the stream was closed, and the write may still land: look before repeating it, "
                               "or raise Client(timeout=...)") from None
            except OSError as e:
                sock.close()
                if reused and head is None and getattr(e, "got", 0) == 0 and not fresh:
                    fresh = True
                    continue  # a kept stream ferryd had closed: no byte of answer, the frame went nowhere
                raise NoAnswer(f"ferryd at {self.socket_path} closed a write stream before answering ({e!r}); the write "
                               "may have landed: look before repeating it") from e
            # Kept for the next frame; one ferryd closed after a
            # malformed frame is found closed when next taken.
            with self._lock:
                if len(self._streams) < MAX_IDLE:
                    self._streams.append((sock, time.monotonic()))
                    return status, body
            sock.close()
            return status, body

    def _take_stream(self, timeout, fresh):
        self._after_fork()
        if not fresh:
            while True:
                with self._lock:
                    sock, idled = self._streams.pop() if self._streams else (None, 0)
                if sock is None:
                    break
                # ferryd closes a stream only after minutes idle (or when
                # it stops: then the frame finds it closed, unanswered,
                # and goes again): one back within _FRESH is taken
                # without a look, which costs a syscall per write.
                if time.monotonic() - idled < _FRESH or _idle_and_open(sock):
                    sock.settimeout(timeout)
                    return sock, True
                sock.close()
        sock = self.dial()
        try:
            sock.settimeout(timeout)
            sock.sendall(f"POST /v1/writes/stream HTTP/1.1\r\nHost: ferryd\r\nContent-Length: 0\r\n"
                         f"Connection: Upgrade\r\nUpgrade: {STREAM_PROTOCOL}\r\n\r\n".encode())
            head = bytearray()
            while not head.endswith(b"\r\n\r\n"):  # read byte by byte: frames' answers follow the head
                b = sock.recv(1)
                if not b:
                    raise http.client.RemoteDisconnected("ferryd closed the connection without an answer")
                head += b
                if len(head) > 8192:
                    raise http.client.LineTooLong("an upgrade answer's head")
        except BaseException:
            sock.close()
            raise
        status = head.split(b" ", 2)[1] if head.startswith(b"HTTP/1.") else b""
        if status != b"101":
            # The refusal's body (the error envelope) follows its head.
            length = 0
            for line in bytes(head).split(b"\r\n")[1:]:
                k, _, v = line.partition(b":")
                if k.strip().lower() == b"content-length" and v.strip().isdigit():
                    length = int(v)
            try:
                body = _recv_exact(sock, length)
            except OSError:
                body = b""
            finally:
                sock.close()
            raise from_answer(int(status) if status.isdigit() else 502, body)
        return sock, False


# What a write stream speaks (api.WriteStreamProtocol).
STREAM_PROTOCOL = "ferry-writes/1"

# A kept write stream back within this many seconds is reused without a
# look at its state (_take_stream).
_FRESH = 1.0


def _recv_exact(sock, n):
    """n bytes from sock; an OSError (its got: how many came) when it ends first."""
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:])
        if not k:
            e = ConnectionResetError(f"the connection ended after {got} of {n} bytes")
            e.got = got
            raise e
        got += k
    return bytes(buf)


# A Unix stream socket's send buffer bounds the bytes in flight to the
# peer: a large body at the default (some 200 KiB) costs both ends a
# wake-up per buffer-full. A connection that sends more asks for _BIG_SNDBUF
# (the kernel caps it at net.core.wmem_max).
_SNDBUF = 256 << 10
_BIG_SNDBUF = 4 << 20


def _grow_sndbuf(sock):
    if sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF) < _BIG_SNDBUF:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, _BIG_SNDBUF)


# The most buffers one sendmsg takes (the kernel's IOV_MAX).
_IOV_MAX = 1024


def _send_all(sock, bufs):
    """Writes every buffer (sendmsg, from where they lie); returns how
    many bytes went, raising what stopped it."""
    total = 0
    while bufs:
        try:
            k = sock.sendmsg(bufs[:_IOV_MAX])
        except OSError as e:
            e.sent = total
            raise
        total += k
        while bufs and k >= bufs[0].nbytes:
            k -= bufs[0].nbytes
            bufs = bufs[1:]
        if k:
            bufs[0] = bufs[0][k:]
    return total


def _read_answer(sock):
    """Reads one HTTP/1.1 answer: (status, whether the connection closes
    after it, the body), its body by Content-Length or chunked."""
    buf = bytearray()
    while (end := buf.find(b"\r\n\r\n")) < 0:
        chunk = sock.recv(65536)
        if not chunk:
            raise http.client.RemoteDisconnected("ferryd closed the connection without an answer")
        buf += chunk
    lines = bytes(buf[:end]).decode("latin-1").split("\r\n")
    parts = lines[0].split(" ", 2)
    if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or not parts[1].isdigit():
        raise http.client.BadStatusLine(lines[0])
    fields = {}
    for line in lines[1:]:
        k, _, v = line.partition(":")
        fields[k.strip().lower()] = v.strip()
    rest = buf[end + 4:]
    if fields.get("transfer-encoding", "").lower() == "chunked":
        body = bytearray()
        while True:
            while (eol := rest.find(b"\r\n")) < 0:
                rest += _recv_some(sock)
            size = int(bytes(rest[:eol]).split(b";")[0], 16)
            while len(rest) < eol + 2 + size + 2:
                rest += _recv_some(sock)
            if size == 0:
                break  # ferryd sends no trailers
            body += rest[eol + 2:eol + 2 + size]
            rest = rest[eol + 2 + size + 2:]
    else:
        size = int(fields.get("content-length", "0"))
        while len(rest) < size:
            rest += _recv_some(sock)
        body = rest[:size]
    close = fields.get("connection", "").lower() == "close" or parts[0] == "HTTP/1.0"
    return int(parts[1]), close, bytes(body)


def _recv_some(sock):
    chunk = sock.recv(65536)
    if not chunk:
        raise http.client.IncompleteRead(b"")
    return chunk


def _exchange(conn, method, path, body, headers):
    """Writes the request on conn and reads the answer's head."""
    try:
        conn.request(method, path, body=body, headers=headers)
    except ConnectionError as e:
        # ferryd may have answered before taking the whole body (a body
        # larger than the arena, say) and closed: that answer is waiting
        # to be read. Without one, nothing of the request was acted on.
        try:
            return conn.getresponse()
        except (OSError, http.client.HTTPException):
            raise _NotSent() from e
    return conn.getresponse()
