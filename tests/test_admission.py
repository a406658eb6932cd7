"""Admission (`berth.admission`): per-key limits checked and settled in memory, on a manual
clock (no timing): the per-minute buckets and their OpenAI headers, concurrency, UTC day and
month budgets, models, paused keys and tiers that are gone, expiry, and what reaches the
usage ledger."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace
from datetime import UTC, datetime, timedelta

import pytest

from berth.admission import (
    Admission,
    KeyExpiredError,
    KeyPausedError,
    ManualClock,
    ModelNotAllowedError,
    QuotaExceededError,
    SocketCaller,
    Ticket,
    UsageLedger,
    socket_caller,
)
from berth.admission.calendar import CalendarPosition, day_of
from berth.admission.headers import format_duration
from berth.config import TierDef, TierTable
from berth.errors import ConfigError
from berth.vocab.limits import KeyLimits, LimitOverrides
from berth.vocab.records import ApiKeyRecord, UsageRecord

CREATED = datetime(2025, 1, 1, tzinfo=UTC)


class Sink:
    """A usage sink that keeps each batch."""

    def __init__(self) -> None:
        self.batches: list[list[UsageRecord]] = []

    def add_usage(self, batch: Iterable[UsageRecord]) -> int:
        self.batches.append(list(batch))
        return len(self.batches[-1])


def key(
    tier: str = "standard", key_id: str = "k-1", name: str = "alice", **limits: object
) -> ApiKeyRecord:
    return ApiKeyRecord(
        key_id,
        name,
        tier,
        "sk-berth-abcd",
        CREATED,
        None,
        LimitOverrides(**limits),  # type: ignore[arg-type]
    )


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()  # 2026-01-01 00:00:00Z


@pytest.fixture
def admission(clock: ManualClock) -> Admission:
    tiers = TierTable({"free": TierDef("free", 10, KeyLimits(rpm=3, tpm=1000))})
    return Admission(tiers, UsageLedger(Sink()), clock=clock)


def settle(admission: Admission, ticket: Ticket, tokens: tuple[int, int] = (0, 0)) -> None:
    admission.settle(
        ticket,
        node_id="local",
        error=False,
        prompt_tokens=tokens[0],
        completion_tokens=tokens[1],
        estimated=False,
    )


def headers(ticket_or_error: Ticket | QuotaExceededError) -> dict[str, str]:
    return {k.decode(): v.decode() for k, v in ticket_or_error.headers}


def test_the_fourth_request_in_a_minute_is_refused_with_openais_headers(
    admission: Admission, clock: ManualClock
) -> None:
    alice = key(rpm=3)
    first = admission.admit(alice, "m", 100)
    assert headers(first) == {
        "x-ratelimit-limit-requests": "3",
        "x-ratelimit-remaining-requests": "2",
        "x-ratelimit-reset-requests": "20s",
    }
    admission.admit(alice, "m", 100)
    admission.admit(alice, "m", 100)

    with pytest.raises(QuotaExceededError) as caught:
        admission.admit(alice, "m", 100)

    refused = caught.value
    assert (refused.http_status, refused.error_code) == (429, "rpm_exceeded")
    assert refused.retry_after_s == pytest.approx(20.0)
    assert headers(refused)["x-ratelimit-remaining-requests"] == "0"
    assert headers(refused)["x-ratelimit-reset-requests"] == "1m0s"
    assert admission.refusals == {("k-1", "rpm_exceeded"): 1}
    clock.advance(20.0)
    admission.admit(alice, "m", 100)  # one more has flowed in


def test_a_tier_gives_its_limits_and_a_key_overrides_them(admission: Admission) -> None:
    bob = key("free", rpm=None)  # no rpm of its own; the tier's tpm stays
    ticket = admission.admit(bob, "m", 400)

    assert admission.limits_of(bob) == KeyLimits(rpm=None, tpm=1000)
    assert headers(ticket) == {
        "x-ratelimit-limit-tokens": "1000",
        "x-ratelimit-remaining-tokens": "900",  # 400 bytes: 100 tokens reserved
        "x-ratelimit-reset-tokens": "6s",
    }
    assert ticket.priority == 10


def test_tokens_per_minute_reserve_the_prompt_estimate_and_settle_the_real_count(
    admission: Admission, clock: ManualClock
) -> None:
    carol = key(tpm=1000)
    ticket = admission.admit(carol, "m", 2000)  # 500 reserved
    settle(admission, ticket, (300, 500))  # 800 used: 300 more taken

    with pytest.raises(QuotaExceededError) as caught:
        admission.admit(carol, "m", 2000)
    assert caught.value.error_code == "tpm_exceeded"
    assert caught.value.retry_after_s == pytest.approx(18.0)  # 300 missing at 1000/60 per s
    clock.advance(18.0)
    admission.admit(carol, "m", 2000)


def test_a_refused_request_takes_nothing(admission: Admission) -> None:
    dave = key(rpm=2, tpm=100)
    admission.admit(dave, "m", 200)  # 50 tokens reserved, 50 left
    with pytest.raises(QuotaExceededError, match="tokens per minute"):
        admission.admit(dave, "m", 4000)  # needs a full bucket
    ticket = admission.admit(dave, "m", 40)  # the refused one took no request
    assert headers(ticket)["x-ratelimit-remaining-requests"] == "0"
    assert headers(ticket)["x-ratelimit-remaining-tokens"] == "40"


def test_a_request_larger_than_the_minute_waits_for_a_full_bucket(
    admission: Admission, clock: ManualClock
) -> None:
    erin = key(tpm=100)
    ticket = admission.admit(erin, "m", 4000)  # 1000 estimated, the bucket was full: admitted
    settle(admission, ticket, (1000, 0))
    with pytest.raises(QuotaExceededError) as caught:
        admission.admit(erin, "m", 4000)
    # 900 tokens of debt, then a full bucket of 100, at 100 per minute: ten minutes.
    assert caught.value.retry_after_s == pytest.approx(600.0)


def test_concurrency_counts_requests_in_flight(admission: Admission) -> None:
    frank = key(max_concurrency=1)
    ticket = admission.admit(frank, "m", 10)

    with pytest.raises(QuotaExceededError) as caught:
        admission.admit(frank, "m", 10)
    assert caught.value.error_code == "max_concurrency_exceeded"
    assert admission.use_of("k-1").in_flight == 1
    settle(admission, ticket)
    admission.admit(frank, "m", 10)


def test_a_ticket_is_settled_once_and_release_gives_back_only_an_unsettled_one(
    admission: Admission,
) -> None:
    gina = key(max_concurrency=2, tpm=1000)
    served = admission.admit(gina, "m", 400)  # 100 reserved each
    failed = admission.admit(gina, "m", 400)
    settle(admission, served, (30, 20))
    admission.release(served)  # settled already: nothing more given back
    settle(admission, served, (30, 20))  # nor counted twice
    admission.release(failed)  # its request ended before an engine answered
    admission.release(failed)
    use = admission.use_of("k-1")
    assert (use.in_flight, use.day_tokens) == (0, 50)
    assert use.tokens_remaining == 950  # only what the served one used
    (row,) = admission.ledger.pending  # the released one left no row
    assert (row.requests, row.prompt_tokens, row.completion_tokens) == (1, 30, 20)


def test_a_daily_budget_stops_the_key_once_spent_until_the_next_utc_day(
    admission: Admission, clock: ManualClock
) -> None:
    clock.advance(23 * 3600)  # 23:00Z
    gina = key(daily_tokens=100)
    settle(admission, admission.admit(gina, "m", 10), (60, 50))

    with pytest.raises(QuotaExceededError) as caught:
        admission.admit(gina, "m", 10)
    assert caught.value.error_code == "daily_tokens_exceeded"
    assert caught.value.retry_after_s == pytest.approx(3600.0)  # until midnight UTC
    assert "used 110 tokens today (UTC), its budget of 100" in str(caught.value)
    clock.advance(3600)
    admission.admit(gina, "m", 10)
    assert admission.use_of("k-1").day_tokens == 0


def test_a_monthly_budget_runs_to_the_end_of_the_utc_month(
    admission: Admission, clock: ManualClock
) -> None:
    hank = key(monthly_tokens=10)
    settle(admission, admission.admit(hank, "m", 10), (10, 0))
    with pytest.raises(QuotaExceededError) as caught:
        admission.admit(hank, "m", 10)
    assert caught.value.error_code == "monthly_tokens_exceeded"
    assert caught.value.retry_after_s == pytest.approx(31 * 86400)  # January has 31 days


def test_budgets_start_from_the_ledgers_totals(admission: Admission) -> None:
    ivy = key(daily_tokens=100, monthly_tokens=1000)
    admission.load([ivy], {"k-1": (40, 999)})
    settle(admission, admission.admit(ivy, "m", 10), (1, 0))
    with pytest.raises(QuotaExceededError, match="this month"):
        admission.admit(ivy, "m", 10)
    assert admission.use_of("k-1").day_tokens == 41


def test_a_key_limited_to_some_models_gets_403_for_another(admission: Admission) -> None:
    jack = key(models=frozenset({"smollm2", "qwen"}))
    admission.admit(jack, "smollm2", 10)
    with pytest.raises(ModelNotAllowedError) as caught:
        admission.admit(jack, "llama", 10)
    refused = caught.value
    assert (refused.http_status, refused.error_code, refused.param) == (
        403,
        "model_not_allowed",
        "model",
    )
    assert "may use: qwen, smollm2" in str(refused)


def test_a_limit_of_zero_pauses_the_key_and_a_gone_tier_is_refused(admission: Admission) -> None:
    with pytest.raises(KeyPausedError, match="its rpm limit is 0") as caught:
        admission.admit(key(rpm=0), "m", 10)
    assert caught.value.error_code == "key_paused"
    with pytest.raises(KeyPausedError, match="tier 'gold' is not defined") as gone:
        admission.admit(key("gold", key_id="k-2"), "m", 10)
    assert (gone.value.http_status, gone.value.error_code) == (403, "unknown_tier")


def test_an_expired_key_is_refused(admission: Admission, clock: ManualClock) -> None:
    now = datetime.fromtimestamp(clock.time(), UTC)
    kate = replace(key(), expires_at=now + timedelta(seconds=10))
    admission.check_expiry(kate)
    clock.advance(10)
    with pytest.raises(KeyExpiredError) as caught:
        admission.check_expiry(kate)
    assert (caught.value.http_status, caught.value.error_code) == (401, "key_expired")


def test_a_changed_record_changes_the_limits_and_keeps_the_use(admission: Admission) -> None:
    leo = key(rpm=3)
    admission.admit(leo, "m", 10)
    admission.update(replace(leo, limits=LimitOverrides(rpm=10)))
    ticket = admission.admit(leo, "m", 10)  # the authenticator's older record: refreshed too

    assert headers(ticket)["x-ratelimit-limit-requests"] == "3"
    newer = replace(leo, limits=LimitOverrides(rpm=10))
    ticket = admission.admit(newer, "m", 10)
    assert headers(ticket)["x-ratelimit-limit-requests"] == "10"
    assert headers(ticket)["x-ratelimit-remaining-requests"] == "0"  # 3 used of 3 kept, +0


def test_the_socket_is_never_limited_and_settled_requests_reach_the_ledger(
    admission: Admission,
) -> None:
    socket = admission.admit(None, "m", 10)
    assert socket.headers == [] and socket.key_id == "socket:cli"
    assert socket.priority == 100  # the admin tier's
    settle(admission, socket, (5, 6))
    unreached = admission.admit(key(), "m", 10)
    admission.settle(
        unreached, node_id=None, error=True, prompt_tokens=0, completion_tokens=0, estimated=False
    )

    (row,) = admission.ledger.pending
    assert row == UsageRecord(
        day=day_of(CalendarPosition.at(1_767_225_600).day_index),
        key_id="socket:cli",
        model="m",
        node_id="local",
        requests=1,
        prompt_tokens=5,
        completion_tokens=6,
    )
    assert admission.name_of("socket:cli") == "socket:cli"


def test_the_desk_workers_requests_take_the_desk_tiers_priority_and_limits(
    clock: ManualClock,
) -> None:
    tiers = TierTable({"desk": TierDef("desk", 20, KeyLimits(rpm=2, max_concurrency=1))})
    admission = Admission(tiers, UsageLedger(Sink()), clock=clock)
    first = admission.admit(SocketCaller.DESK, "m", 10)
    assert (first.key_id, first.priority) == ("socket:desk", 20)
    assert headers(first)["x-ratelimit-limit-requests"] == "2"
    with pytest.raises(QuotaExceededError) as busy:
        admission.admit(SocketCaller.DESK, "m", 10)
    assert busy.value.error_code == "max_concurrency_exceeded"
    settle(admission, first, (3, 4))
    settle(admission, admission.admit(SocketCaller.DESK, "m", 10))
    with pytest.raises(QuotaExceededError) as spent:
        admission.admit(SocketCaller.DESK, "m", 10)
    assert spent.value.error_code == "rpm_exceeded"
    # The CLI over the same socket is not the desk: never limited, at admin priority.
    assert admission.admit(SocketCaller.CLI, "m", 10).priority == 100
    rows = {(r.key_id, r.requests) for r in admission.ledger.pending}
    assert rows == {("socket:desk", 2)}
    assert admission.refusals == {
        ("socket:desk", "max_concurrency_exceeded"): 1,
        ("socket:desk", "rpm_exceeded"): 1,
    }


def test_the_desk_tier_is_built_in_below_standard_and_its_budget_starts_from_the_ledger(
    clock: ManualClock,
) -> None:
    builtin = Admission(TierTable(), UsageLedger(Sink()), clock=clock)
    assert builtin.admit(SocketCaller.DESK, "m", 10).priority == 40  # standard is 50
    tiers = TierTable({"market": TierDef("market", 5, KeyLimits(daily_tokens=100))})
    admission = Admission(tiers, UsageLedger(Sink()), clock=clock, desk_tier="market")
    admission.load([], {"socket:desk": (100, 100)})
    with pytest.raises(QuotaExceededError) as spent:
        admission.admit(SocketCaller.DESK, "m", 10)
    assert spent.value.error_code == "daily_tokens_exceeded"
    with pytest.raises(ConfigError, match="unknown tier 'gold'"):
        Admission(tiers, UsageLedger(Sink()), clock=clock, desk_tier="gold")


@pytest.mark.parametrize(
    ("header", "caller"),
    [
        (None, SocketCaller.CLI),
        (b"desk", SocketCaller.DESK),
        (b" Desk ", SocketCaller.DESK),
        (b"cli", SocketCaller.CLI),
        (b"admin", SocketCaller.CLI),
    ],
)
def test_a_socket_request_is_the_desks_only_when_it_says_so(
    header: bytes | None, caller: SocketCaller
) -> None:
    assert socket_caller(header) is caller


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (0, "0s"),
        (0.0121, "13ms"),
        (0.999, "999ms"),
        (1, "1s"),
        (1.5, "1.5s"),
        (20.000001, "20.001s"),
        (60, "1m0s"),
        (360, "6m0s"),
        (3723.5, "1h2m3.5s"),
        (86400, "24h0m0s"),
    ],
)
def test_durations_are_written_as_openai_writes_them(seconds: float, text: str) -> None:
    assert format_duration(seconds) == text


def test_calendar_months_end_on_their_last_day() -> None:
    december = CalendarPosition.at(datetime(2026, 12, 31, 23, 0, tzinfo=UTC).timestamp())
    assert december.month_end_s == datetime(2027, 1, 1, tzinfo=UTC).timestamp()
    assert december.day_end_s == december.month_end_s
