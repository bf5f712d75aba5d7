"""The exceptions the ferry client raises.

ferryd answers every failure with one envelope,
``{"error": {"code": "...", "message": "..."}}``, and a status that goes
with the code (docs/api.md, "Errors"). Each code has its class here, so
callers catch what they can act on (``except ferry.NoEmbedding``) and
read the daemon's sentence, which says what happened and what to do.
"""

import json
import re

__all__ = [
    "FerryError", "BadRequest", "Refused", "Forbidden", "NoEmbedding", "NotFound",
    "MethodNotAllowed", "Exists", "Busy", "TooLarge", "Internal", "TransferFailed",
    "Unavailable", "Timeout", "ArenaFull", "Unreachable", "NoAnswer", "GPUArenaNotSupported",
]


class FerryError(Exception):
    """Anything ferry raises: an answer ferryd gave, or no answer at all.

    ``status`` is the HTTP status (None when ferryd never answered),
    ``code`` the envelope's code, ``message`` ferryd's sentence.
    """

    code = None  # each subclass's envelope code

    def __init__(self, message, status=None, code=None):
        super().__init__(message)
        self.message = message
        self.status = status
        if code is not None:
            self.code = code

    def __str__(self):
        return f"{self.message} ({self.code})" if self.code else self.message


class BadRequest(FerryError):
    """400: malformed input (JSON, dtype, shape, req_id, a body of the wrong size)."""
    code = "bad_request"


class Refused(FerryError):
    """400: the receiving daemon refused the write (no live slot with that address and key)."""
    code = "refused"


class Forbidden(FerryError):
    """403: the caller is not on ferryd's allow_uids/allow_gids."""
    code = "forbidden"


class NoEmbedding(FerryError):
    """404: nothing is staged under the req_id (after wait_ms)."""
    code = "no_embedding"


class NotFound(FerryError):
    """404: no such receive slot, session or route."""
    code = "not_found"


class MethodNotAllowed(FerryError):
    """405: a known path asked with the wrong method."""
    code = "method_not_allowed"


class Exists(FerryError):
    """409: the req_id is already staged, or already has a receive slot."""
    code = "exists"


class Busy(FerryError):
    """409: the entry is being sent or uploaded."""
    code = "busy"


class TooLarge(FerryError):
    """413: larger than the whole arena, or a JSON body over max_body_bytes."""
    code = "too_large"


class Internal(FerryError):
    """500: a fault inside ferryd; the entry or slot stays for a retry."""
    code = "internal"


class TransferFailed(FerryError):
    """502: the transport failed after the retries; the staged entry is kept.

    ``req_id``, ``session``, ``nbytes`` and ``ret`` (a verbs status, an
    errno name, ``timeout``, ``eof``, ...) are read from ferryd's message,
    which names them as ``(session=..., nbytes=..., ret=...)``; each is
    None when the message does not carry it.
    """
    code = "transfer_failed"

    # daemon/send.go writes: "transfer of R failed (session=S, nbytes=N, ret=X) after ..."
    _FIELDS = re.compile(
        r"(?:transfer of (?P<req_id>\S+) failed )?"
        r"\(session=(?P<session>[^,)]*), nbytes=(?P<nbytes>\d+), ret=(?P<ret>[^)]*)\)")

    def __init__(self, message, status=None, code=None):
        super().__init__(message, status, code)
        m = self._FIELDS.search(message)
        self.req_id = m["req_id"] if m else None
        self.session = m["session"] if m else None
        self.nbytes = int(m["nbytes"]) if m else None
        self.ret = m["ret"] if m else None


class Unavailable(FerryError):
    """503: ferryd is shutting down."""
    code = "unavailable"


class Timeout(FerryError):
    """504: a wait ran out with nothing arrived, or the request outlived request_timeout."""
    code = "timeout"


class ArenaFull(FerryError):
    """507: it would fit the arena, but not the free space now."""
    code = "arena_full"


class Unreachable(FerryError):
    """ferryd's control socket could not be reached at all; ``socket_path`` names it."""
    code = "unreachable"

    def __init__(self, message, socket_path):
        super().__init__(message)
        self.socket_path = socket_path


class NoAnswer(FerryError):
    """ferryd took the request (or may have) but no answer came: the
    connection closed, or the client's timeout ran out. A request that
    changes state may have been carried out: look before repeating it."""
    code = "no_answer"


class GPUArenaNotSupported(FerryError, NotImplementedError):
    """ferryd's arena is GPU memory, which this package cannot map yet
    (that takes the CUDA IPC handle, opened through the CUDA driver)."""


# Every code of docs/api.md's error table, to its class.
_BY_CODE = {cls.code: cls for cls in (
    BadRequest, Refused, Forbidden, NoEmbedding, NotFound, MethodNotAllowed, Exists, Busy,
    TooLarge, Internal, TransferFailed, Unavailable, Timeout, ArenaFull)}


def from_answer(status, body):
    """The exception for an answer that is not a success: the envelope's
    code picks the class (an unknown code gives FerryError); an answer
    without an envelope (431 from the HTTP server, say) gives FerryError
    with code ``http_<status>`` and the body as its message."""
    try:
        err = json.loads(body)["error"]
        code, message = err["code"], err["message"]
        if not isinstance(code, str) or not isinstance(message, str) or not code:
            raise ValueError
    except (ValueError, KeyError, TypeError):
        text = body.decode("utf-8", "replace").strip() if isinstance(body, (bytes, bytearray)) else str(body)
        return FerryError(text or f"HTTP status {status} without a body", status, f"http_{status}")
    return error_for(code, message, status)


def error_for(code, message, status=None):
    """The exception of an error envelope's code and message, wherever the
    envelope came from: an answer (with its status), or a failed batch
    transfer's description (status None)."""
    return _BY_CODE.get(code, FerryError)(message, status, code)
