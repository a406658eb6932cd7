"""Console sign-in sessions: an admin key exchanged for an opaque session id, held in memory.

A session is created when a browser signs in with an admin key (``POST /ui/session``) and
lives in the leader's memory only: a restarted leader signs every browser out. The browser
holds the session id in an ``HttpOnly; Secure; SameSite=Strict`` cookie (:func:`set_cookie`)
and a CSRF token in page memory, sent back as ``X-CSRF-Token`` on every state-changing call
(the "synchronizer token" pattern of the OWASP CSRF Prevention Cheat Sheet; SameSite=Strict
is the second line). The table keeps only a SHA-256 of each session id, so a lookup's timing
or a memory dump reveals no live cookie, and the key's HMAC (never the key) to check on each
use that the key was not revoked since.

A session ends at the first of: sign-out, ``idle_timeout_s`` without use, ``max_age_s`` after
sign-in, the key's revocation (:meth:`SessionTable.drop_key`, or the daemon's check of the
key on each use), or the table's bound (``max_sessions``; the least recently used goes).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

#: The cookie's name.
COOKIE_NAME = "berth_session"
#: The header a state-changing call carries its CSRF token in.
CSRF_HEADER = "x-csrf-token"
#: Seconds a session lives after sign-in, used or not.
DEFAULT_MAX_AGE_S = 8 * 3600.0
#: Seconds a session lives without a request.
DEFAULT_IDLE_TIMEOUT_S = 3600.0
#: Most sessions held at once.
DEFAULT_MAX_SESSIONS = 1024
#: Methods that change nothing (RFC 9110 section 9.2.1, "safe methods"): no CSRF token needed.
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})


def _digest(session_id: str) -> str:
    return hashlib.sha256(session_id.encode()).hexdigest()


@dataclass
class Session:
    """One signed-in browser: the key it signed in with (id, name, HMAC), its CSRF token and
    its times (epoch seconds)."""

    key_id: str
    key_name: str
    key_hash: str
    csrf_token: str
    created_at: float
    expires_at: float
    last_used_at: float

    def csrf_matches(self, token: str | None) -> bool:
        """Whether ``token`` is this session's CSRF token (compared in constant time)."""
        return token is not None and hmac.compare_digest(token, self.csrf_token)


class SessionTable:
    """The leader's console sessions, in memory; times from ``clock`` (epoch seconds)."""

    def __init__(
        self,
        *,
        max_age_s: float = DEFAULT_MAX_AGE_S,
        idle_timeout_s: float = DEFAULT_IDLE_TIMEOUT_S,
        max_sessions: int = DEFAULT_MAX_SESSIONS,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._max_age_s = max_age_s
        self._idle_timeout_s = idle_timeout_s
        self._max_sessions = max_sessions
        self._clock = clock
        self._sessions: OrderedDict[str, Session] = OrderedDict()

    def __len__(self) -> int:
        return len(self._sessions)

    @property
    def max_age_s(self) -> float:
        """Seconds a session lives after sign-in (the cookie's ``Max-Age``)."""
        return self._max_age_s

    def create(self, *, key_id: str, key_name: str, key_hash: str) -> tuple[str, Session]:
        """Open a session for a key; returns ``(session id, session)``. The id goes in the
        cookie and is not kept here."""
        now = self._clock()
        session_id = secrets.token_urlsafe(32)
        session = Session(
            key_id=key_id,
            key_name=key_name,
            key_hash=key_hash,
            csrf_token=secrets.token_urlsafe(32),
            created_at=now,
            expires_at=now + self._max_age_s,
            last_used_at=now,
        )
        while len(self._sessions) >= self._max_sessions:
            self._sessions.popitem(last=False)
        self._sessions[_digest(session_id)] = session
        return session_id, session

    def get(self, session_id: str | None) -> Session | None:
        """The live session of ``session_id`` (its use is recorded), or ``None`` when there is
        none or it expired (an expired one is dropped)."""
        if not session_id:
            return None
        digest = _digest(session_id)
        session = self._sessions.get(digest)
        if session is None:
            return None
        now = self._clock()
        if now >= session.expires_at or now - session.last_used_at >= self._idle_timeout_s:
            del self._sessions[digest]
            return None
        session.last_used_at = now
        self._sessions.move_to_end(digest)
        return session

    def drop(self, session_id: str | None) -> bool:
        """End one session (sign-out); whether there was one."""
        if not session_id:
            return False
        return self._sessions.pop(_digest(session_id), None) is not None

    def drop_key(self, key_id: str) -> int:
        """End every session signed in with key ``key_id`` (it was revoked); how many."""
        gone = [d for d, s in self._sessions.items() if s.key_id == key_id]
        for digest in gone:
            del self._sessions[digest]
        return len(gone)


def session_id_from_cookies(headers: list[tuple[bytes, bytes]]) -> str | None:
    """The value of the ``berth_session`` cookie among ``Cookie`` headers, if any."""
    for name, value in headers:
        if name != b"cookie":
            continue
        for part in value.decode("latin-1").split(";"):
            cookie, _, content = part.strip().partition("=")
            if cookie == COOKIE_NAME and content:
                return content
    return None


def set_cookie(session_id: str, max_age_s: float) -> str:
    """The ``Set-Cookie`` value that gives a browser its session (RFC 6265bis: ``HttpOnly``
    keeps it from scripts, ``Secure`` from plain HTTP, ``SameSite=Strict`` from requests other
    sites start)."""
    return (
        f"{COOKIE_NAME}={session_id}; Path=/; Max-Age={int(max_age_s)}; "
        "HttpOnly; Secure; SameSite=Strict"
    )


def clear_cookie() -> str:
    """The ``Set-Cookie`` value that removes the session cookie (sign-out)."""
    return f"{COOKIE_NAME}=; Path=/; Max-Age=0; HttpOnly; Secure; SameSite=Strict"
