"""Every error code of docs/api.md's table maps to its class: provoked
from real ferryd where a client can provoke it, from canned envelopes
for the rest (internal: only a failed copy into GPU memory raises it)."""

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile

import pytest

import ferry
from ferry.errors import from_answer

from conftest import poll_until, stalled_upload

# docs/api.md's error table, written from the docs: code, status, class.
TABLE = [
    ("bad_request", 400, ferry.BadRequest), ("refused", 400, ferry.Refused), ("forbidden", 403, ferry.Forbidden),
    ("no_embedding", 404, ferry.NoEmbedding), ("not_found", 404, ferry.NotFound),
    ("method_not_allowed", 405, ferry.MethodNotAllowed), ("exists", 409, ferry.Exists), ("busy", 409, ferry.Busy),
    ("too_large", 413, ferry.TooLarge), ("internal", 500, ferry.Internal),
    ("transfer_failed", 502, ferry.TransferFailed), ("unavailable", 503, ferry.Unavailable),
    ("timeout", 504, ferry.Timeout), ("arena_full", 507, ferry.ArenaFull),
]


def expect(cls, status, fn, *args, **kw):
    """Runs fn, which must fail with ferryd's answer of class cls and status."""
    with pytest.raises(cls) as info:
        fn(*args, **kw)
    e = info.value
    assert type(e) is cls and e.status == status and e.code == cls.code and e.message, e
    assert str(e) == f"{e.message} ({cls.code})"
    return e


# --- canned envelopes


@pytest.mark.parametrize("code,status,cls", TABLE, ids=[t[0] for t in TABLE])
def test_each_code_maps_to_its_class(code, status, cls):
    body = json.dumps({"error": {"code": code, "message": f"what happened to r1 ({code}) and what to do"}}).encode()
    e = from_answer(status, body)
    assert type(e) is cls and isinstance(e, ferry.FerryError)
    assert (e.status, e.code, e.message) == (status, code, f"what happened to r1 ({code}) and what to do")


def test_an_unknown_code_and_an_answer_without_envelope_are_ferry_errors():
    e = from_answer(418, b'{"error":{"code":"teapot","message":"short and stout"}}')
    assert type(e) is ferry.FerryError and (e.status, e.code, e.message) == (418, "teapot", "short and stout")
    e = from_answer(431, b"431 Request Header Fields Too Large\n")
    assert type(e) is ferry.FerryError and (e.status, e.code, e.message) == (431, "http_431", "431 Request Header Fields Too Large")


def test_transfer_failed_fields_from_a_canned_message():
    # As daemon/send.go words it.
    msg = ("transfer of r7 failed (session=mooncake://10.0.0.5:15302, nbytes=131072, ret=RETRY_EXC_ERR) after 2 "
           "attempt(s) in 812.0 ms: lane broke; the staged embedding is kept: resend when the peer is back, "
           "or DELETE /v1/embeddings/r7")
    e = from_answer(502, json.dumps({"error": {"code": "transfer_failed", "message": msg}}).encode())
    assert (e.req_id, e.session, e.nbytes, e.ret) == ("r7", "mooncake://10.0.0.5:15302", 131072, "RETRY_EXC_ERR")
    e = from_answer(502, b'{"error":{"code":"transfer_failed","message":"the path broke"}}')
    assert (e.req_id, e.session, e.nbytes, e.ret) == (None, None, None, None)


# --- provoked from real ferryd


def test_no_embedding(tx, rx, req_id):
    slot = rx.receive(req_id, 16)
    e = expect(ferry.NoEmbedding, 404, tx.send, req_id, slot)
    assert req_id in e.message
    expect(ferry.NoEmbedding, 404, tx.delete, req_id)
    expect(ferry.NoEmbedding, 404, tx.commit, req_id, (16,), "u8")
    rx.free(req_id)


def test_exists(tx, rx, req_id):
    tx.stage(req_id, b"e" * 16)
    expect(ferry.Exists, 409, tx.stage, req_id, b"e" * 16)
    tx.delete(req_id)
    rx.receive(req_id, 16)
    expect(ferry.Exists, 409, rx.receive, req_id, 16)
    rx.free(req_id)


def test_refused_for_a_key_that_is_no_slots(tx, rx, req_id):
    slot = rx.receive(req_id, 16)
    tx.stage(req_id, b"k" * 16)
    wrong = ("0" if slot.key[0] != "0" else "1") + slot.key[1:]
    e = expect(ferry.Refused, 400, tx.send, req_id, {**slot.to_dict(), "key": wrong})
    assert req_id in e.message
    assert tx.embedding(req_id)["state"] == "staged"  # kept for a retry
    tx.send(req_id, slot)
    assert rx.wait(req_id, 10) == b"k" * 16
    rx.free(req_id)


def test_not_found(tx, rx, req_id):
    expect(ferry.NotFound, 404, rx.wait, req_id, 0)
    expect(ferry.NotFound, 404, rx.free, req_id)
    expect(ferry.NotFound, 404, tx.teardown, "127.0.0.1:9")
    expect(ferry.NotFound, 404, tx.request, "GET", "/v1/nothing-here")


def test_method_not_allowed(tx):
    e = expect(ferry.MethodNotAllowed, 405, tx.request, "DELETE", "/v1/status")
    assert "GET" in e.message


def test_bad_request(tx, rx, req_id):
    e = expect(ferry.BadRequest, 400, tx.stage, req_id, b"abc", shape=(2,), dtype="u8")
    assert "3 bytes" in e.message and "2 bytes" in e.message
    expect(ferry.BadRequest, 400, tx.stage, "not a req id", b"abc")
    expect(ferry.BadRequest, 400, rx.receive, req_id, 0)
    assert req_id not in [x["req_id"] for x in tx.embeddings()]


def test_timeout(rx, req_id):
    rx.receive(req_id, 16)
    e = expect(ferry.Timeout, 504, rx.wait, req_id, 0.05)
    assert req_id in e.message
    with pytest.raises(ferry.Timeout, match="no data has arrived"):
        rx.received_view(req_id)
    rx.free(req_id)


def test_too_large_and_arena_full(tx, rx, req_id):
    # An upload larger than the arena: ferryd answers before taking the
    # body and closes; the client reads that answer.
    expect(ferry.TooLarge, 413, tx.stage, req_id, bytes(65 << 20))
    expect(ferry.TooLarge, 413, rx.receive, req_id, 1 << 30)
    rx.receive(req_id, 40 << 20)
    e = expect(ferry.ArenaFull, 507, rx.receive, req_id + "-2", 40 << 20)
    assert "--arena-size" in e.message
    rx.free(req_id)
    # The client and its kept connections go on after the early answer.
    assert tx.status()["staged"] >= 0


def test_transfer_failed_names_session_nbytes_and_ret(tx, req_id):
    # A port bound and never listened on: every dial is refused.
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        session = f"127.0.0.1:{closed.getsockname()[1]}"
        tx.stage(req_id, b"t" * 100)
        e = expect(ferry.TransferFailed, 502, tx.send, req_id, {"session": session, "buffer_address": 4096, "key": "ab" * 20})
    assert (e.req_id, e.session, e.nbytes, e.ret) == (req_id, session, 100, "ECONNREFUSED")
    assert tx.embedding(req_id)["state"] == "staged"  # kept for a retry
    tx.delete(req_id)


def test_busy_while_an_upload_is_in_flight(pair, tx, req_id):
    with stalled_upload(pair[0].socket, req_id, 4096) as upload:
        poll_until(lambda: any(e["req_id"] == req_id and e["state"] == "uploading" for e in tx.embeddings()),
                   10, f"{req_id} uploading")
        e = expect(ferry.Busy, 409, tx.delete, req_id)
        assert "uploading" in e.message
        upload.sendall(bytes(4095))
        assert upload.recv(64).startswith(b"HTTP/1.1 201 ")
    tx.delete(req_id)


def test_unavailable_while_draining(start_daemon, req_id):
    d = start_daemon("drain")
    c = d.client()
    with stalled_upload(d.socket, req_id, 4096):
        poll_until(lambda: any(e["state"] == "uploading" for e in c.embeddings()), 10, f"{req_id} uploading")
        d.proc.send_signal(signal.SIGTERM)
        line = d.wait_log(lambda line: str(line.get("message", "")).startswith("draining"), 10, "the draining line")
        assert line["in_flight"] == 1
        e = expect(ferry.Unavailable, 503, c.status)
        assert "shutting down" in e.message
    # The stalled upload ends with its connection; the drain then completes.
    assert d.wait_exit(10) == 0
    c.close()


@pytest.mark.skipif(os.geteuid() != 0, reason="running a client as other users needs root")
def test_forbidden_for_a_uid_off_the_allow_list(start_daemon):
    # Ids no account uses; the kernel needs none. 64990 owns the socket;
    # 64991 is allowed; 64992 may open the socket but is not on the list;
    # 64993 is in no group that may open it.
    directory = tempfile.mkdtemp(prefix="ferry-py-open-")
    os.chmod(directory, 0o755)
    try:
        d = start_daemon("acl", "--socket-group", "64990", "--allow-uids", "64991", directory=directory)
        script = (
            "import json, sys, ferry\n"
            "c = ferry.Client(sys.argv[1])\n"
            "out = []\n"
            "for call in (c.status, c.map_arena):\n"
            "    try:\n"
            "        call()\n"
            "        out.append(None)\n"
            "    except ferry.FerryError as e:\n"
            "        out.append([type(e).__name__, e.status, e.code, e.message])\n"
            "print(json.dumps(out))\n")
        package = os.path.dirname(os.path.dirname(ferry.__file__))
        env = {"PYTHONPATH": package, "PATH": os.environ.get("PATH", "")}

        def run_as(uid, gid):
            out = subprocess.run([sys.executable, "-c", script, d.socket], user=uid, group=gid, extra_groups=[],
                                 env=env, capture_output=True, timeout=60, cwd="/")
            assert out.returncode == 0, out.stderr.decode()
            return json.loads(out.stdout)

        for name, status, code, message in run_as(64992, 64990):
            assert (name, status, code) == ("Forbidden", 403, "forbidden") and "64992" in message
        for name, status, code, message in run_as(64993, 64993):
            assert (name, status, code) == ("Unreachable", None, "unreachable")
            assert "permission denied" in message and d.socket in message
        # The allowed uid is admitted, to the arena too.
        st, arena = run_as(64991, 64990)
        assert st is None and arena is None
    finally:
        for entry in os.listdir(directory):
            os.unlink(os.path.join(directory, entry))
        os.rmdir(directory)


def test_unreachable_names_the_socket_and_the_hint(tmp_path):
    missing = str(tmp_path / "no.sock")
    with pytest.raises(ferry.Unreachable) as info:
        ferry.Client(missing).status()
    e = info.value
    assert e.socket_path == missing and e.status is None and e.code == "unreachable"
    assert missing in str(e) and "no such socket" in str(e) and "FERRY_SOCKET" in str(e)
    # A socket file nothing listens on (a ferryd that stopped uncleanly).
    stale = str(tmp_path / "stale.sock")
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(stale)
        with pytest.raises(ferry.Unreachable, match="nothing listens on it"):
            ferry.Client(stale).map_arena()


def test_the_socket_comes_from_ferry_socket(monkeypatch, pair):
    monkeypatch.setenv("FERRY_SOCKET", pair[0].socket)
    assert ferry.Client().status()["pid"] == pair[0].pid
    monkeypatch.delenv("FERRY_SOCKET")
    assert ferry.Client().socket_path == ferry.DEFAULT_SOCKET == "/run/ferry/ferryd.sock"
