"""The Store facade: migrations, models, deployments and their state transitions."""

from __future__ import annotations

import re
import socket
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import UTC
from pathlib import Path

import pytest
from sqlalchemy import Connection, inspect, text

from berth.errors import (
    ConfigError,
    ConflictError,
    InvalidTransitionError,
    NotFoundError,
    StoreError,
)
from berth.store import LATEST_VERSION, Store
from berth.store.migrations import MIGRATIONS, Migration, migrate
from berth.store.tables import Base
from berth.vocab.records import DeploymentRecord
from berth.vocab.states import DeploymentState

S = DeploymentState

# The state machine as the docs draw it (vocab/states.py): the expected answers, written
# out here rather than read from the module under test.
LEGAL = {
    (S.PENDING, S.LOADING),
    (S.PENDING, S.STOPPING),
    (S.PENDING, S.FAILED),
    (S.LOADING, S.READY),
    (S.LOADING, S.STOPPING),
    (S.LOADING, S.FAILED),
    (S.LOADING, S.RESTARTING),  # a restart's start failed: the next backoff
    (S.LOADING, S.CRASHLOOP),
    (S.READY, S.STOPPING),
    (S.READY, S.FAILED),
    (S.READY, S.RESTARTING),  # its engine ended and the restart policy starts it again
    (S.READY, S.CRASHLOOP),
    (S.RESTARTING, S.LOADING),  # the backoff is over: started again
    (S.RESTARTING, S.STOPPING),  # a stop wins over a pending restart
    (S.RESTARTING, S.FAILED),
    (S.CRASHLOOP, S.LOADING),
    (S.CRASHLOOP, S.STOPPING),
    (S.CRASHLOOP, S.FAILED),
    (S.STOPPING, S.STOPPED),
    (S.STOPPING, S.FAILED),
}
# A legal path from pending to each state.
PATH_TO = {
    S.PENDING: (),
    S.LOADING: (S.LOADING,),
    S.READY: (S.LOADING, S.READY),
    S.RESTARTING: (S.LOADING, S.READY, S.RESTARTING),
    S.CRASHLOOP: (S.LOADING, S.READY, S.CRASHLOOP),
    S.STOPPING: (S.STOPPING,),
    S.STOPPED: (S.STOPPING, S.STOPPED),
    S.FAILED: (S.FAILED,),
}


# The shared ``store`` fixture (conftest.py), with this model, on SQLite and PostgreSQL.
pytestmark = [
    pytest.mark.store_models(("tiny", "/models/tiny.gguf", 1234)),
    pytest.mark.store_engines,
]


@pytest.fixture
def deploy(store: Store) -> Callable[..., DeploymentRecord]:
    def deploy(model: str = "tiny", **kwargs: object) -> DeploymentRecord:
        return store.create_deployment(model, "llamacpp", "process", "local", **kwargs)  # type: ignore[arg-type]

    return deploy


# --- migrations ----------------------------------------------------------------------------


def test_migrate_from_empty_reaches_latest_and_is_idempotent(db_url: str) -> None:
    with Store(db_url) as store:
        assert store.schema_version() == 0
        assert store.migrate() == LATEST_VERSION
        assert store.migrate() == LATEST_VERSION
    with Store(db_url) as reopened:
        assert reopened.migrate() == LATEST_VERSION
        with reopened.engine.connect() as conn:
            versions = conn.execute(text("SELECT version FROM schema_version")).scalars().all()
    assert sorted(versions) == [m.version for m in MIGRATIONS]


def test_migrated_schema_matches_the_orm_tables(store: Store) -> None:
    with store.engine.connect() as conn:
        inspector = inspect(conn)
        for table in Base.metadata.sorted_tables:
            columns = {c["name"]: c["nullable"] for c in inspector.get_columns(table.name)}
            assert columns == {c.name: c.nullable for c in table.columns}, table.name


@pytest.mark.parametrize(
    ("pragma", "expected"), [("journal_mode", "wal"), ("foreign_keys", 1), ("busy_timeout", 30000)]
)
def test_sqlite_connection_settings(store: Store, pragma: str, expected: object) -> None:
    if store.engine.dialect.name != "sqlite":
        pytest.skip("SQLite's connection settings")
    with store.engine.connect() as conn:
        assert conn.exec_driver_sql(f"PRAGMA {pragma}").scalar() == expected


def test_database_newer_than_the_code_is_refused(db_url: str) -> None:
    with Store(db_url) as store:
        store.migrate()
        with store.engine.begin() as conn:
            conn.execute(
                text(
                    "INSERT INTO schema_version (version, description, applied_at) "
                    "VALUES (:version, 'from the future', '2099-01-01 00:00:00')"
                ),
                {"version": LATEST_VERSION + 1},
            )

    with Store(db_url) as newer, pytest.raises(StoreError, match="newer than this berth"):
        newer.migrate()


def test_unmigrated_database_raises_store_error(db_url: str) -> None:
    with Store(db_url) as store, pytest.raises(StoreError):
        store.list_models()


@contextmanager
def tcp_port_nobody_listens_on() -> Iterator[int]:
    """A loopback port held bound but not listening: a connection to it is refused."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        yield held.getsockname()[1]


def test_a_database_out_of_reach_raises_a_one_line_store_error() -> None:
    # libpq's "Connection refused" has its hint on a line of its own; the CLI prints one.
    with tcp_port_nobody_listens_on() as port:
        store = Store(f"postgresql+psycopg://berth:secret@127.0.0.1:{port}/berth")
        with store, pytest.raises(StoreError) as raised:
            store.migrate()
    message = str(raised.value)
    assert message.startswith("database error: connection failed:"), message
    assert "Connection refused Is the server running" in message and "\n" not in message


def test_unusable_url_raises_store_error() -> None:
    with pytest.raises(StoreError):
        Store("definitely not a url")


# --- models --------------------------------------------------------------------------------


def test_models_add_get_list(store: Store) -> None:
    added = store.add_model(
        "qwen", "/models/qwen", source="hub", repo_id="Qwen/Qwen3", revision="abc", size_bytes=9
    )

    assert store.get_model("qwen") == added
    assert added.path == Path("/models/qwen")
    assert (added.source, added.repo_id, added.revision) == ("hub", "Qwen/Qwen3", "abc")
    assert added.created_at.tzinfo == UTC
    assert [m.name for m in store.list_models()] == ["qwen", "tiny"]


def test_duplicate_model_is_a_conflict(store: Store) -> None:
    with pytest.raises(ConflictError, match="tiny"):
        store.add_model("tiny", "/elsewhere")


def test_unknown_model_source_is_refused(store: Store) -> None:
    with pytest.raises(ConfigError):
        store.add_model("x", "/x", source="ftp")  # type: ignore[arg-type]


def test_get_unknown_model_is_not_found(store: Store) -> None:
    with pytest.raises(NotFoundError) as caught:
        store.get_model("nope")
    assert (caught.value.kind, caught.value.ident) == ("model", "nope")


def test_remove_model_refused_while_an_active_deployment_uses_it(
    store: Store, deploy: Callable[..., DeploymentRecord]
) -> None:
    deployment = deploy()

    with pytest.raises(ConflictError, match=deployment.id):
        store.remove_model("tiny")
    store.transition_deployment(deployment.id, S.STOPPING)
    store.transition_deployment(deployment.id, S.STOPPED)
    removed = store.remove_model("tiny")

    assert removed.name == "tiny"
    assert store.list_models() == []
    assert store.get_deployment(deployment.id).model_name == "tiny"
    with pytest.raises(NotFoundError):
        store.remove_model("tiny")


# --- deployments ---------------------------------------------------------------------------


def test_create_deployment_starts_pending(
    store: Store, deploy: Callable[..., DeploymentRecord]
) -> None:
    record = deploy(gpus=(0, 1), ctx=8192, extra_args=("--flash-attn",))

    assert re.fullmatch(r"d-[0-9a-f]{8}", record.id)
    assert record.state is S.PENDING
    assert record.is_active
    assert (record.port, record.pid, record.failure_reason) == (None, None, None)
    assert record.gpus == (0, 1)
    assert record.ctx == 8192
    assert record.extra_args == ("--flash-attn",)
    assert record.served_model_name == "tiny"
    assert record.created_at.tzinfo == UTC
    assert store.get_deployment(record.id) == record


def test_served_model_name_can_differ(deploy: Callable[..., DeploymentRecord]) -> None:
    assert deploy(served_model_name="tiny-chat").served_model_name == "tiny-chat"


def test_deployment_of_unknown_model_is_not_found(
    deploy: Callable[..., DeploymentRecord],
) -> None:
    with pytest.raises(NotFoundError, match="ghost"):
        deploy("ghost")


@pytest.mark.parametrize(("kwargs"), [{"gpus": (-1,)}, {"ctx": 0}])
def test_invalid_deployment_arguments_are_refused(
    deploy: Callable[..., DeploymentRecord], kwargs: dict[str, object]
) -> None:
    with pytest.raises(ConfigError):
        deploy(**kwargs)


def test_list_deployments_newest_first_and_active_only(
    store: Store, deploy: Callable[..., DeploymentRecord]
) -> None:
    first, second, third = deploy(), deploy(), deploy()
    store.transition_deployment(second.id, S.FAILED, failure_reason="boom")

    assert [d.id for d in store.list_deployments()] == [third.id, second.id, first.id]
    assert [d.id for d in store.list_deployments(active_only=True)] == [third.id, first.id]


@pytest.mark.parametrize(("current", "target"), [(c, t) for c in S for t in S])
def test_every_transition_is_checked(
    store: Store, deploy: Callable[..., DeploymentRecord], current: S, target: S
) -> None:
    deployment = deploy()
    for step in PATH_TO[current]:
        store.transition_deployment(deployment.id, step)

    if (current, target) in LEGAL:
        moved = store.transition_deployment(deployment.id, target)
        assert moved.state is target
        assert moved.updated_at > deployment.updated_at
        assert store.get_deployment(deployment.id).state is target
    else:
        with pytest.raises(InvalidTransitionError) as caught:
            store.transition_deployment(deployment.id, target)
        assert (caught.value.current, caught.value.target) == (current.value, target.value)
        assert store.get_deployment(deployment.id).state is current


def test_transition_sets_runtime_fields_and_keeps_unmentioned_ones(
    store: Store, deploy: Callable[..., DeploymentRecord]
) -> None:
    deployment = deploy()

    loading = store.transition_deployment(deployment.id, S.LOADING, port=40001, pid=4242)
    ready = store.transition_deployment(deployment.id, S.READY)
    stopped = store.transition_deployment(deployment.id, S.STOPPING, pid=None)

    assert (loading.port, loading.pid) == (40001, 4242)
    assert (ready.port, ready.pid) == (40001, 4242)
    assert (stopped.port, stopped.pid) == (40001, None)


def test_failure_reason_is_kept(store: Store, deploy: Callable[..., DeploymentRecord]) -> None:
    deployment = deploy()
    store.transition_deployment(deployment.id, S.LOADING)

    failed = store.transition_deployment(
        deployment.id, S.FAILED, failure_reason="engine exited with code 1"
    )

    assert failed.failure_reason == "engine exited with code 1"
    assert not failed.is_active
    assert store.get_deployment(deployment.id).failure_reason == "engine exited with code 1"
    with pytest.raises(InvalidTransitionError):
        store.transition_deployment(deployment.id, S.STOPPING)
    assert store.get_deployment(deployment.id).failure_reason == "engine exited with code 1"


def test_racing_transitions_let_exactly_one_win(
    store: Store, deploy: Callable[..., DeploymentRecord]
) -> None:
    deployment = deploy()
    barrier = threading.Barrier(6)
    outcomes: list[str] = []
    lock = threading.Lock()

    def contend() -> None:
        barrier.wait()
        try:
            store.transition_deployment(deployment.id, S.LOADING)
            result = "moved"
        except InvalidTransitionError:
            result = "refused"
        with lock:
            outcomes.append(result)

    threads = [threading.Thread(target=contend) for _ in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()

    assert sorted(outcomes) == ["moved"] + ["refused"] * 5
    assert store.get_deployment(deployment.id).state is S.LOADING


def test_update_deployment_runtime_keeps_the_state(
    store: Store, deploy: Callable[..., DeploymentRecord]
) -> None:
    deployment = deploy()

    updated = store.update_deployment_runtime(deployment.id, port=41000, pid=99)

    assert (updated.state, updated.port, updated.pid) == (S.PENDING, 41000, 99)
    assert store.get_deployment(deployment.id) == updated


@pytest.mark.parametrize(
    "call",
    [
        lambda s: s.get_deployment("d-00000000"),
        lambda s: s.transition_deployment("d-00000000", S.LOADING),
        lambda s: s.update_deployment_runtime("d-00000000", port=1, pid=1),
    ],
)
def test_unknown_deployment_is_not_found(store: Store, call: Callable[[Store], object]) -> None:
    with pytest.raises(NotFoundError) as caught:
        call(store)
    assert (caught.value.kind, caught.value.ident) == ("deployment", "d-00000000")


def test_a_failing_migration_leaves_the_previous_version(db_url: str) -> None:
    def add_table_then_fail(conn: Connection) -> None:
        conn.exec_driver_sql("CREATE TABLE half_done (id INTEGER PRIMARY KEY)")
        raise RuntimeError("step 2 broke")

    steps = (*MIGRATIONS, Migration(LATEST_VERSION + 1, "broken", add_table_then_fail))
    with Store(db_url) as store:
        with pytest.raises(RuntimeError, match="step 2 broke"):
            migrate(store.engine, migrations=steps)

        assert store.schema_version() == LATEST_VERSION
        with store.engine.connect() as conn:
            assert not inspect(conn).has_table("half_done")


def test_leaders_not_seen_for_seven_days_are_forgotten(store: Store) -> None:
    from berth.daemon.leader_roster import LeaderRoster
    from berth.store.members import FORGET_AFTER_S

    now = 1_800_000_000.0
    store.note_leader_member("https://gone:7443", "holder-gone", now - FORGET_AFTER_S - 1)
    store.note_leader_member("https://standby:7443", "holder-b", now - FORGET_AFTER_S + 60)

    class Me:
        me = "holder-a"

    roster = LeaderRoster(
        store,
        Me(),
        cluster_url="https://a:7443/",
        lease_s=9.0,
        clock=lambda: now,  # type: ignore[arg-type]
    )
    listed = roster._note_and_read()
    assert [m.cluster_url for m in listed] == ["https://a:7443", "https://standby:7443"]
    assert store.forget_leader_members(now - FORGET_AFTER_S) == 0  # nothing left that old
