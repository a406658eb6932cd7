"""The app factory: one ASGI entry point per listener.

``/v1/*`` goes straight to the raw-ASGI OpenAI proxy (the hot path never meets FastAPI's
router); everything else goes to the admin app.  Authentication happens here, once, by
listener: over TCP ``/v1/*`` and ``/metrics`` need any valid key that has not expired and
``/admin/*`` an admin key; over the Unix socket (mode 0600, so only its owner can connect) no
key is needed.  The key's record goes to the proxy, whose admission applies its limits.
"""

from __future__ import annotations

import asyncio

from fastapi import FastAPI
from starlette.types import ASGIApp, Receive, Scope, Send

from berth.admission import AdmissionError
from berth.daemon.admin import build_admin_app
from berth.daemon.admin_services import build_service_router
from berth.daemon.auth import require_tier, secret_from_headers
from berth.daemon.proxy import KEY_SCOPE
from berth.daemon.services import LeaderServices
from berth.errors import AuthError, BerthError
from berth.openai_errors import error_from_exception
from berth.store import ApiKeyRecord

#: Paths that answer without a key on every listener.
OPEN_PATHS = frozenset({"/healthz", "/readyz"})


class LeaderApp:
    """Dispatches one listener's requests to the proxy or the admin app, after auth.

    ``trusted`` is True for the Unix socket listener.
    """

    def __init__(self, services: LeaderServices, admin: FastAPI, *, trusted: bool) -> None:
        self._services = services
        self._admin = admin
        self._proxy: ASGIApp = services.proxy
        self._trusted = trusted

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self._admin(scope, receive, send)
            return
        path: str = scope["path"]
        is_v1 = path.startswith("/v1/")
        if not self._trusted and path not in OPEN_PATHS:
            tier = "admin" if path.startswith("/admin") else "standard"
            try:
                record = await self._authenticate(scope, tier)
            except (AuthError, AdmissionError) as exc:
                await _send_error(send, exc)
                return
            scope[KEY_SCOPE] = record  # the proxy's admission limits by key
        if is_v1:
            await self._proxy(scope, receive, send)
        else:
            await self._admin(scope, receive, send)

    async def _authenticate(self, scope: Scope, tier: str) -> ApiKeyRecord:
        authenticator = self._services.authenticator
        secret = secret_from_headers(scope["headers"])
        record = authenticator.cached(secret)
        if record is None:
            record = await asyncio.to_thread(authenticator.lookup, secret)
        self._services.admission.check_expiry(record)  # 401 once expired
        require_tier(record, tier)
        return record


async def _send_error(send: Send, exc: BerthError) -> None:
    status, body, headers = error_from_exception(exc)
    raw_headers = [(b"content-type", b"application/json")]
    raw_headers += [(k.lower().encode(), v.encode()) for k, v in headers.items()]
    if status == 401:
        raw_headers.append((b"www-authenticate", b"Bearer"))
    await send({"type": "http.response.start", "status": status, "headers": raw_headers})
    await send({"type": "http.response.body", "body": body})


def build_apps(services: LeaderServices) -> tuple[LeaderApp, LeaderApp]:
    """Return ``(public_app, socket_app)`` sharing one admin app and one proxy."""
    admin = build_admin_app(services)
    admin.include_router(build_service_router(services))
    return (
        LeaderApp(services, admin, trusted=False),
        LeaderApp(services, admin, trusted=True),
    )
