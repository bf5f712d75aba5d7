"""The arena mapping and the zero-copy helpers: bounds, the staging
context manager's cleanup, a GPU arena's plain refusal, and ferry
without torch."""

import os
import shutil
import subprocess
import sys

import pytest

import ferry

from conftest import REPO


def test_the_mapping_is_the_arena(pair, tx, req_id):
    with tx.map_arena() as m:
        st = tx.status()["memory"]
        assert m.size == st["size"] and m.arena_file == st["arena_file"] and m.huge_pages is False
        sl = tx.slice(req_id, nbytes=1000)
        m.view(sl["offset"], 1000)[:] = b"z" * 1000
        entry = tx.commit(req_id, (10, 100), "u8")
        assert entry["state"] == "staged"
        # What was written through the mapping is what ferryd sends.
        with pair[1].client() as rx:
            slot = rx.receive(req_id, 1000)
            tx.send(req_id, slot)
            assert rx.wait(req_id, 10) == b"z" * 1000
            rx.free(req_id)
        with pytest.raises(ValueError, match=r"outside ferryd's arena \(67108864 bytes\)"):
            m.view(m.size - 10, 11)
        with pytest.raises(ValueError, match="outside"):
            m.view(-1, 1)


def test_an_arena_in_use_is_not_unmapped(tx):
    m = tx.map_arena()
    v = m.view(0, 16)
    with pytest.raises(BufferError, match="still alive"):
        m.close()
    v.release()
    m.close()


def test_staging_commits_on_success(tx, req_id):
    with tx.staging(req_id, (4, 8), "i32") as r:
        assert (r.req_id, r.nbytes, r.shape, r.dtype) == (req_id, 128, (4, 8), "i32")
        r.memory[:] = bytes(range(128))
    assert (r.entry["state"], r.entry["shape"], r.entry["dtype"]) == ("staged", [4, 8], "i32")
    with tx.map_arena() as m:
        assert bytes(m.view(r.offset, 128)) == bytes(range(128))
    tx.delete(req_id)


def test_staging_deletes_the_reservation_when_the_block_raises(tx, req_id):
    used = tx.status()["memory"]["used"]
    with pytest.raises(RuntimeError, match="the encoder broke"):
        with tx.staging(req_id, (16, 4096), "bf16") as r:
            assert tx.embedding(req_id)["state"] == "reserved"
            r.memory[:4] = b"half"
            raise RuntimeError("the encoder broke")
    with pytest.raises(ferry.NoEmbedding):
        tx.embedding(req_id)
    assert tx.status()["memory"]["used"] == used


def test_staging_deletes_the_reservation_when_the_commit_fails(tx, req_id):
    # The block deletes the entry itself: the commit then finds nothing,
    # and the error is the commit's.
    with pytest.raises(ferry.NoEmbedding):
        with tx.staging(req_id, (8,), "u8"):
            tx.delete(req_id)
    assert req_id not in [e["req_id"] for e in tx.embeddings()]


def test_staging_refuses_bad_shapes_and_dtypes_before_reserving(tx, req_id):
    with pytest.raises(ValueError, match="unknown dtype 'f12'"):
        with tx.staging(req_id, (8,), "f12"):
            pass
    with pytest.raises(ValueError, match="every dimension must be positive"):
        with tx.staging(req_id, (8, 0), "f32"):
            pass
    with pytest.raises(TypeError, match="sequence of positive ints"):
        with tx.staging(req_id, 8, "f32"):
            pass
    assert req_id not in [e["req_id"] for e in tx.embeddings()]


@pytest.mark.skipif(shutil.which("gcc") is None, reason="gcc builds the stand-in CUDA driver (make deps installs it)")
def test_a_gpu_arena_says_the_cuda_path_is_not_here_yet(start_daemon, tmp_path, req_id):
    # ferryd on a GPU arena, over the stand-in libcuda.so.1 the Go tests use.
    lib = tmp_path / "fakecuda"
    lib.mkdir()
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(lib / "libcuda.so.1"),
                    str(REPO / "internal" / "fakecuda" / "testdata" / "fakecuda.c")], check=True, timeout=120)
    d = start_daemon("gpu", "--device", "cuda:0", "--bounce-size", "1MiB", env={"LD_LIBRARY_PATH": str(lib)})
    with d.client() as c:
        assert c.status()["memory"]["kind"] == "cuda"
        def stage_in_place():
            with c.staging(req_id, (8,), "u8"):
                pytest.fail("staging went ahead on a GPU arena")

        for helper in (c.map_arena, stage_in_place):
            with pytest.raises(ferry.GPUArenaNotSupported) as info:
                helper()
            e = info.value
            assert isinstance(e, NotImplementedError) and isinstance(e.__cause__, ferry.BadRequest)
            assert "GPU memory (cuda:0)" in e.message and "CUDA IPC handle" in e.message and "Client.stage" in e.message
        assert c.embeddings() == []  # nothing was reserved
        # Upload staging still works there.
        c.stage(req_id, b"g" * 64)
        c.delete(req_id)


def _python(code):
    package = os.path.dirname(os.path.dirname(ferry.__file__))
    env = {**os.environ, "PYTHONPATH": package}
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)


def test_ferry_imports_without_torch(pair):
    out = _python(
        "import sys\n"
        "sys.modules['torch'] = None  # as if torch were not installed\n"
        "import ferry\n"
        f"c = ferry.Client({pair[0].socket!r})\n"
        "c.status()\n"
        "with c.staging('py-no-torch', (4,), 'f32') as r:\n"
        "    r.memory[:] = bytes(16)\n"
        "    try:\n"
        "        r.tensor()\n"
        "    except ImportError as e:\n"
        "        print(e)\n"
        "c.delete('py-no-torch')\n")
    assert out.returncode == 0, out.stderr
    assert "torch is not installed" in out.stdout
    assert "apt install python3-torch" in out.stdout


def test_importing_ferry_does_not_import_torch():
    out = _python("import sys, ferry; print('torch' in sys.modules)")
    assert out.returncode == 0 and out.stdout.strip() == "False", out.stderr
