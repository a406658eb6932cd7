"""The request handler of each listener of the leader's HTTP server (:mod:`berth.http_server`).

``/v1/*`` goes straight to the OpenAI proxy with the server's own request and writer (the
hot path meets no framework); everything else goes to the admin app through the server's
ASGI adapter. Authentication happens here, once, by listener: over TCP ``/v1/*`` and
``/metrics`` need any valid key that has not expired (in ``Authorization: Bearer`` or, on
every path alike, ``x-api-key``, which the Anthropic SDK sends; refusals under
``/v1/messages`` are Anthropic-shaped) and ``/admin/*`` an admin key whose role the route
allows (the caller goes to the admin app in its request state, :mod:`berth.admin.roles`),
and failed
attempts are limited per client address (429 past the ``auth_failure_*`` settings; see
:mod:`berth.auth.authenticator`); over the Unix socket (mode 0600, so only its owner can connect) no
key is needed: a request there is the desk worker's when it says so
(:data:`berth.admission.SOCKET_CALLER_HEADER`, read on that listener only), else the CLI's.
The key's record, or the socket's caller, goes to the proxy, whose admission applies its
limits. On the public listener, browsers on
the origins of the ``cors_origins`` setting get their preflights answered and CORS headers on
every answer (:mod:`berth.http_server.cors`). The web console (``/ui/*``, and ``/`` for a
browser) needs no key; a browser signed in to it sends a session cookie instead of a key,
which :class:`berth.admin.console.ConsoleGate` checks. A standby leader (``leader_ha``,
:mod:`berth.store.leadership`) answers ``/v1/*`` with 503, ``Retry-After`` and the active
leader's address, before any key is checked; once the key is checked, it answers the
admin API's control commands (:mod:`berth.daemon.controller_gate`) with 409
``not_controller`` naming the controller.
"""

from __future__ import annotations

from fastapi import FastAPI

from berth.admin.console import CONSOLE_HEADERS, ConsoleGate, is_console_path
from berth.admin.roles import KEY_STATE, NO_KEY, check_roles_declared
from berth.admission import (
    SOCKET_CALLER_HEADER,
    Admission,
    AdmissionError,
    SocketCaller,
    socket_caller,
)
from berth.anthropic_errors import is_messages_path, to_anthropic
from berth.auth.authenticator import Authenticator, require_tier, secret_from_headers
from berth.daemon.admin_routes import build_admin
from berth.daemon.controller_gate import controller_only
from berth.daemon.graph import LeaderGraph
from berth.errors import AuthError, BerthError, RateLimitError
from berth.gateway.proxy import OpenAIProxy
from berth.http_server.asgi import AsgiHandler
from berth.http_server.cors import CorsPolicy
from berth.http_server.request import Request
from berth.http_server.writer import ResponseWriter
from berth.openai_errors import error_from_exception
from berth.store.errors import NotControllerError
from berth.store.leadership import Leadership
from berth.vocab.records import ApiKeyRecord

#: Paths that answer without a key on every listener.
OPEN_PATHS = frozenset({"/healthz", "/readyz"})
_CALLER_HEADER = SOCKET_CALLER_HEADER.encode()


class LeaderApp:
    """Serves one listener's requests: the ``proxy`` or the ``admin`` app, after auth.

    Keys are checked by ``authenticator``, their expiry by ``admission``; ``leadership``
    (``None`` for a lone leader) turns ``/v1`` away while this leader stands by.
    ``trusted`` is True for the Unix socket listener; ``cors`` applies on the public one,
    where ``console`` lets a signed-in browser's session stand for an admin key.
    """

    def __init__(
        self,
        proxy: OpenAIProxy,
        admin: FastAPI,
        authenticator: Authenticator,
        admission: Admission,
        leadership: Leadership | None,
        *,
        trusted: bool,
        cors: CorsPolicy | None = None,
        console: ConsoleGate | None = None,
    ) -> None:
        self._admin = AsgiHandler(admin)
        self._proxy = proxy
        self._authenticator = authenticator
        self._admission = admission
        self._leadership = leadership
        self._trusted = trusted
        self._cors = cors if cors is not None and cors.enabled else None
        self._console = console

    async def __call__(self, request: Request, writer: ResponseWriter) -> None:
        path = request.path
        cors = self._cors
        if cors is not None:
            origin = request.header(b"origin")
            if origin is not None:
                if request.method == "OPTIONS":
                    allowed = cors.preflight(
                        origin,
                        request.header(b"access-control-request-method"),
                        request.header(b"access-control-request-headers"),
                    )
                    if allowed is not None:
                        await writer.start(204, allowed)
                        await writer.end()
                        return
                writer.extra_headers = cors.answer_headers(origin)
        if is_console_path(path) or path == "/":
            writer.extra_headers = [*writer.extra_headers, *CONSOLE_HEADERS]
            # /ui/session checks what it is given
            await self._admin(request, writer, state={KEY_STATE: NO_KEY})
            return
        leadership = self._leadership
        if leadership is not None and path.startswith("/v1/") and not leadership.is_active:
            await _send_error(writer, leadership.refusal(), path)  # a standby: go to the active
            return
        key: ApiKeyRecord | SocketCaller | None = None
        if self._trusted:  # the socket: no key, and its caller's word is trusted
            key = socket_caller(request.header(_CALLER_HEADER))
        elif path not in OPEN_PATHS:
            tier = "admin" if path.startswith("/admin") else "standard"
            try:
                key = await self._authenticate(request, tier)
            except (AuthError, RateLimitError, AdmissionError) as exc:
                await _send_error(writer, exc, path)
                return
        if path.startswith("/v1/"):
            # Its admission limits by key; the request log names it.
            name = key.value if isinstance(key, SocketCaller) else key.name if key else ""
            await self._proxy.handle(request, writer, key, key_name=name)
        else:
            standby = leadership is not None and not leadership.is_active
            if standby and controller_only(request.method, path):  # name the controller
                assert leadership is not None
                view = leadership.view()
                refusal = NotControllerError(view.active_address, view.epoch)
                await _send_error(writer, refusal, path)
                return
            # The admin routes check the caller's role (berth.admin.roles).
            caller = NO_KEY if key is None else key
            await self._admin(request, writer, state={KEY_STATE: caller})

    async def _authenticate(self, request: Request, tier: str) -> ApiKeyRecord:
        authenticator = self._authenticator
        secret = secret_from_headers(request.headers)
        if secret is None and self._console is not None:
            signed_in = await self._console.authenticate(request)
            if signed_in is not None:
                self._admission.check_expiry(signed_in)  # 401 once expired
                require_tier(signed_in, tier)
                return signed_in
        # Failed attempts are limited per client address; a key already found valid is not.
        address = request.client[0] if request.client is not None else None
        record = await authenticator.authenticate(
            secret, address=address, surface=_surface(request.path)
        )
        self._admission.check_expiry(record)  # 401 once expired
        require_tier(record, tier)
        return record


def _surface(path: str) -> str:
    """Where a keyed request came in, for the audit log: ``v1``, ``admin`` or ``metrics``."""
    top = path.split("/", 2)[1] if path.startswith("/") else ""
    return top if top in ("v1", "admin", "metrics") else "api"


async def _send_error(writer: ResponseWriter, exc: BerthError, path: str) -> None:
    """Answer a refused authentication: OpenAI-shaped, Anthropic-shaped under
    ``/v1/messages``."""
    reply = error_from_exception(exc)
    if is_messages_path(path):
        reply = to_anthropic(reply)
    status, body, headers = reply
    raw_headers = [
        (b"content-type", b"application/json"),
        (b"content-length", b"%d" % len(body)),
    ]
    raw_headers += [(k.lower().encode(), v.encode()) for k, v in headers.items()]
    if status == 401:
        raw_headers.append((b"www-authenticate", b"Bearer"))
    await writer.start(status, raw_headers)
    await writer.end(body)


def build_apps(graph: LeaderGraph) -> tuple[LeaderApp, LeaderApp]:
    """Return ``(public_app, socket_app)`` sharing one admin app and one proxy."""
    console = ConsoleGate(
        graph.store,
        graph.authenticator,
        graph.pepper,
        check_expiry=graph.admission.check_expiry,
    )
    admin = build_admin(graph, console)
    check_roles_declared(admin)
    cors = CorsPolicy.from_setting(graph.settings.cors_origins)
    shared = (graph.proxy, admin, graph.authenticator, graph.admission, graph.leadership)
    return (
        LeaderApp(*shared, trusted=False, cors=cors, console=console),
        LeaderApp(*shared, trusted=True),
    )
