"""A fake ``vllm serve`` speaking vLLM's LoRA adapter API, for the adapter routing tests.

Run as ``python fake_vllm_server.py serve MODEL --host H --port P --served-model-name NAME
[--enable-lora --max-loras N --max-lora-rank R]`` (tests put a wrapper named ``vllm`` in
front of it and point ``BERTH_VLLM_BIN`` at the wrapper); other flags are ignored. On
``H:P`` it serves, as vLLM does:

* ``GET /health``: 200;
* ``GET /v1/models``: the served name, then each loaded adapter with ``parent`` = the base;
* ``POST /v1/load_lora_adapter`` ``{"lora_name", "lora_path"}``: only with ``--enable-lora``
  and ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`` in the environment (404 otherwise, the route
  does not exist); 400 for a name already loaded or a path without ``adapter_config.json``;
  and, this stand-in's slot limit, 400 when ``--max-loras`` adapters are loaded already;
* ``POST /v1/unload_lora_adapter`` ``{"lora_name"}``: 404 for one not loaded;
* ``POST /v1/chat/completions``: for the served name or a loaded adapter, a JSON answer whose
  content names what answered (``base`` or ``adapter NAME``) and whose ``x_port`` is this
  engine's port; 404 ``The model `X` does not exist.`` for any other model (an adapter that
  is not loaded). Test-only: ``"x_fail_port": P`` makes the engine on port P answer 503.

Every load, unload and completion prints a line (:data:`LOADED`, :data:`UNLOADED`,
:data:`ANSWERED`), flushed, so the engine log shows their order; ``GET /x/adapters`` (no key)
lists the loaded adapters. With ``VLLM_API_KEY`` set, ``/v1/*`` needs ``Authorization:
Bearer`` with it. Only the standard library is used, so it starts in about 0.1 s.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

SCRIPT = Path(__file__).resolve()
LOADED = "fake vllm: loaded adapter"
UNLOADED = "fake vllm: unloaded adapter"
ANSWERED = "fake vllm: answered"


def wrapper(root: Path) -> Path:
    """An executable ``root/bin/vllm`` running this fake with this Python (point
    ``BERTH_VLLM_BIN`` at it)."""
    path = root / "bin" / "vllm"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{SCRIPT}" "$@"\n')
    path.chmod(0o755)
    return path


class _State:
    def __init__(self, args: argparse.Namespace) -> None:
        self.served = args.served_model_name or args.model
        self.port = args.port
        self.lora = args.enable_lora
        self.runtime_updates = os.environ.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING") == "True"
        self.max_loras = args.max_loras
        self.key = os.environ.get("VLLM_API_KEY")
        self.adapters: dict[str, str] = {}
        self.lock = threading.Lock()


def say(line: str) -> None:
    print(line, flush=True)


def _handler(state: _State) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: object) -> None:
            pass

        def _send(self, status: int, payload: object) -> None:
            body = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def _error(self, status: int, message: str) -> None:
            kind = "NotFoundError" if status == 404 else "BadRequestError"
            self._send(status, {"error": {"message": message, "type": kind, "code": status}})

        def _authorized(self) -> bool:
            if state.key is None or not self.path.startswith("/v1/"):
                return True
            if self.headers.get("Authorization") == f"Bearer {state.key}":
                return True
            self._send(401, {"error": "Unauthorized"})
            return False

        def _body(self) -> dict[str, object]:
            length = int(self.headers.get("Content-Length") or 0)
            data = json.loads(self.rfile.read(length) or b"{}")
            return data if isinstance(data, dict) else {}

        def do_GET(self) -> None:
            if self.path == "/health":
                self._send(200, {})
            elif self.path == "/x/adapters":
                with state.lock:
                    self._send(200, sorted(state.adapters))
            elif self.path == "/v1/models":
                if not self._authorized():
                    return
                with state.lock:
                    cards = [{"id": state.served, "object": "model", "parent": None}]
                    cards += [
                        {"id": name, "object": "model", "root": path, "parent": state.served}
                        for name, path in state.adapters.items()
                    ]
                self._send(200, {"object": "list", "data": cards})
            else:
                self._error(404, "Not Found")

        def do_POST(self) -> None:
            if not self._authorized():
                return
            body = self._body()
            if self.path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
                if not (state.lora and state.runtime_updates):
                    self._error(404, "Not Found")
                    return
                name = str(body.get("lora_name", ""))
                if self.path == "/v1/load_lora_adapter":
                    self._load(name, str(body.get("lora_path", "")))
                else:
                    self._unload(name)
            elif self.path == "/v1/chat/completions":
                self._chat(body)
            else:
                self._error(404, "Not Found")

        def _load(self, name: str, path: str) -> None:
            with state.lock:
                if name in state.adapters:
                    self._error(400, f"The lora adapter '{name}' has already been loaded.")
                    return
                if not (Path(path) / "adapter_config.json").is_file():
                    self._error(400, f"Loading lora {name} failed: no adapter found at {path}")
                    return
                if len(state.adapters) >= state.max_loras:
                    self._error(400, f"all {state.max_loras} LoRA slots are taken")
                    return
                state.adapters[name] = path
                say(f"{LOADED} {name}")
            self._send(200, {"message": f"Success: LoRA adapter '{name}' added successfully."})

        def _unload(self, name: str) -> None:
            with state.lock:
                if state.adapters.pop(name, None) is None:
                    self._error(404, f"The lora adapter '{name}' cannot be found.")
                    return
                say(f"{UNLOADED} {name}")
            self._send(200, {"message": f"Success: LoRA adapter '{name}' removed successfully."})

        def _chat(self, body: dict[str, object]) -> None:
            model = str(body.get("model", ""))
            if body.get("x_fail_port") == state.port:
                self._error(503, "the fake engine is told to fail")
                return
            with state.lock:
                if model == state.served:
                    content = "base"
                elif model in state.adapters:
                    content = f"adapter {model}"
                else:
                    self._error(404, f"The model `{model}` does not exist.")
                    return
            say(f"{ANSWERED} {model}")
            self._send(
                200,
                {
                    "id": "chatcmpl-fake",
                    "object": "chat.completion",
                    "created": 1,
                    "model": model,
                    "x_port": state.port,
                    "choices": [
                        {
                            "index": 0,
                            "message": {"role": "assistant", "content": content},
                            "finish_reason": "stop",
                        }
                    ],
                    "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5},
                },
            )

    return Handler


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("command")
    parser.add_argument("model")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--served-model-name")
    parser.add_argument("--enable-lora", action="store_true")
    parser.add_argument("--max-loras", type=int, default=1)
    parser.add_argument("--max-lora-rank", type=int, default=16)
    args, _unknown = parser.parse_known_args()
    state = _State(args)
    server = ThreadingHTTPServer((args.host, args.port), _handler(state))
    say(f"fake vllm listening on {args.host}:{args.port} (max loras {args.max_loras})")
    server.serve_forever()


if __name__ == "__main__":
    main()
