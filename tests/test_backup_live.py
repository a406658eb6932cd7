"""A restore cannot destroy a live cluster, and never takes the lease's epoch back
(``berth.backup.target``; issue 37).

The rule is pure (``live_refusal``, ``restored_epoch``), tested case by case; then
``restore_backup`` on both engines (a SQLite file, a real PostgreSQL database whose URL holds
a password): a database whose lease a leader holds, or renewed within three leases, is
refused with ``--force`` too, naming that database (its password masked) and the leader,
and is left as it was; an idle one is replaced, and its lease epoch ends above every epoch it
had, so the next leader to start takes one more.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import pytest
from sqlalchemy import make_url, text

from berth.backup import create_backup, restore_backup
from berth.backup.postgres import write_lock
from berth.backup.target import (
    LIVE_LEASES,
    RESTORE_HOLDER,
    TargetDatabase,
    live_refusal,
    restored_epoch,
)
from berth.cluster.pki.ca import CertificateAuthority
from berth.errors import ConflictError
from berth.keys import load_or_create_pepper
from berth.paths import BerthHome
from berth.store import Store
from berth.store.lease import LeaseRecord
from berth.store.members import LeaderMember
from support.waiting import wait_for

pytestmark = pytest.mark.store_engines

NOW = 1_800_000_000.0
LEASE_S = 5.0
PASSWORD = "pg-password-for-restores"


def lease(holder: str = "host-a:41:ab12cd", *, renewed_ago: float, held_for: float = LEASE_S,
          epoch: int = 7) -> LeaseRecord:  # fmt: skip
    renewed = NOW - renewed_ago
    return LeaseRecord(holder, "https://a.lan:11500", epoch, renewed - 100, renewed,
                       renewed + held_for)  # fmt: skip


STANDBY = LeaderMember("https://b.lan:11501", "b:1:x", NOW - 2)


def target(record: LeaseRecord | None = None, *members: LeaderMember) -> TargetDatabase:
    return TargetDatabase("postgresql+psycopg://berth:***@db/berth", 16, record, members)


@pytest.mark.parametrize(
    ("database", "live"),
    [
        (target(), False),  # never leased: a single leader without leader_ha, or none yet
        (target(lease(renewed_ago=1.0)), True),  # held now
        (target(lease(renewed_ago=LEASE_S + 1)), True),  # ran out, renewed 6 s ago
        (target(lease(renewed_ago=LIVE_LEASES * LEASE_S + 0.5)), False),  # quiet 3 leases
        # Released by a clean stop (expires when it was released): quiet 3 leases later.
        (target(lease(renewed_ago=2.0, held_for=0.1)), True),
        (target(lease(renewed_ago=LIVE_LEASES * LEASE_S + 1, held_for=0.1)), False),
        # A longer lease than the restore's setting, as its row shows: its window.
        (target(lease(renewed_ago=40.0, held_for=30.0)), True),
        (target(lease(RESTORE_HOLDER, renewed_ago=0.5)), False),  # a restore's own row
        # A standby noted 2 s ago; one noted an hour ago.
        (target(lease(renewed_ago=1e6), STANDBY), True),
        (target(None, LeaderMember("https://b.lan:11501", "b:1:x", NOW - 3600)), False),
    ],
)
def test_a_database_a_leader_used_within_three_leases_is_live(
    database: TargetDatabase, live: bool
) -> None:
    refusal = live_refusal(database, NOW, LEASE_S)
    assert (refusal is not None) is live, refusal
    if refusal is not None:
        assert refusal.startswith(f"refused: the database {database.shown} is in use")
        assert "--force does not change that" in refusal
        assert "berth daemon stop" in refusal and "BERTH_DATABASE_URL" in refusal


def test_the_refusal_names_the_leaders_it_saw() -> None:
    refusal = live_refusal(target(lease(renewed_ago=1.0), STANDBY), NOW, LEASE_S)
    assert refusal is not None
    assert "leader host-a:41:ab12cd (https://a.lan:11500) holds its lease (epoch 7, " in refusal
    assert "renewed 1.0 s ago" in refusal
    assert "leader https://b.lan:11501 was seen 2.0 s ago" in refusal
    assert "quiet for 3 leases (15 s; about 14 s from now)" in refusal


@pytest.mark.parametrize(
    ("backup", "target_epoch", "expected"),
    [(None, 0, None), (3, 0, 4), (3, 7, 8), (9, 7, 10), (None, 7, 8)],
)
def test_the_restored_epoch_is_above_the_backups_and_the_databases(
    backup: int | None, target_epoch: int, expected: int | None
) -> None:
    assert restored_epoch(backup, target_epoch) == expected


# -- restore_backup on both engines --------------------------------------------------------


@pytest.fixture
def database(db_url: str) -> str:
    """``db_url``, with a password in it on PostgreSQL (trust authentication ignores it)."""
    url = make_url(db_url)
    if url.get_backend_name() == "postgresql":
        return url.set(password=PASSWORD).render_as_string(hide_password=False)
    return db_url


def shown(database: str) -> str:
    """How a refusal names ``database``: a SQLite file by its path, a URL password masked."""
    if database.startswith("sqlite:///"):
        return database.removeprefix("sqlite:///")
    return make_url(database).render_as_string(hide_password=True)


class PastClock:
    """A store clock that starts a day ago and moves on by ``step_s`` at each reading."""

    def __init__(self, step_s: float = 100.0) -> None:
        self.at = time.time() - 86400
        self.step_s = step_s

    def __call__(self) -> datetime:
        self.at += self.step_s
        return datetime.fromtimestamp(self.at, UTC)


def take_leases(url: str, times: int, clock: PastClock) -> int:
    """Take the lease ``times`` times, each after the last ran out (in the past); the epoch."""
    with Store(url, clock=clock) as store:
        state = None
        for number in range(times):
            state = store.acquire_lease(f"old-leader-{number}", "https://old.lan:11500", LEASE_S)
        assert state is not None
        return state.epoch


@pytest.fixture
def backed_up(database: str, tmp_path: Path) -> Iterator[tuple[Path, PastClock]]:
    """A backup of a leader whose database's lease was at epoch 3; the clock it used."""
    home = BerthHome(tmp_path / "leader")
    home.ensure()
    CertificateAuthority.load_or_create(home.ca_dir)
    load_or_create_pepper(home.pepper_file)
    clock = PastClock()
    with Store(database) as store:
        store.migrate()
        store.ensure_local_node()
    assert take_leases(database, 3, clock) == 3
    archive = tmp_path / "backup.tar.gz"
    create_backup(home, database, archive)
    yield archive, clock


def test_a_restore_into_an_idle_database_leaves_its_epoch_above_every_one_it_had(
    database: str, backed_up: tuple[Path, PastClock], tmp_path: Path
) -> None:
    archive, clock = backed_up
    assert take_leases(database, 4, clock) == 7  # the cluster went on after the backup

    report = restore_backup(BerthHome(tmp_path / "restored"), archive, force=True,
                            env={"BERTH_DATABASE_URL": database})  # fmt: skip

    assert (report.previous_epoch, report.lease_epoch) == (7, 8)
    with Store(database) as store:
        restored = store.read_lease()
        assert restored is not None
        assert (restored.epoch, restored.holder) == (8, RESTORE_HOLDER)
        assert not restored.live(time.time())  # expired: the next leader takes it
        taken = store.acquire_lease("new-leader", "https://new.lan:11500", LEASE_S)
    assert (taken.role, taken.epoch) == ("active", 9)


def test_a_restore_into_a_live_database_is_refused_even_with_force(
    database: str, backed_up: tuple[Path, PastClock], tmp_path: Path
) -> None:
    archive, _clock = backed_up
    with Store(database) as store:
        held = store.acquire_lease("live-leader:7:abc", "https://live.lan:11500", 30.0)
        store.add_model("made-after-the-backup", "/models/m.gguf")
    assert held.role == "active"
    home = BerthHome(tmp_path / "fresh")  # an empty home: nothing there to blame

    with pytest.raises(ConflictError) as refused:
        restore_backup(home, archive, force=True, env={"BERTH_DATABASE_URL": database})

    message = str(refused.value)
    assert f"the database {shown(database)} is in use by a live cluster" in message
    assert "leader live-leader:7:abc (https://live.lan:11500) holds its lease" in message
    assert f"epoch {held.epoch}" in message and "--force does not change that" in message
    assert PASSWORD not in message and str(home.root) not in message
    with Store(database) as store:  # untouched
        assert [m.name for m in store.list_models()] == ["made-after-the-backup"]
        after = store.read_lease()
        assert after is not None and after.holder == "live-leader:7:abc"
    assert not [p for p in home.root.iterdir() if p.name.startswith("replaced-")]


def test_without_force_an_idle_database_is_named_not_blamed_on_the_home(
    database: str, backed_up: tuple[Path, PastClock], tmp_path: Path
) -> None:
    archive, _clock = backed_up
    with pytest.raises(ConflictError) as refused:
        restore_backup(BerthHome(tmp_path / "fresh"), archive,
                       env={"BERTH_DATABASE_URL": database})  # fmt: skip
    message = str(refused.value)
    assert f"the database {shown(database)} holds a cluster's state" in message
    assert "lease epoch 3" in message and "--force" in message
    assert "already holds a leader's state" not in message  # the fresh home holds nothing


def test_the_write_lock_holds_off_a_leaders_lease_until_it_is_released(
    database: str, backed_up: tuple[Path, PastClock]
) -> None:
    if not database.startswith("postgresql"):
        pytest.skip("SQLite has no session lock: its restore edits the copy before it moves")
    taken: list[int] = []

    def take() -> None:
        with Store(database) as store:
            taken.append(store.acquire_lease("starting", "https://s.lan:11500", LEASE_S).epoch)

    with Store(database) as watcher, write_lock(database):
        leader = threading.Thread(target=take)
        leader.start()

        def waiting() -> bool:
            with watcher.engine.connect() as conn:
                query = (
                    "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted"
                    " AND database = (SELECT oid FROM pg_database"
                    " WHERE datname = current_database())"
                )
                return int(conn.execute(text(query)).scalar_one()) > 0

        wait_for(waiting, 30.0, "the leader's write to wait for the lock")
        assert taken == []
    leader.join(timeout=30.0)
    assert taken == [4]


def test_the_database_the_archives_config_names_is_checked_too(
    database: str, tmp_path: Path
) -> None:
    """The operator's case: ``--force`` into a new home, no ``BERTH_DATABASE_URL``; the
    backup's ``config.toml`` names the live database."""
    if not database.startswith("postgresql"):
        pytest.skip("a SQLite path in config.toml is only restored inside the home")
    home = BerthHome(tmp_path / "leader")
    home.ensure()
    CertificateAuthority.load_or_create(home.ca_dir)
    load_or_create_pepper(home.pepper_file)
    home.config_file.write_text(f'[store]\ndatabase_url = "{database}"\nleader_ha = true\n')
    with Store(database) as store:
        store.migrate()
        store.acquire_lease("live-leader:8:def", "https://live.lan:11500", 30.0)
    archive = tmp_path / "backup.tar.gz"
    create_backup(home, database, archive)

    with pytest.raises(ConflictError, match="is in use by a live cluster") as refused:
        restore_backup(BerthHome(tmp_path / "new"), archive, force=True, env={})
    assert shown(database) in str(refused.value) and PASSWORD not in str(refused.value)
