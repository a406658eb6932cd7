"""The stand-in engine of ``scripts/bench_tunnel.py``: berth launches it as ``llama-server``
(``BERTH_LLAMA_SERVER_BIN`` points at a wrapper that runs this file with llama.cpp's flags).

Raw asyncio + httptools on uvloop: ``POST /v1/chat/completions`` answers a canned chat
completion of about 300 bytes or, with ``"stream": true``, an SSE stream of ``max_tokens``
content events plus role, finish, usage and ``[DONE]`` events, each event its own write
(``bench_interval_ms`` in the request body spaces them out); ``GET /health`` answers ok.
Run: ``python scripts/bench_tunnel_engine.py -m PATH --port P [--host H] [--alias NAME]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import socket
import sys
from typing import cast

import httptools
import uvloop


def _sse_chunk(payload: object) -> bytes:
    event = b"data: " + (payload if isinstance(payload, bytes) else json.dumps(payload).encode())
    event += b"\n\n"
    return b"%x\r\n%s\r\n" % (len(event), event)


class _EngineAnswers:
    """The engine's canned bytes for one served model name."""

    def __init__(self, alias: str) -> None:
        def chunk(delta: dict[str, str], finish: str | None) -> bytes:
            choice = {"index": 0, "delta": delta, "finish_reason": finish}
            return _sse_chunk(dict(head, choices=[choice]))

        head = {"id": "chatcmpl-b", "object": "chat.completion.chunk", "created": 1, "model": alias}
        usage = {"prompt_tokens": 5, "completion_tokens": 16, "total_tokens": 21}
        completion = {
            "id": "chatcmpl-b",
            "object": "chat.completion",
            "created": 1,
            "model": alias,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": "Hello! How can I help you?"},
                    "finish_reason": "stop",
                }
            ],
            "usage": usage,
        }
        self.plain = _http_answer(200, b"application/json", json.dumps(completion).encode())
        self.health = _http_answer(200, b"application/json", b'{"status": "ok"}')
        models = {"object": "list", "data": [{"id": alias, "object": "model"}]}
        self.models = _http_answer(200, b"application/json", json.dumps(models).encode())
        self.not_found = _http_answer(404, b"application/json", b'{"error": "not found"}')
        self.stream_head = (
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
            b"transfer-encoding: chunked\r\n\r\n" + chunk({"role": "assistant"}, None)
        )
        self.token = chunk({"content": "tok "}, None)
        self.stream_tail = (
            chunk({}, "stop")
            + _sse_chunk(dict(head, choices=[], usage=usage))
            + _sse_chunk(b"[DONE]")
            + b"0\r\n\r\n"
        )


def _http_answer(status: int, content_type: bytes, body: bytes) -> bytes:
    reason = b"OK" if status == 200 else b"Not Found"
    return b"HTTP/1.1 %d %s\r\ncontent-type: %s\r\ncontent-length: %d\r\n\r\n%s" % (
        status, reason, content_type, len(body), body)  # fmt: skip


class _EngineProtocol(asyncio.Protocol):
    """One keep-alive connection to the stand-in engine."""

    def __init__(self, answers: _EngineAnswers) -> None:
        self._answers = answers
        self._parser = httptools.HttpRequestParser(self)
        self._url = b""
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

    def on_url(self, url: bytes) -> None:
        self._url += url

    def on_body(self, body: bytes) -> None:
        self._body.append(body)

    def on_message_complete(self) -> None:
        transport = self._transport
        assert transport is not None
        path, self._url = self._url.split(b"?", 1)[0], b""
        body, self._body = b"".join(self._body), []
        answers = self._answers
        if path == b"/health":
            transport.write(answers.health)
        elif path == b"/v1/models":
            transport.write(answers.models)
        elif path != b"/v1/chat/completions" or not body:
            transport.write(answers.not_found)
        else:
            request = json.loads(body)
            if not request.get("stream"):
                transport.write(answers.plain)
                return
            tokens = int(request.get("max_tokens") or 16)
            interval_s = float(request.get("bench_interval_ms") or 0) / 1000
            transport.write(answers.stream_head)
            if interval_s <= 0:
                for _ in range(tokens):  # each event its own write, as an engine sends them
                    transport.write(answers.token)
                transport.write(answers.stream_tail)
            else:
                self._paced(transport, tokens, interval_s)

    def _paced(self, transport: asyncio.Transport, left: int, interval_s: float) -> None:
        if transport.is_closing():
            return
        if left == 0:
            transport.write(self._answers.stream_tail)
            return
        transport.write(self._answers.token)
        loop = asyncio.get_running_loop()
        loop.call_later(interval_s, self._paced, transport, left - 1, interval_s)


def serve_engine(argv: list[str]) -> None:
    """Serve as ``llama-server``: llama.cpp's flags, unknown ones ignored."""
    parser = argparse.ArgumentParser(prog="llama-server", add_help=False)
    parser.add_argument("-m", "--model", required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--alias", default="model")
    args, _ignored = parser.parse_known_args(argv)
    answers = _EngineAnswers(args.alias)

    async def main() -> None:
        loop = asyncio.get_running_loop()
        server = await loop.create_server(
            lambda: _EngineProtocol(answers), args.host, args.port, backlog=4096
        )
        print(f"bench engine listening on {args.host}:{args.port}", flush=True)
        stop = asyncio.Event()
        loop.add_signal_handler(signal.SIGTERM, stop.set)
        loop.add_signal_handler(signal.SIGINT, stop.set)
        async with server:
            await stop.wait()

    uvloop.run(main())


if __name__ == "__main__":
    serve_engine(sys.argv[1:])
