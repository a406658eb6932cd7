"""The public request as the proxy carries it: parsed once into a :class:`PublicRequest`.

The proxy (:mod:`berth.gateway.proxy`) reads a completion request's body once
(:func:`read_body`, bounded), parses it once (:func:`parse_request`) and hands the value
from stage to stage; a stage that changes it returns a new one (the value is frozen), so
what a later stage (a tracer, a router that hashes prompt prefixes) reads is what the
earlier ones made of it. The parsed body is a ``dict`` shared by every stage and never
changed in place: a rewriter builds a new one (``{**body, ...}``).

Shapes: ``body`` is the JSON object the client sent (``str`` keys); ``raw`` its bytes, as
received or as the last rewriter wrote them (they always encode ``body``); headers are
lower-case ``(name, value)`` byte pairs, as the HTTP server gives them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Final, NamedTuple

from berth.admission import SocketCaller
from berth.anthropic_errors import COUNT_TOKENS_PATH, MESSAGES_PATH
from berth.gateway.exchange import ClientRequest, model_in, payload_of
from berth.http_server.errors import HttpServerError
from berth.routing.errors import InvalidRequestError, RequestTooLargeError
from berth.store.records import ApiKeyRecord

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
    request: ClientRequest, content_length: bytes | None, limit: int
) -> bytes | None:
    """The request body (at most ``limit`` bytes), or ``None`` if the client left while
    sending it.

    Raises :class:`InvalidRequestError` (400) for a ``Content-Length`` that is not a number,
    :class:`RequestTooLargeError` (413) for a body announced or found over ``limit``.
    """
    if content_length is not None:
        if not content_length.isdigit():
            raise InvalidRequestError("invalid Content-Length header", code="invalid_request")
        if int(content_length) > limit:
            raise RequestTooLargeError(limit)
    parts: list[bytes] = []
    size = 0
    try:
        while chunk := await request.read_chunk():
            size += len(chunk)
            if size > limit:
                raise RequestTooLargeError(limit)
            parts.append(chunk)
    except HttpServerError:
        return None
    return parts[0] if len(parts) == 1 else b"".join(parts)


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
) -> PublicRequest:
    """The request whose body is ``raw``, parsed once.

    ``is_adapter(model)``, when given, says whether ``model`` names a LoRA adapter (then
    ``adapter`` is set to it). Raises :class:`InvalidRequestError` (400): ``invalid_json``
    unless ``raw`` is a JSON object (no ``NaN`` or ``Infinity``), ``missing_model`` without a
    ``"model"`` string.
    """
    body = payload_of(raw)
    model = model_in(body)
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
        len(raw),
        model,
        body.get("stream") is True,
        model if is_adapter is not None and is_adapter(model) else None,
    )
