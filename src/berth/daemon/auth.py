"""API-key authentication for the TCP listeners.

Keys arrive as ``Authorization: Bearer <secret>`` (what the OpenAI SDKs send) or
``x-api-key: <secret>``.  A key is looked up by its HMAC-SHA256 under the leader's pepper, so
the store never holds a usable secret.

Lookups are cached, to keep the database off the proxy's hot path: a record is used for at
most ``cache_ttl_s`` seconds after its read began, and revoking or changing a key through the
admin API clears the cache at once (a read in flight then is not cached, and answers only the
requests that arrived before).  So that steady traffic never waits for the store, a record
past three quarters of its lifetime is read again in the background the first time it is used,
while the request goes on with the cached one; only a key unused for longer than that is read
while its request waits.  At most one read per secret is in flight: requests that arrive
meanwhile wait for it instead of each reading.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable

from berth.errors import AuthError
from berth.keys import hash_secret
from berth.store import ApiKeyRecord, Store

_log = logging.getLogger(__name__)

#: Seconds a positive lookup stays cached.
DEFAULT_CACHE_TTL_S = 5.0
#: Share of that lifetime after which a record in use is read again in the background.
REFRESH_AFTER_SHARE = 0.75
#: Most entries kept in the cache (oldest dropped first).
MAX_CACHE_ENTRIES = 4096

_MISSING_KEY = "missing API key: send 'Authorization: Bearer <key>'"


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
    """Checks secrets against the store, with a positive cache read ahead of its expiry (see
    the module docstring). ``clock`` gives monotonic seconds."""

    def __init__(
        self,
        store: Store,
        pepper: bytes,
        *,
        cache_ttl_s: float = DEFAULT_CACHE_TTL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._store = store
        self._pepper = pepper
        self._cache_ttl_s = cache_ttl_s
        self._refresh_after_s = cache_ttl_s * REFRESH_AFTER_SHARE
        self._clock = clock
        # secret -> (record, when the read that found it began, whether to read it again
        # ahead of its end: not after that failed once)
        self._cache: dict[str, tuple[ApiKeyRecord, float, bool]] = {}
        # (secret, generation) -> the read in flight for it
        self._reads: dict[tuple[str, int], asyncio.Task[ApiKeyRecord]] = {}
        # Bumped by forget_all: a read begun before it must neither refill the cache nor
        # answer a request that arrived after it.
        self._generation = 0

    async def authenticate(self, secret: str | None) -> ApiKeyRecord:
        """The record for ``secret``: cached while within its lifetime (read again in the
        background once past :data:`REFRESH_AFTER_SHARE` of it), otherwise read from the
        store in a worker thread, one read per secret at a time. Raises ``AuthError`` (401)
        when the secret is missing, unknown or revoked."""
        if not secret:
            raise AuthError(_MISSING_KEY)
        hit = self._cache.get(secret)
        if hit is not None:
            age = self._clock() - hit[1]
            if age < self._cache_ttl_s:
                if age >= self._refresh_after_s and hit[2]:
                    ahead = (secret, self._generation)
                    if ahead not in self._reads:
                        self._start_read(ahead, background=True)
                return hit[0]
        reading = (secret, self._generation)
        read = self._reads.get(reading) or self._start_read(reading, background=False)
        return await asyncio.shield(read)  # one waiter leaving does not end the others' read

    @property
    def reads_in_flight(self) -> int:
        """How many key reads from the store are under way (background ones included)."""
        return len(self._reads)

    def forget_all(self) -> None:
        """Drop the cache (after a key is revoked or changed); reads in flight are not
        cached when they finish, and requests from now on do not wait for them."""
        self._cache.clear()
        self._generation += 1

    def _read(self, secret: str) -> ApiKeyRecord:
        record = self._store.find_api_key(hash_secret(secret, self._pepper))
        if record is None:
            raise AuthError("invalid API key")
        return record

    def _keep(self, secret: str, record: ApiKeyRecord, generation: int, read_at: float) -> None:
        if generation != self._generation:
            return
        if secret not in self._cache and len(self._cache) >= MAX_CACHE_ENTRIES:
            self._cache.pop(next(iter(self._cache)))
        self._cache[secret] = (record, read_at, True)

    def _start_read(
        self, reading: tuple[str, int], *, background: bool
    ) -> asyncio.Task[ApiKeyRecord]:
        task = asyncio.create_task(self._read_in_thread(*reading), name="api-key-read")
        self._reads[reading] = task
        task.add_done_callback(lambda done: self._read_done(reading, done, background))
        return task

    async def _read_in_thread(self, secret: str, generation: int) -> ApiKeyRecord:
        read_at = self._clock()
        try:
            record = await asyncio.to_thread(self._read, secret)
        except AuthError:
            if generation == self._generation:
                self._cache.pop(secret, None)  # unknown or revoked now: no more cached use
            raise
        self._keep(secret, record, generation, read_at)
        return record

    def _read_done(
        self, reading: tuple[str, int], task: asyncio.Task[ApiKeyRecord], background: bool
    ) -> None:
        if self._reads.get(reading) is task:
            del self._reads[reading]
        if task.cancelled():
            return
        error = task.exception()  # retrieved here, so an unawaited failure is not reported
        if background and error is not None and not isinstance(error, AuthError):
            # The store failed: the cached record stays usable until its lifetime ends, and
            # is not read again before (then a request waits for the read, and sees it fail).
            _log.warning("reading an API key again failed: %r", error)
            secret, generation = reading
            hit = self._cache.get(secret)
            if hit is not None and generation == self._generation:
                self._cache[secret] = (hit[0], hit[1], False)


def require_tier(record: ApiKeyRecord, tier: str) -> None:
    """Raise ``AuthError`` (403) unless ``record`` may use an endpoint needing ``tier``."""
    if tier == "admin" and record.tier != "admin":
        raise AuthError("this endpoint needs an admin key", status=403)
