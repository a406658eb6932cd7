"""The limit on failed authentication per client address (:mod:`berth.auth.limiter`):
a token bucket per address, tokens given back by valid keys, one audit line per window, a
bounded table of addresses."""

from __future__ import annotations

import pytest

from berth.auth.limiter import FailedAuthLimiter, Refused, address_key

ADDRESS = "203.0.113.7"


def spend(limiter: FailedAuthLimiter, address: str, count: int, now: float) -> None:
    for _ in range(count):
        assert limiter.take(address, now) is None


@pytest.mark.parametrize(("burst", "rate_per_s"), [(1, 1.0), (5, 0.5), (20, 2.0)])
def test_a_burst_is_allowed_then_refused_until_a_token_comes_back(
    burst: int, rate_per_s: float
) -> None:
    limiter = FailedAuthLimiter(burst=burst, rate_per_s=rate_per_s)
    spend(limiter, ADDRESS, burst, now=0.0)

    refused = limiter.take(ADDRESS, 0.0)
    assert isinstance(refused, Refused)
    assert refused.retry_after_s == pytest.approx(1.0 / rate_per_s)

    half = 0.5 / rate_per_s  # half a token back: still refused, for the other half
    later = limiter.take(ADDRESS, half)
    assert later is not None and later.retry_after_s == pytest.approx(half)
    assert limiter.take(ADDRESS, 1.0 / rate_per_s) is None  # one token: one attempt
    assert limiter.take(ADDRESS, 1.0 / rate_per_s) is not None


def test_valid_keys_give_their_token_back_so_only_failures_count() -> None:
    limiter = FailedAuthLimiter(burst=3, rate_per_s=0.01)
    for _ in range(100):  # a busy address with a good key: each attempt gives its token back
        assert limiter.take(ADDRESS, 1.0) is None
        limiter.give_back(ADDRESS, 1.0)
    spend(limiter, ADDRESS, 3, now=1.0)  # three failures
    assert limiter.take(ADDRESS, 1.0) is not None


def test_attempts_in_progress_count_before_they_fail() -> None:
    limiter = FailedAuthLimiter(burst=2, rate_per_s=1.0)
    spend(limiter, ADDRESS, 2, now=0.0)  # two concurrent guesses, neither answered yet
    assert limiter.take(ADDRESS, 0.0) is not None


def test_addresses_are_limited_apart() -> None:
    limiter = FailedAuthLimiter(burst=1, rate_per_s=1.0)
    spend(limiter, ADDRESS, 1, now=0.0)
    assert limiter.take(ADDRESS, 0.0) is not None
    assert limiter.take("198.51.100.1", 0.0) is None


def test_one_audit_line_per_window_with_the_refusals_in_between() -> None:
    limiter = FailedAuthLimiter(burst=1, rate_per_s=0.001, audit_window_s=60.0)
    spend(limiter, ADDRESS, 1, now=0.0)

    first = limiter.take(ADDRESS, 1.0)
    assert first is not None and first.audit and first.refused_before == 0
    quiet = [limiter.take(ADDRESS, 1.0 + i) for i in range(1, 11)]
    assert all(r is not None and not r.audit for r in quiet)

    next_window = limiter.take(ADDRESS, 61.0)
    assert next_window is not None and next_window.audit
    assert next_window.refused_before == 10


def test_the_table_of_addresses_is_bounded_least_recently_used_first() -> None:
    limiter = FailedAuthLimiter(burst=1, rate_per_s=0.001, max_addresses=3)
    for host in ("10.0.0.1", "10.0.0.2", "10.0.0.3"):
        spend(limiter, host, 1, now=0.0)
    assert limiter.take("10.0.0.1", 0.0) is not None  # 10.0.0.1 is now the most recent
    spend(limiter, "10.0.0.4", 1, now=0.0)  # drops 10.0.0.2, the least recently used

    assert len(limiter) == 3
    assert limiter.take("10.0.0.1", 0.0) is not None
    assert limiter.take("10.0.0.3", 0.0) is not None
    assert limiter.take("10.0.0.2", 0.0) is None  # forgotten: a fresh bucket


def test_an_address_back_to_a_full_bucket_is_forgotten() -> None:
    limiter = FailedAuthLimiter(burst=2, rate_per_s=1.0)
    assert limiter.take(ADDRESS, 0.0) is None
    limiter.give_back(ADDRESS, 0.0)
    assert len(limiter) == 0


@pytest.mark.parametrize(
    ("address", "counted_as"),
    [
        ("192.0.2.1", "192.0.2.1"),
        ("::ffff:192.0.2.1", "192.0.2.1"),
        ("2001:db8:1:2:3:4:5:6", "2001:db8:1:2::/64"),
        ("2001:db8:1:2:ffff::1", "2001:db8:1:2::/64"),
        ("not-an-address", "not-an-address"),
    ],
)
def test_ipv6_addresses_count_by_their_64_block(address: str, counted_as: str) -> None:
    assert address_key(address) == counted_as


def test_a_limiter_without_tokens_is_refused_when_made() -> None:
    with pytest.raises(ValueError, match="burst"):
        FailedAuthLimiter(burst=0, rate_per_s=1.0)
