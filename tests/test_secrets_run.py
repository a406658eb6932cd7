"""Secrets stay secret through a whole run (issue 37): every log, error and ``config show``
of leaders on a real PostgreSQL whose URL holds a password, with a ``cluster_secret`` of 15
characters (refused everywhere it is read) and then a valid one, is searched for the
password and both secrets: no hit.

What is collected: the output (stdout and stderr) of every command run, refusals included
(``config show`` and ``--json``, ``doctor`` and ``--json``, ``daemon start``, ``backup
create``/``verify``/``restore``, ``leader status``, ``status``, ``key create``,
``daemon install-service --dry-run``), ``/admin/config``, and every file under each home's
``logs/`` (the daemon logs, the audit log). The archive itself is not searched: it carries
``config.toml``, and says so (``tests/test_backup.py``).
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import make_url

from support.cluster_harness import Cluster, clean_env, cli
from support.postgres import PostgresServer

pytestmark = [pytest.mark.slow, pytest.mark.needs("postgresql")]

#: The role the leaders log in as, with a password (the test server trusts every login:
#: the password is only carried, which is what must not leak).
ROLE = "berth_leaders"


@pytest.fixture
def database(postgres_server: PostgresServer) -> Iterator[tuple[str, str]]:
    """A fresh database owned by a role with a password; its URL (password in it) and the
    password."""
    password = "pw" + secrets.token_hex(10)
    url = postgres_server.create_database()
    name = make_url(url).database
    with postgres_server._admin() as conn:  # the server's own superuser, for the role
        conn.execute(f'DROP ROLE IF EXISTS "{ROLE}"')
        conn.execute(f"CREATE ROLE \"{ROLE}\" LOGIN SUPERUSER PASSWORD '{password}'")
        conn.execute(f'ALTER DATABASE "{name}" OWNER TO "{ROLE}"')
    with_password = make_url(url).set(username=ROLE, password=password)
    try:
        yield with_password.render_as_string(hide_password=False), password
    finally:
        postgres_server.drop_database(url)
        with postgres_server._admin() as conn:
            conn.execute(f'DROP ROLE IF EXISTS "{ROLE}"')


def test_no_log_error_or_config_show_holds_a_secret(
    database: tuple[str, str], tmp_path: Path
) -> None:
    url, password = database
    short_secret = secrets.token_urlsafe(16)[:15]  # one short of the 16 required
    good_secret = secrets.token_urlsafe(24)
    other_secret = secrets.token_urlsafe(24)  # a second cluster's
    searched = [password, short_secret, good_secret, other_secret]
    outputs: list[str] = []

    def run(home: Path, *args: str, env: dict[str, str], ok: bool | None = None) -> str:
        result = cli(home, *args, env=env, check=False, timeout_s=180)
        said = result.stdout + result.stderr
        outputs.append(f"$ berth {' '.join(args)} (exit {result.returncode})\n{said}")
        if ok is not None:
            assert (result.returncode == 0) is ok, outputs[-1]
        return said

    # 1. A cluster_secret of 15 characters: in config.toml, then in the environment.
    a_home = tmp_path / "a" / "leader"
    a_home.mkdir(parents=True)
    config = a_home / "config.toml"

    def write_config(secret: str | None) -> None:
        line = "" if secret is None else f'cluster_secret = "{secret}"\n'
        config.write_text(f'[store]\ndatabase_url = "{url}"\nleader_ha = true\n{line}'
                          "[server]\nleader_only = true\n")  # fmt: skip

    write_config(short_secret)
    assert password in config.read_text()  # the run really carries it
    bare = clean_env({"BERTH_LEADER_LEASE_S": "2.0"})
    for env in (bare, {**bare, "BERTH_CLUSTER_SECRET": short_secret}):
        if "BERTH_CLUSTER_SECRET" in env:
            config.write_text(
                config.read_text().replace(f'cluster_secret = "{short_secret}"\n', "")
            )
        for args in (
            ("config", "show"),
            ("config", "show", "--json"),
            ("daemon", "start"),
            ("backup", "create", str(tmp_path / "refused.tar.gz")),
        ):
            said = run(a_home, *args, env=env, ok=False)
            assert "cluster_secret" in said and "at least 16 characters" in said, said
        doctor = run(a_home, "doctor", "--json", env=env)
        assert "at least 16 characters" in doctor

    # 2. A valid secret (A's in config.toml, B's in its environment): the two leaders
    # share the CA through the database; B starts with an empty home.
    write_config(good_secret)
    env_a = bare
    env_b = {**bare, "BERTH_DATABASE_URL": url, "BERTH_CLUSTER_SECRET": good_secret,
             "BERTH_LEADER_HA": "true", "BERTH_LEADER_ONLY": "true"}  # fmt: skip
    a = Cluster(tmp_path / "a", env_a)
    b = Cluster(tmp_path / "b", env_b)
    started: list[Cluster] = []
    try:
        for leader in (a, b):
            leader.start()
            started.append(leader)
        for leader in (a, b):
            home = leader.leader_home
            for args in (
                ("config", "show"),
                ("config", "show", "--json"),
                ("doctor",),
                ("doctor", "--json"),
                ("leader", "status"),
                ("status",),
                ("daemon", "install-service", "--dry-run"),
            ):
                run(home, *args, env=leader.env)
            outputs.append(json.dumps(leader.admin("GET", "/admin/config")))
        archive = tmp_path / "backup.tar.gz"
        made = run(a.leader_home, "backup", "create", str(archive), env=env_a, ok=True)
        assert "the database password (config.toml [store] database_url)" in made
        run(a.leader_home, "backup", "verify", str(archive), env=env_a, ok=True)
        # A restore aimed at the live database: refused, naming it (password masked).
        refused = run(tmp_path / "restored", "backup", "restore", str(archive), "--force",
                      env=env_a, ok=False)  # fmt: skip
        assert "is in use by a live cluster" in refused and f"{ROLE}:***@" in refused
        # A third leader with another cluster's secret: refused at start.
        c = Cluster(tmp_path / "c", {**env_b, "BERTH_CLUSTER_SECRET": other_secret})
        c.leader_home.mkdir(parents=True)
        wrong = run(c.leader_home, "daemon", "start", "--public-port", str(c.public_port),
                    "--cluster-port", str(c.cluster_port), env=c.env, ok=False)  # fmt: skip
        assert "cluster_secret does not open" in wrong
        run(a.leader_home, "leader", "step-down", env=env_a, ok=True)  # b takes over
    finally:
        for leader in started:
            leader.berth("daemon", "stop", check=False)

    logs = [
        f"--- {path}\n{path.read_text(errors='replace')}"
        for root in (tmp_path / "a", tmp_path / "b", tmp_path / "c")
        for path in sorted(root.rglob("logs/*"))
        if path.is_file()
    ]
    assert any("berth leader ready" in text for text in logs)  # the daemons' logs are read
    everything = "\n".join(outputs + logs)
    print(f"searched {len(outputs)} outputs and {len(logs)} log files, {len(everything)} chars")
    hits = {s: everything.count(s) for s in searched}
    assert hits == dict.fromkeys(searched, 0), [
        line for line in everything.splitlines() if any(s in line for s in searched)
    ]
