"""API-key authentication for the TCP listeners.

Keys arrive as ``Authorization: Bearer <secret>`` (what the OpenAI SDKs send) or
``x-api-key: <secret>``.  A key is looked up by its HMAC-SHA256 under the leader's pepper, so
the store never holds a usable secret.  Lookups are cached for ``cache_ttl_s`` seconds to keep
the database off the proxy's hot path; revoking through the admin API clears the cache at once.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

from berth.errors import AuthError
from berth.keys import hash_secret
from berth.store import ApiKeyRecord, Store

#: Seconds a positive lookup stays cached.
DEFAULT_CACHE_TTL_S = 5.0
#: Most entries kept in the cache (oldest dropped first).
MAX_CACHE_ENTRIES = 4096


def secret_from_headers(headers: Iterable[tuple[bytes, bytes]]) -> str | None:
    """The key a request carries in ``Authorization: Bearer`` or ``x-api-key``, if any."""
    for name, value in headers:
        if name == b"authorization":
            scheme, _, token = value.decode("latin-1").partition(" ")
            if scheme.lower() == "bearer" and token.strip():
                return token.strip()
        elif name == b"x-api-key" and value:
            return value.decode("latin-1").strip()
    return None


class Authenticator:
    """Checks secrets against the store, with a short positive cache."""

    def __init__(
        self, store: Store, pepper: bytes, *, cache_ttl_s: float = DEFAULT_CACHE_TTL_S
    ) -> None:
        self._store = store
        self._pepper = pepper
        self._cache_ttl_s = cache_ttl_s
        self._cache: dict[str, tuple[ApiKeyRecord, float]] = {}

    def lookup(self, secret: str | None) -> ApiKeyRecord:
        """Return the key record for ``secret``.

        Raises ``AuthError`` (401) when the secret is missing, unknown or revoked.  This may
        read the database: call it from a worker thread when the cache misses
        (:meth:`cached` first).
        """
        if not secret:
            raise AuthError("missing API key: send 'Authorization: Bearer <key>'")
        key_hash = hash_secret(secret, self._pepper)
        record = self._store.find_api_key(key_hash)
        if record is None:
            raise AuthError("invalid API key")
        if len(self._cache) >= MAX_CACHE_ENTRIES:
            self._cache.pop(next(iter(self._cache)))
        self._cache[secret] = (record, time.monotonic() + self._cache_ttl_s)
        return record

    def cached(self, secret: str | None) -> ApiKeyRecord | None:
        """The cached record for ``secret`` if still fresh; never touches the database."""
        if not secret:
            return None
        hit = self._cache.get(secret)
        if hit is None or hit[1] < time.monotonic():
            return None
        return hit[0]

    def forget_all(self) -> None:
        """Drop the cache (after a key is revoked)."""
        self._cache.clear()


def require_tier(record: ApiKeyRecord, tier: str) -> None:
    """Raise ``AuthError`` (403) unless ``record`` may use an endpoint needing ``tier``."""
    if tier == "admin" and record.tier != "admin":
        raise AuthError("this endpoint needs an admin key", status=403)
