"""API-key authentication for the TCP listeners.

Keys arrive as ``Authorization: Bearer <secret>`` (what the OpenAI SDKs send) or
``x-api-key: <secret>``.  A key is looked up by its HMAC-SHA256 under the leader's pepper, so
the store never holds a usable secret.

Lookups are cached, to keep the database off the proxy's hot path, and no request waits for
a key it found valid to be read again (stale-while-revalidate): a record past three quarters
of ``cache_ttl_s`` is read again in the background the first time it is used, while the
request goes on with the cached one, and the entry is served until the new read replaces it,
however slow the store is, for up to ``max_stale_s`` (:data:`MAX_STALE_S`, 60 s) after its
last good read.  A read that fails (the store out of reach) is tried again a quarter of
``cache_ttl_s`` later, still in the background.  Past ``max_stale_s`` unread, a request
waits for the read (bounded by the store's call deadline, :mod:`berth.store.deadlines`).

A key changed (revoked, its limits or tier or expiry changed) is dropped from the cache at
once when this leader hears of it (:meth:`Authenticator.forget`: its own admin API, or another
leader's change through :mod:`berth.auth.key_sync`), so its next request waits for the
read and a revoked key is refused; a read begun before the change answers only the requests
that arrived before it, and is not cached.  When the change feed cannot say which key changed
(:meth:`Authenticator.forget_all`), every key is read again that way.  At most one read per
secret is in flight: requests that arrive meanwhile wait for it instead of each reading.
:attr:`AuthCounts.waits` counts the requests that waited for a read, by why: ``new`` (a key
not cached on this leader), ``changed``, ``stale`` (past ``max_stale_s``).

Bad secrets cost the store little, however many arrive:

* a secret the store does not know is remembered as invalid for
  :data:`NEGATIVE_CACHE_TTL_S` seconds, by its keyed hash (never the secret itself), at most
  :data:`MAX_NEGATIVE_ENTRIES` of them, oldest dropped first; creating or changing a key
  through the admin API forgets them all, since one may have just become valid;
* at most :data:`MAX_CONCURRENT_MISSES` reads for secrets never found valid run at once (the
  others wait their turn), so a spray of distinct secrets cannot take the worker threads that
  the rest of the leader reads and writes the store with;
* with a :class:`~berth.auth.limiter.FailedAuthLimiter`, a request whose secret is not
  already known valid takes a token from its client address's bucket before its secret is
  looked up, and gives it back if the secret was valid; an address out of tokens is refused
  with ``RateLimitError`` (429, ``Retry-After``) without a store read, held
  ``refusal_delay_s`` first (a sprayer that sends its next guess as soon as it is answered
  then costs the leader a few answers a second per connection, not thousands), and the
  first refusal of each audit window is written to the audit log.  A secret known
  valid never meets the limiter: one found valid (still in the cache, even past its
  lifetime or after the cache was dropped), or whose keyed hash is one of the leader's keys
  (:meth:`Authenticator.know`: every unrevoked key when the leader starts, and each one
  created since). So a valid key is served from an address that sprays bad ones.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Final

from berth.auth.limiter import FailedAuthLimiter, Refused
from berth.errors import AuthError, RateLimitError
from berth.keys import hash_secret
from berth.store import Store
from berth.vocab.records import ApiKeyRecord

_log = logging.getLogger(__name__)

#: Seconds a positive lookup stays cached.
DEFAULT_CACHE_TTL_S = 5.0
#: Share of that lifetime after which a record in use is read again in the background.
REFRESH_AFTER_SHARE = 0.75
#: Seconds a record found valid is served after its last good read while reads of it fail
#: or have not come back: the bound of stale-while-revalidate.
MAX_STALE_S: Final = 60.0
#: Most entries kept in the cache (oldest dropped first).
MAX_CACHE_ENTRIES = 4096
#: Seconds a secret the store did not know is answered 401 without reading it again.
NEGATIVE_CACHE_TTL_S: Final = 3.0
#: Most invalid secrets remembered (oldest dropped first).
MAX_NEGATIVE_ENTRIES: Final = 4096
#: Most store reads at once for secrets never found valid (the default executor has
#: ``min(32, cpus + 4)`` threads; these leave the others to the rest of the leader).
MAX_CONCURRENT_MISSES: Final = 4

_MISSING_KEY = "missing API key: send 'Authorization: Bearer <key>'"
_INVALID_KEY = "invalid API key"

#: Writes one event to the audit log (:meth:`berth.cluster.pki.enrollment.AuditLog.append`).
Audit = Callable[[Mapping[str, object]], None]


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


@dataclass
class AuthCounts:
    """What the authenticator did since it started (``/metrics``)."""

    #: API-key reads from the store (background ones included).
    key_reads: int = 0
    #: Requests refused 401 because their secret was remembered invalid (no read).
    cached_invalid: int = 0
    #: Requests refused 401 because the store did not know their secret.
    invalid: int = 0
    #: Requests refused 429 by the limiter of failed authentication.
    rate_limited: int = 0
    #: Requests that waited for a key read, by why (``new``, ``changed``, ``stale``).
    waits: dict[str, int] = field(default_factory=dict)


@dataclass(slots=True)
class _Entry:
    record: ApiKeyRecord
    #: when the read that found it began (monotonic seconds)
    read_at: float
    #: not before this is it read again (a failed read waits a while; monotonic seconds)
    next_read_at: float
    #: the cache's generation it was read in: served only while that is the current one
    generation: int
    #: False once its key changed: its next request waits for a read
    usable: bool = True


class Authenticator:
    """Checks secrets against the store, with a positive cache read ahead of its expiry, a
    negative cache, a bound on concurrent misses and, with ``limiter``, a limit of failed
    attempts per client address (see the module docstring). ``clock`` gives monotonic
    seconds; ``audit`` writes the limiter's audit lines; ``negative_ttl_s`` is how long an
    invalid secret is remembered, ``max_stale_s`` how long a record is served unread, and
    ``refusal_delay_s`` how long the limiter's refusal is held before it is raised (at most
    its ``retry_after_s``), in seconds."""

    def __init__(
        self,
        store: Store,
        pepper: bytes,
        *,
        cache_ttl_s: float = DEFAULT_CACHE_TTL_S,
        negative_ttl_s: float = NEGATIVE_CACHE_TTL_S,
        max_stale_s: float = MAX_STALE_S,
        limiter: FailedAuthLimiter | None = None,
        refusal_delay_s: float = 0.0,
        audit: Audit | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._store = store
        self._pepper = pepper
        self._cache_ttl_s = cache_ttl_s
        self._refresh_after_s = cache_ttl_s * REFRESH_AFTER_SHARE
        self._retry_read_s = cache_ttl_s - self._refresh_after_s
        self._max_stale_s = max(max_stale_s, cache_ttl_s)
        self._negative_ttl_s = negative_ttl_s
        self._limiter = limiter
        self._refusal_delay_s = refusal_delay_s
        self._audit = audit
        self._clock = clock
        self.counts = AuthCounts()
        # secret -> its record; kept past its lifetime and its generation (until dropped as
        # the oldest or found invalid), as the mark of a secret once found valid
        self._cache: dict[str, _Entry] = {}
        # keyed hashes of the leader's keys, known without a read (see know())
        self._known_hashes: set[str] = set()
        # keyed hash of a secret the store did not know -> when that read began
        self._invalid: dict[str, float] = {}
        # (secret, read generation) -> the read in flight for it
        self._reads: dict[tuple[str, int], asyncio.Task[ApiKeyRecord]] = {}
        self._miss_slots = asyncio.Semaphore(MAX_CONCURRENT_MISSES)
        # Bumped by forget_all: no entry read before it is served.
        self._generation = 0
        # Bumped by every forget (and forget_all): a read begun before it must neither
        # refill the cache nor answer a request that arrived after it.
        self._read_generation = 0

    async def authenticate(
        self, secret: str | None, *, address: str | None = None, surface: str = "v1"
    ) -> ApiKeyRecord:
        """The record for ``secret``: cached while within its lifetime (read again in the
        background once past :data:`REFRESH_AFTER_SHARE` of it), otherwise read from the
        store in a worker thread, one read per secret at a time.

        ``address`` is the client's (``None``: not limited); ``surface`` names where the
        request came in (``v1``, ``admin``, ``metrics``, ``console``) for the audit log.
        Raises ``AuthError`` (401) when the secret is missing, unknown or revoked, and
        ``RateLimitError`` (429, with ``retry_after_s``) when ``address`` has failed too
        often and the secret is not known valid.
        """
        if not secret:
            raise AuthError(_MISSING_KEY)
        hit = self._cache.get(secret)
        why = "new"
        if hit is not None:
            why = "changed"
            if hit.usable and hit.generation == self._generation:
                now = self._clock()
                age = now - hit.read_at
                if age < self._max_stale_s:
                    if age >= self._refresh_after_s and now >= hit.next_read_at:
                        self._read_ahead(secret)
                    return hit.record
                why = "stale"
        key_hash = hash_secret(secret, self._pepper)
        known = hit is not None or key_hash in self._known_hashes
        limiter = self._limiter if not known and address is not None else None
        if limiter is None:
            return await self._look_up(secret, key_hash, known=known, why=why)
        assert address is not None
        refused = limiter.take(address, self._clock())
        if refused is not None:
            self.counts.rate_limited += 1
            if refused.audit:
                await self._write_audit(address, surface, refused, limiter)
            # Held a moment: a client that sends its next guess when told gets few answers.
            delay_s = min(self._refusal_delay_s, refused.retry_after_s)
            if delay_s > 0:
                await asyncio.sleep(delay_s)
            raise RateLimitError(
                "too many failed API key attempts from this address",
                retry_after_s=refused.retry_after_s,  # from the refusal, rounded up: >= 1 s
            )
        try:
            record = await self._look_up(secret, key_hash, known=False, why=why)
        except (AuthError, asyncio.CancelledError):
            raise  # a failure, or a client that left before it was told: the token stays taken
        except Exception:
            limiter.give_back(address, self._clock())  # the store failed, not the client
            raise
        limiter.give_back(address, self._clock())
        return record

    @property
    def reads_in_flight(self) -> int:
        """How many key reads from the store are under way (background ones included)."""
        return len(self._reads)

    def forget(self, key_ids: Iterable[str]) -> None:
        """The keys ``key_ids`` were created, revoked or changed: stop serving them from
        the cache (their next request waits for a read), and forget the invalid secrets (one
        may be valid now); reads in flight are not cached when they finish, and requests
        from now on do not wait for them.  Other keys are served on as before."""
        changed = set(key_ids)
        for entry in self._cache.values():
            if entry.record.id in changed:
                entry.usable = False
        self._invalid.clear()
        self._read_generation += 1

    def forget_all(self) -> None:
        """As :meth:`forget`, for every key (a change whose key is not known)."""
        self._invalid.clear()
        self._generation += 1
        self._read_generation += 1

    def know(self, key_hashes: Iterable[str]) -> None:
        """``key_hashes`` are of this leader's keys (all of them when it starts, then each
        one the admin API creates): a secret with one of them never meets the limiter, even
        before its first use. It is still read from the store; one found revoked or unknown
        is no longer known."""
        self._known_hashes.update(key_hashes)

    async def _look_up(self, secret: str, key_hash: str, *, known: bool, why: str) -> ApiKeyRecord:
        failed_at = self._invalid.get(key_hash)
        if failed_at is not None:
            if self._clock() - failed_at < self._negative_ttl_s:
                self.counts.cached_invalid += 1
                raise AuthError(_INVALID_KEY)
            del self._invalid[key_hash]
        reading = (secret, self._read_generation)
        read = self._reads.get(reading) or self._start_read(
            reading, key_hash, background=False, gated=not known
        )
        self.counts.waits[why] = self.counts.waits.get(why, 0) + 1
        return await asyncio.shield(read)  # one waiter leaving does not end the others' read

    def _read_ahead(self, secret: str) -> None:
        """Read ``secret`` again in the background (unless a read of it is in flight)."""
        ahead = (secret, self._read_generation)
        if ahead not in self._reads:
            self._start_read(ahead, hash_secret(secret, self._pepper), background=True,
                             gated=False)  # fmt: skip

    def _read(self, key_hash: str) -> ApiKeyRecord:
        record = self._store.find_api_key(key_hash)
        if record is None:
            raise AuthError(_INVALID_KEY)
        return record

    def _keep(self, secret: str, record: ApiKeyRecord, generation: int, read_at: float) -> None:
        if generation != self._read_generation:
            return
        if secret not in self._cache and len(self._cache) >= MAX_CACHE_ENTRIES:
            self._cache.pop(next(iter(self._cache)))
        self._cache[secret] = _Entry(record, read_at, read_at, self._generation)

    def _remember_invalid(self, key_hash: str, read_at: float) -> None:
        self._invalid.pop(key_hash, None)
        if len(self._invalid) >= MAX_NEGATIVE_ENTRIES:
            del self._invalid[next(iter(self._invalid))]
        self._invalid[key_hash] = read_at

    def _start_read(
        self, reading: tuple[str, int], key_hash: str, *, background: bool, gated: bool
    ) -> asyncio.Task[ApiKeyRecord]:
        secret, generation = reading
        task = asyncio.create_task(
            self._read_in_thread(secret, key_hash, generation, gated), name="api-key-read"
        )
        self._reads[reading] = task
        task.add_done_callback(lambda done: self._read_done(reading, done, background))
        return task

    async def _read_in_thread(
        self, secret: str, key_hash: str, generation: int, gated: bool
    ) -> ApiKeyRecord:
        if gated:
            async with self._miss_slots:
                return await self._read_and_keep(secret, key_hash, generation)
        return await self._read_and_keep(secret, key_hash, generation)

    async def _read_and_keep(self, secret: str, key_hash: str, generation: int) -> ApiKeyRecord:
        read_at = self._clock()
        self.counts.key_reads += 1
        try:
            record = await asyncio.to_thread(self._read, key_hash)
        except AuthError:
            self.counts.invalid += 1
            if generation == self._read_generation:  # not one begun before a key was created
                self._known_hashes.discard(key_hash)
                self._cache.pop(secret, None)  # unknown or revoked now: no more cached use
                self._remember_invalid(key_hash, read_at)
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
            # The store failed: the cached record stays usable up to max_stale_s after its
            # last good read, and is read again a while later, still in the background.
            _log.warning("reading an API key again failed: %r", error)
            hit = self._cache.get(reading[0])
            if hit is not None:
                hit.next_read_at = self._clock() + self._retry_read_s

    async def _write_audit(
        self, address: str, surface: str, refused: Refused, limiter: FailedAuthLimiter
    ) -> None:
        if self._audit is None:
            return
        event: dict[str, object] = {
            "event": "auth.rate_limited",
            "at": datetime.now(UTC).isoformat(),
            "source_address": address,
            "surface": surface,
            "retry_after_s": round(refused.retry_after_s, 3),
            "refused_before": refused.refused_before,
            "burst": limiter.burst,
            "rate_per_s": limiter.rate_per_s,
        }
        try:
            await asyncio.to_thread(self._audit, event)
        except OSError as exc:  # an unwritable audit log must not stop authentication
            _log.warning("auth: cannot write the audit log (%s): %s", exc, event)


def require_tier(record: ApiKeyRecord, tier: str) -> None:
    """Raise ``AuthError`` (403) unless ``record`` may use an endpoint needing ``tier``."""
    if tier == "admin" and record.tier != "admin":
        raise AuthError("this endpoint needs an admin key", status=403)
