"""OpenAI-style error bodies and strict JSON encoding for every response of the server.

Every body the server writes is valid JSON: NaN and infinities become ``null`` (the
standard has no spelling for them), and text that is not valid Unicode (a lone surrogate
echoed back in an error message) is written with backslash escapes instead of failing.
"""

from __future__ import annotations

import json
import logging
import math
from typing import Any

from tapllm._text import check_unicode

logger = logging.getLogger("tapllm")

# HTTP status of each error type a request can finish with.
ERROR_STATUS = {"invalid_request_error": 400, "server_error": 500, "service_unavailable": 503}


def finite_or_none(obj: Any) -> Any:
    """``obj`` with every NaN or infinite float replaced by ``None`` (recursively)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: finite_or_none(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [finite_or_none(v) for v in obj]
    return obj


def dumps(obj: Any) -> str:
    """Strict JSON text of ``obj`` (non-finite floats become null)."""
    try:
        return json.dumps(obj, ensure_ascii=False, allow_nan=False)
    except ValueError:  # a NaN or infinity somewhere: never write invalid JSON
        logger.debug("non-finite number in a response body, written as null")
        return json.dumps(finite_or_none(obj), ensure_ascii=False, allow_nan=False)


def encode(obj: Any) -> bytes:
    """``dumps(obj)`` as UTF-8; lone surrogates are written as ``\\udXXX`` escapes."""
    return dumps(obj).encode("utf-8", "backslashreplace")


def error_body(message: str, type_: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    """``{"error": {...}}`` as the OpenAI API writes it."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


class APIError(Exception):
    """An error answered with an OpenAI-style body."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def body(self) -> bytes:
        """The response body."""
        return encode(error_body(self.message, self.type, self.param, self.code))


def check_text(text: str, field: str) -> None:
    """``APIError`` 400 naming ``field`` if ``text`` is not valid Unicode (holds a lone surrogate).

    JSON can carry ``"\\ud800"`` escapes that no UTF-8 text has (``tapllm._text.check_unicode``).
    """
    try:
        check_unicode(text, field)
    except ValueError as exc:
        raise APIError(400, str(exc), param=field) from None
