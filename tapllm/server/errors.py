"""vLLM-style error bodies and strict JSON encoding for every response of the server.

An error body is vLLM's: ``{"error": {"message", "type", "param", "code"}}`` where ``type`` is
vLLM's name for the status (``BadRequestError``, ``NotFoundError``, ...), ``code`` the HTTP status
as an integer and ``param`` the request field at fault (``None`` when no one field is).

Every body the server writes is valid JSON: NaN and infinities become ``null`` (the
standard has no spelling for them), and text that is not valid Unicode (a lone surrogate
echoed back in an error message) is written with backslash escapes instead of failing.
"""

from __future__ import annotations

import json
import logging
import math
import re
from collections.abc import Iterable
from http import HTTPStatus
from typing import Any

from tapllm.utils.text import check_unicode

logger = logging.getLogger("tapllm")

# HTTP status of each error type a request can finish with (``Request.error_type``).
ERROR_STATUS = {"invalid_request_error": 400, "server_error": 500, "service_unavailable": 503}

# vLLM's error type of each status (vllm/entrypoints/serve/exception_handling); others: the status phrase.
ERROR_TYPES = {400: "BadRequestError", 404: "NotFoundError", 422: "UnprocessableEntityError",
               500: "InternalServerError", 501: "NotImplementedError", 503: "ServiceUnavailableError"}

_LEADING_FIELD = re.compile(r"[A-Za-z_]\w*(?:\[\d+\])?(?:\.[A-Za-z_]\w*(?:\[\d+\])?)*")


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


def error_type(status: int) -> str:
    """vLLM's ``type`` for an error answered with ``status``."""
    if status in ERROR_TYPES:
        return ERROR_TYPES[status]
    try:
        return HTTPStatus(status).phrase
    except ValueError:  # 499, a client that went away, is no standard status
        return "ClientClosedRequest" if status == 499 else "Error"


def error_body(message: str, status: int, param: str | None = None) -> dict[str, Any]:
    """``{"error": {...}}`` as vLLM writes it: ``code`` is the HTTP status."""
    return {"error": {"message": message, "type": error_type(status), "param": param, "code": status}}


def param_of(message: str, fields: Iterable[str]) -> str | None:
    """The request field a validation message starts by naming (``"top_p must be ..."`` -> ``top_p``), if
    its root is one of ``fields``; the prompt's token count over the context is vLLM's ``input_tokens``."""
    if message.startswith("prompt is ") and "the model's context" in message:
        return "input_tokens"
    found = _LEADING_FIELD.match(message)
    if found is None:
        return None
    name = found.group(0)
    return name if re.split(r"[.\[]", name, maxsplit=1)[0] in set(fields) else None


class APIError(Exception):
    """An error answered with a vLLM-style body (``param``: the request field at fault)."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param

    def body(self) -> bytes:
        """The response body."""
        return encode(error_body(self.message, self.status, self.param))


def check_text(text: str, field: str) -> None:
    """``APIError`` 400 naming ``field`` if ``text`` is not valid Unicode (holds a lone surrogate).

    JSON can carry ``"\\ud800"`` escapes that no UTF-8 text has (``tapllm.utils.text.check_unicode``).
    """
    try:
        check_unicode(text, field)
    except ValueError as exc:
        raise APIError(400, str(exc), param=field) from None
