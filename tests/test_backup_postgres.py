"""``berth backup`` on PostgreSQL (``berth.backup.postgres``): a leader's database dumped with
``pg_dump`` into the archive beside its CA and pepper, restored with ``pg_restore`` into
another database of a real server; a database that holds state is only replaced with
``force``, and then dumped aside first."""

from __future__ import annotations

import stat
import tarfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from berth.backup import create_backup, restore_backup, verify_backup
from berth.cluster.pki.ca import CertificateAuthority
from berth.errors import ConfigError, ConflictError
from berth.keys import hash_secret, load_or_create_pepper
from berth.paths import BerthHome
from berth.store import Store
from berth.vocab.roles import Tier
from support.postgres import PostgresServer

pytestmark = pytest.mark.needs("postgresql")


@pytest.fixture
def pg_pair(postgres_server: PostgresServer) -> Iterator[tuple[str, str]]:
    """Two fresh databases: the leader's, and one to restore into."""
    urls = (postgres_server.create_database(), postgres_server.create_database())
    yield urls
    for url in urls:
        postgres_server.drop_database(url)


def every_file_private(root: Path) -> bool:
    """Whether every file under ``root`` is 0600 (what a backup or restore writes)."""
    modes = {p: stat.S_IMODE(p.stat().st_mode) for p in root.rglob("*") if p.is_file()}
    assert modes, f"no files under {root}"
    loose = {str(p): f"{m:o}" for p, m in modes.items() if m != 0o600}
    assert not loose, loose
    return True


def _pg_leader_home(root: Path, url: str) -> BerthHome:
    """A leader's home (CA, pepper) whose database is ``url``: a key and a connected agent."""
    home = BerthHome(root)
    home.ensure()
    CertificateAuthority.load_or_create(home.ca_dir)
    pepper = load_or_create_pepper(home.pepper_file)
    with Store(url) as store:
        store.migrate()
        store.ensure_local_node()
        store.add_api_key("ops", Tier.ADMIN, hash_secret("sk-berth-secret", pepper), "sk-berth-se")
        node = store.enroll_node("gpu-a", "sha256:" + "ab" * 32)
        store.set_node_status(node.id, "ready")
    return home


def test_a_postgresql_leader_is_backed_up_and_restored_into_another_database(
    pg_pair: tuple[str, str], tmp_path: Path
) -> None:
    source, target = pg_pair
    home = _pg_leader_home(tmp_path / "leader", source)
    dest = tmp_path / "backup.tar.gz"

    manifest = create_backup(home, source, dest)
    assert manifest.database_member == "berth.pgdump"
    with tarfile.open(dest) as archive:
        assert "berth.db" not in archive.getnames()
    assert verify_backup(dest).schema_version == manifest.schema_version

    restored = BerthHome(tmp_path / "restored")
    report = restore_backup(restored, dest, env={"BERTH_DATABASE_URL": target})
    assert report.database_path is None and report.replaced_dir is None
    assert report.database_url == target  # no password in it to mask
    assert (restored.ca_dir / "ca.key").is_file() and restored.pepper_file.is_file()
    assert not (restored.root / "berth.pgdump").exists()
    with Store(target) as store:
        assert [k.name for k in store.list_api_keys()] == ["ops"]
        statuses = {n.label: n.status for n in store.list_nodes()}
        assert statuses["gpu-a"] == "unreachable"  # not connected to the restored leader


def test_a_database_with_state_is_replaced_only_with_force_and_kept_as_a_dump(
    pg_pair: tuple[str, str], tmp_path: Path
) -> None:
    source, target = pg_pair
    home = _pg_leader_home(tmp_path / "leader", source)
    dest = tmp_path / "backup.tar.gz"
    create_backup(home, source, dest)
    with Store(target) as other:
        other.migrate()
        other.add_api_key("theirs", Tier.STANDARD, "hash-theirs", "sk-berth-th")

    fresh = BerthHome(tmp_path / "fresh")
    with pytest.raises(ConflictError, match="the database"):
        restore_backup(fresh, dest, env={"BERTH_DATABASE_URL": target})
    report = restore_backup(fresh, dest, force=True, env={"BERTH_DATABASE_URL": target})
    assert report.replaced_dir is not None
    kept = report.replaced_dir / "berth.pgdump"
    assert kept.stat().st_size > 0
    assert stat.S_IMODE(kept.stat().st_mode) == 0o600  # it was 0644: pg_dump's umask
    assert every_file_private(fresh.root)
    with Store(target) as store:
        assert [k.name for k in store.list_api_keys()] == ["ops"]


def test_a_dump_is_not_restored_into_sqlite(pg_pair: tuple[str, str], tmp_path: Path) -> None:
    source, _target = pg_pair
    home = _pg_leader_home(tmp_path / "leader", source)
    dest = tmp_path / "backup.tar.gz"
    create_backup(home, source, dest)
    with pytest.raises(ConfigError, match="PostgreSQL dump"):
        restore_backup(BerthHome(tmp_path / "restored"), dest, env={})
