"""The cluster listener: where agents register and dial in (aiohttp, mutual TLS optional).

It is an :class:`aiohttp.web.Application`, not a uvicorn app, because the agent link needs
the client certificate and uvicorn does not hand it to ASGI apps; aiohttp exposes the
asyncio transport, whose ``ssl_object`` holds the peer certificate.  The server runs on the
daemon's loop over a socket berth binds itself.

TLS: the server certificate is issued by the berth CA for the cluster host; a client
certificate is *optional* at the TLS level (``CERT_OPTIONAL``) so ``GET /admin/ca.pem`` and
registration work without one, but one that is presented must chain to the berth CA (only
that CA is trusted), else the handshake fails.  Routes:

- ``GET /admin/ca.pem``: the root the server certificate chains to (the CA; the old one
  during a CA rotation), what enrollment URIs pin;
- ``POST /admin/nodes/register``: ``{"token", "csr_pem"}`` → the agent's certificate
  (failed attempts rate-limited per source address; see :mod:`berth.cluster.pki.enrollment`);
- ``GET /cluster/agent``: the agents' WebSocket, handled by the injected ``agent_handler``.

Bounds (the listener settings, :class:`berth.http_server.limits.ListenerLimits`): aiohttp
caps a head's line length (the smaller of 8190 bytes and ``max_head_bytes``) and its header
count, and closes an idle keep-alive connection after ``keepalive_timeout_s``; each
connection is wrapped in a :class:`berth.http_server.guard.GuardedProtocol`, which caps
connections (in all and per source address) and closes one whose first request has not
arrived within ``head_timeout_s`` (also the TLS handshake's limit); a registration body must
arrive within ``body_timeout_s``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import ssl
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Final

from aiohttp import web

from berth.cluster.pki.ca import CertificateAuthority
from berth.cluster.pki.enrollment import EnrollmentService, RegistrationRateLimiter
from berth.errors import BerthError, ConfigError, RateLimitError
from berth.http_server.errors import RequestTimeoutError
from berth.http_server.guard import GuardedProtocol, request_began
from berth.http_server.limits import ConnectionGate, ListenerLimits
from berth.openai_errors import error_from_exception

log = logging.getLogger(__name__)

AgentHandler = Callable[[web.Request], Awaitable[web.StreamResponse]]

#: Largest registration body accepted (a CSR is about 500 bytes).
MAX_REGISTER_BODY_BYTES: Final = 64 * 1024
CA_PEM_MEDIA_TYPE: Final = "application/x-pem-file"


def cluster_tls_files(
    ca: CertificateAuthority, hosts: str | Sequence[str], ca_dir: Path
) -> tuple[Path, Path]:
    """The cluster listener's certificate and key under ``ca_dir``, issued by ``ca`` for
    ``hosts`` (one name or several: what agents dial, see ``Settings.cluster_hosts``; plus
    ``localhost``, 127.0.0.1 and ::1) and re-issued when one of them is not among its SANs
    or it is close to expiry."""
    names = [hosts] if isinstance(hosts, str) else list(hosts)
    cert, key = ca_dir / "cluster.pem", ca_dir / "cluster.key"
    ca.ensure_server_certificate(sorted({*names, "localhost", "127.0.0.1", "::1"}), cert, key)
    return cert, key


#: OpenSSL's ``X509_V_FLAG_NO_CHECK_TIME`` (x509_vfy.h; the ssl module has no name for it).
_NO_CHECK_TIME: Final = 0x200000


def cluster_ssl_context(
    ca: CertificateAuthority, cert_path: Path, key_path: Path
) -> ssl.SSLContext:
    """A TLS 1.2+ server context: ``cert_path``/``key_path`` as the server identity, every
    root of the berth CA's trust bundle (two during a rotation) as the only trust roots for
    client certificates, which are optional.

    The handshake checks the client chain's signatures but not its dates: an expired agent
    certificate is refused by the hub after the handshake, with the typed close code
    ``CERTIFICATE_EXPIRED`` and a log line naming the node (:mod:`berth.cluster.pki.renewal`),
    instead of a TLS alert nobody can tell from a network fault.
    """
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(str(cert_path), str(key_path))
    context.load_verify_locations(cadata=ca.trust_bundle_pem.decode())
    context.verify_mode = ssl.CERT_OPTIONAL
    context.verify_flags |= _NO_CHECK_TIME
    return context


def build_cluster_app(
    *,
    enrollment: EnrollmentService,
    ca_pem: bytes | Callable[[], bytes],
    agent_handler: AgentHandler,
    on_registered: Callable[[str], Awaitable[None]] | None = None,
    rate_limiter: RegistrationRateLimiter | None = None,
    monotonic: Callable[[], float] = time.monotonic,
    body_timeout_s: float = ListenerLimits.body_timeout_s,
) -> web.Application:
    """The cluster listener's app, from explicit dependencies.

    ``monotonic`` is the rate limiter's clock; a registration body must arrive within
    ``body_timeout_s``. Errors are answered in the OpenAI error shape: 400 for a malformed
    body or CSR, 401 for a refused token, 408 for a body too slow, 429 with ``Retry-After``
    over the rate limit.
    """
    limiter = rate_limiter or RegistrationRateLimiter()

    @web.middleware
    async def berth_errors(
        request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        request_began(request.transport)  # the connection's head timer stops here
        try:
            return await handler(request)
        except BerthError as exc:
            status, body, headers = error_from_exception(exc)
            return web.Response(
                body=body, status=status, headers=headers, content_type="application/json"
            )

    async def ca_certificate(_request: web.Request) -> web.Response:
        body = ca_pem() if callable(ca_pem) else ca_pem
        return web.Response(body=body, content_type=CA_PEM_MEDIA_TYPE)

    async def register(request: web.Request) -> web.Response:
        source = request.remote or "unknown"
        try:
            async with asyncio.timeout(body_timeout_s):
                body = await request.json(loads=json.loads)
        except TimeoutError:
            raise RequestTimeoutError(
                f"the registration body did not arrive within {body_timeout_s:g} s"
            ) from None
        except (ValueError, UnicodeDecodeError):
            body = None  # refused below, after it counted against the rate limit
        token = body.get("token") if isinstance(body, dict) else None
        csr_pem = body.get("csr_pem") if isinstance(body, dict) else None
        token_text = token if isinstance(token, str) else ""
        attempted_at = monotonic()
        retry_after_s = limiter.check(source, attempted_at)
        if retry_after_s is not None:
            await asyncio.to_thread(
                enrollment.audit_rate_limited, token_text, source, retry_after_s
            )
            raise RateLimitError(
                "too many registration attempts from this address", retry_after_s=retry_after_s
            )
        if not isinstance(token, str) or not token or not isinstance(csr_pem, str):
            await asyncio.to_thread(enrollment.audit_malformed, token_text, source)
            raise ConfigError('the body must be {"token": "...", "csr_pem": "..."}')
        registration = await asyncio.to_thread(enrollment.register, token, csr_pem, source)
        limiter.succeeded(source, attempted_at)  # only failures count against an address
        if on_registered is not None:
            # A re-enrolled node's old certificate no longer counts: its live link goes.
            await on_registered(registration.node_id)
        return web.json_response(asdict(registration))

    app = web.Application(middlewares=[berth_errors], client_max_size=MAX_REGISTER_BODY_BYTES)
    app.router.add_get("/admin/ca.pem", ca_certificate)
    app.router.add_post("/admin/nodes/register", register)
    app.router.add_get("/cluster/agent", agent_handler)
    return app


class ClusterListener:
    """Runs the cluster app on the current loop over an already bound socket, within
    ``limits`` (see the module docstring for which bound is kept by whom)."""

    def __init__(
        self,
        app: web.Application,
        sock: socket.socket,
        ssl_context: ssl.SSLContext,
        limits: ListenerLimits | None = None,
    ):
        self._limits = limits = limits or ListenerLimits()
        line_bytes = min(8190, limits.max_head_bytes)
        self._runner = web.AppRunner(
            app,
            access_log=None,
            handle_signals=False,
            keepalive_timeout=limits.keepalive_timeout_s,
            max_line_size=line_bytes,
            max_field_size=line_bytes,
            max_headers=limits.max_header_count,
        )
        self._sock = sock
        self._ssl = ssl_context
        self._gate = ConnectionGate(limits)
        self._server: asyncio.Server | None = None
        self._started = False

    @property
    def gate(self) -> ConnectionGate:
        return self._gate

    async def start(self) -> None:
        """Start accepting connections."""
        self._started = True
        await self._runner.setup()
        handlers = self._runner.server
        assert handlers is not None, "set up above"
        gate, limits = self._gate, self._limits
        self._server = await asyncio.get_running_loop().create_server(
            lambda: GuardedProtocol(handlers(), gate, limits, "cluster"),
            sock=self._sock,
            ssl=self._ssl,
            ssl_handshake_timeout=limits.head_timeout_s,
        )

    async def stop(self) -> None:
        """Stop accepting, close open connections (agent WebSockets included); closes the
        socket even if :meth:`start` never ran."""
        if self._server is not None:
            self._server.close()
        if self._started:
            await self._runner.cleanup()
        self._sock.close()
