"""OpenAI-shaped error bodies, and the one mapping from berth errors to HTTP answers.

Every HTTP error berth sends, from the proxy or the admin API, has the body the OpenAI API
reference documents for errors (https://platform.openai.com/docs/guides/error-codes)::

    {"error": {"message": "...", "type": "invalid_request_error", "param": null, "code": null}}

so that OpenAI client libraries surface the message. :func:`error_from_exception` is the
translation point for :class:`berth.errors.BerthError`: it reads the exception's ``http_status``
and ``error_type`` class attributes and, where present, three optional attributes:

* ``error_code: str | None`` -- the ``code`` field (a stable machine-readable name);
* ``param: str | None`` -- the ``param`` field (the request field at fault);
* ``retry_after_s: float`` -- adds a ``Retry-After`` header (RFC 9110 section 10.2.3, whole
  seconds, rounded up).
"""

from __future__ import annotations

import json
import math
from typing import NamedTuple

from berth.errors import BerthError, NotFoundError

_INTERNAL_MESSAGE = "internal server error"


class ErrorResponse(NamedTuple):
    """An HTTP error answer: status, JSON body bytes, and extra headers (name -> value)."""

    status: int
    body: bytes
    headers: dict[str, str]


def error_body(
    message: str, *, type: str, code: str | None = None, param: str | None = None
) -> bytes:
    """Serialise one OpenAI error object: ``{"error": {"message", "type", "param", "code"}}``.

    ``type`` is the OpenAI error type (``invalid_request_error``, ``authentication_error``,
    ``permission_error``, ``not_found_error``, ``rate_limit_error``, ``server_error``, or a
    berth one such as ``engine_error``). Returns compact UTF-8 JSON.
    """
    error = {"message": message, "type": type, "param": param, "code": code}
    return json.dumps({"error": error}, separators=(",", ":")).encode()


def error_from_exception(exc: BaseException) -> ErrorResponse:
    """Map an exception to ``(status, body, extra headers)``.

    A :class:`BerthError` keeps its status, type and message (see the module docstring for the
    optional ``error_code``, ``param`` and ``retry_after_s``). A missing model or deployment
    gets the code ``<kind>_not_found`` (OpenAI answers an unknown model with
    ``model_not_found``). Any other exception is a bug: it becomes a 500 whose body does not
    leak the exception's text; the caller logs it.
    """
    if not isinstance(exc, BerthError):
        return ErrorResponse(500, error_body(_INTERNAL_MESSAGE, type="server_error"), {})
    code = _optional_str(exc, "error_code")
    if code is None and isinstance(exc, NotFoundError):
        code = exc.not_found_code
    body = error_body(str(exc), type=exc.error_type, code=code, param=_optional_str(exc, "param"))
    headers: dict[str, str] = {}
    retry_after_s = getattr(exc, "retry_after_s", None)
    if isinstance(retry_after_s, int | float) and not isinstance(retry_after_s, bool):
        headers["Retry-After"] = str(max(0, math.ceil(retry_after_s)))
    return ErrorResponse(exc.http_status, body, headers)


def stream_error_events(
    message: str, *, type: str = "server_error", code: str | None = None
) -> bytes:
    """The bytes that end an event stream which failed after it began.

    One ``data:`` event holding an OpenAI error object, then ``data: [DONE]``, the terminator
    OpenAI chat and completion streams use, so clients stop reading instead of hanging.
    """
    return b"data: " + error_body(message, type=type, code=code) + b"\n\ndata: [DONE]\n\n"


def _optional_str(exc: BaseException, name: str) -> str | None:
    value = getattr(exc, name, None)
    return value if isinstance(value, str) else None
