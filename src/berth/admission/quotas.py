"""Per-key limits on the request path: admit a request, then settle it when its answer ends.

One request, as the proxy sees it::

    admission.admit(key, model, request_bytes) -> Ticket     (or an AdmissionError)
        ... a slot at a deployment, the engine's answer ...
    admission.settle(ticket, node_id=..., error=..., prompt_tokens=..., ...)

:meth:`Admission.admit` checks, in this order, and takes nothing unless every check passes:
the key's tier exists and no limit is 0 (403), the model is one the key may use (403),
requests in flight (``max_concurrency``), the token budgets of the UTC day and month, the
requests of the last minute (``rpm``) and the tokens of the last minute (``tpm``, on the
prompt estimate of :func:`berth.admission.estimate.prompt_tokens`); 429 for any of those.
It then counts the request in flight, takes one request and the estimate from the minute
buckets (:class:`~berth.admission.bucket.TokenBucket`), reserves the prompt estimate plus
the request's ``max_tokens`` (else :data:`DEFAULT_COMPLETION_RESERVE`) against a key's
day and month budgets, and returns a :class:`Ticket` carrying the key's rate-limit headers
and its tier's priority. A budget counts what was used and what requests in flight
reserved, and admits while that is under it, so concurrent requests overrun a budget by
at most one request's reservation (where each uses no more than it reserved).
:meth:`Admission.settle` gives the in-flight slot back, settles the tokens-per-minute and
budget reservations against the real count, adds the tokens to the day's and month's, and
records the request in the usage ledger (:mod:`berth.admission.ledger`). A ticket is settled once:
:meth:`Admission.release` settles one that nothing settled (its request ended before an
engine answered, or failed) as an error that used no tokens, and does nothing to one
already settled, so the request path calls it in a ``finally`` around everything after
admission, whatever way the request ends.

Before admission, while its body arrives, a request holds its body's bytes against its
key's bound on body bytes in flight (:meth:`Admission.hold_body`, a
:class:`~berth.admission.key_quota.BodyHold`): what a key's bodies cost the leader to hold
and parse is bounded before any other limit can be checked.

Everything here is in memory and takes microseconds: no store access, no I/O. The counts
are the keys' own (one process) or the host's (``counters``, :mod:`berth.host.keys`: every
serving process of the host checks and takes in one locked step on one row per key). Limits come
from the key's record and its tier (:meth:`LimitOverrides.apply
<berth.vocab.limits.LimitOverrides.apply>`); the budgets start from the ledger's totals
(:meth:`Admission.load`). The minute buckets start full at each leader start.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from datetime import date

from berth.admission.calendar import CalendarPosition, day_of, month_start
from berth.admission.clock import Clock, SystemClock
from berth.admission.errors import (
    KeyExpiredError,
    KeyPausedError,
    ModelNotAllowedError,
    QuotaExceededError,
)
from berth.admission.estimate import prompt_tokens as estimate_prompt_tokens
from berth.admission.key_quota import BodyHold, KeyQuota, Ticket
from berth.admission.ledger import UsageLedger
from berth.admission.socket import SocketCaller
from berth.config.tiers import DESK_TIER, TierTable
from berth.host.keys import LOCAL_KEYS, KeyCounters
from berth.vocab.limits import KeyLimits
from berth.vocab.records import ApiKeyRecord

#: The key id requests over the leader's Unix socket were counted under before berth told
#: its callers apart (:class:`~berth.admission.socket.SocketCaller`: ``socket:cli`` and
#: ``socket:desk`` since); older ledger rows keep it.
SOCKET_KEY_ID = ""
#: How those rows are named in metrics and ``berth usage``.
SOCKET_KEY_NAME = "(socket)"
#: Seconds a request refused for ``max_concurrency`` is told to wait.
CONCURRENCY_RETRY_S = 1.0
#: Completion tokens a request that states no ``max_tokens`` reserves against its key's
#: day and month budgets (with its prompt estimate) until its answer ends.
DEFAULT_COMPLETION_RESERVE = 1024


@dataclass(frozen=True, slots=True)
class KeyUse:
    """What a key uses now: requests in flight, tokens of the UTC day and month, what its
    per-minute limits have left (``None``: no such limit), and the request body bytes its
    requests hold."""

    in_flight: int
    day_tokens: int
    month_tokens: int
    requests_remaining: int | None
    tokens_remaining: int | None
    body_bytes: int = 0


class Admission:
    """Admits and settles requests against each key's limits (see the module doc).

    ``tiers`` are the leader's tiers; ``ledger`` receives each settled request. Keys are
    known from :meth:`load`, :meth:`update`, or the first request they make. Requests over
    the Unix socket carry no key: the CLI's (:attr:`SocketCaller.CLI`) are never limited and
    wait at the ``admin`` priority; the desk worker's (:attr:`SocketCaller.DESK`) take the
    limits and priority of the tier ``desk_tier`` names (:class:`ConfigError
    <berth.errors.ConfigError>` when no tier has that name).
    ``max_body_bytes_per_key`` bounds the request body bytes one key's requests (the desk
    worker's too) hold at once (``None``: no bound). ``counters`` is where the keys' counts
    live (:mod:`berth.host.keys`: in this process by default, or the host's shared state).
    """

    def __init__(
        self,
        tiers: TierTable,
        ledger: UsageLedger,
        *,
        clock: Clock | None = None,
        desk_tier: str = DESK_TIER,
        max_body_bytes_per_key: int | None = None,
        counters: KeyCounters = LOCAL_KEYS,
    ) -> None:
        self.tiers = tiers
        self._counters = counters
        self.ledger = ledger
        self.max_body_bytes_per_key = max_body_bytes_per_key
        self._clock: Clock = clock or SystemClock()
        self._monotonic = self._clock.monotonic
        self._wall = self._clock.time
        self._quotas: dict[str, KeyQuota] = {}
        self._names: dict[str, str] = {SOCKET_KEY_ID: SOCKET_KEY_NAME}
        for caller in SocketCaller:
            self._names[caller.value] = caller.value
        cli = SocketCaller.CLI.value
        self._socket = KeyQuota(cli, cli, None)
        self._socket.host_row = -2  # never limited: counted in this process alone
        self._socket.priority = tiers.require("admin").priority
        desk = tiers.require(desk_tier)
        self._desk = KeyQuota(SocketCaller.DESK.value, SocketCaller.DESK.value, None)
        self._desk.tier = desk.name
        self._desk.configure(desk.limits, desk.priority, self._clock.monotonic())
        self._calendar = CalendarPosition.at(self._clock.time())
        #: Refusals since start: (key id, error code) -> count.
        self.refusals: dict[tuple[str, str], int] = {}

    # -- keys ---------------------------------------------------------------------------------

    def load(self, keys: Iterable[ApiKeyRecord], totals: Mapping[str, tuple[int, int]]) -> None:
        """Know ``keys`` (revoked ones only by name, for metrics), with the tokens each used
        today and this month so far (``totals``: key id -> (day, month), from the ledger;
        the desk worker's too, for its tier's budgets)."""
        calendar = self._position()
        quotas: list[KeyQuota] = [self._desk]
        for record in keys:
            self._names[record.id] = record.name
            if record.is_revoked:
                continue
            quota = self._configure(KeyQuota(record.id, record.name, record))
            self._quotas[record.id] = quota
            quotas.append(quota)
        for quota in quotas:
            day, month = totals.get(quota.key_id, (0, 0))
            quota.day_index, quota.day_tokens = calendar.day_index, day
            quota.month_index, quota.month_tokens = calendar.month_index, month
            self._counters.seed(quota)  # the host's count wins where there is one

    def budget_days(self) -> tuple[date, date]:
        """``(today, the first day of this month)``, UTC: the ledger totals :meth:`load`
        wants start there."""
        today = day_of(self._position().day_index)
        return today, month_start(today)

    def update(self, record: ApiKeyRecord) -> None:
        """Take a key's new record on (created, or its tier, limits or expiry changed)."""
        self._names[record.id] = record.name
        if record.is_revoked:
            self._quotas.pop(record.id, None)
            return
        quota = self._quotas.get(record.id)
        if quota is None:
            quota = self._quotas[record.id] = KeyQuota(record.id, record.name, record)
        quota.record, quota.name, quota.tier = record, record.name, record.tier
        self._configure(quota)

    def limits_of(self, record: ApiKeyRecord) -> KeyLimits:
        """The limits ``record`` works under: its tier's with its own put in (no limits for a
        tier that is not defined: such a key is refused anyway)."""
        tier = self.tiers.get(record.tier)
        return record.limits.apply(tier.limits if tier is not None else KeyLimits())

    def use_of(self, key_id: str) -> KeyUse:
        """What the key ``key_id`` uses now (zeros for a key that made no request)."""
        quota = self._quotas.get(key_id)
        if quota is None:
            return KeyUse(0, 0, 0, None, None)
        counters = self._counters
        if counters.shared and counters.load(quota):
            try:
                return self._use(quota)
            finally:
                counters.store(quota)
        return self._use(quota)

    def _use(self, quota: KeyQuota) -> KeyUse:
        calendar = self._position()
        self._roll(quota, calendar)
        now = self._clock.monotonic()
        requests = tokens = None
        if quota.requests is not None:
            quota.requests.refill(now)
            requests = quota.requests.remaining
        if quota.tokens is not None:
            quota.tokens.refill(now)
            tokens = quota.tokens.remaining
        return KeyUse(
            quota.in_flight,
            quota.day_tokens,
            quota.month_tokens,
            requests,
            tokens,
            quota.body_bytes,
        )

    def name_of(self, key_id: str) -> str:
        """The name of the key ``key_id`` (its id when it is unknown here)."""
        return self._names.get(key_id, key_id)

    def names(self) -> Iterator[tuple[str, str]]:
        """Every ``(key id, name)`` known, revoked keys and the Unix socket's callers
        included."""
        return iter(self._names.items())

    # -- the request path ---------------------------------------------------------------------

    def check_expiry(self, key: ApiKeyRecord) -> None:
        """Raise :class:`KeyExpiredError` (401) once ``key``'s expiry has passed."""
        expires_at = key.expires_at
        if expires_at is not None and expires_at.timestamp() <= self._clock.time():
            raise KeyExpiredError(
                f"this API key expired at {expires_at.isoformat()}", key_id=key.id
            )

    def hold_body(self, key: ApiKeyRecord | SocketCaller | None) -> BodyHold | None:
        """A hold for the body of a request of ``key`` (see :class:`BodyHold`), to take its
        bytes as they arrive and release them when the request is over; ``None`` when they
        are not bounded (the CLI's requests, or no ``max_body_bytes_per_key``)."""
        max_bytes = self.max_body_bytes_per_key
        if max_bytes is None or key is None or key is SocketCaller.CLI:
            return None
        return BodyHold(self._quota_of(key), max_bytes, self._refused, self._counters)

    def admit(
        self,
        key: ApiKeyRecord | SocketCaller | None,
        model: str,
        request_bytes: int,
        max_tokens: int | None = None,
    ) -> Ticket:
        """Admit a request of ``key`` for the public model name ``model`` with a body of
        ``request_bytes``, or refuse it. Over the Unix socket ``key`` is the caller there
        (``None``: the CLI): the CLI's are never limited, the desk's go through its tier's
        limits as a key's do. ``max_tokens`` is the most the request asked the engine to
        generate (``None``: it said nothing), for the budgets' reservation.

        Raises :class:`KeyPausedError` or :class:`ModelNotAllowedError` (403), or
        :class:`QuotaExceededError` (429, with ``retry_after_s`` and the rate-limit headers);
        a refused request takes nothing. Never blocks, never touches the store.
        """
        if key is None or key is SocketCaller.CLI:
            quota = self._socket
            quota.in_flight += 1
            return Ticket(quota, model, 0, [])
        quota = self._quota_of(key)
        if quota.refusal is not None:
            self._refused(quota, quota.refusal.error_code)
            raise quota.refusal
        models = quota.models
        if models is not None and model not in models:
            self._refused(quota, "model_not_allowed")
            allowed = ", ".join(sorted(models))
            raise ModelNotAllowedError(
                f"this key may not use the model {model!r}; it may use: {allowed}",
                key_id=quota.key_id,
            )
        counters = self._counters
        if counters.shared and counters.load(quota):
            try:
                return self._take(quota, model, request_bytes, max_tokens)
            finally:
                counters.store(quota)
        return self._take(quota, model, request_bytes, max_tokens)

    def _take(
        self, quota: KeyQuota, model: str, request_bytes: int, max_tokens: int | None
    ) -> Ticket:
        # The counted checks of admit() and the take, on the key's counts (the host's,
        # locked, with shared counters).
        cap = quota.max_concurrency
        if cap is not None and quota.in_flight >= cap:
            raise self._over(
                quota,
                "max_concurrency",
                f"this key already has {quota.in_flight} "
                f"{'request' if quota.in_flight == 1 else 'requests'} in flight, its limit",
                CONCURRENCY_RETRY_S,
            )
        if quota.uses_calendar:
            wall = self._wall()
            calendar = self._calendar
            if (
                wall >= calendar.day_end_s  # a new day: roll, then check
                or quota.day_index != calendar.day_index
                or quota.month_index != calendar.month_index
                or quota.day_tokens + quota.reserved_tokens >= quota.daily_cap
                or quota.month_tokens + quota.reserved_tokens >= quota.monthly_cap
            ):
                self._check_budgets(quota, wall)
            budget = estimate_prompt_tokens(request_bytes) + (
                DEFAULT_COMPLETION_RESERVE if max_tokens is None else max(0, max_tokens)
            )
        else:
            budget = 0
        requests, tokens = quota.requests, quota.tokens
        reserved = 0
        if requests is not None or tokens is not None:
            now = self._monotonic()
            if requests is not None and requests.refill(now) < 1.0:
                raise self._over(
                    quota,
                    "rpm",
                    f"this key's limit of {requests.capacity:.0f} requests per minute is spent",
                    requests.wait_s(1.0),
                )
            if tokens is not None:
                reserved = estimate_prompt_tokens(request_bytes)
                needed = min(float(reserved), tokens.capacity)
                if tokens.refill(now) < needed:
                    raise self._over(
                        quota,
                        "tpm",
                        f"this key's limit of {tokens.capacity:.0f} tokens per minute is spent "
                        f"(this request needs about {reserved})",
                        tokens.wait_s(needed),
                    )
                tokens.take(reserved)
            if requests is not None:
                requests.take(1.0)
            headers = quota.headers()
        else:
            headers = []
        quota.in_flight += 1
        quota.reserved_tokens += budget
        return Ticket(quota, model, reserved, headers, budget)

    def settle(
        self,
        ticket: Ticket,
        *,
        node_id: str | None,
        error: bool,
        prompt_tokens: int,
        completion_tokens: int,
        estimated: bool,
        cached_tokens: int = 0,
    ) -> None:
        """End an admitted request: ``node_id`` is the node whose engine answered (``None``
        when none was reached: nothing goes in the ledger), ``error`` whether the answer was
        an error or broke off, the tokens as the engine reported them (``estimated``: as
        berth estimated them; ``cached_tokens``: the prompt's read from the engine's cache,
        where it said). A ticket is settled once: later calls (and :meth:`release`) do
        nothing."""
        if ticket.settled:
            return
        ticket.settled = True
        quota = ticket.quota
        used = prompt_tokens + completion_tokens
        counters = self._counters
        if counters.shared and counters.load(quota):
            try:
                calendar = self._give_back(quota, ticket, used)
            finally:
                counters.store(quota)
        else:
            calendar = self._give_back(quota, ticket, used)
        if node_id is not None:
            self.ledger.record(
                calendar.day_index,
                quota.key_id,
                ticket.model,
                node_id,
                error=error,
                prompt_tokens=prompt_tokens,
                completion_tokens=completion_tokens,
                estimated=estimated,
                cached_tokens=cached_tokens,
            )

    def _give_back(self, quota: KeyQuota, ticket: Ticket, used: int) -> CalendarPosition:
        # settle()'s counting: the key's counts (the host's, locked, with shared counters).
        quota.in_flight -= 1
        quota.reserved_tokens -= ticket.budget_tokens
        tokens = quota.tokens
        if tokens is not None:
            tokens.take(used - ticket.reserved_tokens)
        calendar = self._calendar
        if self._wall() >= calendar.day_end_s:
            calendar = self._position()
        if quota.day_index != calendar.day_index or quota.month_index != calendar.month_index:
            self._roll(quota, calendar)
        quota.day_tokens += used
        quota.month_tokens += used
        return calendar

    def release(self, ticket: Ticket) -> None:
        """Give back what ``ticket`` holds if nothing settled it: its request ended before
        an engine answered, or failed on its way (:meth:`settle` as an error that used no
        tokens, with no ledger row). Does nothing to a settled ticket."""
        if not ticket.settled:
            self.settle(
                ticket,
                node_id=None,
                error=True,
                prompt_tokens=0,
                completion_tokens=0,
                estimated=False,
            )

    # -- inside -------------------------------------------------------------------------------

    def _quota_of(self, key: ApiKeyRecord | SocketCaller) -> KeyQuota:
        # The quota of a key (or of the desk worker); a record the authenticator read again
        # is taken on first.
        if key is SocketCaller.DESK:
            return self._desk
        if key is SocketCaller.CLI:
            return self._socket
        found = self._quotas.get(key.id)
        return found if found is not None and found.record is key else self._refresh(key, found)

    def _refresh(self, key: ApiKeyRecord, quota: KeyQuota | None) -> KeyQuota:
        # A record the authenticator read again; the limits change only if the record did.
        if quota is None:
            quota = self._quotas[key.id] = KeyQuota(key.id, key.name, key)
            self._names[key.id] = key.name
            return self._configure(quota)
        changed = quota.record != key
        quota.record, quota.name, quota.tier = key, key.name, key.tier
        return self._configure(quota) if changed else quota

    def _configure(self, quota: KeyQuota) -> KeyQuota:
        record = quota.record
        assert record is not None
        tier = self.tiers.get(record.tier)
        now = self._clock.monotonic()
        quota.configure(self.limits_of(record), tier.priority if tier else 0, now)
        if tier is None:
            quota.refusal = KeyPausedError(
                f"this key's tier {record.tier!r} is not defined in the leader's config.toml; "
                f"move the key to a defined tier (berth key set {record.id} --tier ...)",
                key_id=quota.key_id,
                error_code="unknown_tier",
            )
        return quota

    def _position(self, wall: float | None = None) -> CalendarPosition:
        calendar = self._calendar
        if wall is None:
            wall = self._wall()
        if wall >= calendar.day_end_s:
            calendar = self._calendar = CalendarPosition.at(wall)
        return calendar

    @staticmethod
    def _roll(quota: KeyQuota, calendar: CalendarPosition) -> None:
        if quota.day_index != calendar.day_index:
            quota.day_index, quota.day_tokens = calendar.day_index, 0
        if quota.month_index != calendar.month_index:
            quota.month_index, quota.month_tokens = calendar.month_index, 0

    def _check_budgets(self, quota: KeyQuota, wall: float) -> None:
        calendar = self._position(wall)
        self._roll(quota, calendar)
        limits = quota.limits
        daily, monthly = limits.daily_tokens, limits.monthly_tokens
        reserved = quota.reserved_tokens
        held = f" (and {reserved} are reserved by requests in flight)" if reserved else ""
        if monthly is not None and quota.month_tokens + reserved >= monthly:
            raise self._over(
                quota,
                "monthly_tokens",
                f"this key has used {quota.month_tokens} tokens this month (UTC){held}, its "
                f"budget of {monthly}",
                calendar.month_end_s - wall,
            )
        if daily is not None and quota.day_tokens + reserved >= daily:
            raise self._over(
                quota,
                "daily_tokens",
                f"this key has used {quota.day_tokens} tokens today (UTC){held}, its budget "
                f"of {daily}",
                calendar.day_end_s - wall,
            )

    def _over(
        self, quota: KeyQuota, limit: str, message: str, retry_after_s: float
    ) -> QuotaExceededError:
        code = f"{limit}_exceeded"
        self._refused(quota, code)
        return QuotaExceededError(
            message,
            key_id=quota.key_id,
            error_code=code,
            retry_after_s=retry_after_s,
            headers=quota.headers(),
        )

    def _refused(self, quota: KeyQuota, code: str) -> None:
        pair = (quota.key_id, code)
        self.refusals[pair] = self.refusals.get(pair, 0) + 1
