"""One key's state on the request path: its effective limits and what it has used
(:class:`KeyQuota`), an admitted request's claim on it (:class:`Ticket`), and the body
bytes its requests hold (:class:`BodyHold`).

:class:`~berth.admission.quotas.Admission` decides with these; here is only what a key
holds: the limits taken on from its record and tier (a bucket keeps its level when its
size changes), the counters of requests in flight and tokens of the UTC day and month, and
the rate-limit headers built from its minute buckets (reused while the buckets stand still).

The counters are the key's fields; where they live is :mod:`berth.host`'s business: in
process they are the only count, and with the host's shared state
(:class:`~berth.host.keys.SharedKeyCounters`) they are brought in and written back around
each decision, so every serving process of the host decides on the same counts.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from berth.admission.bucket import TokenBucket
from berth.admission.errors import Header, KeyPausedError, QuotaExceededError
from berth.admission.headers import REQUESTS_HEADERS, TOKENS_HEADERS, bucket_headers
from berth.host.keys import LOCAL_KEYS, KeyCounters
from berth.vocab.limits import NUMERIC_LIMITS, KeyLimits
from berth.vocab.records import ApiKeyRecord


class KeyQuota:
    """One key's effective limits and what it has used (see the module doc)."""

    __slots__ = (
        "_headers",
        "_headers_levels",
        "body_bytes",
        "daily_cap",
        "day_index",
        "day_tokens",
        "host_row",
        "in_flight",
        "key_id",
        "limits",
        "max_concurrency",
        "models",
        "month_index",
        "month_tokens",
        "monthly_cap",
        "name",
        "priority",
        "record",
        "refusal",
        "requests",
        "reserved_tokens",
        "tier",
        "tokens",
        "uses_calendar",
    )

    def __init__(self, key_id: str, name: str, record: ApiKeyRecord | None) -> None:
        self.key_id = key_id
        self.name = name
        self.record = record
        self.tier = record.tier if record is not None else ""
        self.priority = 0
        self.limits = KeyLimits()
        self.models: frozenset[str] | None = None
        self.max_concurrency: int | None = None
        self.requests: TokenBucket | None = None
        self.tokens: TokenBucket | None = None
        self.uses_calendar = False
        #: the token budgets of a day and a month (infinite: none)
        self.daily_cap = self.monthly_cap = math.inf
        self.refusal: KeyPausedError | None = None
        self.in_flight = 0
        #: tokens reserved against the day's and month's budgets by requests in flight
        self.reserved_tokens = 0
        #: its row in the host's shared table (-1: not looked up yet; see berth.host.keys)
        self.host_row = -1
        #: request body bytes its requests hold now (:class:`BodyHold`)
        self.body_bytes = 0
        self.day_index = -1
        self.day_tokens = 0
        self.month_index = -1
        self.month_tokens = 0
        # The last headers built, and the bucket levels they were built at.
        self._headers: list[Header] = []
        self._headers_levels = (math.nan, math.nan)

    def configure(self, limits: KeyLimits, priority: int, now: float) -> None:
        """Take ``limits`` on, keeping what was used (a bucket keeps its level, at most its
        new size)."""
        self.limits = limits
        self.priority = priority
        self.models = limits.models
        self.max_concurrency = limits.max_concurrency
        self.requests = _bucket(self.requests, limits.rpm, now)
        self.tokens = _bucket(self.tokens, limits.tpm, now)
        self.uses_calendar = limits.daily_tokens is not None or limits.monthly_tokens is not None
        daily, monthly = limits.daily_tokens, limits.monthly_tokens
        self.daily_cap = math.inf if daily is None else daily
        self.monthly_cap = math.inf if monthly is None else monthly
        self._headers_levels = (math.nan, math.nan)  # new buckets: new headers
        self.refusal = None
        zero = [name for name in NUMERIC_LIMITS if getattr(limits, name) == 0]
        if zero:
            self.refusal = KeyPausedError(
                f"this key may make no requests: its {zero[0]} limit is 0",
                key_id=self.key_id,
                error_code="key_paused",
            )

    def headers(self) -> list[Header]:
        """The rate-limit headers for this key's answers, as its buckets are now: the list
        built for the last answer when both buckets are at the same levels as then (the
        same levels give the same values), so a key whose buckets stay full, or do not
        move between two answers, costs two comparisons. Shared: never change it."""
        requests, tokens = self.requests, self.tokens
        levels = self._headers_levels
        requests_level = requests.level if requests is not None else 0.0
        tokens_level = tokens.level if tokens is not None else 0.0
        if requests_level == levels[0] and tokens_level == levels[1]:
            return self._headers
        if requests is None:
            out = bucket_headers(TOKENS_HEADERS, tokens) if tokens is not None else []
        else:
            out = bucket_headers(REQUESTS_HEADERS, requests)
            if tokens is not None:
                out += bucket_headers(TOKENS_HEADERS, tokens)
        self._headers = out
        self._headers_levels = (requests_level, tokens_level)
        return out


def _bucket(current: TokenBucket | None, per_minute: int | None, now: float) -> TokenBucket | None:
    if per_minute is None or per_minute == 0:
        return None
    if current is None:
        return TokenBucket(per_minute, now)
    if current.capacity == per_minute:
        return current
    return current.resized(per_minute, now)


class Ticket:
    """An admitted request: what :meth:`~berth.admission.quotas.Admission.settle` needs,
    the ``headers`` to send on its answer, and its tier's ``priority`` (for an admission
    queue, higher first). ``reserved_tokens`` were taken from the minute's tokens,
    ``budget_tokens`` reserved against the day's and month's budgets. ``settled`` once its
    claim is given back (settled once only)."""

    __slots__ = (
        "budget_tokens",
        "headers",
        "model",
        "priority",
        "quota",
        "reserved_tokens",
        "settled",
    )

    def __init__(
        self,
        quota: KeyQuota,
        model: str,
        reserved_tokens: int,
        headers: list[Header],
        budget_tokens: int = 0,
    ) -> None:
        self.quota = quota
        self.model = model
        self.priority = quota.priority
        self.reserved_tokens = reserved_tokens
        self.budget_tokens = budget_tokens
        self.headers = headers
        self.settled = False

    @property
    def key_id(self) -> str:
        """The admitted key's id (a :class:`SocketCaller`'s value over the Unix socket)."""
        return self.quota.key_id


#: Seconds a request refused for its key's body bytes in flight is told to wait.
BODY_BYTES_RETRY_S = 1.0


class BodyHold:
    """The request body bytes one request of a key holds, counted against the key's bound
    on body bytes in flight (``max_bytes``: all its requests together): :meth:`take` as
    the body arrives (or at once, by its ``Content-Length``), :meth:`release` when the
    request is over (once or more: the second does nothing). ``counters``: where the key's
    count lives (:mod:`berth.host.keys`; the key's own field by default)."""

    __slots__ = ("_counters", "_max_bytes", "_quota", "_refused", "held")

    def __init__(
        self,
        quota: KeyQuota,
        max_bytes: int,
        refused: Callable[[KeyQuota, str], None],
        counters: KeyCounters = LOCAL_KEYS,
    ) -> None:
        self._quota = quota
        self._max_bytes = max_bytes
        self._refused = refused  # counts a refusal, as admission's own are counted
        self._counters = counters
        self.held = 0

    def take(self, size: int) -> None:
        """Hold ``size`` more bytes. Raises :class:`QuotaExceededError` (429
        ``body_bytes_exceeded``, nothing taken) when the key's requests would then hold
        more than the bound."""
        quota = self._quota
        counters = self._counters
        if counters.shared and counters.load(quota):
            try:
                self._take(quota, size)
            finally:
                counters.store(quota)
        else:
            self._take(quota, size)

    def _take(self, quota: KeyQuota, size: int) -> None:
        if quota.body_bytes + size > self._max_bytes:
            self._refused(quota, "body_bytes_exceeded")
            others = quota.body_bytes - self.held
            raise QuotaExceededError(
                f"this key's requests would hold {others + self.held + size} bytes of request "
                f"bodies at once, over the server's limit of {self._max_bytes} "
                "(max_body_bytes_per_key); send fewer large requests at a time",
                key_id=quota.key_id,
                error_code="body_bytes_exceeded",
                retry_after_s=BODY_BYTES_RETRY_S,
            )
        quota.body_bytes += size
        self.held += size

    def release(self) -> None:
        """Give back every byte held."""
        quota = self._quota
        counters = self._counters
        locked = counters.shared and counters.load(quota)
        quota.body_bytes -= self.held
        self.held = 0
        if locked:
            counters.store(quota)
