"""ferry's dtype names, their element sizes, and torch's names for them.

torch is optional: nothing here imports it until a torch helper is
called, and a tensor is recognised only when the caller's process has
imported torch already (it cannot have made one otherwise).
"""

import math
import operator
import sys

# ferry's name: (element size in bytes, torch's name). docs/api.md lists
# the names; ferryd also takes torch's spellings, as this table does.
_DTYPES = {
    "f64": (8, "float64"), "f32": (4, "float32"), "f16": (2, "float16"), "bf16": (2, "bfloat16"),
    "f8e4m3": (1, "float8_e4m3fn"), "f8e5m2": (1, "float8_e5m2"),
    "i64": (8, "int64"), "i32": (4, "int32"), "i16": (2, "int16"), "i8": (1, "int8"),
    "u8": (1, "uint8"), "bool": (1, "bool"),
}
_BY_TORCH_NAME = {t: n for n, (_, t) in _DTYPES.items()}

NAMES = tuple(sorted(_DTYPES))


def _torch_module():
    return sys.modules.get("torch")


def require_torch():
    """The torch module, or ImportError saying how to get it."""
    try:
        import torch
    except ImportError as e:
        raise ImportError(
            "this ferry helper makes torch tensors, and torch is not installed for this Python: "
            "install it (Debian: apt install python3-torch), or use the memoryview helpers "
            "(ArenaMapping.view, Client.received_view, Reservation.memory)") from e
    return torch


def is_tensor(obj):
    torch = _torch_module()
    return torch is not None and isinstance(obj, torch.Tensor)


def canonical(dtype):
    """ferry's name for dtype: a ferry name (bf16), torch's name for one
    (bfloat16), or a torch.dtype."""
    torch = _torch_module()
    if torch is not None and isinstance(dtype, torch.dtype):
        name = str(dtype).removeprefix("torch.")
        if name in _BY_TORCH_NAME:
            return _BY_TORCH_NAME[name]
        raise ValueError(
            f"{dtype} has no ferry dtype: ferry carries {', '.join(NAMES)}; "
            "view the tensor as one of them (e.g. tensor.view(torch.uint8)) and back on the other side")
    if not isinstance(dtype, str):
        raise TypeError(f"dtype must be a ferry dtype name ({', '.join(NAMES)}), torch's name for one, "
                        f"or a torch.dtype, not {type(dtype).__name__}")
    name = dtype.strip().lower()
    if name in _DTYPES:
        return name
    if name in _BY_TORCH_NAME:
        return _BY_TORCH_NAME[name]
    raise ValueError(f"unknown dtype {dtype!r}: use one of {', '.join(NAMES)}, "
                     "or torch's name for one (float32, bfloat16, ...)")


def shape_of(shape):
    """shape as a tuple of positive ints, or an error saying what is wrong."""
    if isinstance(shape, (str, bytes)) or not hasattr(shape, "__iter__"):
        raise TypeError(f"shape must be a sequence of positive ints, e.g. (16, 4096), not {shape!r}")
    try:
        dims = tuple(operator.index(d) for d in shape)
    except TypeError:
        raise TypeError(f"shape {shape!r} has a dimension that is not an int: give positive ints, e.g. (16, 4096)") from None
    if not dims:
        raise ValueError("shape is empty: give 1 to 8 positive dimensions (reshape a 0-d tensor to (1,))")
    if any(d <= 0 for d in dims):
        raise ValueError(f"shape {dims}: every dimension must be positive")
    return dims


def itemsize(dtype):
    return _DTYPES[canonical(dtype)][0]


def nbytes(shape, dtype):
    """The byte count of a tensor of shape and dtype, as ferryd counts it."""
    return math.prod(shape_of(shape)) * itemsize(dtype)


def torch_dtype(dtype):
    """torch's dtype for a ferry dtype (the installed torch must have it)."""
    torch = require_torch()
    name = _DTYPES[canonical(dtype)][1]
    try:
        return getattr(torch, name)
    except AttributeError:
        raise ValueError(f"torch {torch.__version__} has no {name} (ferry's {canonical(dtype)}): "
                         "use a torch that has it, or view the bytes as u8") from None


def tensor_bytes(t):
    """A CPU tensor's bytes, in row-major order, as a buffer for upload (a
    copy only where the tensor is on a GPU or not contiguous)."""
    flat = t.detach().cpu().contiguous().reshape(-1)
    torch = _torch_module()
    if flat.dtype != torch.uint8:
        flat = flat.view(torch.uint8)
    return memoryview(flat.numpy())


def tensor_over(memory, shape, dtype):
    """A torch tensor of shape and dtype over memory, sharing it (no copy)."""
    torch = require_torch()
    tdt = torch_dtype(dtype)
    shape = shape_of(shape)
    need = nbytes(shape, dtype)
    if memory.nbytes != need:
        raise ValueError(f"shape {shape} {canonical(dtype)} is {need} bytes, but the memory is {memory.nbytes} bytes")
    return torch.frombuffer(memory, dtype=tdt).view(shape)


def device_name(device):
    """ferryd's name for a device ("cuda:3", "cpu"): such a name as given,
    a torch.device, or a tensor's (its ``.device``); None stays None (the
    first of ferryd's devices)."""
    if device is None or isinstance(device, str):
        return device
    device = getattr(device, "device", device)  # a tensor: the device it is on
    kind, index = getattr(device, "type", None), getattr(device, "index", None)
    if kind == "cpu":
        return "cpu"
    if kind == "cuda":
        if index is None:  # torch.device("cuda"): the current one
            index = require_torch().cuda.current_device()
        return f"cuda:{index}"
    raise ValueError(f"{device!r} is not a device ferryd keeps an arena on: give \"cuda:N\" or \"cpu\", "
                     "a torch.device, or a tensor on one")
