"""A stand-in ow desk, written from the protocol (``shared/specs/ow-desk-protocol.md``), for tests.

It is real HTTP (aiohttp.web, optionally TLS) on 127.0.0.1 and an ephemeral port, and it
checks what it is sent as strictly as the protocol allows:

* ``POST /api/v1/node``: registration (model id pattern, price 1..5000, a known
  ``machineSecret`` groups the node with that machine, a 32-byte base64url ``enc_pubkey``);
  answers ``secret`` (``sk-node-`` + 32), ``code``, ``price``, ``price_basis``;
* ``POST /api/v1/pulse``: every field typed as the protocol lists them, recorded;
* ``POST /api/v1/jobs/claim``: ``204`` or the next job for the node's model, plain or sealed
  for the node (``x-ow-wait`` 1..15 holds the claim that long for a job);
* ``POST /api/v1/jobs/finish`` and ``/fail``: only for a job this node claimed, recorded;
* ``POST`` / ``GET /api/v1/node/check``: a pool test (a ``check_`` job) and its result;
* ``GET /api/v1/node/status``: ``state``, ``check``, ``lastSeen``;
* ``POST /api/v1/node/link``: a one-time ``code`` and ``expiresAt``.

Every call but registration needs ``Authorization: Bearer <node secret>`` (401 otherwise).
The sealing side (:func:`seal_prompt`) is written here from the protocol's four steps, not
imported from berth, so the worker's unsealing is checked against an independent writer.
:meth:`DeskStandin.script` makes a path answer scripted faults (an error status, a body
that is not JSON) before its normal answers. State is guarded by a lock, so a test thread
may add jobs and read outcomes while :class:`ThreadedDeskStandin` serves from its own loop.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import re
import secrets
import ssl
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Literal

from aiohttp import web
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

MODEL_ID = re.compile(r"[a-zA-Z0-9._:/-]{1,80}")
SECRET_ALPHABET = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_-"
WRAP_INFO = b"owt-sealed-prompt-wrap-v1"
#: The prompt of the stand-in's pool tests.
CHECK_PROMPT = "Reply with the single word: ready"
#: The price the stand-in suggests when a registration names none.
SUGGESTED_PRICE = 120

Tamper = Literal["envelope_aad", "wrap_aad", "tag", "other_key", "wrap_tag"]


# -- the sealing side -----------------------------------------------------------------------------


def b64url(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).decode().rstrip("=")


def unb64url(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def node_id_of(secret: str) -> str:
    """``node_`` + the first 8 hex characters of SHA-256 of the node secret."""
    return "node_" + hashlib.sha256(secret.encode()).hexdigest()[:8]


@dataclass(frozen=True)
class SealInputs:
    """Everything random in a sealing, fixed for known-answer tests."""

    ephemeral_private: bytes
    content_key: bytes
    nonce: bytes
    wrap_nonce: bytes

    @classmethod
    def random(cls) -> SealInputs:
        return cls(
            secrets.token_bytes(32),
            secrets.token_bytes(32),
            secrets.token_bytes(12),
            secrets.token_bytes(12),
        )


def seal_prompt(
    prompt: str,
    *,
    job_id: str,
    node_secret: str,
    host_public: bytes,
    inputs: SealInputs | None = None,
    wrap_aad: bytes | None = None,
    envelope_aad: bytes | None = None,
) -> dict[str, Any]:
    """The ``enc`` object of a sealed job: ``prompt`` sealed for the host whose raw X25519
    public key is ``host_public`` and the node of ``node_secret``.

    ``wrap_aad`` / ``envelope_aad`` replace the protocol's AADs (to build tampered jobs).
    """
    given = inputs or SealInputs.random()
    ephemeral = X25519PrivateKey.from_private_bytes(given.ephemeral_private)
    epk = ephemeral.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)
    shared = ephemeral.exchange(X25519PublicKey.from_public_bytes(host_public))
    wrap_key = HKDF(
        algorithm=hashes.SHA256(), length=32, salt=epk + host_public, info=WRAP_INFO
    ).derive(shared)
    wrap_aad = wrap_aad if wrap_aad is not None else f"{job_id}:{node_id_of(node_secret)}".encode()
    wrapped = AESGCM(wrap_key).encrypt(given.wrap_nonce, given.content_key, wrap_aad)
    envelope_aad = envelope_aad if envelope_aad is not None else job_id.encode()
    sealed = AESGCM(given.content_key).encrypt(given.nonce, prompt.encode(), envelope_aad)
    return {
        "envelope": {
            "epk": b64url(epk),
            "nonce": b64url(given.nonce),
            "ct": b64url(sealed[:-16]),
            "tag": b64url(sealed[-16:]),
        },
        "wrappedKey": b64url(wrapped[:-16]),
        "wrapNonce": b64url(given.wrap_nonce),
        "wrapTag": b64url(wrapped[-16:]),
    }


def _flip_last(text: str) -> str:
    raw = bytearray(unb64url(text))
    raw[-1] ^= 0x01
    return b64url(bytes(raw))


# -- the desk's state -----------------------------------------------------------------------------


@dataclass
class StandinNode:
    """One registered model."""

    secret: str
    model: str
    code: str
    price: int
    price_basis: str
    machine: str
    enc_pubkey: bytes
    pulses: list[dict[str, Any]] = field(default_factory=list)
    last_seen: float | None = None
    check: dict[str, Any] | None = None
    claim_headers: list[dict[str, str]] = field(default_factory=list)


@dataclass
class StandinJob:
    """A job waiting for, or handed to, a node."""

    id: str
    model: str
    prompt: str
    sealed: bool
    tamper: Tamper | None = None
    claimed_by: str | None = None


@dataclass
class Outcome:
    """How a job ended: ``finish`` (with the body) or ``fail``."""

    kind: Literal["finish", "fail"]
    body: dict[str, Any]


@dataclass(frozen=True)
class Fault:
    """One scripted answer: ``status`` with ``body`` (not JSON when so written)."""

    status: int = 500
    body: bytes = b'{"error": "scripted failure"}'


class DeskStandin:
    """The desk's state and its aiohttp app; serve with :meth:`start` in the running loop."""

    def __init__(self, *, tls: ssl.SSLContext | None = None) -> None:
        self._tls = tls
        self._lock = threading.Lock()
        self.nodes: dict[str, StandinNode] = {}
        self.jobs: dict[str, StandinJob] = {}
        self.outcomes: dict[str, Outcome] = {}
        self.pending: dict[str, deque[str]] = {}
        self.requests: list[tuple[str, str]] = []
        self.check_requests: list[str] = []
        self.registrations: list[dict[str, Any]] = []
        self._faults: dict[str, deque[Fault]] = {}
        self._counter = 0
        self._runner: web.AppRunner | None = None
        self.port = 0

    # -- test controls ------------------------------------------------------------------------

    @property
    def url(self) -> str:
        scheme = "https" if self._tls is not None else "http"
        return f"{scheme}://127.0.0.1:{self.port}"

    def script(self, path: str, *faults: Fault) -> None:
        """Answer the next calls to ``path`` with ``faults``, in order, then normally."""
        with self._lock:
            self._faults.setdefault(path, deque()).extend(faults)

    def add_job(
        self, model: str, prompt: str, *, sealed: bool = False, tamper: Tamper | None = None
    ) -> str:
        """Queue a caller's job for ``model``; returns its id (``job_...``)."""
        with self._lock:
            return self._queue("job", model, prompt, sealed=sealed, tamper=tamper)

    def node_for(self, model: str) -> StandinNode:
        with self._lock:
            return next(n for n in self.nodes.values() if n.model == model)

    def outcome(self, job_id: str) -> Outcome | None:
        with self._lock:
            return self.outcomes.get(job_id)

    def wait_outcome(self, job_id: str, timeout_s: float = 60.0) -> Outcome:
        """Block (a test thread) until ``job_id`` finished or failed."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            found = self.outcome(job_id)
            if found is not None:
                return found
            time.sleep(0.05)
        raise AssertionError(f"job {job_id} got no finish or fail in {timeout_s} s")

    async def until(self, predicate: Callable[[], bool], timeout_s: float = 10.0) -> None:
        """Wait (in the serving loop) until ``predicate()`` holds."""
        deadline = time.monotonic() + timeout_s
        while not predicate():
            if time.monotonic() > deadline:
                raise AssertionError("the stand-in desk did not see what the test waited for")
            await asyncio.sleep(0.01)

    async def outcome_of(self, job_id: str, timeout_s: float = 10.0) -> Outcome:
        await self.until(lambda: self.outcome(job_id) is not None, timeout_s)
        found = self.outcome(job_id)
        assert found is not None
        return found

    # -- serving ------------------------------------------------------------------------------

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._faults_first])
        app.router.add_post("/api/v1/node", self._register)
        app.router.add_post("/api/v1/pulse", self._pulse)
        app.router.add_post("/api/v1/jobs/claim", self._claim)
        app.router.add_post("/api/v1/jobs/finish", self._finish)
        app.router.add_post("/api/v1/jobs/fail", self._fail)
        app.router.add_post("/api/v1/node/check", self._request_check)
        app.router.add_get("/api/v1/node/check", self._check_result)
        app.router.add_get("/api/v1/node/status", self._status)
        app.router.add_post("/api/v1/node/link", self._link)
        return app

    async def start(self, port: int = 0) -> None:
        self._runner = web.AppRunner(self.app(), access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", port, ssl_context=self._tls)
        await site.start()
        server = site._server
        assert server is not None
        self.port = server.sockets[0].getsockname()[1]  # type: ignore[attr-defined]

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def __aenter__(self) -> DeskStandin:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    # -- handlers -----------------------------------------------------------------------------

    @web.middleware
    async def _faults_first(self, request: web.Request, handler: Any) -> web.StreamResponse:
        with self._lock:
            self.requests.append((request.method, request.path))
            queue = self._faults.get(request.path)
            fault = queue.popleft() if queue else None
        if fault is not None:
            return web.Response(
                status=fault.status, body=fault.body, content_type="application/json"
            )
        response: web.StreamResponse = await handler(request)
        return response

    async def _register(self, request: web.Request) -> web.Response:
        body = await _json_object(request)
        model, price = body.get("model"), body.get("price")
        machine_secret, pubkey = body.get("machineSecret"), body.get("enc_pubkey")
        if set(body) - {"model", "price", "machineSecret", "enc_pubkey"}:
            raise _error(400, "unknown fields")
        if not isinstance(model, str) or not MODEL_ID.fullmatch(model):
            raise _error(400, "model must match [a-zA-Z0-9._:/-]{1,80}")
        if price is not None and (type(price) is not int or not 1 <= price <= 5000):
            raise _error(400, "price must be an integer from 1 to 5000")
        if not isinstance(pubkey, str):
            raise _error(400, "enc_pubkey is required")
        try:
            raw_key = unb64url(pubkey)
        except ValueError:
            raise _error(400, "enc_pubkey is not base64url") from None
        if len(raw_key) != 32 or b64url(raw_key) != pubkey:
            raise _error(400, "enc_pubkey must be 32 bytes of unpadded base64url")
        with self._lock:
            self.registrations.append(body)
            if machine_secret is None:
                machine = f"m{len(self.nodes) + 1}"
            elif machine_secret in self.nodes:
                machine = self.nodes[machine_secret].machine
            else:
                raise _error(400, "machineSecret is not a node of this desk")
            secret = "sk-node-" + "".join(secrets.choice(SECRET_ALPHABET) for _ in range(32))
            node = StandinNode(
                secret=secret,
                model=model,
                code=f"N{len(self.nodes) + 1:03d}",
                price=price if price is not None else SUGGESTED_PRICE,
                price_basis="host" if price is not None else "suggested",
                machine=machine,
                enc_pubkey=raw_key,
            )
            self.nodes[secret] = node
        return web.json_response(
            {
                "secret": node.secret,
                "code": node.code,
                "price": node.price,
                "price_basis": node.price_basis,
            }
        )

    async def _pulse(self, request: web.Request) -> web.Response:
        node = self._node(request)
        body = await _json_object(request)
        expected: dict[str, Callable[[Any], bool]] = {
            "chip": lambda v: v is None or isinstance(v, str),
            "vram_gb": _number_or_null,
            "vram_used_gb": _number_or_null,
            "tok_per_s": _number_or_null,
            "busy": lambda v: isinstance(v, bool),
            "slots": lambda v: type(v) is int and v >= 0,
            "models": lambda v: isinstance(v, list) and all(isinstance(m, str) for m in v),
            "enc_pubkey": lambda v: isinstance(v, str),
        }
        for name, valid in expected.items():
            if name not in body or not valid(body[name]):
                raise _error(400, f"pulse field {name} is missing or mistyped")
        if unb64url(body["enc_pubkey"]) != node.enc_pubkey:
            raise _error(400, "enc_pubkey differs from the registered key")
        with self._lock:
            node.pulses.append(body)
            node.last_seen = time.time()
        return web.json_response({"ok": True})

    async def _claim(self, request: web.Request) -> web.StreamResponse:
        node = self._node(request)
        if await request.read():
            raise _error(400, "a claim has no body")
        wait = request.headers.get("x-ow-wait")
        with self._lock:
            node.claim_headers.append({k.lower(): v for k, v in request.headers.items()})
            node.last_seen = time.time()
        wait_s = 0
        if wait is not None:
            if not wait.isdigit() or not 1 <= int(wait) <= 15:
                raise _error(400, "x-ow-wait must be 1 to 15")
            wait_s = int(wait)
        deadline = time.monotonic() + wait_s
        while True:
            with self._lock:
                queue = self.pending.get(node.model)
                job = self.jobs[queue.popleft()] if queue else None
                if job is not None:
                    job.claimed_by = node.secret
                    return web.json_response(self._job_json(job, node))
            if time.monotonic() >= deadline:
                return web.Response(status=204)
            await asyncio.sleep(0.02)

    def _job_json(self, job: StandinJob, node: StandinNode) -> dict[str, Any]:
        if not job.sealed:
            return {"id": job.id, "model": job.model, "prompt": job.prompt}
        host_public, job_secret = node.enc_pubkey, node.secret
        wrap_aad = envelope_aad = None
        if job.tamper == "other_key":
            host_public = (
                X25519PrivateKey.generate()
                .public_key()
                .public_bytes(Encoding.Raw, PublicFormat.Raw)
            )
        elif job.tamper == "wrap_aad":  # sealed for another node of the same host
            job_secret = "sk-node-" + "x" * 32
        elif job.tamper == "envelope_aad":
            envelope_aad = b"job_someone_else"
        enc = seal_prompt(
            job.prompt,
            job_id=job.id,
            node_secret=job_secret,
            host_public=host_public,
            wrap_aad=wrap_aad,
            envelope_aad=envelope_aad,
        )
        if job.tamper == "tag":
            enc["envelope"]["tag"] = _flip_last(enc["envelope"]["tag"])
        elif job.tamper == "wrap_tag":
            enc["wrapTag"] = _flip_last(enc["wrapTag"])
        return {"id": job.id, "model": job.model, "prompt": "", "prompt_mode": "sealed", "enc": enc}

    async def _finish(self, request: web.Request) -> web.Response:
        node = self._node(request)
        body = await _json_object(request)
        if set(body) != {"id", "output", "prompt_tokens", "completion_tokens"}:
            raise _error(400, "finish takes id, output, prompt_tokens, completion_tokens")
        if not isinstance(body["output"], str) or not all(
            type(body[k]) is int and body[k] >= 0 for k in ("prompt_tokens", "completion_tokens")
        ):
            raise _error(400, "finish fields mistyped")
        self._end(node, body, "finish")
        return web.json_response({"ok": True})

    async def _fail(self, request: web.Request) -> web.Response:
        node = self._node(request)
        body = await _json_object(request)
        if set(body) != {"id"}:
            raise _error(400, "fail takes id only")
        self._end(node, body, "fail")
        return web.json_response({"ok": True})

    def _end(
        self, node: StandinNode, body: dict[str, Any], kind: Literal["finish", "fail"]
    ) -> None:
        with self._lock:
            job = self.jobs.get(body["id"]) if isinstance(body["id"], str) else None
            if job is None or job.claimed_by != node.secret:
                raise _error(404, "no such job claimed by this node")
            if job.id in self.outcomes:
                raise _error(409, "job already ended")
            self.outcomes[job.id] = Outcome(kind, body)
            if node.check is not None and node.check.get("job") == job.id:
                node.check = {
                    "job": job.id,
                    "status": "passed" if kind == "finish" else "failed",
                    **({"output": body["output"]} if kind == "finish" else {}),
                }

    async def _request_check(self, request: web.Request) -> web.Response:
        node = self._node(request)
        with self._lock:
            self.check_requests.append(node.model)
            job_id = self._queue("check", node.model, CHECK_PROMPT, sealed=False, tamper=None)
            node.check = {"job": job_id, "status": "pending"}
        return web.json_response({"ok": True, "job": job_id})

    async def _check_result(self, request: web.Request) -> web.Response:
        node = self._node(request)
        with self._lock:
            return web.json_response(node.check or {"status": "none"})

    async def _status(self, request: web.Request) -> web.Response:
        node = self._node(request)
        with self._lock:
            recent = node.last_seen is not None and time.time() - node.last_seen < 180
            pending = node.check is not None and node.check["status"] == "pending"
            state = "checking" if pending else "ready" if recent else "offline"
            seen = None
            if node.last_seen is not None:
                seen = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(node.last_seen))
            return web.json_response({"state": state, "check": node.check, "lastSeen": seen})

    async def _link(self, request: web.Request) -> web.Response:
        node = self._node(request)
        expires = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() + 600))
        return web.json_response({"code": f"LINK-{node.machine.upper()}", "expiresAt": expires})

    # -- helpers ------------------------------------------------------------------------------

    def _queue(
        self, prefix: str, model: str, prompt: str, *, sealed: bool, tamper: Tamper | None
    ) -> str:
        self._counter += 1
        job = StandinJob(f"{prefix}_{self._counter:04d}", model, prompt, sealed, tamper)
        self.jobs[job.id] = job
        self.pending.setdefault(model, deque()).append(job.id)
        return job.id

    def _node(self, request: web.Request) -> StandinNode:
        auth = request.headers.get("authorization", "")
        secret = auth.removeprefix("Bearer ")
        with self._lock:
            node = self.nodes.get(secret) if auth.startswith("Bearer ") else None
        if node is None:
            raise _error(401, "unknown node secret")
        return node


def _number_or_null(value: Any) -> bool:
    return value is None or (isinstance(value, int | float) and not isinstance(value, bool))


def _error(status: int, message: str) -> web.HTTPException:
    body = json.dumps({"error": message})
    kind = {
        400: web.HTTPBadRequest,
        401: web.HTTPUnauthorized,
        404: web.HTTPNotFound,
        409: web.HTTPConflict,
    }[status]
    return kind(text=body, content_type="application/json")


async def _json_object(request: web.Request) -> dict[str, Any]:
    if request.content_type != "application/json":
        raise _error(400, "expected application/json")
    try:
        body = json.loads(await request.read())
    except ValueError:
        raise _error(400, "body is not JSON") from None
    if not isinstance(body, dict):
        raise _error(400, "body must be an object")
    return body


class ThreadedDeskStandin(DeskStandin):
    """A :class:`DeskStandin` serving from its own thread and loop (for CLI subprocesses)."""

    def __init__(self, *, tls: ssl.SSLContext | None = None) -> None:
        super().__init__(tls=tls)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)

    def __enter__(self) -> ThreadedDeskStandin:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self.start(), self._loop).result(10)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        asyncio.run_coroutine_threadsafe(self.stop(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()
