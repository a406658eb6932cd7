"""Cross-origin requests from browsers (the Fetch standard's CORS protocol) for the public
listener: :class:`CorsPolicy`, pure.

With no allowed origins (the default) nothing changes: no ``Access-Control-*`` header is
ever sent and a preflight is a request like any other (401 without a key). For an allowed
origin:

* a preflight (``OPTIONS`` with ``Origin`` and ``Access-Control-Request-Method``) is answered
  ``204`` without a key, allowing the methods berth serves and the request headers the
  browser asked for (the key itself still travels in ``Authorization`` and is checked on the
  real request), cached by the browser for ``max_age_s``;
* every answer to a request from it (errors too, so that a browser can read a 401) carries
  ``Access-Control-Allow-Origin`` and exposes ``X-Request-Id`` and ``Retry-After``.

An origin listed by name is echoed back with ``Access-Control-Allow-Credentials: true``
and ``Vary: Origin``; ``*`` allows any origin, answered ``*`` and never with credentials
(the Fetch standard refuses that pair, and it would let any site use a browser's
credentials for berth).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from berth.errors import ConfigError

ALLOWED_METHODS = b"GET, POST, PUT, PATCH, DELETE, OPTIONS"
EXPOSED_HEADERS = b"x-request-id, retry-after"
# An origin as browsers send it: scheme "://" host [":" port], nothing after.
_ORIGIN = re.compile(r"^[a-z][a-z0-9+.-]*://[^/?#\s]+$")
_HEADER_LIST = re.compile(rb"^[!#$%&'*+.^_`|~0-9A-Za-z-]+(\s*,\s*[!#$%&'*+.^_`|~0-9A-Za-z-]+)*$")


def parse_origins(text: str | None) -> tuple[str, ...]:
    """The origins of the ``cors_origins`` setting: a comma-separated list of
    ``scheme://host[:port]`` (or ``*``), blanks ignored. Raises :class:`ConfigError` for an
    entry that is not an origin (a path, a missing scheme)."""
    origins: list[str] = []
    for entry in (text or "").split(","):
        origin = entry.strip().rstrip("/").lower()
        if not origin:
            continue
        if origin != "*" and not _ORIGIN.match(origin):
            raise ConfigError(
                f"cors_origins: {entry.strip()!r} is not an origin; expected "
                "scheme://host[:port] (e.g. https://chat.example.com) or *"
            )
        origins.append(origin)
    return tuple(origins)


def cors_origins_problem(text: str) -> str | None:
    """Why ``text`` is not a valid ``cors_origins`` value, or ``None`` (a setting check)."""
    try:
        parse_origins(text)
    except ConfigError as exc:
        return str(exc).removeprefix("cors_origins: ")
    return None


@dataclass(frozen=True)
class CorsPolicy:
    """Which browser origins may call the public listener, and the headers that say so."""

    origins: frozenset[str]
    max_age_s: int = 600

    @classmethod
    def from_setting(cls, text: str | None) -> CorsPolicy:
        return cls(frozenset(parse_origins(text)))

    @property
    def enabled(self) -> bool:
        return bool(self.origins)

    def _allow(self, origin: bytes) -> list[tuple[bytes, bytes]] | None:
        text = origin.decode("latin-1").lower()
        if text in self.origins:
            return [
                (b"access-control-allow-origin", origin),
                (b"access-control-allow-credentials", b"true"),
                (b"vary", b"Origin"),
            ]
        if "*" in self.origins:
            return [(b"access-control-allow-origin", b"*")]
        return None

    def preflight(
        self, origin: bytes | None, method: bytes | None, request_headers: bytes | None
    ) -> list[tuple[bytes, bytes]] | None:
        """The headers of a ``204`` answer to a preflight from ``origin`` asking for
        ``method`` (``Access-Control-Request-Method``) and ``request_headers``
        (``Access-Control-Request-Headers``), or ``None`` when it is not one berth allows
        (it is then served as an ordinary request)."""
        if origin is None or method is None or not self.origins:
            return None
        headers = self._allow(origin)
        if headers is None:
            return None
        headers.append((b"access-control-allow-methods", ALLOWED_METHODS))
        if request_headers and _HEADER_LIST.match(request_headers.strip()):
            headers.append((b"access-control-allow-headers", request_headers.strip()))
        headers.append((b"access-control-max-age", b"%d" % self.max_age_s))
        return headers

    def answer_headers(self, origin: bytes | None) -> list[tuple[bytes, bytes]]:
        """The headers every answer to a request from ``origin`` carries (none when the
        origin is not allowed, or the request has none)."""
        if origin is None or not self.origins:
            return []
        headers = self._allow(origin)
        if headers is None:
            return []
        headers.append((b"access-control-expose-headers", EXPOSED_HEADERS))
        return headers
