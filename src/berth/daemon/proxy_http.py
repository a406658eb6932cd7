"""Raw ASGI plumbing of the proxy (:mod:`berth.daemon.proxy`): the ASGI types, what of a
request's headers reaches an engine, the ``model`` of a request body, and a JSON answer.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Awaitable, Callable, MutableMapping, Sequence
from typing import Any

from berth.routing.errors import InvalidRequestError

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

# Request headers an engine may see. Credentials (Authorization, Cookie, x-api-key, api-key)
# and everything else stay at the proxy. W3C Trace Context / Baggage headers pass for tracing.
_FORWARDED_HEADERS = frozenset(
    {b"content-type", b"accept", b"traceparent", b"tracestate", b"baggage"}
)
_VALID_REQUEST_ID = re.compile(rb"[0-9A-Za-z._:/+=-]{1,128}")


def scan_headers(
    raw: Sequence[tuple[bytes, bytes]],
) -> tuple[bytes, list[tuple[bytes, bytes]], bytes | None]:
    """``(request id, headers for the engine, Content-Length)`` from the ASGI headers."""
    request_id: bytes | None = None
    content_length: bytes | None = None
    forward: list[tuple[bytes, bytes]] = []
    content_type = False
    for header in raw:
        name = header[0]
        if name in _FORWARDED_HEADERS:
            forward.append(header)
            content_type = content_type or name == b"content-type"
        elif name == b"content-length":
            content_length = header[1]
        elif name == b"x-request-id" and _VALID_REQUEST_ID.fullmatch(header[1]):
            request_id = header[1]
    if request_id is None:
        request_id = os.urandom(16).hex().encode()  # as uuid4().hex, at a fifth of the cost
    forward.append((b"x-request-id", request_id))
    forward.append((b"accept-encoding", b"identity"))
    if not content_type:
        forward.append((b"content-type", b"application/json"))
    return request_id, forward, content_length


def model_of(body: bytes) -> str:
    """The ``model`` of an OpenAI request body; :class:`InvalidRequestError` if it has none."""
    return model_in(payload_of(body))


def payload_of(body: bytes) -> dict[str, Any]:
    """An OpenAI request body parsed; :class:`InvalidRequestError` unless a JSON object."""
    try:
        payload = json.loads(body)
    except ValueError as exc:  # also invalid UTF-8
        raise InvalidRequestError(
            f"the request body is not valid JSON: {exc}", code="invalid_json"
        ) from exc
    if not isinstance(payload, dict):
        raise InvalidRequestError("the request body must be a JSON object", code="invalid_json")
    return payload


def model_in(payload: dict[str, Any]) -> str:
    """The ``model`` of a parsed request body; :class:`InvalidRequestError` if it has none."""
    model = payload.get("model")
    if not isinstance(model, str) or not model:
        raise InvalidRequestError(
            "you must provide a model parameter", code="missing_model", param="model"
        )
    return model


def with_model(body: bytes, model: str) -> bytes:
    """``body`` (a JSON object :func:`model_of` accepted) with its ``model`` set to ``model``.

    Re-serialised compactly; every other field keeps its value.
    """
    payload = json.loads(body)
    payload["model"] = model
    return json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode()


async def send_json(
    send: Send,
    status: int,
    body: bytes,
    request_id: bytes,
    extra: Sequence[tuple[bytes, bytes]] = (),
) -> None:
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", b"%d" % len(body)),
        (b"x-request-id", request_id),
        *extra,
    ]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
