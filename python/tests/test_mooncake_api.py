"""ferry.mooncake's surface against Mooncake's Python engine, so that a
framework's one-import switch (``from mooncake.engine import
TransferEngine`` to ``from ferry.mooncake import TransferEngine``) meets
the names, parameters and opcodes it was written against. The list here
is Mooncake's (mooncake-integration's TransferEnginePy @3b5a5941: help()
of a build; ../shared/reference/inference-frameworks.md);
test_mooncake_real.py checks it against a real build where one is given
(MOONCAKE_PY)."""

import ctypes
import inspect
import re

import pytest

import ferry.mooncake as mc
from ferry.mooncake import TransferEngine, TransferOpcode

_ONE = "target_hostname, buffer, peer_buffer_address, length"
_BATCH = "target_hostname, buffers, peer_buffer_addresses, lengths"

# Every method of Mooncake's engine and its parameters as its pybind
# module states them: a name where Mooncake names the parameter (callers
# may pass it by keyword), "_" where it does not (pybind's argN: by
# position only), "name=default" where it has a default.
MOONCAKE_SIGNATURES = {
    "initialize": "_, _, _, _",
    "initialize_ext": "_, _, _, _, _",
    "get_rpc_port": "",
    "register_memory": "buffer_addr, capacity, location='*'",
    "unregister_memory": "_",
    "batch_register_memory": "buffer_addresses, capacities, location='*'",
    "batch_unregister_memory": "_",
    "allocate_managed_buffer": "_",
    "free_managed_buffer": "_, _",
    "get_first_buffer_address": "_",
    "write_bytes_to_buffer": "_, _, _",
    "read_bytes_from_buffer": "_, _",
    "transfer_sync_write": f"{_ONE}, transport_hint=''",
    "transfer_sync_read": f"{_ONE}, transport_hint=''",
    "batch_transfer_sync_write": f"{_BATCH}, transport_hint=''",
    "batch_transfer_sync_read": f"{_BATCH}, transport_hint=''",
    "transfer_sync": f"{_ONE}, opcode, notify=None, transport_hint=''",
    "batch_transfer_sync": f"{_BATCH}, opcode, notify=None, transport_hint=''",
    "transfer_submit_write": f"{_ONE}, transport_hint=''",
    "transfer_check_status": "_",
    "batch_transfer_async_write": f"{_BATCH}, transport_hint=''",
    "batch_transfer_async_read": f"{_BATCH}, transport_hint=''",
    "batch_transfer_async": f"{_BATCH}, opcode, transport_hint=''",
    "get_batch_transfer_status": "_",
    "get_notifies": "",
    "send_probe": "peer_server_name",
    "get_engine": "",
    "get_engine_ptr": "",
    "get_local_topology": "device_name=None",
    "warmup_efa_segment": "segment_name",
    # A build with USE_CUDA only.
    "transfer_write_on_cuda": f"{_ONE}, stream_ptr=0, transport_hint=''",
    "transfer_read_on_cuda": f"{_ONE}, stream_ptr=0, transport_hint=''",
    "batch_transfer_write_on_cuda": f"{_BATCH}, stream_ptr=0, transport_hint=''",
    "batch_transfer_read_on_cuda": f"{_BATCH}, stream_ptr=0, transport_hint=''",
}


def ferry_params(name):
    """ferry's method name's parameters in MOONCAKE_SIGNATURES' form, each
    as Mooncake's would read where Mooncake's is "_" and ferry's can be
    passed by position with no default."""
    out = []
    for p in list(inspect.signature(getattr(TransferEngine, name)).parameters.values())[1:]:
        assert p.kind == p.POSITIONAL_OR_KEYWORD, f"{name}: {p} is not a plain parameter"
        out.append(p.name if p.default is p.empty else f"{p.name}={p.default!r}")
    return out


def same_params(name, ferry, mooncake):
    """Whether ferry's parameters are Mooncake's, "_" matching any
    parameter without a default."""
    return len(ferry) == len(mooncake) and all(m == f or (m == "_" and "=" not in f) for f, m in zip(ferry, mooncake))


def split(params):
    return [p for p in params.split(", ") if p]


def test_every_method_has_mooncakes_parameters():
    # Names, order and defaults: a positional transport_hint lands in
    # transport_hint, and no internal parameter can be reached.
    for name, params in MOONCAKE_SIGNATURES.items():
        assert callable(getattr(TransferEngine, name, None)), name
        if name in mc._NOT_IMPLEMENTED:
            continue
        got = ferry_params(name)
        assert same_params(name, got, split(params)), f"{name}({', '.join(got)}): Mooncake's is {name}({params})"


def test_mooncakes_opcode_names_and_values():
    # Mooncake's spellings (TransferOpcode.Read/Write, module-level Read
    # and Write, TransferEngine.TransferOpcode) and ferry's older ones.
    assert (int(TransferOpcode.Read), int(TransferOpcode.Write)) == (0, 1)
    assert TransferOpcode.READ is TransferOpcode.Read and TransferOpcode.WRITE is TransferOpcode.Write
    assert (mc.Read, mc.Write) == (TransferOpcode.Read, TransferOpcode.Write)
    assert TransferEngine.TransferOpcode is TransferOpcode
    for name in ("TransferEngine", "TransferOpcode", "TransferNotify", "Read", "Write"):
        assert name in mc.__all__, name


class PybindOpcode:
    """Stands in for Mooncake's pybind enum: not an int, but int()-able
    (test_mooncake_real.py passes the real one)."""

    def __init__(self, value):
        self.value = value

    def __index__(self):
        return self.value

    def __repr__(self):
        return f"<TransferOpcode.{'Write' if self.value else 'Read'}: {self.value}>"


@pytest.mark.parametrize("opcode", [TransferOpcode.Write, TransferOpcode.WRITE, 1, PybindOpcode(1)])
def test_every_spelling_of_write_is_a_write(tmp_path, opcode):
    # The opcode is taken (an unregistered buffer is what fails), and a
    # positional transport_hint after it is taken too.
    engine = TransferEngine(socket_path=str(tmp_path / "none.sock"))
    assert engine.transfer_sync("127.0.0.1:1", 1, 2, 3, opcode, None, "tcp") == -1
    assert "register_memory it first" in engine.last_failure.message, engine.last_failure
    assert engine.batch_transfer_sync("127.0.0.1:1", [1], [2], [3], opcode, None, "rdma") == -1
    assert "register_memory it first" in engine.last_failure.message, engine.last_failure
    # The asynchronous submit reaches the write (which fails: an
    # unregistered buffer), not an opcode refusal.
    batch = engine.batch_transfer_async("127.0.0.1:1", [1], [2], [3], opcode, "tcp")
    assert batch > 0, engine.last_failure
    assert engine.get_batch_transfer_status([batch]) == -1
    assert engine.last_failure.method == "batch_transfer_async_write"
    assert "register_memory it first" in engine.last_failure.message, engine.last_failure
    assert engine.close() == 0


@pytest.mark.parametrize("opcode", [7, -1, True, "1", 1.0, None])
def test_other_opcodes_are_refused_naming_them(tmp_path, opcode):
    engine = TransferEngine(socket_path=str(tmp_path / "none.sock"))
    assert engine.transfer_sync("127.0.0.1:1", 1, 2, 3, opcode) == -1
    assert f"opcode {opcode!r}: want TransferOpcode.Write (1) or Read (0)" in engine.last_failure.message
    assert engine.batch_transfer_async("127.0.0.1:1", [1], [2], [3], opcode) == 0
    assert f"opcode {opcode!r}" in engine.last_failure.message


def test_every_method_of_mooncakes_engine_is_there(tmp_path):
    engine = TransferEngine(socket_path=str(tmp_path / "none.sock"))
    for name in mc._NOT_IMPLEMENTED:
        with pytest.raises(NotImplementedError, match=f"TransferEngine.{name}: .*docs/python.md"):
            getattr(engine, name)("127.0.0.1:1", 1, 2, 3)
    assert set(mc._NOT_IMPLEMENTED) <= set(MOONCAKE_SIGNATURES)
    assert engine.get_engine() is engine
    # transfer_sync's Read is a read (an unregistered buffer: -1); a notify
    # is a TransferNotify (test_mooncake_notifies.py).
    assert engine.transfer_sync("127.0.0.1:1", 1, 2, 3, TransferOpcode.Read) == -1
    assert engine.last_failure.method == "transfer_sync" and "register_memory it first" in engine.last_failure.message
    assert engine.batch_transfer_sync("127.0.0.1:1", [1], [2], [3], TransferOpcode.Write, notify=("a", "b")) == -1
    assert "want a TransferNotify(name, msg)" in engine.last_failure.message


@pytest.mark.parametrize("length", [-1, -4096, 1.5, "4", True, None])
def test_read_bytes_from_buffer_refuses_a_length_not_a_byte_count(tmp_path, length):
    # Mooncake's raises TypeError (its binding takes a size_t); a negative
    # length read up to the first NUL byte here.
    buf = ctypes.create_string_buffer(b"abc\0def", 8)
    engine = TransferEngine(socket_path=str(tmp_path / "none.sock"))
    with pytest.raises(TypeError, match=f"length {re.escape(repr(length))}: want a whole number of bytes, 0 or more"):
        engine.read_bytes_from_buffer(ctypes.addressof(buf), length)
    assert engine.read_bytes_from_buffer(ctypes.addressof(buf), 0) == b""
    assert engine.read_bytes_from_buffer(ctypes.addressof(buf), 7) == b"abc\0def"
