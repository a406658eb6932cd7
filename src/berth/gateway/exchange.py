"""The proxy's side of a client exchange (:mod:`berth.gateway.proxy`): what it needs of a
request and of the writer of its answer, what of a request's headers reaches an engine, a
request body parsed and its ``model``, and a JSON answer.

The proxy is served two ways, through the same two interfaces: by berth's own HTTP server
(:mod:`berth.http_server`, whose ``Request`` and ``ResponseWriter`` are a
:class:`ClientRequest` and a :class:`ClientWriter` as they are), and as an ASGI app
(:mod:`berth.gateway.asgi` adapts ``receive`` and ``send``).
"""

from __future__ import annotations

import gc
import json
import math
import os
import re
from collections.abc import Awaitable, Callable, MutableMapping, Sequence
from typing import Any, Final, NamedTuple, Protocol, TypeGuard, runtime_checkable

from berth.conforms import conforms
from berth.routing.errors import InvalidRequestError

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


class ClientRequest(Protocol):
    """A client's request as the proxy reads it.

    ``read_chunk`` returns the body piece by piece, ``b""`` at its end, and raises
    :class:`berth.http_server.errors.HttpServerError` when the client went away first.
    ``watch_disconnect(callback)`` calls ``callback`` (once) if the client goes away before
    the answer ends, at once if it already has; ``None`` stops watching.
    """

    method: str
    path: str
    query: bytes
    headers: list[tuple[bytes, bytes]]

    async def read_chunk(self) -> bytes: ...

    def watch_disconnect(self, callback: Callable[[], None] | None) -> None: ...


class ClientWriter(Protocol):
    """The writer of the answer to a client: ``start`` once, ``write`` pieces, ``end`` once.

    ``buffers_writes`` is true when ``write`` only waits while the client is slow (berth's
    own server); false when each ``write`` waits for its bytes to be taken (ASGI), in which
    case the proxy reads the engine's answer ahead of it in a bounded buffer.
    """

    buffers_writes: bool

    async def start(self, status: int, headers: Sequence[tuple[bytes, bytes]]) -> None: ...

    async def write(self, data: bytes) -> None: ...

    async def end(self, data: bytes = b"") -> None: ...


@runtime_checkable
class PushWriter(ClientWriter, Protocol):
    """A :class:`ClientWriter` that can also be written to without waiting (berth's own
    server's :class:`~berth.http_server.writer.ResponseWriter`), for a relay that is pushed
    from the engine connection's callbacks: ``write_now`` and ``end_now`` write at once (the
    transport buffers), ``write_paused`` says the client is slow, ``drain`` waits until it
    is not."""

    @property
    def write_paused(self) -> bool: ...

    def write_now(self, data: bytes) -> None: ...

    def end_now(self, data: bytes = b"") -> None: ...

    async def drain(self) -> None: ...


def can_write_now(writer: ClientWriter) -> TypeGuard[PushWriter]:
    """``writer`` is a :class:`PushWriter` (decided once per class)."""
    return conforms(writer, PushWriter)


# Request headers an engine may see. Credentials (Authorization, Cookie, x-api-key, api-key)
# and everything else stay at the proxy. W3C Trace Context / Baggage headers pass for tracing;
# Anthropic's version and beta headers for the Messages API (a request without a version goes
# without one: llama-server and vLLM do not require it).
_FORWARDED_HEADERS = frozenset(
    {
        b"content-type",
        b"accept",
        b"traceparent",
        b"tracestate",
        b"baggage",
        b"anthropic-version",
        b"anthropic-beta",
    }
)
_VALID_REQUEST_ID = re.compile(rb"[0-9A-Za-z._:/+=-]{1,128}")


class ClientHead(NamedTuple):
    """What the proxy reads off a request's headers (:func:`scan_headers`): its id (the
    client's ``X-Request-Id`` when valid, else 32 random hex digits), the headers an engine
    may see, and its ``Content-Length`` (``None``: not sent)."""

    request_id: bytes
    forward: list[tuple[bytes, bytes]]
    content_length: bytes | None


def scan_headers(raw: Sequence[tuple[bytes, bytes]]) -> ClientHead:
    """The request's :class:`ClientHead` from its (lower-case) headers."""
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
    return ClientHead(request_id, forward, content_length)


def payload_of(body: bytes) -> dict[str, Any]:
    """An OpenAI request body parsed (:func:`decode_body`'s first half)."""
    return decode_body(body)[0]


def decode_body(body: bytes) -> tuple[dict[str, Any], bytes]:
    """An OpenAI request body parsed, and its bytes as UTF-8: ``body`` itself, unless it
    came in UTF-16 or -32 or with a byte order mark (then its text in UTF-8, which is what
    engines read). Raises :class:`InvalidRequestError` (``invalid_json``) unless ``body``
    is a JSON object whose every value can be written again as JSON.

    Read as ``json.loads`` reads bytes (the encoding detected the same way: UTF-8, -16 or
    -32, a UTF-8 BOM skipped), with one decoder for every request instead of one made per
    call (``loads`` with an argument builds a decoder each time: about 3 µs of a small
    request), and stricter where the standard library takes what no engine can read back
    and no rewriter can write again: ``NaN`` and the infinities, numbers beyond a double's
    range (``1e400``, which Python reads as infinity), and strings with a lone UTF-16
    surrogate (``"\\ud800"`` unpaired, or its bytes in the text), which no UTF-8 text can
    carry (RFC 8259 section 8.2). A body over :data:`_GC_PAUSE_BYTES` is parsed with the
    garbage collector paused (:func:`_decode_large`).
    """
    try:
        encoding = json.detect_encoding(body)
        text = body.decode(encoding)  # strict: a surrogate's bytes are not UTF-8 (RFC 3629)
        if len(body) < _GC_PAUSE_BYTES:
            payload = _REQUEST_DECODER.decode(text)
        else:
            payload = _decode_large(text)
    except (ValueError, RecursionError) as exc:  # also invalid UTF-8, too deeply nested
        raise InvalidRequestError(
            f"the request body is not valid JSON: {exc}", code="invalid_json"
        ) from exc
    if not isinstance(payload, dict):
        raise InvalidRequestError("the request body must be a JSON object", code="invalid_json")
    if "\\ud" in text or "\\uD" in text:  # an escaped surrogate: is every one paired?
        _refuse_lone_surrogates(payload)
    if encoding != "utf-8":
        body = text.encode()
    return payload, body


#: Bodies at least this long are parsed with the garbage collector paused.
_GC_PAUSE_BYTES = 64 * 1024


def _decode_large(text: str) -> Any:
    """``text`` parsed with the garbage collector paused: a parse makes only new lists and
    dicts, in a tree (no cycles), so no collection during it can free anything, and a
    large body's parse triggers many (each visiting what the parse made so far). Paused,
    a body of 500,000 empty arrays parses in 29 ms instead of 102 ms here."""
    if not gc.isenabled():
        return _REQUEST_DECODER.decode(text)
    gc.disable()
    try:
        return _REQUEST_DECODER.decode(text)
    finally:
        gc.enable()


def _refuse_constant(name: str) -> Any:
    # Python's json takes NaN, Infinity and -Infinity; RFC 8259 (section 6) has no such
    # numbers, and engines refuse them, each in its own words.
    raise ValueError(f"{name} is not a JSON number")


def _finite_float(text: str) -> float:
    # A number beyond a double's range reads as an infinity, which json.dumps would write
    # back as Infinity (not JSON) in any body a rewriter writes.
    value = float(text)
    if math.isinf(value):
        raise ValueError(f"{text} is beyond the range of a double")
    return value


_REQUEST_DECODER = json.JSONDecoder(parse_constant=_refuse_constant, parse_float=_finite_float)


def _refuse_lone_surrogates(payload: dict[str, Any]) -> None:
    """Raise :class:`InvalidRequestError` if a key or string of ``payload`` holds a
    surrogate (the decoder joins each escaped pair into one character; what is left was
    unpaired)."""
    stack: list[Any] = [payload]
    while stack:
        value = stack.pop()
        items = value.items() if isinstance(value, dict) else enumerate(value)
        for key, item in items:
            if isinstance(key, str):
                _check_text(key)
            if isinstance(item, str):
                _check_text(item)
            elif isinstance(item, dict | list):
                stack.append(item)


def _check_text(text: str) -> None:
    if text.isascii():
        return
    try:
        text.encode()
    except UnicodeEncodeError as exc:
        raise InvalidRequestError(
            "the request body is not valid JSON: a string holds the lone surrogate "
            f"\\u{ord(text[exc.start]):04x} (half of a UTF-16 pair without the other half), "
            "which is no Unicode character",
            code="invalid_json",
        ) from None


#: A parsed JSON value's type, in words, by its Python type (``json`` gives no others).
_JSON_KINDS: Final = {
    bool: "a boolean",
    int: "a number",
    float: "a number",
    str: "a string",
    list: "an array",
    dict: "an object",
}


def model_in(payload: dict[str, Any]) -> str:
    """The ``model`` of a parsed request body; :class:`InvalidRequestError` if it has none
    (``missing_model``) or it is not a string (``invalid_type``)."""
    model = payload.get("model")
    if model is not None and not isinstance(model, str):
        raise InvalidRequestError(
            f"'model' must be a string (a model's name), not {_JSON_KINDS[type(model)]}",
            code="invalid_type",
            param="model",
        )
    if not model:
        raise InvalidRequestError(
            "you must provide a model parameter", code="missing_model", param="model"
        )
    return model


async def send_json(
    writer: ClientWriter,
    status: int,
    body: bytes,
    request_id: bytes,
    extra: Sequence[tuple[bytes, bytes]] = (),
) -> None:
    """Answer ``status`` with the JSON ``body``, its length, the request id and ``extra``."""
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", b"%d" % len(body)),
        (b"x-request-id", request_id),
        *extra,
    ]
    await writer.start(status, headers)
    await writer.end(body)
