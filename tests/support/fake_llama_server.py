"""A fake ``llama-server``: takes llama.cpp's flags as berth passes them, serves a tiny API.

Run it as ``python fake_llama_server.py -m PATH --host H --port P --alias NAME [-c N] ...``
(tests put a shell wrapper named ``llama-server`` in front of it and point
``BERTH_LLAMA_SERVER_BIN`` at the wrapper).  Unknown flags are accepted and ignored, as
berth appends ``--extra-arg`` values verbatim.  It serves, on ``H:P``:

* ``GET /health``: 200 ``{"status": "ok"}`` (llama-server answers 503 while loading);
* ``GET /v1/models``: the alias as the only model;
* ``POST /v1/chat/completions``: a fixed answer, as JSON or, with ``"stream": true``, as an
  SSE stream (chunked, one event per word, ``data: [DONE]``), with a usage chunk before
  ``[DONE]`` only when ``stream_options.include_usage`` asks for it (as llama-server does).

Test-only request fields (the tunnel tests): ``"x_bulk_bytes": N`` with ``"stream": true``
streams about N bytes of SSE events of 64 KiB each; ``"x_events": N`` with
``"x_event_delay_s": S`` streams N small events S seconds apart, printing
:data:`CLIENT_GONE` if the client goes away first; every JSON answer carries
``"x_received_bytes"``, the size of the request body; ``"x_head_delay_s": S`` waits S seconds
before answering at all (a request queued in the engine; it prints :data:`HOLDING` first),
only on the engine listening on ``"x_head_delay_port"`` when that is given;
``"x_hold_file": PATH`` holds the answer likewise until PATH exists (at most
:data:`HOLD_LIMIT_S`), for a test that releases it when it has seen what it asserts rather than
after a time a loaded machine may outlast;
``"x_no_usage": true`` answers without any usage (an engine that reports none).

With ``LLAMA_API_KEY`` in its environment (how berth gives llama-server its key) it checks
``Authorization: Bearer <key>`` as llama-server does: ``/health`` and ``/v1/health`` stay
public, everything else (``/v1/*``, ``/props``, ``/slots``) answers 401 with llama-server's
error body without it.  It prints the ``Authorization`` header of every completion request it
gets (:data:`AUTH_SEEN`; its own key as a placeholder), so tests can tell that a client's own
key never arrives.

Test-only flags: ``--fail-start`` prints an error line (:data:`FAIL_LINE`) and exits 1
before listening; ``--x-setsid-grandchild PIDFILE`` first starts a helper process whose own
child calls ``setsid()`` and writes its pid to PIDFILE (a helper leaving the engine's process
group and session); ``--x-unhealthy`` makes ``/health`` answer 503 forever;
``--x-start-delay-s S`` waits S seconds before listening (a model that takes a while to
load); ``--x-fail-start-if PATH`` does as ``--fail-start`` once PATH exists (an engine that
served, then exits at once on every start); ``--x-die-by SIGNAL`` (``ILL``, ``SEGV``) kills
itself with that signal before listening (a binary built for another CPU, a crash).  Lines
it prints
go to stdout, flushed, so berth's engine log shows them.

Only the standard library is used, so the engine starts in about 0.1 s
(``support/standin_engine.py`` needs aiohttp and is driven in-process instead).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import signal
import subprocess
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import FrameType

#: This file: tests run it by path (``python SCRIPT ...``), so it imports only the standard
#: library.
SCRIPT = Path(__file__).resolve()
#: What the engine answers to every chat completion.
ANSWER = "Hello from the fake llama-server."
#: The line printed by ``--fail-start`` before exiting 1.
FAIL_LINE = "error: fake llama-server refuses to start (--fail-start)"
#: Printed once the engine listens; tests find it in ``berth logs``.
LISTENING = "fake llama-server listening on"
#: Printed when a client closes the connection before a slow stream ended.
CLIENT_GONE = "fake llama-server: client went away mid-stream"
#: Printed when a request starts waiting before its answer (``x_head_delay_s``,
#: ``x_hold_file``).
HOLDING = "fake llama-server: holding a request before answering"
#: The longest ``x_hold_file`` holds an answer whose file never comes (a test that failed first).
HOLD_LIMIT_S = 120.0
#: (prompt, completion) token counts reported in ``usage``.
USAGE = (5, 6)
#: Printed with the ``Authorization`` header (or ``-``) of each completion request.
AUTH_SEEN = "fake llama-server: authorization"
#: The paths llama-server answers without its API key.
PUBLIC_PATHS = frozenset({"/health", "/v1/health"})

# The helper: forks a child that leaves the session (setsid), writes its pid, and sleeps.
_SETSID_HELPER = """
import os, sys, time
if os.fork() == 0:
    os.setsid()
    with open(sys.argv[1] + ".tmp", "w") as out:
        out.write(str(os.getpid()))
    os.rename(sys.argv[1] + ".tmp", sys.argv[1])
time.sleep(3600)
"""


def _parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(prog="llama-server", add_help=False)
    parser.add_argument("-m", "--model", required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--alias", default="model")
    parser.add_argument("-c", "--ctx-size", type=int, default=None)
    parser.add_argument("-ngl", "--n-gpu-layers", default=None)
    parser.add_argument("--fail-start", action="store_true")
    parser.add_argument("--x-fail-start-if", type=Path, default=None)
    parser.add_argument("--x-setsid-grandchild", default=None)
    parser.add_argument("--x-unhealthy", action="store_true")
    parser.add_argument("--x-start-delay-s", type=float, default=0.0)
    parser.add_argument("--x-die-by", default=None)
    return parser.parse_known_args(argv)


def _usage() -> dict[str, int]:
    prompt, completion = USAGE
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


def _chunk(alias: str, delta: dict[str, str], finish: str | None) -> dict[str, object]:
    return {
        "id": "chatcmpl-fake",
        "object": "chat.completion.chunk",
        "created": 1,
        "model": alias,
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
    }


def stream_events(alias: str, *, include_usage: bool) -> list[bytes]:
    """The events of a streamed answer, as this engine writes them for ``alias``."""
    words = ANSWER.split(" ")
    chunks = [_chunk(alias, {"role": "assistant"}, None)]
    chunks += [
        _chunk(alias, {"content": word + (" " if i < len(words) - 1 else "")}, None)
        for i, word in enumerate(words)
    ]
    chunks.append(_chunk(alias, {}, "stop"))
    if include_usage:
        chunks.append({**_chunk(alias, {}, None), "choices": [], "usage": _usage()})
    events = [f"data: {json.dumps(c)}\n\n".encode() for c in chunks]
    return [*events, b"data: [DONE]\n\n"]


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    alias = "model"
    api_key: str | None = None
    unhealthy = False

    def log_message(self, format: str, *args: object) -> None:
        print(f"request: {format % args}", flush=True)

    def _refused(self) -> bool:
        """Answer 401 as llama-server does when a key is set and not presented."""
        if self.api_key is None or self.path in PUBLIC_PATHS:
            return False
        if self.headers.get("Authorization") == f"Bearer {self.api_key}":
            return False
        error = {"message": "Invalid API Key", "type": "authentication_error", "code": 401}
        self._json(401, {"error": error})
        return True

    def do_GET(self) -> None:
        if self._refused():
            return
        if self.path == "/health":
            if self.unhealthy:
                self._json(503, {"error": {"code": 503, "message": "Loading model"}})
            else:
                self._json(200, {"status": "ok"})
        elif self.path in ("/props", "/slots"):
            self._json(200, {"path": self.path, "alias": self.alias})
        elif self.path == "/v1/models":
            model = {"id": self.alias, "object": "model", "created": 1, "owned_by": "llamacpp"}
            self._json(200, {"object": "list", "data": [model]})
        else:
            self._json(404, {"error": {"code": 404, "message": "File Not Found"}})

    def do_POST(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length)
        if self._refused():
            return
        seen = self.headers.get("Authorization") or "-"
        # Its own key is never printed (berth's tests look for it in the log).
        shown = "<the engine's key>" if self.api_key and seen.endswith(self.api_key) else seen
        print(f"{AUTH_SEEN} {shown}", flush=True)
        if self.path != "/v1/chat/completions":
            self._json(404, {"error": {"code": 404, "message": "File Not Found"}})
            return
        try:
            body = json.loads(raw)
        except ValueError:
            self._json(400, {"error": {"code": 400, "message": "invalid JSON body"}})
            return
        port = self.server.server_address[1]
        if body.get("x_head_delay_s") and body.get("x_head_delay_port", port) == port:
            print(f"{HOLDING} for {body['x_head_delay_s']} s", flush=True)
            time.sleep(float(body["x_head_delay_s"]))  # a request queued in this engine
        if body.get("x_hold_file"):
            print(f"{HOLDING} until {body['x_hold_file']} exists", flush=True)
            hold_file, deadline = Path(body["x_hold_file"]), time.monotonic() + HOLD_LIMIT_S
            while not hold_file.exists() and time.monotonic() < deadline:
                time.sleep(0.02)
        if body.get("stream") and body.get("x_bulk_bytes"):
            self._bulk(int(body["x_bulk_bytes"]))
            return
        if body.get("stream") and body.get("x_events"):
            self._slow(int(body["x_events"]), float(body.get("x_event_delay_s", 0.1)))
            return
        reports_usage = not body.get("x_no_usage")
        if body.get("stream"):
            options = body.get("stream_options") or {}
            asked = bool(options.get("include_usage")) and reports_usage
            self._sse(stream_events(self.alias, include_usage=asked))
            return
        message = {"role": "assistant", "content": ANSWER}
        answer: dict[str, object] = {
            "id": "chatcmpl-fake",
            "object": "chat.completion",
            "created": 1,
            "model": self.alias,
            "choices": [{"index": 0, "message": message, "finish_reason": "stop"}],
        }
        if reports_usage:
            answer["usage"] = _usage()
        answer["x_received_bytes"] = len(raw)
        self._json(200, answer)

    def _json(self, status: int, payload: object) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _sse(self, events: list[bytes]) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        for event in events:
            self.wfile.write(b"%x\r\n%s\r\n" % (len(event), event))
            self.wfile.flush()
        self.wfile.write(b"0\r\n\r\n")

    def _bulk(self, total_bytes: int) -> None:
        event = b'data: {"x": "' + b"a" * (64 * 1024 - 15) + b'"}\n\n'
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        sent = 0
        frame = b"%x\r\n%s\r\n" % (len(event), event)
        while sent < total_bytes:
            self.wfile.write(frame)
            sent += len(event)
        done = b"data: [DONE]\n\n"
        self.wfile.write(b"%x\r\n%s\r\n0\r\n\r\n" % (len(done), done))

    def _slow(self, events: int, delay_s: float) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        try:
            for i in range(events):
                event = f"data: {json.dumps(_chunk(self.alias, {'content': str(i)}, None))}\n\n"
                self.wfile.write(b"%x\r\n%s\r\n" % (len(event), event.encode()))
                self.wfile.flush()
                time.sleep(delay_s)
            self.wfile.write(b"0\r\n\r\n")
        except OSError:
            print(CLIENT_GONE, flush=True)


def _on_sigterm(_signum: int, _frame: FrameType | None) -> None:
    print("fake llama-server: SIGTERM, shutting down", flush=True)
    sys.exit(0)


def main(argv: list[str]) -> int:
    args, extra = _parse(argv)
    print(f"fake llama-server: model {args.model}, alias {args.alias}, extra {extra}", flush=True)
    if args.x_setsid_grandchild:
        subprocess.Popen([sys.executable, "-c", _SETSID_HELPER, args.x_setsid_grandchild])
    if args.fail_start or (args.x_fail_start_if is not None and args.x_fail_start_if.exists()):
        print(FAIL_LINE, flush=True)
        return 1
    if args.x_die_by:
        print(f"fake llama-server: killing itself with SIG{args.x_die_by}", flush=True)
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # no core file left in the cwd
        os.kill(os.getpid(), signal.Signals[f"SIG{args.x_die_by}"])
    signal.signal(signal.SIGTERM, _on_sigterm)
    if args.x_start_delay_s:
        print(f"fake llama-server: loading for {args.x_start_delay_s} s", flush=True)
        time.sleep(args.x_start_delay_s)

    class Handler(_Handler):
        alias = args.alias
        api_key = os.environ.get("LLAMA_API_KEY")
        unhealthy = args.x_unhealthy

    server = ThreadingHTTPServer((args.host, args.port), Handler)
    server.daemon_threads = True
    print(f"{LISTENING} http://{args.host}:{args.port}", flush=True)
    try:
        server.serve_forever()
    finally:
        server.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
