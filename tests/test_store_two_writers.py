"""Two leaders on one database: two ``Store`` objects writing at once, on SQLite (one file)
and on PostgreSQL, never lose a usage batch, never both move a deployment out of one state,
and a key change made through one is what the other reads."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from datetime import date

import pytest

from berth.errors import ConflictError, InvalidTransitionError
from berth.store import LATEST_VERSION, Store
from berth.vocab.limits import LimitOverrides
from berth.vocab.records import UsageRecord
from berth.vocab.states import DeploymentState

pytestmark = pytest.mark.store_engines

DAY = date(2026, 3, 14)
#: Batches each writer adds, each to the same ledger rows as the other's.
BATCHES = 40


@pytest.fixture
def two_stores(db_url: str) -> Iterator[tuple[Store, Store]]:
    """Two stores on one migrated database, as two leaders have."""
    with Store(db_url) as first, Store(db_url) as second:
        first.migrate()
        second.migrate()
        first.ensure_local_node()
        yield first, second


def _at_once(*jobs: Callable[[], object]) -> list[BaseException]:
    """Run ``jobs`` in threads released together; the exceptions they raised."""
    start = threading.Barrier(len(jobs))
    errors: list[BaseException] = []

    def run(job: Callable[[], object]) -> None:
        start.wait()
        try:
            job()
        except BaseException as exc:  # collected for the test's assert
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(job,)) for job in jobs]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return errors


def _batch(key: str) -> list[UsageRecord]:
    return [
        UsageRecord(DAY, key, model, "local", 1, 0, 10, 5, 0, 0) for model in ("m1", "m2", "m3")
    ]


def test_usage_batches_from_two_writers_all_count(two_stores: tuple[Store, Store]) -> None:
    first, second = two_stores

    def writer(store: Store) -> Callable[[], None]:
        def job() -> None:
            for _ in range(BATCHES):
                store.add_usage([*_batch("k-a"), *_batch("k-b")])

        return job

    assert _at_once(writer(first), writer(second)) == []
    rows = first.list_usage(since=DAY)
    assert len(rows) == 6
    assert {(r.requests, r.prompt_tokens, r.completion_tokens) for r in rows} == {
        (2 * BATCHES, 20 * BATCHES, 10 * BATCHES)
    }
    assert second.token_totals(day=DAY, month_start=DAY) == {
        "k-a": (3 * 2 * BATCHES * 15,) * 2,
        "k-b": (3 * 2 * BATCHES * 15,) * 2,
    }


def test_a_deployment_leaves_a_state_once_when_two_writers_race(
    two_stores: tuple[Store, Store],
) -> None:
    first, second = two_stores
    first.add_model("tiny", "/models/tiny.gguf")
    for _ in range(10):
        deployment = first.create_deployment("tiny", "llamacpp", "process", "local")

        def move(store: Store, deployment_id: str = deployment.id) -> Callable[[], object]:
            return lambda: store.transition_deployment(deployment_id, DeploymentState.LOADING)

        errors = _at_once(move(first), move(second))
        assert [type(e) for e in errors] == [InvalidTransitionError]
        assert second.get_deployment(deployment.id).state is DeploymentState.LOADING


def test_key_changes_from_two_writers_are_all_kept(two_stores: tuple[Store, Store]) -> None:
    first, second = two_stores
    keys = [first.add_api_key(f"key-{n}", "standard", f"hash-{n}", f"bk-{n}") for n in range(10)]

    def revoke_all() -> None:
        for key in keys:
            first.revoke_api_key(key.id)

    def limit_all() -> None:
        for key in keys:
            # Revoked first: a revoked key is not changed.
            with contextlib.suppress(ConflictError):
                second.update_api_key(key.id, limits=LimitOverrides(rpm=7))

    assert _at_once(revoke_all, limit_all) == []
    for key in second.list_api_keys():
        assert key.revoked_at is not None
        assert first.find_api_key(f"hash-{key.name.removeprefix('key-')}") is None
    # A secret's hash is stored once, whichever leader writes it first.
    errors = _at_once(
        lambda: first.add_api_key("same", "standard", "hash-x", "bk-x"),
        lambda: second.add_api_key("same", "standard", "hash-x", "bk-x"),
    )
    assert [type(e) for e in errors] == [ConflictError]


def test_two_leaders_migrating_one_fresh_database_at_once_both_succeed(db_url: str) -> None:
    with Store(db_url) as first, Store(db_url) as second:
        versions: list[int] = []
        errors = _at_once(lambda: versions.append(first.migrate()),
                          lambda: versions.append(second.migrate()))  # fmt: skip
        assert errors == []
        assert versions == [LATEST_VERSION, LATEST_VERSION]
