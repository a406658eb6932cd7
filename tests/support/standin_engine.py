"""A scripted stand-in for an OpenAI-compatible engine (llama-server, vLLM, SGLang).

Two servers, both real HTTP on 127.0.0.1 and an ephemeral port:

* :class:`StandinEngine` (aiohttp.web) plays one scripted :class:`Reply` per request, in
  order, then its default reply. A reply is a list of steps -- stall, send the status line
  and headers, write bytes (optionally after a pause, so that each write is its own TCP
  segment and its own read at the proxy), die -- which covers JSON answers, SSE streams,
  writes that cut a UTF-8 character in half, engine errors, a death mid-stream and a stall
  before the headers. Each request is recorded (:class:`ReceivedRequest`): its headers and
  body, how many bytes were written back, and whether and when the client went away.
* :func:`serve_fast_engine` (raw asyncio + httptools) answers every request with one canned
  JSON body or SSE stream, as cheaply as possible, for the proxy benchmark.

Reply builders: :func:`json_reply`, :func:`sse_reply`, :func:`error_reply`,
:func:`chat_chunks`, :func:`responses_events`.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, cast

import httptools
from aiohttp import web

# -- scripts -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Stall:
    """Wait ``seconds`` (before the headers, if it comes first)."""

    seconds: float


@dataclass(frozen=True)
class Hold:
    """Wait until the test sets the request's :attr:`ReceivedRequest.release` (an engine
    busy for exactly as long as the test wants)."""


@dataclass(frozen=True)
class Head:
    """Send the status line and headers; ``content_length=None`` means chunked encoding."""

    status: int = 200
    content_type: str = "application/json"
    content_length: int | None = None
    headers: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class Write:
    """Write ``data`` after ``pause_s``; each write is flushed to the socket on its own."""

    data: bytes
    pause_s: float = 0.0


@dataclass(frozen=True)
class Die:
    """Close the connection now, mid-answer."""


Step = Stall | Hold | Head | Write | Die


@dataclass(frozen=True)
class Reply:
    """What the engine does for one request."""

    steps: tuple[Step, ...]


def json_reply(payload: object, *, status: int = 200) -> Reply:
    """A JSON answer with a Content-Length, written at once."""
    body = json.dumps(payload).encode()
    return Reply((Head(status, "application/json", len(body)), Write(body)))


def error_reply(status: int, message: str, *, type: str = "invalid_request_error") -> Reply:
    """An engine error in the OpenAI shape (as llama-server answers)."""
    return json_reply({"error": {"message": message, "type": type, "code": status}}, status=status)


def sse_event(payload: object) -> bytes:
    """One ``data:`` event; a dict is serialised as JSON."""
    data = payload if isinstance(payload, str) else json.dumps(payload)
    return f"data: {data}\n\n".encode()


def sse_reply(
    events: Iterable[bytes],
    *,
    pause_s: float = 0.0,
    die_after: int | None = None,
    stall_s: float = 0.0,
) -> Reply:
    """An event stream, one write per item of ``events`` (raw bytes, sent as they are).

    ``pause_s`` separates the writes; ``die_after`` closes the connection after that many
    writes; ``stall_s`` waits before the headers.
    """
    steps: list[Step] = []
    if stall_s:
        steps.append(Stall(stall_s))
    steps.append(Head(200, "text/event-stream"))
    for i, event in enumerate(events):
        if die_after is not None and i == die_after:
            steps.append(Die())
            break
        steps.append(Write(event, pause_s if i else 0.0))
    return Reply(tuple(steps))


def chat_chunks(
    texts: Sequence[str],
    *,
    tool_call: bool = False,
    usage: tuple[int, int] | None = (7, 5),
    model: str = "m",
) -> list[bytes]:
    """A chat completion stream: one choice per item of ``texts`` (``n=len(texts)``).

    Content deltas of all choices interleave, word by word, each chunk naming its choice
    ``index``; ``tool_call`` adds a tool call to choice 0 streamed in argument fragments;
    ``usage`` = (prompt, completion) adds the final ``choices: []`` usage chunk
    (``stream_options.include_usage``); ``data: [DONE]`` ends the stream.
    """

    def chunk(choices: list[dict[str, Any]], **extra: Any) -> bytes:
        payload = {
            "id": "chatcmpl-1",
            "object": "chat.completion.chunk",
            "created": 1,
            "model": model,
            "choices": choices,
            **extra,
        }
        return sse_event(payload)

    out = [
        chunk([{"index": i, "delta": {"role": "assistant"}, "finish_reason": None}])
        for i in range(len(texts))
    ]
    words = [text.split(" ") for text in texts]
    for step in range(max(len(w) for w in words)):
        for i, choice_words in enumerate(words):
            if step < len(choice_words):
                piece = choice_words[step] + (" " if step < len(choice_words) - 1 else "")
                delta = {"content": piece}
                out.append(chunk([{"index": i, "delta": delta, "finish_reason": None}]))
    if tool_call:
        call = {"index": 0, "id": "call_1", "type": "function"}
        call["function"] = {"name": "get_weather", "arguments": ""}
        out.append(chunk([{"index": 0, "delta": {"tool_calls": [call]}, "finish_reason": None}]))
        for fragment in ('{"city', '": "Par', 'is"}'):
            delta = {"tool_calls": [{"index": 0, "function": {"arguments": fragment}}]}
            out.append(chunk([{"index": 0, "delta": delta, "finish_reason": None}]))
    for i in range(len(texts)):
        reason = "tool_calls" if tool_call and i == 0 else "stop"
        out.append(chunk([{"index": i, "delta": {}, "finish_reason": reason}]))
    if usage is not None:
        prompt, completion = usage
        counts = {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
        }
        out.append(chunk([], usage=counts))
    out.append(b"data: [DONE]\n\n")
    return out


def responses_events(text: str, *, usage: tuple[int, int] = (11, 3)) -> list[bytes]:
    """A Responses API stream (``event:`` lines, ``response.completed`` carrying usage)."""

    def event(kind: str, payload: dict[str, Any]) -> bytes:
        return f"event: {kind}\ndata: {json.dumps({'type': kind, **payload})}\n\n".encode()

    response: dict[str, Any] = {"id": "resp_1", "object": "response", "usage": None}
    prompt, completion = usage
    done_usage = {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": completion,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt + completion,
    }
    return [
        event("response.created", {"response": response}),
        event("response.output_text.delta", {"delta": text}),
        event("response.completed", {"response": {**response, "usage": done_usage}}),
    ]


def message(text: str, *, usage: tuple[int, int, int] = (5, 3, 2)) -> dict[str, Any]:
    """An Anthropic Messages answer (as llama-server gives it); ``usage`` = (input not
    cached, output, cache read)."""
    uncached, output, cached = usage
    counts = {"cache_read_input_tokens": cached, "input_tokens": uncached, "output_tokens": output}
    return {
        "id": "msg_1",
        "type": "message",
        "role": "assistant",
        "content": [{"type": "text", "text": text}],
        "model": "m",
        "stop_reason": "end_turn",
        "stop_sequence": None,
        "usage": counts,
    }


def message_events(texts: Sequence[str], *, usage: tuple[int, int, int] = (5, 3, 2)) -> list[bytes]:
    """A Messages stream, llama-server's way: the input counts in ``message_start``, the
    output in ``message_delta``; one text delta per item of ``texts``."""

    def event(kind: str, payload: dict[str, Any]) -> bytes:
        return f"event: {kind}\ndata: {json.dumps({'type': kind, **payload})}\n\n".encode()

    uncached, output, cached = usage
    start = {**message(""), "content": [], "stop_reason": None}
    start["usage"] = {"cache_read_input_tokens": cached, "input_tokens": uncached}
    start["usage"]["output_tokens"] = 0
    block = {"index": 0, "content_block": {"type": "text", "text": ""}}
    deltas = [{"index": 0, "delta": {"type": "text_delta", "text": text}} for text in texts]
    ending = {"delta": {"stop_reason": "end_turn", "stop_sequence": None}}
    ending["usage"] = {"output_tokens": output}
    return [
        event("message_start", {"message": start}),
        event("content_block_start", block),
        *[event("content_block_delta", delta) for delta in deltas],
        event("content_block_stop", {"index": 0}),
        event("message_delta", ending),
        event("message_stop", {}),
    ]


# -- the scripted engine -----------------------------------------------------------------------


@dataclass
class ReceivedRequest:
    """One request as the engine saw it, and what became of it."""

    method: str
    path: str
    query: str
    headers: dict[str, str]
    body: bytes
    received_at: float
    bytes_written: int = 0
    #: True while a write waits for the client to take data (the transport's buffer is full:
    #: aiohttp's write only yields then), i.e. while the engine is held up by backpressure.
    writing: bool = False
    completed: bool = False
    died: bool = False
    disconnected_at: float | None = None
    disconnected: asyncio.Event = field(default_factory=asyncio.Event)
    #: set by the test to end a :class:`Hold` step
    release: asyncio.Event = field(default_factory=asyncio.Event)

    def json(self) -> Any:
        return json.loads(self.body)


class StandinEngine:
    """A scripted OpenAI-compatible engine on ``base_url`` (use ``async with``).

    With ``api_key`` it checks ``Authorization: Bearer <api_key>`` as llama-server does: a
    request without it (``/health`` aside) is recorded and answered 401, unscripted.
    """

    def __init__(self, default: Reply | None = None, *, api_key: str | None = None) -> None:
        self.default = default or json_reply(chat_completion("hello"))
        self.api_key = api_key
        self.requests: list[ReceivedRequest] = []
        self._replies: deque[Reply] = deque()
        self._runner: web.AppRunner | None = None
        self.port = 0

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def script(self, *replies: Reply) -> None:
        """Queue replies for the next requests, in order (then ``default`` again)."""
        self._replies.extend(replies)

    async def __aenter__(self) -> StandinEngine:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._handle)
        # handler_cancellation: a client that goes away cancels the handler, which is how
        # the stand-in notices a disconnect even while it stalls.
        self._runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
        await self._runner.setup()
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        await web.SockSite(self._runner, sock).start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def wait_for_request(self, timeout_s: float = 30.0) -> ReceivedRequest:
        """The first request received, once it has arrived."""
        deadline = time.monotonic() + timeout_s
        while not self.requests:
            if time.monotonic() > deadline:
                raise TimeoutError("no request reached the stand-in engine")
            await asyncio.sleep(0.005)
        return self.requests[0]

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        record = ReceivedRequest(
            method=request.method,
            path=request.path,
            query=request.query_string,
            headers={k.lower(): v for k, v in request.headers.items()},
            body=await request.read(),
            received_at=time.monotonic(),
        )
        self.requests.append(record)
        if (
            self.api_key is not None
            and request.path != "/health"
            and record.headers.get("authorization") != f"Bearer {self.api_key}"
        ):
            reply = error_reply(401, "Invalid API Key", type="authentication_error")
        else:
            reply = self._replies.popleft() if self._replies else self.default
        response: web.StreamResponse | None = None
        try:
            for step in reply.steps:
                if isinstance(step, Stall):
                    await asyncio.sleep(step.seconds)
                elif isinstance(step, Hold):
                    await record.release.wait()
                elif isinstance(step, Head):
                    response = web.StreamResponse(status=step.status)
                    response.content_type = step.content_type
                    for name, value in step.headers:
                        response.headers[name] = value
                    if step.content_length is not None:
                        response.content_length = step.content_length
                    else:
                        response.enable_chunked_encoding()
                    await response.prepare(request)
                elif isinstance(step, Write):
                    assert response is not None, "a Write needs a Head first"
                    if step.pause_s:
                        await asyncio.sleep(step.pause_s)
                    record.writing = True
                    await response.write(step.data)
                    record.writing = False
                    record.bytes_written += len(step.data)
                else:
                    record.died = True
                    assert request.transport is not None
                    request.transport.close()
                    await asyncio.sleep(3600)  # cancelled when the connection is lost
            assert response is not None, "a reply needs a Head"
            await response.write_eof()
            record.completed = True
            return response
        except (asyncio.CancelledError, ConnectionResetError):
            if not record.died:
                record.disconnected_at = time.monotonic()
                record.disconnected.set()
            raise


def chat_completion(text: str, usage: tuple[int, int] = (7, 2)) -> dict[str, Any]:
    """A non-streamed chat completion answering ``text``, with ``usage`` (prompt, completion)."""
    prompt, completion = usage
    return {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "created": 1,
        "model": "m",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "finish_reason": "stop",
            }
        ],
        "usage": {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
        },
    }


# -- the fast engine, for the benchmark --------------------------------------------------------

FAST_STREAM_EVENTS = 16


def _fast_answers() -> tuple[bytes, bytes]:
    body = json.dumps(chat_completion("Hello! How can I help you today?")).encode()
    plain = (
        b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n"
        % len(body)
        + body
    )
    events = b"".join(chat_chunks(["word " * (FAST_STREAM_EVENTS - 1) + "end"]))
    chunked = b"%x\r\n%s\r\n0\r\n\r\n" % (len(events), events)
    stream = (
        b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
        b"transfer-encoding: chunked\r\n\r\n" + chunked
    )
    return plain, stream


class _FastProtocol(asyncio.Protocol):
    """Keep-alive HTTP/1.1: a canned stream when the body asks for one, else canned JSON."""

    def __init__(self, plain: bytes, stream: bytes) -> None:
        self._plain = plain
        self._stream = stream
        self._parser = httptools.HttpRequestParser(self)
        self._body: list[bytes] = []
        self._transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement asyncio.Transport without subclassing it
        self._transport = cast(asyncio.Transport, transport)
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError:
            assert self._transport is not None
            self._transport.close()

    def on_body(self, body: bytes) -> None:
        self._body.append(body)

    def on_message_complete(self) -> None:
        body = b"".join(self._body)
        self._body.clear()
        streamed = b'"stream": true' in body or b'"stream":true' in body
        assert self._transport is not None
        self._transport.write(self._stream if streamed else self._plain)


async def serve_fast_engine(host: str = "127.0.0.1", port: int = 0) -> asyncio.Server:
    """Start the benchmark engine; its answers are fixed: a chat completion (~300 bytes) or
    a stream of ``FAST_STREAM_EVENTS`` content chunks plus a usage chunk and ``[DONE]``,
    written in one piece."""
    plain, stream = _fast_answers()
    loop = asyncio.get_running_loop()
    return await loop.create_server(lambda: _FastProtocol(plain, stream), host, port, backlog=1024)
