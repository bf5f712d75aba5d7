"""ferry: the Python client of ferryd, ferry's per-host tensor transfer daemon.

    import ferry
    rx = ferry.Client("/run/ferry/ferryd.sock")      # the receiving host
    slot = rx.receive("r1", ferry.nbytes((16, 4096), "bf16"))
    # ... hand slot.to_dict() to the sender ...
    tx = ferry.Client()                                # the sending host
    tx.stage("r1", tensor)
    tx.send("r1", slot)
    data = rx.wait("r1", timeout=30)

docs/python.md has the rest. torch is optional: only the tensor helpers need it.
"""

from .arena import ArenaMapping
from .client import DEFAULT_SOCKET, Client, Reservation, Response, Slot
from .cuda import CUDARegion
from .regions import Region, new_memfd
from .dtypes import NAMES as DTYPES
from .dtypes import nbytes
from .errors import (ArenaFull, BadRequest, Busy, Exists, FerryError, Forbidden, GPUArenaNotSupported, Internal,
                     MethodNotAllowed, NoAnswer, NoEmbedding, NotFound, Refused, Timeout, TooLarge, TransferFailed,
                     Unavailable, Unreachable)

__version__ = "0.1.0"

__all__ = [
    "Client", "Slot", "Reservation", "Response", "ArenaMapping", "Region", "CUDARegion", "new_memfd", "nbytes", "DTYPES", "DEFAULT_SOCKET",
    "FerryError", "BadRequest", "Refused", "Forbidden", "NoEmbedding", "NotFound", "MethodNotAllowed", "Exists",
    "Busy", "TooLarge", "Internal", "TransferFailed", "Unavailable", "Timeout", "ArenaFull", "Unreachable",
    "NoAnswer", "GPUArenaNotSupported",
]
