"""The usage ledger: the in-memory buffer (`berth.admission.ledger`) written in batches to the
store (`Store.add_usage`), what a failed write keeps, the totals the metrics read, and the
key columns of migration 6 (limits, expiry, lookup by name)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from datetime import UTC, date, datetime, timedelta
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import text

from berth.admission import Admission, ManualClock, UsageCollector, UsageLedger
from berth.admission.calendar import day_index_of
from berth.config import TierTable
from berth.errors import ConflictError, NotFoundError, StoreError
from berth.store import Store
from berth.vocab.limits import LimitOverrides
from berth.vocab.records import UsageRecord

# Every test that uses the store runs on SQLite and on PostgreSQL (conftest.py).
pytestmark = pytest.mark.store_engines

DAY = date(2026, 3, 14)


def _record(ledger: UsageLedger, *, day: date = DAY, key_id: str = "k-1", model: str = "m",
            node: str = "local", tokens: tuple[int, int] = (3, 4), error: bool = False,
            estimated: bool = False) -> None:  # fmt: skip
    ledger.record(
        day_index_of(day),
        key_id,
        model,
        node,
        error=error,
        prompt_tokens=tokens[0],
        completion_tokens=tokens[1],
        estimated=estimated,
    )


async def test_requests_are_summed_in_memory_and_written_in_one_batch(store: Store) -> None:
    ledger = UsageLedger(store)
    _record(ledger)
    _record(ledger, tokens=(10, 20), error=True)
    _record(ledger, model="n", estimated=True)

    assert await ledger.flush() == 2  # two rows, three requests
    assert await ledger.flush() == 0
    _record(ledger)  # a later batch adds to the same row
    await ledger.flush()

    rows = store.list_usage(since=DAY)
    assert rows == [
        UsageRecord(DAY, "k-1", "m", "local", 3, 1, 16, 28, 0, 0),
        UsageRecord(DAY, "k-1", "n", "local", 1, 0, 3, 4, 1, 7),
    ]


async def test_a_failed_write_keeps_the_batch_for_the_next_flush() -> None:
    class FlakySink:
        def __init__(self) -> None:
            self.fail = True
            self.written: list[UsageRecord] = []

        def add_usage(self, batch: Iterable[UsageRecord]) -> int:
            if self.fail:
                raise StoreError("database is locked")
            self.written.extend(batch)
            return len(self.written)

    sink = FlakySink()
    ledger = UsageLedger(sink)
    _record(ledger)
    with pytest.raises(StoreError):
        await ledger.flush()
    _record(ledger)
    sink.fail = False
    await ledger.flush()

    assert [r.requests for r in sink.written] == [2]
    assert list(ledger.totals()) == [("k-1", "m", (2, 0, 6, 8))]


async def test_run_writes_every_interval_and_once_more_when_stopped(store: Store) -> None:
    ledger = UsageLedger(store, flush_interval_s=0.01)
    runner = asyncio.create_task(ledger.run())
    _record(ledger)
    while not store.list_usage(since=DAY):
        await asyncio.sleep(0.01)
    _record(ledger, model="last")
    ledger.stop()
    await runner

    assert {r.model for r in store.list_usage(since=DAY)} == {"m", "last"}
    assert ledger.pending == []


def test_usage_is_listed_by_day_key_and_model_and_summed_for_budgets(store: Store) -> None:
    yesterday = DAY - timedelta(days=1)
    store.add_usage(
        [
            UsageRecord(DAY, "k-1", "m", "local", 1, 0, 10, 5),
            UsageRecord(DAY, "k-1", "m", "n-2", 1, 0, 1, 1),
            UsageRecord(yesterday, "k-1", "m", "local", 1, 0, 100, 0),
            UsageRecord(DAY, "k-2", "x", "local", 2, 0, 7, 0),
            UsageRecord(date(2026, 2, 28), "k-1", "m", "local", 1, 0, 1000, 0),
        ]
    )

    assert len(store.list_usage(since=yesterday)) == 4
    assert [r.node_id for r in store.list_usage(since=DAY, key_id="k-1")] == ["local", "n-2"]
    assert [r.key_id for r in store.list_usage(since=DAY, model="x")] == ["k-2"]
    assert store.list_usage(since=yesterday, until=yesterday)[0].prompt_tokens == 100
    assert store.token_totals(day=DAY, month_start=date(2026, 3, 1)) == {
        "k-1": (17, 117),
        "k-2": (7, 7),
    }
    with pytest.raises(ValueError, match="negative"):
        store.add_usage([UsageRecord(DAY, "k-1", "m", "local", requests=-1)])


async def test_the_metrics_name_keys_and_never_show_a_secret(store: Store) -> None:
    record = store.add_api_key("team a", "standard", "0" * 64, "sk-berth-abcd")
    admission = Admission(TierTable(), UsageLedger(store), clock=ManualClock())
    admission.load([record], {})
    ticket = admission.admit(record, "smollm2", 40)
    admission.settle(
        ticket, node_id="local", error=False, prompt_tokens=5, completion_tokens=6, estimated=False
    )
    registry = CollectorRegistry()
    registry.register(UsageCollector(admission))
    before = generate_latest(registry).decode()
    await admission.ledger.flush()  # written or not, the series stay the same
    text = generate_latest(registry).decode()

    assert text == before
    assert "sk-berth" not in text and record.id not in text
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }
    labels = (("key", "team a"), ("model", "smollm2"))
    assert samples[("berth_key_requests_total", labels)] == 1
    assert samples[("berth_key_tokens_total", (*labels[:1], ("kind", "prompt"), labels[1]))] == 5


# -- keys: limits, expiry, lookup by name ------------------------------------------------------


def test_keys_keep_their_limits_and_expiry_and_are_found_by_name(store: Store) -> None:
    expires = datetime(2027, 1, 1, tzinfo=UTC)
    own = LimitOverrides(rpm=3, models=frozenset({"a"}), tpm=None)
    added = store.add_api_key(
        "ci", "free", "1" * 64, "sk-berth-1111", limits=own, expires_at=expires
    )

    assert store.lookup_api_key("ci") == added
    assert store.lookup_api_key(added.id).limits == own
    assert added.expires_at == expires
    changed = store.update_api_key("ci", tier="standard", limits=LimitOverrides(), expires_at=None)
    assert (changed.tier, changed.limits, changed.expires_at) == (
        "standard",
        LimitOverrides(),
        None,
    )
    assert store.find_api_key("1" * 64) == changed


def test_a_name_two_keys_share_is_refused_and_revoked_keys_step_aside(store: Store) -> None:
    first = store.add_api_key("dup", "standard", "2" * 64, "sk-berth-2222")
    second = store.add_api_key("dup", "standard", "3" * 64, "sk-berth-3333")
    with pytest.raises(
        ConflictError, match=f"2 keys are named 'dup' \\({first.id}, {second.id}\\)"
    ):
        store.lookup_api_key("dup")
    store.revoke_api_key(first.id)
    assert store.lookup_api_key("dup").id == second.id
    with pytest.raises(NotFoundError):
        store.lookup_api_key("nobody")
    with pytest.raises(ConflictError, match="revoked"):
        store.update_api_key(first.id, tier="standard")


async def test_cached_prompt_tokens_are_summed_apart_and_written(store: Store) -> None:
    ledger = UsageLedger(store)
    for cached in (30, 12):
        ledger.record(
            day_index_of(DAY),
            "k-1",
            "m",
            "local",
            error=False,
            prompt_tokens=40,
            completion_tokens=5,
            estimated=False,
            cached_tokens=cached,
        )
    _record(ledger)  # a request whose engine said nothing of a cache
    await ledger.flush()
    (row,) = store.list_usage(since=DAY)
    assert (row.requests, row.prompt_tokens, row.cached_tokens) == (3, 83, 42)


def test_migration_11_gives_the_ledgers_rows_no_cached_tokens(tmp_path: Path) -> None:
    from sqlalchemy import create_engine

    from berth.store.migrations import MIGRATIONS, migrate

    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    engine = create_engine(url)
    migrate(engine, migrations=tuple(m for m in MIGRATIONS if m.version < 11))
    with engine.begin() as conn:
        conn.execute(
            text(
                "INSERT INTO usage_ledger VALUES "
                "('2026-03-14', 'k-1', 'm', 'local', 2, 0, 10, 4, 0, 0)"
            )
        )
    engine.dispose()
    with Store(url) as migrated:
        migrated.migrate()
        (row,) = migrated.list_usage(since=DAY)
    assert (row.requests, row.prompt_tokens, row.cached_tokens) == (2, 10, 0)
