"""The web console's routes on the leader: its static files at ``/ui/``, sign-in sessions at
``/ui/session``, the recent requests at ``GET /admin/requests``, and the gate that lets a
signed-in browser's cookie stand in for an admin key (:class:`ConsoleGate`).

``/ui/*`` needs no key: the files are public, and ``/ui/session`` checks what it is given.
Every ``/ui`` answer carries :data:`CONSOLE_HEADERS`, a strict Content-Security-Policy
among them: the console's own scripts, styles and API only, no inline code, no frames.
"""

from __future__ import annotations

import asyncio
import mimetypes
from collections.abc import Callable

from fastapi import APIRouter, Query, Request
from fastapi.responses import RedirectResponse, Response

from berth.admin.roles import OPEN, needs
from berth.admission.errors import KeyExpiredError
from berth.api import role_name
from berth.api.console import (
    RequestOut,
    RequestsPage,
    SessionIn,
    SessionInfo,
    SessionState,
    SignedOut,
)
from berth.auth.authenticator import Authenticator
from berth.console import static_files
from berth.console.sessions import (
    COOKIE_NAME,
    CSRF_HEADER,
    SAFE_METHODS,
    Session,
    SessionTable,
    clear_cookie,
    session_id_from_cookies,
    set_cookie,
)
from berth.errors import AuthError, NotFoundError
from berth.http_server.request import Request as HttpRequest
from berth.keys import hash_secret
from berth.observability.request_log import RequestEntry, RequestLog
from berth.store import Store
from berth.vocab.records import ApiKeyRecord
from berth.vocab.roles import Role

#: The Content-Security-Policy of every console answer: only the leader's own files and API;
#: no inline scripts or styles, no plugins, no frames, no <base>, forms post only to us.
CONTENT_SECURITY_POLICY = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; font-src 'self'; base-uri 'none'; form-action 'self'; "
    "frame-ancestors 'none'"
)
#: Headers sent with every ``/ui`` answer.
CONSOLE_HEADERS: tuple[tuple[bytes, bytes], ...] = (
    (b"content-security-policy", CONTENT_SECURITY_POLICY.encode()),
    (b"x-content-type-options", b"nosniff"),
    (b"referrer-policy", b"no-referrer"),
    (b"x-frame-options", b"DENY"),
    (b"cross-origin-opener-policy", b"same-origin"),
)
#: Most requests one ``GET /admin/requests`` returns.
MAX_REQUESTS_PAGE = 500


def is_console_path(path: str) -> bool:
    """Whether ``path`` is the console's (``/ui``, ``/ui/...``)."""
    return path == "/ui" or path.startswith("/ui/")


class ConsoleGate:
    """Signs browsers in and out, and checks a signed-in browser's later requests.

    A cookie counts only while its session lives and its key is not revoked (checked in the
    store on every use, so a revoked key's sessions end at their next request); a
    state-changing request must also carry the session's CSRF token.
    """

    def __init__(
        self,
        store: Store,
        authenticator: Authenticator,
        pepper: bytes,
        *,
        check_expiry: Callable[[ApiKeyRecord], None],
    ) -> None:
        self.sessions = SessionTable()
        self._store = store
        self._authenticator = authenticator
        self._pepper = pepper
        self._check_expiry = check_expiry

    async def sign_in(self, secret: str, *, address: str | None = None) -> tuple[str, Session]:
        """Open a session for the admin key ``secret``, sent from the client ``address``:
        ``(session id, session)``.

        Raises ``AuthError``: 401 for an unknown or revoked key, 403 for a standard one;
        ``KeyExpiredError`` (401) for a key past its expiry; ``RateLimitError`` (429) when
        ``address`` failed too often (the limit of :mod:`berth.auth.authenticator`, shared with the
        API: a key already found valid is not refused).
        """
        record = await self._authenticator.authenticate(
            secret.strip(), address=address, surface="console"
        )
        self._check_expiry(record)
        if record.tier != "admin":
            raise AuthError(
                f"key {record.name!r} is a standard key: the console needs an admin key",
                status=403,
            )
        return self.sessions.create(
            key_id=record.id,
            key_name=record.name,
            key_hash=hash_secret(secret.strip(), self._pepper),
        )

    async def session(self, session_id: str | None) -> tuple[Session, ApiKeyRecord] | None:
        """The live session of ``session_id`` and its key's record; ``None`` when there is
        none, it expired, or its key was revoked or is past its expiry (the key's sessions
        are dropped then)."""
        session = self.sessions.get(session_id)
        if session is None:
            return None
        record = await asyncio.to_thread(self._store.find_api_key, session.key_hash)
        if record is None or _expired(record, self._check_expiry):
            self.sessions.drop_key(session.key_id)
            return None
        return session, record

    async def authenticate(self, request: HttpRequest) -> ApiKeyRecord | None:
        """The key a request signed in with by cookie; ``None`` when it sent no session
        cookie. Raises ``AuthError`` (401) for a dead session, 403 for a state-changing
        request without the session's CSRF token."""
        session_id = session_id_from_cookies(request.headers)
        if session_id is None:
            return None
        found = await self.session(session_id)
        if found is None:
            raise AuthError("your console session has ended: sign in again")
        session, record = found
        if request.method not in SAFE_METHODS:
            token = request.header(CSRF_HEADER.encode())
            if not session.csrf_matches(None if token is None else token.decode("latin-1")):
                raise AuthError(
                    f"this call needs the session's {CSRF_HEADER} header: reload the console",
                    status=403,
                )
        return record


def _expired(record: ApiKeyRecord, check_expiry: Callable[[ApiKeyRecord], None]) -> bool:
    try:
        check_expiry(record)
    except KeyExpiredError:
        return True
    return False


def _session_info(session: Session, record: ApiKeyRecord) -> SessionInfo:
    return SessionInfo(
        key_name=session.key_name,
        role=role_name(record.role or Role.ADMIN),
        csrf_token=session.csrf_token,
        expires_at=session.expires_at,
    )


def _request_view(entry: RequestEntry) -> RequestOut:
    return RequestOut(
        seq=entry.seq,
        at=entry.at,
        request_id=entry.request_id,
        key_name=entry.key_name,
        model=entry.model,
        node=entry.node_id,
        deployment=entry.deployment_id,
        status=entry.status,
        ttfb_ms=entry.ttfb_ms,
        duration_ms=entry.duration_ms,
        prompt_tokens=entry.prompt_tokens,
        completion_tokens=entry.completion_tokens,
        retries=list(entry.retries),
        error_reason=entry.error_reason,
        cached_tokens=entry.cached_tokens,
    )


def _load_static() -> dict[str, tuple[bytes, str]]:
    """The console's files by name, with their content types; read once, at start-up."""
    loaded: dict[str, tuple[bytes, str]] = {}
    for item in static_files().iterdir():
        if item.is_file():
            kind = mimetypes.guess_type(item.name)[0] or "application/octet-stream"
            if kind.startswith("text/") or kind == "application/javascript":
                kind += "; charset=utf-8"
            loaded[item.name] = (item.read_bytes(), kind)
    return loaded


def build_console_router(gate: ConsoleGate, request_log: RequestLog) -> APIRouter:
    """The routes of ``/``, ``/ui/*`` and ``GET /admin/requests``."""
    router = APIRouter()
    files = _load_static()

    @router.get("/", include_in_schema=False, dependencies=[OPEN])
    async def root(request: Request) -> Response:
        if "text/html" in request.headers.get("accept", ""):
            return RedirectResponse("/ui/", status_code=303)
        raise NotFoundError("path", "/")

    @router.get("/ui", include_in_schema=False, dependencies=[OPEN])
    async def ui_bare() -> Response:
        return RedirectResponse("/ui/", status_code=303)

    @router.get("/ui/session", dependencies=[OPEN])
    async def current_session(request: Request) -> SessionState:
        found = await gate.session(request.cookies.get(COOKIE_NAME))
        if found is None:
            return SessionState(signed_in=False, session=None)
        return SessionState(signed_in=True, session=_session_info(*found))

    @router.post("/ui/session", status_code=201, dependencies=[OPEN])
    async def sign_in(body: SessionIn, request: Request, response: Response) -> SessionInfo:
        address = request.client.host if request.client is not None else None
        session_id, session = await gate.sign_in(body.key, address=address)
        found = await gate.session(session_id)  # the key as stored now, with its role
        if found is None:
            raise AuthError("the key was revoked while signing in: sign in again")
        response.headers["set-cookie"] = set_cookie(session_id, gate.sessions.max_age_s)
        response.headers["cache-control"] = "no-store"
        return _session_info(session, found[1])

    @router.delete("/ui/session", dependencies=[OPEN])
    async def sign_out(request: Request, response: Response) -> SignedOut:
        session_id = request.cookies.get(COOKIE_NAME)
        found = await gate.session(session_id)
        if found is not None:
            if not found[0].csrf_matches(request.headers.get(CSRF_HEADER)):
                raise AuthError(f"signing out needs the session's {CSRF_HEADER} header", status=403)
            gate.sessions.drop(session_id)
        response.headers["set-cookie"] = clear_cookie()
        return SignedOut()

    @router.api_route(
        "/ui/{name}", methods=["GET", "HEAD"], include_in_schema=False, dependencies=[OPEN]
    )
    async def static(name: str) -> Response:
        found = files.get(name or "index.html")
        if found is None:
            raise NotFoundError("file", name)
        body, kind = found
        return Response(body, media_type=kind, headers={"cache-control": "no-cache"})

    @router.api_route("/ui/", methods=["GET", "HEAD"], include_in_schema=False, dependencies=[OPEN])
    async def index() -> Response:
        return await static("index.html")

    @router.get("/admin/requests", dependencies=[needs(Role.VIEWER)])
    async def recent_requests(
        after: int = Query(0, ge=0, le=2**63 - 1),
        limit: int = Query(200, ge=0, le=MAX_REQUESTS_PAGE),
    ) -> RequestsPage:
        entries = request_log.after(after, limit=limit)
        return RequestsPage(
            last_seq=request_log.last_seq,
            capacity=request_log.capacity,
            requests=[_request_view(e) for e in entries],
        )

    return router
