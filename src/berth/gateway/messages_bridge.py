"""Where a Messages API request goes: passed through, or translated to a chat completion.

The proxy's hook for Anthropic's paths, in two places. After the router's plan, the routing
stage (:class:`berth.gateway.stages.Routing`) calls :func:`route_messages`: it keeps the
deployments whose engine serves the path (:func:`berth.routing.capability.serving`), or,
when none serves ``/v1/messages``, gives back the request rewritten as a chat completion
(:func:`berth.gateway.anthropic_chat.translate_request`: its ``body`` and ``raw``, and
``engine_path`` ``/v1/chat/completions``) for every planned deployment. Each attempt
(:class:`berth.gateway.attempt.Attempts`) then hands the engine's answer to
:func:`translated_answer`, which gives it back as a Message: whole
(:class:`TranslatedAnswer`) or as a Messages stream (:class:`TranslatedStream`). Both are
:class:`EngineAnswer`\\ s, so the relay, its usage reading (the Messages form, from the
translated bytes), its error shape and its broken-stream ending are the same as for an
engine that speaks the Messages API. A token count (``/v1/messages/count_tokens``) is not
translated: chat completions count no tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

from berth.anthropic_errors import MESSAGES_PATH
from berth.engine_http.answer import EngineAnswer, read_body
from berth.engine_http.errors import UpstreamProtocolError
from berth.engine_http.origin import Origin, parse_origin
from berth.gateway.anthropic_answer import AnswerNotTranslatableError, translate_answer
from berth.gateway.anthropic_chat import Translated, translate_request
from berth.gateway.anthropic_stream import ChatToMessagesStream
from berth.gateway.request import PublicRequest
from berth.gateway.sse import SSEEventSplitter, parse_event, split_events
from berth.routing.capability import serving
from berth.routing.resolver import Upstream
from berth.vocab.engines import serves_path

__all__ = [
    "CHAT_PATH",
    "TranslatedAnswer",
    "TranslatedStream",
    "route_messages",
    "translated_answer",
]

#: Where a translated Messages request is sent.
CHAT_PATH = "/v1/chat/completions"


def route_messages(
    request: PublicRequest, plan: Sequence[Upstream]
) -> tuple[PublicRequest, list[Upstream]]:
    """The request to one of Anthropic's paths as its engines must get it, and its plan.

    Passed through (``request`` as it is) to the planned deployments whose engine serves
    its path when one does; else, for ``/v1/messages``, translated for all of them: the
    request with the chat completion as its ``body`` and ``raw`` and ``engine_path`` set.
    Raises :class:`~berth.routing.errors.InvalidRequestError` (400): what the translation
    refuses (:func:`~berth.gateway.anthropic_chat.translate_request`), or, for a token
    count no engine serves, ``path_not_served``.
    """
    path = request.path
    if path != MESSAGES_PATH or any(serves_path(u.engine, path) for u in plan):
        return request, serving(plan, path)
    translation = translate_request(request.body)
    rewritten = request._replace(body=translation.chat, raw=translation.body, engine_path=CHAT_PATH)
    return rewritten, list(plan)


def translated_answer(
    request: PublicRequest, answer: EngineAnswer, upstream: Upstream
) -> EngineAnswer:
    """``upstream``'s ``answer`` to ``request`` as the client must read it: as it is unless
    :func:`route_messages` translated the request; then an error stays as it is (the relay
    makes its body Anthropic-shaped) and any other answer is translated (named by the
    request id when the engine's has no id)."""
    if request.engine_path != CHAT_PATH or request.dialect != "messages" or answer.status >= 400:
        return answer
    stop = request.body.get("stop")
    translation = Translated(
        request.raw,
        request.body,
        request.model,  # as the client named it
        tuple(stop) if isinstance(stop, list) else (),
        request.stream,
    )
    request_id = request.request_id.decode()
    if translation.streamed:
        return TranslatedStream(answer, translation, upstream, request_id)
    return TranslatedAnswer(answer, translation, upstream, request_id)


class _Translating:
    """What both translated answers share: the engine's status, a head of their own (its
    content type; no length, no encoding), and closing the engine's answer."""

    content_type = b"application/json"

    def __init__(
        self, answer: EngineAnswer, translation: Translated, upstream: Upstream, request_id: str
    ) -> None:
        self._answer = answer
        self._translation = translation
        self._upstream = upstream
        self._request_id = request_id
        self._eof = False
        self.status = answer.status
        self.headers = [(b"content-type", self.content_type)]
        self.content_length: int | None = None

    def header(self, name: bytes) -> bytes | None:
        return self.content_type if name == b"content-type" else None

    @property
    def at_eof(self) -> bool:
        return self._eof

    async def read_chunk(self) -> bytes:
        raise NotImplementedError  # each translation reads its own way

    async def read(self, limit_bytes: int | None = None) -> bytes:
        return await read_body(self, limit_bytes)

    def close(self) -> None:
        self._answer.close()

    def _untranslatable(self, why: str) -> UpstreamProtocolError:
        upstream = self._upstream
        # a remote engine has no address of its own: the error names its node, as the
        # tunnel's and the direct path's errors do
        origin = Origin(upstream.node_id, 0) if upstream.remote else parse_origin(upstream.base_url)
        return UpstreamProtocolError(origin, f"answered what berth cannot translate: {why}")

    def _check_encoding(self) -> None:
        if self._answer.header(b"content-encoding"):
            raise self._untranslatable("a compressed body")


class TranslatedAnswer(_Translating):
    """A non-streamed chat completion given as a Message: read whole at the first read,
    translated, and given in one piece. Its ``content_length`` is the engine's (a hint of
    its size, for the relay's choice of buffering); the translation's own length differs.

    Reads raise :class:`UpstreamProtocolError` for an answer that cannot be translated, and
    what the engine's answer raises."""

    def __init__(
        self, answer: EngineAnswer, translation: Translated, upstream: Upstream, request_id: str
    ) -> None:
        super().__init__(answer, translation, upstream, request_id)
        self.content_length = answer.content_length

    async def read_chunk(self) -> bytes:
        if self._eof:
            return b""
        self._check_encoding()
        data = await read_body(self._answer)
        self._eof = True
        try:
            return translate_answer(data, self._translation, fallback_id=self._request_id)
        except AnswerNotTranslatableError as exc:
            raise self._untranslatable(exc.why) from None


class TranslatedStream(_Translating):
    """A chat completion stream given as a Messages stream
    (:class:`~berth.gateway.anthropic_stream.ChatToMessagesStream`), piece by piece as the
    engine's events arrive. A read raises what the engine's answer raises (the relay then
    ends the client's stream with its error event)."""

    content_type = b"text/event-stream"

    def __init__(
        self, answer: EngineAnswer, translation: Translated, upstream: Upstream, request_id: str
    ) -> None:
        super().__init__(answer, translation, upstream, request_id)
        self._splitter = SSEEventSplitter()
        self._stream = ChatToMessagesStream(translation, fallback_id=request_id)

    async def read_chunk(self) -> bytes:
        self._check_encoding()
        stream = self._stream
        while not self._eof:
            chunk = await self._answer.read_chunk()
            out = self._translate(self._splitter.feed(chunk)) if chunk else b""
            if not chunk or self._answer.at_eof:  # read to its end: the pool keeps it
                rest = self._splitter.take_pending()  # an event the engine did not end
                out += self._translate(rest + b"\n\n" if rest.strip() else b"")
                out += stream.finish()
                self._eof = True
            if out:
                return out
        return b""

    def _translate(self, events: bytes) -> bytes:
        """The Messages events for ``events`` (whole chat completion events)."""
        out = b""
        stream = self._stream
        for raw in split_events(events):
            event = parse_event(raw)
            if event is not None and event.data:
                out += stream.feed(event.data)
            if stream.ended:
                break
        return out
