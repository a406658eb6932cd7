"""``berth doctor``'s store line (``berth.doctor.store``): the database at ``database_url``
opened, its schema version against this berth's, the leader lease with ``leader_ha``; on
SQLite and PostgreSQL, and for a server that does not answer."""

from __future__ import annotations

import socket
import time
from pathlib import Path

import pytest
from sqlalchemy import text

from berth.config import Settings
from berth.doctor.store import store_check
from berth.paths import BerthHome
from berth.store import LATEST_VERSION, Store

pytestmark = pytest.mark.store_engines


def _settings(tmp_path: Path, url: str, *, ha: bool = False) -> Settings:
    env = {"BERTH_DATABASE_URL": url, "BERTH_LEADER_HA": "true" if ha else "false"}
    return Settings.load(BerthHome(tmp_path / "home"), env=env)


def test_a_migrated_store_passes_with_its_version_and_lease(db_url: str, tmp_path: Path) -> None:
    with Store(db_url) as store:
        store.migrate()
        store.acquire_lease("a", "https://a.example:11500", 60.0)
    check = store_check(_settings(tmp_path, db_url, ha=True))
    assert check.verdict == "ok", check
    assert f"schema version {LATEST_VERSION}" in check.detail
    assert "lease held by https://a.example:11500 (epoch 1)" in check.detail


def test_an_older_schema_warns_and_a_newer_one_fails(db_url: str, tmp_path: Path) -> None:
    with Store(db_url) as store:
        store.migrate()
        with store.engine.begin() as conn:
            latest = {"v": LATEST_VERSION}
            conn.execute(text("DELETE FROM schema_version WHERE version = :v"), latest)
    older = store_check(_settings(tmp_path, db_url))
    assert older.verdict == "warn" and older.hint == "berth daemon start"
    with Store(db_url) as store, store.engine.begin() as conn:
        conn.execute(
            text(
                "INSERT INTO schema_version (version, description, applied_at) "
                "VALUES (:v, 'future', '2099-01-01 00:00:00')"
            ),
            {"v": LATEST_VERSION + 5},
        )
    newer = store_check(_settings(tmp_path, db_url))
    assert newer.verdict == "fail" and "newer than this berth" in newer.detail


def test_a_server_that_does_not_answer_fails_with_a_hint(tmp_path: Path) -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]  # closed again: nobody listens there
    url = f"postgresql+psycopg://berth:secret@127.0.0.1:{port}/berth"
    check = store_check(_settings(tmp_path, url))
    assert check.verdict == "fail" and "database_url" in check.hint
    assert "secret" not in check.detail and "***" in check.detail


def test_no_leader_holding_the_lease_fails(db_url: str, tmp_path: Path) -> None:
    """After a step-down with no standby (or with every leader stopped) nothing serves: the
    store line fails, naming the lease it read (issue 37: it said ok)."""
    with Store(db_url) as store:
        store.migrate()
        state = store.acquire_lease("a", "https://a.example:11500", 60.0)
        store.release_lease("a", state.epoch)  # a clean stop or a step-down
    check = store_check(_settings(tmp_path, db_url, ha=True))
    assert check.verdict == "fail", check
    assert "no leader holds the lease: it ran out" in check.detail
    assert "epoch 1, last held by https://a.example:11500" in check.detail
    assert "berth daemon start" in check.hint
    # Without leader_ha there is no lease to hold: the one leader is active by itself.
    assert store_check(_settings(tmp_path, db_url)).verdict == "ok"


def test_a_lease_never_taken_fails_too(db_url: str, tmp_path: Path) -> None:
    with Store(db_url) as store:
        store.migrate()
    check = store_check(_settings(tmp_path, db_url, ha=True))
    assert check.verdict == "fail" and "none has ever taken it" in check.detail


def test_the_leaders_seen_within_the_lease_are_counted(db_url: str, tmp_path: Path) -> None:
    with Store(db_url) as store:
        store.migrate()
        store.acquire_lease("a", "https://a.example:11500", 60.0)
        now_s = time.time()
        store.note_leader_member("https://a.example:11501", "a", now_s)
        store.note_leader_member("https://b.example:11501", "b", now_s)
        store.note_leader_member("https://c.example:11501", "c", now_s - 3600)
    check = store_check(_settings(tmp_path, db_url, ha=True))
    assert check.verdict == "ok", check
    assert "2 leader(s) seen within the lease" in check.detail
