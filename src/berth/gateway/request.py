"""The public request as the proxy carries it: parsed once into a :class:`PublicRequest`.

The proxy (:mod:`berth.gateway.proxy`) reads a completion request's body once
(:func:`read_body`, bounded), parses it once (:func:`parse_request`) and hands the value
from stage to stage; a stage that changes it returns a new one (the value is frozen), so
what a later stage (a tracer, a router that hashes prompt prefixes) reads is what the
earlier ones made of it. The parsed body is a ``dict`` shared by every stage and never
changed in place: a rewriter builds a new one (``{**body, ...}``).

Shapes: ``body`` is the JSON object the client sent (``str`` keys); ``raw`` its bytes, as
received or as the last rewriter wrote them (they always encode ``body``, in UTF-8); headers
are lower-case ``(name, value)`` byte pairs, as the HTTP server gives them.

What a body may be is checked here, at the edge, before any stage sees it: its size and
elements as it arrives (:func:`read_body`, :mod:`berth.gateway.body_limits`), then, parsed,
that it is a JSON object whose text every stage can write again as JSON (no lone surrogate,
no number beyond a double's range: :func:`berth.gateway.exchange.decode_body`), with a
``"model"`` string, a boolean ``"stream"``, at least one message where a conversation is
asked for, and no more messages or content parts than the
limits allow (:func:`parse_request`).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, Final, NamedTuple

from berth.admission import BodyHold, SocketCaller
from berth.anthropic_errors import COUNT_TOKENS_PATH, MESSAGES_PATH
from berth.gateway.body_limits import BodyLimits, ElementCounter, check_shape, too_many_elements
from berth.gateway.exchange import ClientRequest, decode_body, model_in
from berth.http_server.errors import HttpServerError
from berth.routing.errors import InvalidRequestError, RequestTooLargeError
from berth.vocab.records import ApiKeyRecord

__all__ = ["DIALECTS", "PublicRequest", "parse_request", "read_body"]

#: The paths relayed to engines, and the API each speaks (:class:`PublicRequest`'s
#: ``dialect``): OpenAI's (``""``), or Anthropic's Messages (passed through to the engines
#: that serve it): ``"messages"``, ``"count_tokens"``.
DIALECTS: Final = {
    "/v1/chat/completions": "",
    "/v1/completions": "",
    "/v1/embeddings": "",
    "/v1/responses": "",
    MESSAGES_PATH: "messages",
    COUNT_TOKENS_PATH: "count_tokens",
}

#: The paths whose ``messages`` must hold at least one message, as OpenAI's chat completions
#: and Anthropic's Messages (and its token count) require.
_CONVERSATION_PATHS: Final = frozenset({"/v1/chat/completions", MESSAGES_PATH, COUNT_TOKENS_PATH})


class PublicRequest(NamedTuple):
    """One public completion request, parsed once (:func:`parse_request`); immutable (a
    named tuple: it costs a request a microsecond, where a frozen dataclass costs several),
    changed by building another (``request._replace(body=..., raw=...)``: a rewriter gives
    a new dict and its bytes together, never the shared dict changed).

    The client's side: ``path`` (``/v1/chat/completions``), ``dialect`` (see
    :data:`DIALECTS`), ``query`` (the raw query string, without ``?``), ``request_id`` (the
    client's ``X-Request-Id`` when valid, else 32 random hex digits), ``headers`` (the
    client's, as received: the router's session headers are among them) and ``forward``
    (those an engine may see, :func:`berth.gateway.exchange.scan_headers`). ``key`` is the
    API key record the listener authenticated (over the Unix socket its caller there,
    ``None`` for the CLI), ``key_name`` its name for the request log.

    The body: ``body`` parsed (a JSON object; shared, never changed in place), ``raw`` its
    bytes as the engine gets them when no engine needs a body of its own, ``received_bytes``
    the size the client sent (the admission estimate's input), ``model`` its ``"model"``,
    ``stream`` whether it asked for an event stream (``"stream": true``) and ``adapter`` the
    LoRA adapter its model names (``None``: a model, not an adapter).

    Set by later stages: ``strip_usage`` (the usage rewriter asked the engine for a stream's
    usage on the client's behalf, so the relay takes that event out) and ``affinity_key``
    (the routing stage's session key: a session header's, or the API key's; ``None`` when
    the model had one candidate, or before routing). ``engine_path`` is the path the
    engines are asked at when it is not ``path`` (a rewriter that translates the request to
    another API sets it with the body; ``None``: ``path``); ``path`` stays the client's, for
    the shape of its answers.
    """

    path: str
    dialect: str
    query: bytes
    request_id: bytes
    headers: list[tuple[bytes, bytes]]
    forward: list[tuple[bytes, bytes]]
    key: ApiKeyRecord | SocketCaller | None
    key_name: str
    body: dict[str, Any]
    raw: bytes
    received_bytes: int
    model: str
    stream: bool
    adapter: str | None = None
    strip_usage: bool = False
    affinity_key: str | None = None
    engine_path: str | None = None


async def read_body(
    request: ClientRequest,
    content_length: bytes | None,
    limit: int,
    *,
    max_elements: int | None = None,
    hold: BodyHold | None = None,
) -> bytes | None:
    """The request body (at most ``limit`` bytes, and at most ``max_elements`` JSON
    elements when given), or ``None`` if the client left while sending it. ``hold``, when
    given, takes the body's bytes against its key's bound on body bytes in flight: all at
    once by its ``Content-Length``, else as they arrive (the caller releases it).

    A body is refused as soon as it is known to be over a bound, without reading (or
    holding) the rest. Its elements are counted only once it is larger than
    ``max_elements`` bytes (:class:`~berth.gateway.body_limits.ElementCounter`).

    Raises :class:`InvalidRequestError` (400) for a ``Content-Length`` that is not a number,
    :class:`RequestTooLargeError` (413) for a body announced or found over ``limit``,
    :class:`InvalidRequestError` (413, ``too_many_elements``) for one over
    ``max_elements``, and what ``hold.take`` raises (429).
    """
    announced = None
    if content_length is not None:
        if not content_length.isdigit():
            raise InvalidRequestError("invalid Content-Length header", code="invalid_request")
        announced = int(content_length)
        if announced > limit:
            raise RequestTooLargeError(limit)
        if hold is not None:
            hold.take(announced)
            hold = None  # taken: the server reads no more than announced
    parts: list[bytes] = []
    size = 0
    counter: ElementCounter | None = None
    try:
        while chunk := await request.read_chunk():
            size += len(chunk)
            if size > limit:
                raise RequestTooLargeError(limit)
            if hold is not None:
                hold.take(len(chunk))
            parts.append(chunk)
            if max_elements is not None and size > max_elements:
                if counter is None:  # no smaller body can hold more elements than bytes
                    counter = _counter_for(parts)
                    for part in parts[:-1]:
                        counter.feed(part)
                if counter.feed(chunk) > max_elements:
                    raise too_many_elements(max_elements)
    except HttpServerError:
        return None
    return parts[0] if len(parts) == 1 else b"".join(parts)


def _counter_for(parts: list[bytes]) -> ElementCounter:
    """An element counter for a body that begins with ``parts`` (at least 4 bytes): one
    that tells strings apart for UTF-8, else one that counts every comma and bracket."""
    head = parts[0] if len(parts[0]) >= 4 else b"".join(parts)[:4]
    return ElementCounter(utf8=json.detect_encoding(head).startswith("utf-8"))


def parse_request(
    raw: bytes,
    *,
    path: str,
    dialect: str,
    query: bytes,
    request_id: bytes,
    headers: list[tuple[bytes, bytes]],
    forward: list[tuple[bytes, bytes]],
    key: ApiKeyRecord | SocketCaller | None = None,
    key_name: str = "",
    is_adapter: Callable[[str], bool] | None = None,
    limits: BodyLimits | None = None,
) -> PublicRequest:
    """The request whose body is ``raw``, parsed once.

    ``is_adapter(model)``, when given, says whether ``model`` names a LoRA adapter (then
    ``adapter`` is set to it). ``raw`` is the body as the engines get it, unless it came in
    UTF-16 or -32 or with a byte order mark (then ``raw`` is its UTF-8 text). Raises
    :class:`InvalidRequestError`: 400 ``invalid_json`` unless ``raw`` is a JSON object
    whose text can be written again as JSON
    (:func:`~berth.gateway.exchange.decode_body`), ``missing_model`` without a ``"model"``
    string (``invalid_type`` for a ``"model"`` that is not one), ``invalid_type`` for a
    ``"stream"`` that is not a boolean (or null), ``empty_array`` for an empty
    ``"messages"`` on a chat path (:data:`_CONVERSATION_PATHS`); 413 for
    more messages or content parts than ``limits`` allow
    (:func:`~berth.gateway.body_limits.check_shape`).
    """
    received_bytes = len(raw)
    body, raw = decode_body(raw)
    model = model_in(body)
    stream = body.get("stream")
    if stream is not True and stream is not False and stream is not None:
        raise InvalidRequestError(
            f"'stream' must be a boolean, not {_json_type(stream)}",
            code="invalid_type",
            param="stream",
        )
    if path in _CONVERSATION_PATHS and body.get("messages") == []:
        # An engine given no messages still generates, until its length or our timeout.
        raise InvalidRequestError(
            "'messages' is an empty array: give at least one message",
            code="empty_array",
            param="messages",
        )
    if limits is not None:
        check_shape(path, body, limits, len(raw))
    return PublicRequest(  # by position: a named tuple is built fastest so
        path,
        dialect,
        query,
        request_id,
        headers,
        forward,
        key,
        key_name,
        body,
        raw,
        received_bytes,
        model,
        stream is True,
        model if is_adapter is not None and is_adapter(model) else None,
    )


def _json_type(value: object) -> str:
    """The JSON type of a parsed value, in words (``a string``, ``a number``...)."""
    if isinstance(value, str):
        return "a string"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, list):
        return "an array"
    return "an object"
