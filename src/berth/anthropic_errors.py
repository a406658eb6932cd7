"""Anthropic-shaped error bodies for the Messages API paths, converted from berth's own.

berth's errors are answered in the OpenAI shape everywhere (:mod:`berth.openai_errors`);
a request to ``/v1/messages`` or ``/v1/messages/count_tokens`` (:func:`is_messages_path`)
gets the same answer converted, at the edge, to the shape the Anthropic API reference
documents for errors (https://docs.anthropic.com/en/api/errors)::

    {"type": "error", "error": {"type": "invalid_request_error", "message": "..."}}

The status is kept; the error's ``type`` is the one Anthropic gives that status
(:func:`anthropic_type`), so that its SDK raises its own class for it
(``anthropic.AuthenticationError`` for a 401, ``anthropic.RateLimitError`` for a 429, ...).
Headers are kept too: a 429's ``Retry-After`` and ``retry-after-ms``, which that SDK reads
before retrying, come from berth's own limits as on every other path.
"""

from __future__ import annotations

import json
from typing import Final

from berth.openai_errors import ErrorResponse

#: The paths of the Messages API that berth serves; their errors are Anthropic-shaped.
MESSAGES_PATH: Final = "/v1/messages"
COUNT_TOKENS_PATH: Final = "/v1/messages/count_tokens"

# The Anthropic error type for each status it documents; others by their class (4xx, 5xx).
_TYPES: Final = {
    400: "invalid_request_error",
    401: "authentication_error",
    402: "billing_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
    504: "timeout_error",
    529: "overloaded_error",
}


def is_messages_path(path: str) -> bool:
    """Whether ``path`` is under ``/v1/messages`` (its errors are Anthropic-shaped, an
    unknown one's 404 included)."""
    return path == MESSAGES_PATH or path.startswith("/v1/messages/")


def anthropic_type(status: int) -> str:
    """The Anthropic error ``type`` for an HTTP ``status`` (``invalid_request_error`` for
    a 4xx it has no name for, ``api_error`` for a 5xx)."""
    found = _TYPES.get(status)
    if found is not None:
        return found
    return "invalid_request_error" if status < 500 else "api_error"


def anthropic_error_body(message: str, *, type: str) -> bytes:
    """Serialise one Anthropic error: ``{"type": "error", "error": {"type", "message"}}``,
    compact UTF-8 JSON."""
    payload = {"type": "error", "error": {"type": type, "message": message}}
    return json.dumps(payload, separators=(",", ":")).encode()


def anthropic_body(body: bytes, status: int) -> bytes:
    """An error body (berth's OpenAI-shaped one, an engine's, or anything) in the Anthropic
    shape for ``status``: one already in that shape is kept as it is; otherwise its
    ``error.message`` (or top-level ``message``, or text) is kept and its type is the
    status's."""
    message = ""
    try:
        payload = json.loads(body)
    except ValueError:
        payload = None
    if isinstance(payload, dict):
        error = payload.get("error")
        if payload.get("type") == "error" and isinstance(error, dict):
            return body
        found = error.get("message") if isinstance(error, dict) else payload.get("message")
        message = found if isinstance(found, str) else ""
    elif payload is None:
        message = body.decode("utf-8", errors="replace").strip()[:2000]
    return anthropic_error_body(message or f"HTTP {status}", type=anthropic_type(status))


def to_anthropic(reply: ErrorResponse) -> ErrorResponse:
    """``reply`` (from :func:`berth.openai_errors.error_from_exception`) with its body in
    the Anthropic shape; status and headers unchanged."""
    return ErrorResponse(reply.status, anthropic_body(reply.body, reply.status), reply.headers)


def stream_error_event(message: str, *, type: str = "api_error") -> bytes:
    """The event that ends a Messages stream which failed after it began: ``event: error``
    with an Anthropic error, as the Messages streaming reference documents (its SDK raises
    it as an ``APIStatusError``)."""
    return b"event: error\ndata: " + anthropic_error_body(message, type=type) + b"\n\n"
