"""``berth backup create|restore|verify``: in-process against real homes (a real SQLite store,
CA and pepper), through the real CLI for the refusals a user sees, and end to end on a real
cluster: a backup of a running leader with two agents, the leader's home deleted, restored,
and both agents back and serving without re-enrolling."""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import shutil
import socket
import sqlite3
import stat
import subprocess
import sys
import tarfile
import threading
import time
from datetime import UTC, datetime
from pathlib import Path

import openai
import pytest

from berth.backup import (
    MANIFEST_NAME,
    create_backup,
    member_refusal,
    restore_backup,
    verify_backup,
)
from berth.backup.restore import database_elsewhere_note
from berth.cluster.pki.ca import CertificateAuthority
from berth.errors import ConfigError, ConflictError, DaemonError, StoreError
from berth.keys import hash_secret, load_or_create_pepper
from berth.paths import BerthHome
from berth.store import LATEST_VERSION, Store
from berth.vocab.roles import Tier
from support.cluster_harness import Cluster, clean_env, served_by_node
from support.fake_llama_server import ANSWER


def _url(home: BerthHome) -> str:
    return f"sqlite:///{home.db_file}"


def make_leader_home(root: Path) -> BerthHome:
    """A leader's home as a started daemon leaves it: database, CA, certificates, pepper."""
    home = BerthHome(root)
    home.ensure()
    ca = CertificateAuthority.load_or_create(home.ca_dir)
    ca.ensure_server_certificate(
        ["127.0.0.1"], home.ca_dir / "cluster.pem", home.ca_dir / "cluster.key"
    )
    pepper = load_or_create_pepper(home.pepper_file)
    home.config_file.write_text('[server]\npublic_host = "leader.lan"\n')
    with Store(_url(home)) as store:
        store.migrate()
        store.ensure_local_node()
        store.add_api_key("ops", Tier.ADMIN, hash_secret("sk-berth-secret", pepper), "sk-berth-se")
        node = store.enroll_node("gpu-a", "sha256:" + "ab" * 32)
        store.set_node_status(node.id, "ready")  # its agent is connected
    return home


@pytest.fixture
def leader_home(tmp_path: Path) -> BerthHome:
    return make_leader_home(tmp_path / "leader")


@pytest.fixture
def archive(leader_home: BerthHome, tmp_path: Path) -> Path:
    dest = tmp_path / "backup.tar.gz"
    create_backup(leader_home, _url(leader_home), dest)
    return dest


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


# -- create ----------------------------------------------------------------------------------


def test_a_backup_holds_the_database_ca_pepper_and_config(
    leader_home: BerthHome, tmp_path: Path
) -> None:
    dest = tmp_path / "backup.tar.gz"

    manifest = create_backup(leader_home, _url(leader_home), dest)

    assert _mode(dest) == 0o600
    names = {f.name for f in manifest.files}
    assert names == {
        "berth.db", "ca/ca.pem", "ca/ca.key", "ca/cluster.pem", "ca/cluster.key", "key_pepper",
        "config.toml",
    }  # fmt: skip
    assert manifest.schema_version == LATEST_VERSION
    with tarfile.open(dest) as tar:
        members = tar.getmembers()
        assert members[0].name == MANIFEST_NAME
        listed = json.loads(tar.extractfile(members[0]).read())  # type: ignore[union-attr]
        assert listed["schema_version"] == LATEST_VERSION
        assert listed["berth_version"] and listed["created_at"]
        for member in members[1:]:
            data = tar.extractfile(member).read()  # type: ignore[union-attr]
            entry = next(f for f in manifest.files if f.name == member.name)
            assert hashlib.sha256(data).hexdigest() == entry.sha256
            assert member.mode == 0o600, member.name  # certificates too (issue 37)
        pepper = tar.extractfile("key_pepper").read()  # type: ignore[union-attr]
    assert pepper == leader_home.pepper_file.read_bytes()


def test_a_backup_names_every_secret_it_carries_and_shows_none(
    leader_home: BerthHome, tmp_path: Path
) -> None:
    password, secret = "pw-in-the-config", "a-cluster-secret-in-the-config"
    leader_home.config_file.write_text(
        f'[store]\ndatabase_url = "postgresql+psycopg://berth:{password}@db.lan/berth"\n'
        f'leader_ha = true\ncluster_secret = "{secret}"\n'
        '[tracing]\ntracing_headers = "authorization=Bearer%20tok"\n'
    )
    dest = tmp_path / "backup.tar.gz"

    manifest = create_backup(leader_home, _url(leader_home), dest)

    assert manifest.secrets == (
        "the CA key (ca/ca.key)",
        "the private keys ca/cluster.key",
        "the key pepper (key_pepper)",
        "the database password (config.toml [store] database_url)",
        "cluster_secret (config.toml [store] cluster_secret)",
        "the values of tracing_headers (config.toml [tracing] tracing_headers)",
    )
    assert verify_backup(dest).secrets == manifest.secrets
    listed = _read_members(dest)[MANIFEST_NAME].decode()
    assert password not in listed and secret not in listed


def test_a_database_url_without_a_password_is_no_secret(
    leader_home: BerthHome, tmp_path: Path
) -> None:
    leader_home.config_file.write_text(
        '[store]\ndatabase_url = "postgresql+psycopg://berth@db/b"\n'
    )
    manifest = create_backup(leader_home, _url(leader_home), tmp_path / "b.tar.gz")
    assert not [s for s in manifest.secrets if "config.toml" in s]


def test_the_database_copy_is_consistent_while_another_writer_writes(
    leader_home: BerthHome, tmp_path: Path
) -> None:
    """The daemon writes in WAL mode while the backup runs: the copy is one snapshot."""
    stop = threading.Event()
    written: list[int] = []

    def write_models() -> None:
        with Store(_url(leader_home)) as store:
            while not stop.is_set():
                store.add_model(f"m{len(written)}", "/models/x.gguf")
                written.append(1)

    writer = threading.Thread(target=write_models)
    writer.start()
    try:
        while len(written) < 20:
            threading.Event().wait(0.01)
        create_backup(leader_home, _url(leader_home), tmp_path / "during.tar.gz")
    finally:
        stop.set()
        writer.join()

    restored = BerthHome(tmp_path / "restored")
    restore_backup(restored, tmp_path / "during.tar.gz", env={})
    conn = sqlite3.connect(restored.db_file)
    try:
        assert conn.execute("PRAGMA integrity_check").fetchone() == ("ok",)
        count = conn.execute("SELECT count(*) FROM models").fetchone()[0]
    finally:
        conn.close()
    assert 20 <= count <= len(written)


def test_only_sqlite_and_postgresql_are_backed_up(leader_home: BerthHome, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="SQLite and PostgreSQL"):
        create_backup(leader_home, "mysql://berth:pw@db/berth", tmp_path / "b.tar.gz")
    assert not (tmp_path / "b.tar.gz").exists()


def test_a_home_without_a_ca_is_not_a_leader_home(tmp_path: Path) -> None:
    agent = BerthHome(tmp_path / "agent")
    agent.root.mkdir()
    agent.agent_config.write_text("node_id: n-1\n")

    with pytest.raises(ConfigError, match="an agent's home"):
        create_backup(agent, _url(agent), tmp_path / "b.tar.gz")
    with pytest.raises(ConfigError, match="not a leader's home"):
        create_backup(BerthHome(tmp_path / "empty"), _url(agent), tmp_path / "b.tar.gz")


def test_an_existing_file_is_replaced_only_with_force(
    archive: Path, leader_home: BerthHome
) -> None:
    before = archive.read_bytes()

    with pytest.raises(ConflictError, match="--force"):
        create_backup(leader_home, _url(leader_home), archive)
    assert archive.read_bytes() == before

    create_backup(leader_home, _url(leader_home), archive, force=True)
    verify_backup(archive)
    assert not [p for p in archive.parent.iterdir() if p.name.startswith(".")]  # no leftovers


# -- verify ----------------------------------------------------------------------------------


def test_a_truncated_archive_is_refused(archive: Path) -> None:
    archive.write_bytes(archive.read_bytes()[: archive.stat().st_size // 2])

    with pytest.raises(ConfigError, match="truncated or corrupt"):
        verify_backup(archive)


def test_a_damaged_file_fails_its_checksum(archive: Path, tmp_path: Path) -> None:
    members = _read_members(archive)
    members["key_pepper"] = b"x" * 32
    _write_members(archive, members)

    with pytest.raises(ConfigError, match="key_pepper does not match its checksum"):
        verify_backup(archive)
    with pytest.raises(ConfigError, match="checksum"):
        restore_backup(BerthHome(tmp_path / "new"), archive, env={})
    assert not (tmp_path / "new" / "key_pepper").exists()


@pytest.mark.parametrize(
    ("name", "reason"),
    [
        ("/etc/cron.d/evil", "absolute path"),
        ("../evil", "leaves the home"),
        ("ca/../../evil", "leaves the home"),
        ("logs/daemon.log", "unexpected member"),
    ],
)
def test_members_outside_the_home_are_refused(
    archive: Path, tmp_path: Path, name: str, reason: str
) -> None:
    members = _read_members(archive)
    members[name] = b"owned"
    _write_members(archive, members, manifest_too=True)

    with pytest.raises(ConfigError, match=reason):
        restore_backup(BerthHome(tmp_path / "new"), archive, env={})
    assert not (tmp_path / "evil").exists()
    assert not (tmp_path / "new" / "berth.db").exists()


def test_a_member_the_manifest_does_not_list_is_refused(archive: Path) -> None:
    members = _read_members(archive)
    members["adopted.yaml"] = b"[]\n"
    _write_members(archive, members)  # the manifest still lists the old set

    with pytest.raises(ConfigError, match="does not list"):
        verify_backup(archive)


def test_something_that_is_not_a_backup_is_refused(tmp_path: Path) -> None:
    plain = tmp_path / "notes.tar.gz"
    plain.write_bytes(b"just text")
    with pytest.raises(ConfigError, match="not a berth backup"):
        verify_backup(plain)
    with pytest.raises(ConfigError, match="does not exist"):
        verify_backup(tmp_path / "missing.tar.gz")


@pytest.mark.parametrize(
    ("name", "allowed"),
    [("berth.db", True), ("ca/ca.key", True), ("ca/.hidden", False), ("ca/sub/x", False),
     ("C:/x", False), ("ca\\..\\x", False), ("key_pepper", True)],
)  # fmt: skip
def test_which_member_names_a_backup_may_hold(name: str, allowed: bool) -> None:
    assert (member_refusal(name) is None) is allowed


# -- restore ---------------------------------------------------------------------------------


def test_restore_brings_back_the_same_leader_with_private_permissions(
    leader_home: BerthHome, archive: Path, tmp_path: Path
) -> None:
    home = BerthHome(tmp_path / "new")

    report = restore_backup(home, archive, env={})

    assert report.database_path == home.db_file and report.replaced_dir is None
    assert _mode(home.root) == 0o700 and _mode(home.ca_dir) == 0o700
    for name in (
        "berth.db", "key_pepper", "config.toml", "ca/ca.key", "ca/cluster.key", "ca/ca.pem",
        "ca/cluster.pem",
    ):  # fmt: skip
        assert _mode(home.root / name) == 0o600, name  # every file a restore writes
    for name in ("key_pepper", "config.toml", "ca/ca.key", "ca/ca.pem"):
        assert (home.root / name).read_bytes() == (leader_home.root / name).read_bytes(), name
    original = CertificateAuthority.load_or_create(leader_home.ca_dir).fingerprint_sha256
    assert CertificateAuthority.load_or_create(home.ca_dir).fingerprint_sha256 == original
    with Store(_url(home)) as store:
        pepper = home.pepper_file.read_bytes()
        assert store.find_api_key(hash_secret("sk-berth-secret", pepper)) is not None
        node = store.get_node_by_label("gpu-a")
        assert node.cert_fingerprint == "sha256:" + "ab" * 32
        # Until its agent redials the restored leader, it is not connected to it.
        assert node.status == "unreachable"
        assert store.get_node("local").status == "ready"
    assert not [p for p in home.root.iterdir() if p.name.startswith(".restore")]


def test_restore_refuses_to_overwrite_a_leader_without_force(
    leader_home: BerthHome, archive: Path
) -> None:
    with Store(_url(leader_home)) as store:
        store.add_model("after-the-backup", "/m.gguf")

    with pytest.raises(ConflictError, match=r"already holds a leader's state .*--force"):
        restore_backup(leader_home, archive, env={})
    with Store(_url(leader_home)) as store:
        assert [m.name for m in store.list_models()] == ["after-the-backup"]


def test_restore_with_force_moves_the_old_state_aside(
    leader_home: BerthHome, archive: Path
) -> None:
    old_key = (leader_home.ca_dir / "ca.key").read_bytes()
    shutil.rmtree(leader_home.ca_dir)  # a new CA made since the backup
    CertificateAuthority.load_or_create(leader_home.ca_dir)
    newer_key = (leader_home.ca_dir / "ca.key").read_bytes()
    (leader_home.root / "berth.db-wal").write_bytes(b"a stale write-ahead log")

    report = restore_backup(leader_home, archive, force=True, env={})

    assert (leader_home.ca_dir / "ca.key").read_bytes() == old_key
    assert report.replaced_dir is not None
    assert (report.replaced_dir / "ca" / "ca.key").read_bytes() == newer_key
    assert (report.replaced_dir / "berth.db-wal").exists()
    assert not (leader_home.root / "berth.db-wal").exists()  # it must never meet the restored db
    with Store(_url(leader_home)) as store:
        assert store.get_node_by_label("gpu-a").label == "gpu-a"
    # Again within the same second: the first replaced folder is kept, a second one made.
    again = restore_backup(leader_home, archive, force=True, env={}, now=_fixed_now)
    twice = restore_backup(leader_home, archive, force=True, env={}, now=_fixed_now)
    assert again.replaced_dir is not None and twice.replaced_dir is not None
    assert twice.replaced_dir.name == f"{again.replaced_dir.name}-2"


def _fixed_now() -> datetime:
    return datetime(2026, 11, 30, 12, 0, 0, tzinfo=UTC)


def test_restore_refuses_while_the_daemon_of_that_home_runs(archive: Path, tmp_path: Path) -> None:
    home = BerthHome(tmp_path / "running")
    home.root.mkdir()
    daemon = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)  # a daemon answering here
    daemon.bind(str(home.socket_file))
    daemon.listen(1)
    try:
        with pytest.raises(DaemonError, match=r"is running .*berth daemon stop"):
            restore_backup(home, archive, env={})
    finally:
        daemon.close()
    assert not home.db_file.exists()


def test_a_backup_from_a_newer_schema_is_refused(archive: Path, tmp_path: Path) -> None:
    members = _read_members(archive)
    manifest = json.loads(members[MANIFEST_NAME])
    manifest["schema_version"] = LATEST_VERSION + 1
    members[MANIFEST_NAME] = json.dumps(manifest).encode()
    _write_members(archive, members)

    with pytest.raises(StoreError, match="newer than this berth"):
        restore_backup(BerthHome(tmp_path / "new"), archive, env={})


def test_a_database_outside_the_home_is_restored_only_where_the_operator_says(
    leader_home: BerthHome, tmp_path: Path
) -> None:
    elsewhere = tmp_path / "data" / "state.db"
    elsewhere.parent.mkdir()
    shutil.move(leader_home.db_file, elsewhere)
    leader_home.config_file.write_text(f'[store]\ndatabase_url = "sqlite:///{elsewhere}"\n')
    create_backup(leader_home, f"sqlite:///{elsewhere}", tmp_path / "b.tar.gz")
    elsewhere.unlink()

    # The archive's config.toml alone never chooses a path outside the home.
    with pytest.raises(ConfigError, match=r"outside .*: set BERTH_DATABASE_URL"):
        restore_backup(BerthHome(tmp_path / "new"), tmp_path / "b.tar.gz", env={})
    assert not elsewhere.exists()

    report = restore_backup(
        BerthHome(tmp_path / "new"),
        tmp_path / "b.tar.gz",
        env={"BERTH_DATABASE_URL": f"sqlite:///{elsewhere}"},
    )

    assert report.database_path == elsewhere and elsewhere.is_file()
    assert not (tmp_path / "new" / "berth.db").exists()


def test_restored_modes_ignore_the_manifest(leader_home: BerthHome, tmp_path: Path) -> None:
    archive = tmp_path / "b.tar.gz"
    create_backup(leader_home, f"sqlite:///{leader_home.db_file}", archive)
    tampered = tmp_path / "t.tar.gz"
    with tarfile.open(archive) as source, tarfile.open(tampered, "w:gz") as target:
        for member in source.getmembers():
            data = source.extractfile(member)
            assert data is not None
            content = data.read()
            if member.name == "manifest.json":
                manifest = json.loads(content)
                for entry in manifest["files"]:
                    entry["mode"] = 0o4777
                content = json.dumps(manifest).encode()
                member.size = len(content)
            target.addfile(member, io.BytesIO(content))

    restore_backup(BerthHome(tmp_path / "new"), tampered, env={})

    key = tmp_path / "new" / "ca" / "ca.key"
    assert key.stat().st_mode & 0o7777 == 0o600
    assert (tmp_path / "new" / "ca" / "ca.pem").stat().st_mode & 0o7777 == 0o600


# -- the CLI ---------------------------------------------------------------------------------


def _berth(home: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "berth", "--home", str(home), *args],
        capture_output=True, text=True, timeout=120, env=clean_env({}),
    )  # fmt: skip


@pytest.mark.slow
def test_the_cli_says_what_is_wrong_in_one_line(leader_home: BerthHome, tmp_path: Path) -> None:
    made = _berth(leader_home.root, "backup", "create", str(tmp_path / "b.tar.gz"))
    assert made.returncode == 0, made.stderr
    assert "backup written" in made.stdout
    assert "It holds secrets: the CA key (ca/ca.key);" in made.stdout
    assert "the key pepper (key_pepper). Keep it as safe as the leader." in made.stdout

    again = _berth(leader_home.root, "backup", "create", str(tmp_path / "b.tar.gz"))
    assert again.returncode == 2
    assert again.stderr.strip().count("\n") == 0 and "--force" in again.stderr

    restored = _berth(leader_home.root, "backup", "restore", str(tmp_path / "b.tar.gz"))
    assert restored.returncode == 2 and "already holds a leader's state" in restored.stderr

    agent = _berth(tmp_path / "nothing", "backup", "create", str(tmp_path / "c.tar.gz"))
    assert agent.returncode == 2 and "not a leader's home" in agent.stderr

    checked = _berth(leader_home.root, "backup", "verify", str(tmp_path / "b.tar.gz"))
    assert checked.returncode == 0 and "every file matches" in checked.stdout


# -- helpers ---------------------------------------------------------------------------------


def _read_members(archive: Path) -> dict[str, bytes]:
    with tarfile.open(archive) as tar:
        return {m.name: tar.extractfile(m).read() for m in tar.getmembers()}  # type: ignore[union-attr]


def _write_members(archive: Path, members: dict[str, bytes], *, manifest_too: bool = False) -> None:
    """Rewrite ``archive`` with ``members`` (manifest first); with ``manifest_too`` the
    manifest is updated to list them, checksums and all (a well-formed but hostile backup)."""
    if manifest_too:
        manifest = json.loads(members[MANIFEST_NAME])
        manifest["files"] = [
            {"name": n, "size_bytes": len(d), "sha256": hashlib.sha256(d).hexdigest(), "mode": 384}
            for n, d in members.items()
            if n != MANIFEST_NAME
        ]
        members[MANIFEST_NAME] = json.dumps(manifest).encode()
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for name in [MANIFEST_NAME, *(n for n in members if n != MANIFEST_NAME)]:
            info = tarfile.TarInfo(name)
            info.size = len(members[name])
            tar.addfile(info, io.BytesIO(members[name]))
    archive.write_bytes(gzip.compress(buffer.getvalue()))


# -- end to end ------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_leader_restored_from_backup_gets_its_agents_back(
    cluster: Cluster, tmp_path: Path
) -> None:
    agents = [cluster.add_agent(label) for label in ("gpu-a", "gpu-b")]
    for agent in agents:
        cluster.deploy(f"tiny-{agent.label}", tmp_path / "tiny.gguf", agent)
    certificates = {a.label: a.cert.read_bytes() for a in agents}
    archive = tmp_path / "leader-backup.tar.gz"

    cluster.berth("backup", "create", str(archive))  # while the leader runs
    cluster.berth("daemon", "stop")
    shutil.rmtree(cluster.leader_home)
    restored = cluster.berth("backup", "restore", str(archive))
    assert "restored" in restored.stdout
    cluster.berth("daemon", "start", "--public-port", str(cluster.public_port),
                  "--cluster-port", str(cluster.cluster_port))  # fmt: skip

    for agent in agents:
        # The agents redial with backoff (capped at 30 s) and are accepted as they are.
        cluster.wait_node(agent.node_id, "ready", timeout_s=60)
    with cluster.openai() as client:  # the key made before the backup still works
        for agent in agents:
            answer = _chat_once_routed(client, f"tiny-{agent.label}")
            assert answer == ANSWER
            # ... relayed by the leader to that agent (the 503s before it name no node).
            assert served_by_node(cluster, f"tiny-{agent.label}")[agent.node_id] == 1
    # Nobody re-enrolled: the agents still hold the certificates they had.
    assert {a.label: a.cert.read_bytes() for a in agents} == certificates


def _chat_once_routed(client: openai.OpenAI, model: str, timeout_s: float = 30) -> str | None:
    """One chat completion, once the leader routes ``model`` again: between an agent's Hello
    and the end of its reconciliation the leader answers 503 (with Retry-After)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            answer = client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": "hi"}]
            )
        except openai.InternalServerError as exc:
            if exc.status_code != 503 or time.monotonic() > deadline:
                raise
            time.sleep(0.2)
            continue
        return answer.choices[0].message.content


def test_a_restore_into_a_database_the_home_does_not_name_is_pointed_out() -> None:
    # Restored with BERTH_DATABASE_URL into another database, while config.toml still names
    # the source: a start without the variable would open the source, not the restore.
    restored = "postgresql+psycopg://berth:***@db.lan:5432/berth2"
    source = "postgresql+psycopg://berth:secret@db.lan:5432/berth"

    note = database_elsewhere_note(restored, source)

    assert note is not None and "secret" not in note
    assert "postgresql+psycopg://berth:***@db.lan:5432/berth," in note
    assert "keep BERTH_DATABASE_URL set" in note
    assert database_elsewhere_note(restored, source + "2") is None
    assert database_elsewhere_note(None, "sqlite:////srv/berth/berth.db") is None  # SQLite
