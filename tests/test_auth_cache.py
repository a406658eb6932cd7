"""The API-key cache of :class:`berth.auth.authenticator.Authenticator`, against a real store: no
request with a key found valid waits for its re-read (stale-while-revalidate, up to
``MAX_STALE_S``), concurrent misses share one read, and a key revoked or changed stops being
served from the cache; bad secrets are remembered, read a few at a time, and limited per
client address without ever refusing a key found valid."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Mapping

import pytest

from berth.auth.authenticator import (
    MAX_CONCURRENT_MISSES,
    MAX_STALE_S,
    NEGATIVE_CACHE_TTL_S,
    Authenticator,
)
from berth.auth.limiter import FailedAuthLimiter
from berth.errors import AuthError, RateLimitError
from berth.keys import generate_secret, hash_secret, key_prefix
from berth.store import Store
from berth.vocab.records import ApiKeyRecord
from support.waiting import wait_for_async

PEPPER = b"p" * 32
TTL_S = 5.0


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class CountedReads:
    """Counts the store's key reads; :attr:`gate`, when set, holds each read (the row already
    read) until opened."""

    def __init__(self, store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
        self.count = 0
        self.gate: threading.Event | None = None
        self.failure: Exception | None = None
        read = store.find_api_key

        def counted(key_hash: str) -> ApiKeyRecord | None:
            self.count += 1
            found = read(key_hash)
            if self.gate is not None:
                assert self.gate.wait(10), "the test never opened the gate"
            if self.failure is not None:
                raise self.failure
            return found

        monkeypatch.setattr(store, "find_api_key", counted)


def add_key(store: Store, name: str = "app") -> tuple[str, ApiKeyRecord]:
    secret = generate_secret()
    record = store.add_api_key(name, "standard", hash_secret(secret, PEPPER), key_prefix(secret))
    return secret, record


@pytest.fixture
def monotonic() -> Clock:
    return Clock()


@pytest.fixture
def reads(store: Store, monkeypatch: pytest.MonkeyPatch) -> CountedReads:
    return CountedReads(store, monkeypatch)


@pytest.fixture
def authenticator(store: Store, monotonic: Clock, reads: CountedReads) -> Authenticator:
    return Authenticator(store, PEPPER, cache_ttl_s=TTL_S, clock=monotonic)


async def settle(authenticator: Authenticator) -> None:
    """Until the reads in flight (background ones included) have finished."""
    async with asyncio.timeout(10):
        while authenticator.reads_in_flight:
            await asyncio.sleep(0.005)


async def test_a_record_in_use_is_read_again_in_the_background_while_requests_go_on(
    store: Store, authenticator: Authenticator, monotonic: Clock, reads: CountedReads
) -> None:
    secret, record = add_key(store)
    assert await authenticator.authenticate(secret) == record
    assert reads.count == 1

    monotonic.now += TTL_S * 0.5  # young: no read
    assert await authenticator.authenticate(secret) == record
    assert reads.count == 1

    reads.gate = threading.Event()
    monotonic.now += TTL_S * 0.3  # past three quarters of the lifetime: read again, not waited for
    async with asyncio.timeout(2):
        assert await authenticator.authenticate(secret) == record
        assert await authenticator.authenticate(secret) == record  # one read in flight only
    await asyncio.sleep(0.05)
    assert reads.count == 2
    reads.gate.set()
    await settle(authenticator)

    # The lifetime now counts from that read: past the first one's end, still no wait.
    reads.gate = threading.Event()
    monotonic.now += TTL_S * 0.5
    async with asyncio.timeout(2):
        assert await authenticator.authenticate(secret) == record
    assert reads.count == 2
    reads.gate.set()


async def test_a_record_past_its_lifetime_is_served_while_it_is_read_again(
    store: Store, authenticator: Authenticator, monotonic: Clock, reads: CountedReads
) -> None:
    """Stale-while-revalidate: however slow the read (held here), the request does not wait
    for it; the read that finds the key revoked ends its use."""
    secret, record = add_key(store)
    await authenticator.authenticate(secret)
    assert authenticator.counts.waits == {"new": 1}  # its first use waited, nothing since

    monotonic.now += TTL_S * 4  # long past its lifetime, within MAX_STALE_S
    store.revoke_api_key(record.id)  # by another leader whose notification was lost, say
    reads.gate = threading.Event()
    async with asyncio.timeout(2):  # the read is held: a wait for it would time out
        assert await authenticator.authenticate(secret) == record
        assert await authenticator.authenticate(secret) == record
    await wait_for_async(lambda: reads.count == 2, 10, "the read in the background")
    assert authenticator.reads_in_flight == 1
    reads.gate.set()
    await settle(authenticator)

    with pytest.raises(AuthError, match="invalid API key"):
        await authenticator.authenticate(secret)
    assert authenticator.counts.waits == {"new": 1}  # the refusal came from the negative cache


async def test_past_the_stale_bound_the_request_waits_for_the_read(
    store: Store, authenticator: Authenticator, monotonic: Clock, reads: CountedReads
) -> None:
    secret, record = add_key(store)
    await authenticator.authenticate(secret)
    monotonic.now += MAX_STALE_S
    reads.gate = threading.Event()
    waiting = asyncio.ensure_future(authenticator.authenticate(secret))
    await wait_for_async(lambda: reads.count == 2, 10, "the read")
    assert not waiting.done()
    reads.gate.set()
    assert await waiting == record
    assert authenticator.counts.waits == {"new": 1, "stale": 1}


async def test_a_changed_key_waits_for_its_read_and_the_others_do_not(
    store: Store, authenticator: Authenticator, reads: CountedReads
) -> None:
    changed_secret, changed = add_key(store, "changed")
    other_secret, other = add_key(store, "other")
    await authenticator.authenticate(changed_secret)
    await authenticator.authenticate(other_secret)
    store.revoke_api_key(changed.id)
    authenticator.forget([changed.id])  # what the admin API and the key sync do

    reads.gate = threading.Event()
    async with asyncio.timeout(2):
        assert await authenticator.authenticate(other_secret) == other
    refused = asyncio.ensure_future(authenticator.authenticate(changed_secret))
    await wait_for_async(lambda: reads.count == 3, 10, "the changed key's read")
    assert not refused.done()
    reads.gate.set()
    with pytest.raises(AuthError, match="invalid API key"):
        await refused
    assert authenticator.counts.waits == {"new": 2, "changed": 1}


async def test_requests_that_miss_together_share_one_read(
    store: Store, authenticator: Authenticator, reads: CountedReads
) -> None:
    secret, record = add_key(store)
    reads.gate = threading.Event()
    waiting = [asyncio.ensure_future(authenticator.authenticate(secret)) for _ in range(5)]
    await asyncio.sleep(0.05)
    reads.gate.set()

    assert await asyncio.gather(*waiting) == [record] * 5
    assert reads.count == 1


async def test_one_waiter_cancelled_does_not_end_the_read_of_the_others(
    store: Store, authenticator: Authenticator, reads: CountedReads
) -> None:
    secret, record = add_key(store)
    reads.gate = threading.Event()
    leaving = asyncio.ensure_future(authenticator.authenticate(secret))
    staying = asyncio.ensure_future(authenticator.authenticate(secret))
    await asyncio.sleep(0.05)
    leaving.cancel()
    reads.gate.set()

    assert await staying == record
    with pytest.raises(asyncio.CancelledError):
        await leaving


async def test_a_key_the_background_read_finds_revoked_is_no_longer_served(
    store: Store, authenticator: Authenticator, monotonic: Clock, reads: CountedReads
) -> None:
    secret, record = add_key(store)
    await authenticator.authenticate(secret)
    store.revoke_api_key(record.id)

    monotonic.now += TTL_S * 0.8
    assert await authenticator.authenticate(secret) == record  # within its lifetime still
    await settle(authenticator)

    with pytest.raises(AuthError, match="invalid API key"):
        await authenticator.authenticate(secret)


async def test_a_read_in_flight_when_the_cache_is_dropped_is_not_cached(
    store: Store, authenticator: Authenticator, reads: CountedReads
) -> None:
    secret, record = add_key(store)
    reads.gate = threading.Event()
    first = asyncio.ensure_future(authenticator.authenticate(secret))
    await asyncio.sleep(0.05)
    # Revoked through the admin API while the read is under way (it read the row already).
    authenticator.forget_all()
    reads.gate.set()
    assert await first == record  # that request was in before the revocation

    reads.gate = None
    store.revoke_api_key(record.id)
    with pytest.raises(AuthError, match="invalid API key"):
        await authenticator.authenticate(secret)
    assert reads.count == 2


async def test_a_request_after_the_cache_is_dropped_does_not_share_a_read_begun_before(
    store: Store, authenticator: Authenticator, reads: CountedReads
) -> None:
    secret, record = add_key(store)
    reads.gate = threading.Event()
    before = asyncio.ensure_future(authenticator.authenticate(secret))
    await asyncio.sleep(0.05)  # its read found the key unrevoked and is held
    store.revoke_api_key(record.id)  # what the admin API does: revoke, then drop the cache
    authenticator.forget_all()
    after = asyncio.ensure_future(authenticator.authenticate(secret))
    await asyncio.sleep(0.05)
    reads.gate.set()

    assert await before == record
    with pytest.raises(AuthError, match="invalid API key"):
        await after
    assert reads.count == 2


async def test_a_store_failure_in_the_background_keeps_the_record_up_to_the_stale_bound(
    store: Store,
    authenticator: Authenticator,
    monotonic: Clock,
    reads: CountedReads,
    caplog: pytest.LogCaptureFixture,
) -> None:
    secret, record = add_key(store)
    await authenticator.authenticate(secret)

    reads.failure = OSError("database is locked")
    monotonic.now += TTL_S * 0.8
    with caplog.at_level(logging.WARNING, logger="berth.auth.authenticator"):
        assert await authenticator.authenticate(secret) == record
        await settle(authenticator)
    assert "reading an API key again failed" in caplog.text
    assert await authenticator.authenticate(secret) == record  # and no read meanwhile
    assert reads.count == 2

    # Past its lifetime: still served, and read again a while after the failure.
    monotonic.now += TTL_S
    assert await authenticator.authenticate(secret) == record
    await settle(authenticator)
    assert reads.count == 3

    # Past the stale bound: the request waits for the read, and sees the failure.
    monotonic.now += MAX_STALE_S
    with pytest.raises(OSError, match="database is locked"):
        await authenticator.authenticate(secret)
    assert authenticator.counts.waits == {"new": 1, "stale": 1}


async def test_a_missing_or_unknown_secret_is_refused(
    authenticator: Authenticator, reads: CountedReads
) -> None:
    with pytest.raises(AuthError, match="missing API key"):
        await authenticator.authenticate(None)
    with pytest.raises(AuthError, match="invalid API key"):
        await authenticator.authenticate(generate_secret())
    assert reads.count == 1


# -- bad secrets: the negative cache, the bound on misses, the limiter -------------------------

ADDRESS = "203.0.113.7"


class AuditLines:
    def __init__(self) -> None:
        self.lines: list[dict[str, object]] = []

    def __call__(self, event: Mapping[str, object]) -> None:
        self.lines.append(dict(event))


def limited(
    store: Store, monotonic: Clock, *, burst: int = 3, rate_per_s: float = 0.01
) -> tuple[Authenticator, AuditLines]:
    audit = AuditLines()
    limiter = FailedAuthLimiter(burst=burst, rate_per_s=rate_per_s)
    return (
        Authenticator(
            store, PEPPER, cache_ttl_s=TTL_S, limiter=limiter, audit=audit, clock=monotonic
        ),
        audit,
    )


async def test_an_invalid_secret_is_remembered_without_another_read_until_it_expires(
    authenticator: Authenticator, monotonic: Clock, reads: CountedReads
) -> None:
    bad = generate_secret()
    for _ in range(5):
        with pytest.raises(AuthError, match="invalid API key"):
            await authenticator.authenticate(bad)
    assert reads.count == 1
    assert authenticator.counts.cached_invalid == 4

    monotonic.now += NEGATIVE_CACHE_TTL_S
    with pytest.raises(AuthError, match="invalid API key"):
        await authenticator.authenticate(bad)
    assert reads.count == 2


async def test_creating_a_key_forgets_the_invalid_secrets(
    store: Store, authenticator: Authenticator, reads: CountedReads
) -> None:
    secret = generate_secret()
    with pytest.raises(AuthError):
        await authenticator.authenticate(secret)
    # The secret becomes valid (restored, or created elsewhere), and the admin API's
    # change of a key drops the caches.
    record = store.add_api_key("late", "standard", hash_secret(secret, PEPPER), key_prefix(secret))
    authenticator.forget_all()

    assert await authenticator.authenticate(secret) == record
    assert reads.count == 2


async def test_the_negative_cache_is_bounded_oldest_dropped_first(
    authenticator: Authenticator, reads: CountedReads, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("berth.auth.authenticator.MAX_NEGATIVE_ENTRIES", 3)
    secrets = [generate_secret() for _ in range(4)]
    for secret in secrets:
        with pytest.raises(AuthError):
            await authenticator.authenticate(secret)
    assert reads.count == 4

    for secret in secrets[1:]:  # the newest three are remembered
        with pytest.raises(AuthError):
            await authenticator.authenticate(secret)
    assert reads.count == 4
    with pytest.raises(AuthError):  # the oldest was dropped
        await authenticator.authenticate(secrets[0])
    assert reads.count == 5


async def test_a_spray_of_distinct_secrets_reads_a_few_at_a_time(
    store: Store, authenticator: Authenticator, reads: CountedReads
) -> None:
    secret, record = add_key(store)
    assert await authenticator.authenticate(secret) == record  # found valid once
    reads.gate = threading.Event()
    spray = [
        asyncio.ensure_future(authenticator.authenticate(generate_secret())) for _ in range(40)
    ]
    await wait_for_async(lambda: reads.count == 1 + MAX_CONCURRENT_MISSES, 30, "4 reads held")
    await asyncio.sleep(0.1)
    assert reads.count == 1 + MAX_CONCURRENT_MISSES  # the others wait for a turn
    reads.gate.set()
    results = await asyncio.gather(*spray, return_exceptions=True)
    assert all(isinstance(r, AuthError) for r in results)
    assert reads.count == 1 + 40


async def test_a_burst_of_bad_secrets_is_refused_429_without_reads_and_audited_once(
    store: Store, monotonic: Clock, reads: CountedReads
) -> None:
    authenticator, audit = limited(store, monotonic, burst=3, rate_per_s=0.01)
    for _ in range(3):
        with pytest.raises(AuthError, match="invalid API key"):
            await authenticator.authenticate(generate_secret(), address=ADDRESS)
    for _ in range(50):
        with pytest.raises(RateLimitError) as refused:
            await authenticator.authenticate(generate_secret(), address=ADDRESS, surface="admin")
    assert refused.value.http_status == 429
    assert refused.value.retry_after_s == pytest.approx(100.0)
    assert reads.count == 3
    assert authenticator.counts.rate_limited == 50
    (line,) = audit.lines
    assert line["event"] == "auth.rate_limited"
    assert line["source_address"] == ADDRESS and line["surface"] == "admin"
    assert line["burst"] == 3 and line["refused_before"] == 0
    assert not any(isinstance(v, str) and "sk-berth" in v for v in line.values())

    # Another address is not refused; the limited one is once its token has come back.
    with pytest.raises(AuthError, match="invalid API key"):
        await authenticator.authenticate(generate_secret(), address="198.51.100.2")
    monotonic.now += 100.0
    with pytest.raises(AuthError, match="invalid API key"):
        await authenticator.authenticate(generate_secret(), address=ADDRESS)


async def test_a_key_found_valid_is_served_while_its_address_is_refused(
    store: Store, monotonic: Clock, reads: CountedReads
) -> None:
    authenticator, _ = limited(store, monotonic, burst=2)
    secret, record = add_key(store)
    assert await authenticator.authenticate(secret, address=ADDRESS) == record
    for _ in range(2):
        with pytest.raises(AuthError):
            await authenticator.authenticate(generate_secret(), address=ADDRESS)
    with pytest.raises(RateLimitError):
        await authenticator.authenticate(generate_secret(), address=ADDRESS)

    assert await authenticator.authenticate(secret, address=ADDRESS) == record  # cached
    monotonic.now += TTL_S * 2  # past its lifetime: read again, not refused
    assert await authenticator.authenticate(secret, address=ADDRESS) == record
    authenticator.forget_all()  # another key changed: read again, still not refused
    assert await authenticator.authenticate(secret, address=ADDRESS) == record
    assert reads.count == 5


async def test_valid_keys_do_not_spend_their_address_tokens(
    store: Store, monotonic: Clock, reads: CountedReads
) -> None:
    authenticator, _ = limited(store, monotonic, burst=2)
    keys = [add_key(store, f"k{i}") for i in range(10)]
    for secret, record in keys:  # ten new keys from one address (a NAT, say)
        assert await authenticator.authenticate(secret, address=ADDRESS) == record
    with pytest.raises(AuthError, match="invalid API key"):
        await authenticator.authenticate(generate_secret(), address=ADDRESS)


async def test_a_revoked_key_meets_the_limiter_again(
    store: Store, monotonic: Clock, reads: CountedReads
) -> None:
    authenticator, _ = limited(store, monotonic, burst=1)
    secret, record = add_key(store)
    await authenticator.authenticate(secret, address=ADDRESS)
    store.revoke_api_key(record.id)
    authenticator.forget_all()
    with pytest.raises(AuthError, match="invalid API key"):  # once known: read, not limited
        await authenticator.authenticate(secret, address=ADDRESS)
    with pytest.raises(AuthError, match="invalid API key"):  # remembered invalid: a token
        await authenticator.authenticate(secret, address=ADDRESS)
    with pytest.raises(RateLimitError):
        await authenticator.authenticate(secret, address=ADDRESS)
    assert reads.count == 2


async def test_a_refusal_is_held_before_it_is_answered(
    store: Store, monotonic: Clock, reads: CountedReads
) -> None:
    limiter = FailedAuthLimiter(burst=1, rate_per_s=0.01)
    authenticator = Authenticator(
        store, PEPPER, limiter=limiter, refusal_delay_s=1.0, clock=monotonic
    )
    with pytest.raises(AuthError):
        await authenticator.authenticate(generate_secret(), address=ADDRESS)
    refusal = asyncio.ensure_future(authenticator.authenticate(generate_secret(), address=ADDRESS))
    for _ in range(5):
        await asyncio.sleep(0)
    assert not refusal.done()  # held
    with pytest.raises(RateLimitError) as refused:
        await refusal
    assert refused.value.retry_after_s == pytest.approx(100.0)


async def test_a_key_of_the_leader_is_served_on_its_first_use_while_its_address_is_refused(
    store: Store, monotonic: Clock, reads: CountedReads
) -> None:
    authenticator, _ = limited(store, monotonic, burst=1)
    secret, record = add_key(store)  # on the leader before it started, or created since
    authenticator.know(store.api_key_hashes())
    with pytest.raises(AuthError):
        await authenticator.authenticate(generate_secret(), address=ADDRESS)
    with pytest.raises(RateLimitError):
        await authenticator.authenticate(generate_secret(), address=ADDRESS)

    assert await authenticator.authenticate(secret, address=ADDRESS) == record  # never used yet

    revoked_secret, revoked = add_key(store, "old")
    authenticator.know(store.api_key_hashes())
    store.revoke_api_key(revoked.id)
    with pytest.raises(AuthError, match="invalid API key"):  # read once: known no more
        await authenticator.authenticate(revoked_secret, address=ADDRESS)
    monotonic.now += NEGATIVE_CACHE_TTL_S
    with pytest.raises(RateLimitError):
        await authenticator.authenticate(revoked_secret, address=ADDRESS)
    assert reads.count == 3
