"""Kept-alive connections: reused between calls and threads, replaced
when ferryd closed them, and a request that may have been acted on never
sent twice."""

import os
import socket
import threading

import pytest

import ferry

from conftest import CountingDial


def test_calls_reuse_one_connection(pair):
    dial = CountingDial(pair[0].socket)
    with ferry.Client(pair[0].socket, dial=dial) as c:
        for _ in range(20):
            c.status()
        c.embeddings()
        c.metrics()
        assert dial.count == 1


def test_threads_share_a_few_connections(pair):
    dial = CountingDial(pair[0].socket)
    errors = []

    def work():
        try:
            for _ in range(25):
                assert c.status()["pid"] == pair[0].pid
        except BaseException as e:  # reported by the test thread
            errors.append(e)

    with ferry.Client(pair[0].socket, dial=dial) as c:
        threads = [threading.Thread(target=work) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not errors and not any(t.is_alive() for t in threads)
        # At most one connection per thread in flight at once.
        assert 1 <= dial.count <= 4


def test_a_restarted_ferryd_is_reached_on_a_fresh_connection(start_daemon, req_id):
    first = start_daemon("restart")
    dial = CountingDial(first.socket)
    c = ferry.Client(first.socket, dial=dial)
    assert c.status()["pid"] == first.pid
    first.stop()  # closes the connection the client keeps
    second = start_daemon("restart")
    # A read and a write after it both go out on one new connection.
    assert c.status()["pid"] == second.pid
    c.receive(req_id, 16)
    c.free(req_id)
    assert dial.count == 2
    c.close()


class ScriptedServer:
    """A Unix-socket HTTP server that handles successive requests as its
    script says: "answer" ({}), "not found" (a 404 not_found error), "drop"
    (close without answering), or "hang" (never answer). It records each request's method and path."""

    def __init__(self, path, script):
        self.script = list(script)
        self.seen = []
        self._hung = []
        self._listener = socket.socket(socket.AF_UNIX)
        self._listener.bind(path)
        self._listener.listen()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self):
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return  # closed by close()
            threading.Thread(target=self._handle, args=(conn,), daemon=True).start()

    def _handle(self, conn):
        f = conn.makefile("rb")
        while True:
            line = f.readline()
            if not line:
                conn.close()
                return
            method, path, _ = line.decode().split(" ", 2)
            length = 0
            while (header := f.readline()) not in (b"\r\n", b""):
                name, _, value = header.decode().partition(":")
                if name.lower() == "content-length":
                    length = int(value)
            f.read(length)
            self.seen.append((method, path))
            action = self.script.pop(0)
            if action == "drop":
                f.close()
                conn.close()
                return
            if action == "not found":
                body = b'{"error":{"code":"not_found","message":"no receive slot for req_id r1"}}'
                conn.sendall(b"HTTP/1.1 404 Not Found\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
                continue
            if action == "hang":
                self._hung.append(conn)
                return
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}")

    def close(self):
        self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        for conn in self._hung:
            conn.close()
        self._thread.join(10)


@pytest.fixture
def scripted(tmp_path):
    servers = []

    def make(script):
        path = str(tmp_path / f"scripted{len(servers)}.sock")
        servers.append(ScriptedServer(path, script))
        return path, servers[-1]

    yield make
    for s in servers:
        s.close()


@pytest.mark.parametrize("post, path", [
    (lambda c: c.request("POST", "/v1/receives", b'{"req_id":"r1","nbytes":16}', "application/json"), "/v1/receives"),
    # Client.write's own lean request, on the same kept connections.
    (lambda c: c.write(ferry.Slot(session="127.0.0.1:1", buffer_address=4096, key="00" * 20), b"z" * 64), "/v1/writes?"),
])
def test_a_post_the_server_may_have_acted_on_is_not_sent_again(scripted, post, path):
    sock, server = scripted(["answer", "drop", "answer"])
    dial = CountingDial(sock)
    c = ferry.Client(sock, dial=dial)
    c.status()
    with pytest.raises(ferry.NoAnswer, match="may have been carried out"):
        post(c)
    assert len(server.seen) == 2 and server.seen[0] == ("GET", "/v1/status")
    assert server.seen[1][0] == "POST" and server.seen[1][1].startswith(path)
    assert dial.count == 1


@pytest.mark.parametrize("method", ["GET", "DELETE"])
def test_a_read_or_delete_is_sent_again_on_a_fresh_connection(scripted, method):
    path, server = scripted(["answer", "drop", "answer"])
    dial = CountingDial(path)
    c = ferry.Client(path, dial=dial)
    c.status()
    assert c.request(method, "/v1/receives/r1").status == 200
    assert server.seen == [("GET", "/v1/status"), (method, "/v1/receives/r1"), (method, "/v1/receives/r1")]
    assert dial.count == 2


def test_a_delete_sent_again_that_finds_nothing_answers_as_done(scripted):
    # The dropped DELETE may have been carried out before the connection
    # closed: its resend's not_found means what was asked holds.
    path, server = scripted(["answer", "drop", "not found", "not found"])
    c = ferry.Client(path)
    c.status()
    c.free("r1")
    assert server.seen == [("GET", "/v1/status"), ("DELETE", "/v1/receives/r1"), ("DELETE", "/v1/receives/r1")]
    # Asked once, not_found is an answer like any other.
    with pytest.raises(ferry.NotFound):
        c.free("r1")


def test_no_answer_within_the_clients_timeout(scripted):
    path, server = scripted(["hang"])
    with pytest.raises(ferry.NoAnswer, match="within 0.2 s"):
        ferry.Client(path, timeout=0.2).status()
    assert server.seen == [("GET", "/v1/status")]


def test_a_forked_child_does_not_share_kept_connections(pair):
    # The parent's kept-alive connection is not the child's to use: it
    # dials its own, and the parent's stays in step.
    dial = CountingDial(pair[0].socket)
    with ferry.Client(pair[0].socket, dial=dial) as c:
        c.status()
        assert dial.count == 1
        pid = os.fork()
        if pid == 0:
            try:
                ok = c.status()["pid"] == pair[0].pid and dial.count == 2
            except BaseException:
                ok = False
            os._exit(0 if ok else 1)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert c.status()["pid"] == pair[0].pid
        assert dial.count == 1


def test_a_write_is_one_request_on_a_kept_connection(pair, rx, req_id):
    # Client.write: the bytes go inline with one POST /v1/writes, on the
    # connection the other calls keep; the answer comes once they landed.
    dial = CountingDial(pair[0].socket)
    c = ferry.Client(pair[0].socket, dial=dial)
    data = os.urandom(200_000)
    slot = rx.receive(req_id, len(data))
    assert c.write(slot, memoryview(data))["nbytes"] == len(data)
    assert rx.wait(req_id, 10) == data
    rx.free(req_id)
    for i in range(3):
        slot = rx.receive(f"{req_id}-{i}", 16)
        c.write(slot, b"x" * 16)
        rx.free(f"{req_id}-{i}")
    assert dial.count == 1
    assert c.embeddings() == []  # nothing was staged


def test_a_refused_write_raises_and_keeps_the_connection(pair, rx, req_id):
    dial = CountingDial(pair[0].socket)
    c = ferry.Client(pair[0].socket, dial=dial)
    slot = rx.receive(req_id, 16)
    rx.free(req_id)
    with pytest.raises(ferry.Refused, match="nothing is kept"):
        c.write(slot, b"y" * 16)
    with pytest.raises(ferry.BadRequest, match="more than the 16 of the receive slot"):
        c.write(slot, b"y" * 17)
    c.status()
    assert dial.count == 1


def test_a_list_of_buffers_is_staged_one_after_another(tx, rx, req_id):
    parts = [os.urandom(n) for n in (1, 4096, 70_000)]
    e = tx.stage(req_id, [memoryview(p) for p in parts])
    assert e["nbytes"] == sum(map(len, parts))
    slot = rx.receive(req_id, e["nbytes"])
    tx.send(req_id, slot)
    assert rx.wait(req_id, 10) == b"".join(parts)
    rx.free(req_id)


def test_a_large_body_goes_out_on_a_larger_send_buffer(pair, req_id):
    # A Unix socket's default send buffer (some 200 KiB) makes a 64 MiB
    # upload cost both ends hundreds of wake-ups: the connection that
    # sends one asks for more (the kernel caps it at wmem_max).
    dial = CountingDial(pair[0].socket)
    c = ferry.Client(pair[0].socket, dial=dial)
    c.stage(req_id, [bytes(1 << 20)])
    conn = c._transport._idle[0]
    assert conn.sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF) >= min(2 << 20, int(open("/proc/sys/net/core/wmem_max").read()))
    c.delete(req_id)
    assert dial.count == 1
