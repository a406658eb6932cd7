"""Two real leader daemons on one database with ``leader_ha`` (docs/ha.md), PostgreSQL and one
SQLite file (two leaders on one host): one is
active, the other a standby whose ``/readyz`` and ``/v1`` answer 503 naming the active; when
the active is killed with SIGKILL the standby takes the lease over (a new epoch) and serves;
an active stopped past its lease steps down to standby when resumed (and leads again once
the lease is free); ``berth leader step-down`` hands
over while a client that retries on 503 gets nothing else.

The two homes share the CA and the key pepper, as leaders that share agents and keys must:
on PostgreSQL through the database, sealed under ``cluster_secret`` (the second home starts
empty), on SQLite copied by hand.
The kill-to-served time is printed, not asserted (a speed target belongs in a benchmark).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from berth.cluster.pki.ca import CertificateAuthority
from berth.keys import load_or_create_pepper
from support.cluster_harness import Cluster, clean_env
from support.postgres import PostgresServer
from support.processes import alive, wait_gone
from support.waiting import wait_for

pytestmark = pytest.mark.slow

#: A short lease, so the takeover after the kill comes within seconds, long enough that a
#: loaded machine does not let it lapse while the test looks.
LEASE_S = "2.0"
TAKEOVER_BOUND_S = 60.0
#: The PostgreSQL pair's ``cluster_secret`` (the CA and pepper shared through the database).
CLUSTER_SECRET = "test-cluster-secret-0123456789"


@pytest.fixture(params=["sqlite", "postgresql"])
def ha_pair(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[tuple[Cluster, Cluster]]:
    """Leaders ``a`` (started first: active) and ``b`` (standby) on one database."""
    server: PostgresServer | None = None
    if request.param == "postgresql":
        server = request.getfixturevalue("postgres_server")
        url = server.create_database()
    else:
        url = f"sqlite:///{tmp_path / 'shared' / 'berth.db'}"
    env = clean_env(
        {
            "BERTH_DATABASE_URL": url,
            "BERTH_LEADER_HA": "true",
            "BERTH_LEADER_LEASE_S": LEASE_S,
            "BERTH_LEADER_ONLY": "true",
        }
    )
    if server is not None:
        # On PostgreSQL the CA and pepper go through the database, sealed under the secret:
        # b's home starts empty and gets a's at its start.
        env["BERTH_CLUSTER_SECRET"] = CLUSTER_SECRET
    a, b = Cluster(tmp_path / "a", env), Cluster(tmp_path / "b", env)
    if server is None:
        # On SQLite they are copied by hand (the other way docs/ha.md gives).
        CertificateAuthority.load_or_create(a.leader_home / "ca")
        load_or_create_pepper(a.leader_home / "key_pepper")
        b.leader_home.mkdir(parents=True)
        shutil.copytree(a.leader_home / "ca", b.leader_home / "ca")
        shutil.copy2(a.leader_home / "key_pepper", b.leader_home / "key_pepper")
    started: list[Cluster] = []
    try:
        for leader in (a, b):
            leader.start()
            started.append(leader)
        if server is not None:
            shared = CertificateAuthority.load_or_create(a.leader_home / "ca")
            assert CertificateAuthority.load_or_create(b.leader_home / "ca").fingerprint_sha256 == (
                shared.fingerprint_sha256
            )
            assert (b.leader_home / "key_pepper").read_bytes() == (
                a.leader_home / "key_pepper"
            ).read_bytes()
        yield a, b
    finally:
        for leader in started:
            leader.berth("daemon", "stop", check=False)
        if server is not None:
            server.drop_database(url)


def _get(leader: Cluster, path: str, *, key: str = "") -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    with httpx.Client(base_url=leader.base_url, verify=leader.tls(), timeout=30.0) as http:
        return http.get(path, headers=headers)


def test_the_standby_answers_503_and_takes_over_when_the_active_is_killed(
    ha_pair: tuple[Cluster, Cluster],
) -> None:
    a, b = ha_pair
    assert _get(a, "/readyz").status_code == 200
    active = a.admin("GET", "/admin/leader")
    assert (active["role"], active["epoch"], active["ha"]) == ("active", 1, True)
    assert active["active_address"] == a.base_url

    standby = b.admin("GET", "/admin/leader")
    assert (standby["role"], standby["active_address"]) == ("standby", a.base_url)
    ready = _get(b, "/readyz")
    assert (ready.status_code, ready.json()) == (503, {"status": "standby"})
    refused = _get(b, "/v1/models", key=a.api_key)
    assert refused.status_code == 503 and int(refused.headers["retry-after"]) >= 1
    assert a.base_url in refused.json()["error"]["message"]
    assert refused.json()["error"]["code"] == "standby_leader"
    # The key made on a works on a, and (one pepper, one database) on b once it leads.
    assert _get(a, "/v1/models", key=b.api_key).status_code == 200

    pid = a.leader_pid()
    killed_at = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    assert wait_gone(pid, 10.0)
    wait_for(lambda: _get(b, "/readyz").status_code == 200, TAKEOVER_BOUND_S,
             "the standby to take the lease over")  # fmt: skip
    served = _get(b, "/v1/models", key=a.api_key)
    print(f"kill -9 of the active to the new active's first answer: "
          f"{time.monotonic() - killed_at:.2f} s (lease {LEASE_S} s)")  # fmt: skip
    assert served.status_code == 200, served.text
    now = b.admin("GET", "/admin/leader")
    assert (now["role"], now["epoch"], now["active_address"]) == ("active", 2, b.base_url)


def test_a_stopped_active_that_resumes_after_a_takeover_stands_by(
    ha_pair: tuple[Cluster, Cluster],
) -> None:
    a, b = ha_pair
    pid = a.leader_pid()
    os.kill(pid, signal.SIGSTOP)  # past its lease: b takes over
    try:
        wait_for(lambda: _get(b, "/readyz").status_code == 200, TAKEOVER_BOUND_S,
                 "the standby to take the lease over")  # fmt: skip
    finally:
        os.kill(pid, signal.SIGCONT)
    # a finds its lease gone at its next look, steps down, and stays on as a standby.
    log_file = a.leader_home / "logs" / "daemon.log"
    wait_for(lambda: "standing by: the leader-only loops stopped" in log_file.read_text(),
             TAKEOVER_BOUND_S, "the old active to step down")  # fmt: skip
    assert alive(pid), "the old active exited rather than standing by"
    log = log_file.read_text()
    assert "lost the lease" in log and "stepping down to standby" in log
    print("old active's log:", *[line for line in log.splitlines()
          if "leadership:" in line or "standing by" in line][-5:], sep="\n  ")  # fmt: skip
    role = a.admin("GET", "/admin/leader")
    assert (role["role"], role["epoch"], role["active_address"]) == ("standby", 2, b.base_url)
    status = a.berth("leader", "status").stdout
    print(f"old active after SIGCONT: /admin/leader {role}; berth leader status: {status!r}")
    assert "standby" in status
    ready = _get(a, "/readyz")
    assert (ready.status_code, ready.json()) == (503, {"status": "standby"})
    refused = _get(a, "/v1/models", key=a.api_key)
    assert refused.status_code == 503 and b.base_url in refused.json()["error"]["message"]
    now = b.admin("GET", "/admin/leader")
    assert (now["role"], now["epoch"]) == ("active", 2)

    # b stops (handing the lease back): a, standing by, takes it and leads again.
    b.berth("daemon", "stop")
    wait_for(lambda: _get(a, "/readyz").status_code == 200, TAKEOVER_BOUND_S,
             "the old active to lead again")  # fmt: skip
    again = a.admin("GET", "/admin/leader")
    assert (again["role"], again["epoch"]) == ("active", 3)
    assert _get(a, "/v1/models", key=a.api_key).status_code == 200


def test_a_step_down_hands_over_while_a_client_that_retries_on_503_never_fails(
    ha_pair: tuple[Cluster, Cluster],
) -> None:
    a, b = ha_pair
    pid = a.leader_pid()
    refused = b.berth("leader", "step-down", check=False)  # a standby has nothing to hand over
    assert refused.returncode != 0 and "standby" in refused.stderr + refused.stdout

    failures: list[str] = []
    answered = 0
    stepped_at = time.monotonic()
    a.berth("leader", "step-down")
    # A client behind a load balancer: either leader, retrying on 503 or a refused
    # connection, until b answers; nothing else may come back.
    while time.monotonic() - stepped_at < TAKEOVER_BOUND_S:
        for leader in (a, b):
            try:
                reply = _get(leader, "/v1/models", key=a.api_key)
            except httpx.TransportError:
                continue  # a has closed its listener
            if reply.status_code == 200:
                answered += 1
            elif reply.status_code != 503:
                failures.append(f"{leader.leader_home.name}: {reply.status_code} {reply.text}")
        if b.admin("GET", "/admin/leader")["role"] == "active" and not alive(pid):
            break
        time.sleep(0.05)
    assert failures == []
    assert wait_gone(pid, TAKEOVER_BOUND_S), "the old active did not exit"
    print(f"step-down to the new active: {time.monotonic() - stepped_at:.2f} s, "
          f"{answered} answers meanwhile")  # fmt: skip
    assert _get(b, "/v1/models", key=a.api_key).status_code == 200
    assert b.admin("GET", "/admin/leader")["epoch"] == 2
    assert "active, epoch 2" in b.berth("leader", "status").stdout


def test_a_standby_stops_cleanly_and_leaves_the_active_alone(
    ha_pair: tuple[Cluster, Cluster],
) -> None:
    a, b = ha_pair
    pid = b.leader_pid()
    b.berth("daemon", "stop")
    assert wait_gone(pid, TAKEOVER_BOUND_S)
    assert "lost the lease" not in (b.leader_home / "logs" / "daemon.log").read_text()
    now = a.admin("GET", "/admin/leader")
    assert (now["role"], now["epoch"]) == ("active", 1)
    assert _get(a, "/v1/models", key=a.api_key).status_code == 200


def _store_line(leader: Cluster) -> dict[str, str]:
    """``berth doctor --json``'s store line."""
    result = leader.berth("doctor", "--leader-only", "--json", check=False)
    lines: list[dict[str, str]] = json.loads(result.stdout)
    return next(line for line in lines if line["name"] == "store")


def test_a_step_down_with_no_standby_is_refused_naming_what_was_checked(tmp_path: Path) -> None:
    """A lone leader with ``leader_ha``: ``step-down`` would leave no active leader, so it is
    refused (issue 37: it said "a standby takes over" and left none); ``--force`` does it,
    and then ``berth doctor`` fails on the lease (it said ok)."""
    url = f"sqlite:///{tmp_path / 'shared' / 'berth.db'}"
    env = clean_env({"BERTH_DATABASE_URL": url, "BERTH_LEADER_HA": "true",
                     "BERTH_LEADER_LEASE_S": LEASE_S, "BERTH_LEADER_ONLY": "true"})  # fmt: skip
    lone = Cluster(tmp_path / "lone", env)
    lone.start()
    try:
        pid = lone.leader_pid()
        refused = lone.berth("leader", "step-down", check=False)
        print("step-down with no standby:", refused.stderr.strip())
        assert refused.returncode == 2
        assert (
            f"refused: no other leader was seen within the lease ({float(LEASE_S):g} s) in "
            f"leader_members of {url} (no other leader at all)"
        ) in refused.stderr
        assert "--force" in refused.stderr
        assert alive(pid) and lone.admin("GET", "/admin/leader")["role"] == "active"
        assert _store_line(lone)["verdict"] == "ok"

        forced = lone.berth("leader", "step-down", "--force")
        assert "no other leader was seen (--force)" in forced.stdout
        assert wait_gone(pid, TAKEOVER_BOUND_S), "the leader did not exit"
        store = _store_line(lone)
        print("berth doctor after it:", store)
        assert store["verdict"] == "fail"
        assert "no leader holds the lease" in store["detail"]
    finally:
        lone.berth("daemon", "stop", check=False)


def test_where_things_stand_is_said_on_a_standby_and_with_a_leader_stopped(
    ha_pair: tuple[Cluster, Cluster],
) -> None:
    """Issue 41's messages: a control command on the standby names the controller (it said
    "node gpu-a is not connected"); ``daemon start`` says controller or standby member and
    the database; ``status`` and ``leader status`` with the local leader stopped name the
    controller from the lease row."""
    a, b = ha_pair
    ran = b.berth("run", "tiny", "--engine", "llamacpp", check=False)
    print("berth run on the standby:", ran.stderr.strip())
    assert ran.returncode == 2
    assert "standby member, not the controller" in ran.stderr
    assert f"control commands go to the controller at {a.base_url} (epoch 1)" in ran.stderr
    assert len(ran.stderr.strip().splitlines()) == 1
    with httpx.Client(transport=httpx.HTTPTransport(uds=str(b.leader_home / "berth.sock")),
                      base_url="http://berth", timeout=30.0) as api:  # fmt: skip
        refused = api.post("/admin/deployments", json={"model": "tiny"})
    assert refused.status_code == 409, refused.text
    assert refused.json()["error"]["code"] == "not_controller"
    assert a.base_url in refused.json()["error"]["message"]
    assert b.admin("GET", "/admin/deployments") == []  # reads are every leader's

    assert "standby member" in b.berth("leader", "status").stdout
    b.berth("daemon", "stop")
    database = b.env["BERTH_DATABASE_URL"]
    for command in (("status",), ("leader", "status")):
        stopped = b.berth(*command, check=False)
        print(f"berth {' '.join(command)} with b stopped:", stopped.stdout.strip(),
              stopped.stderr.strip(), sep="\n")  # fmt: skip
        assert stopped.returncode != 0 and "not running" in stopped.stderr
        assert f"this leader is not running; controller {a.base_url} (epoch 1" in stopped.stdout

    started = b.berth("daemon", "start", "--public-port", str(b.public_port),
                      "--cluster-port", str(b.cluster_port))  # fmt: skip
    print("berth daemon start of a standby:", started.stdout)
    assert f"standby member: serves once it takes the lease; the controller is {a.base_url}" in (
        started.stdout
    )
    assert f"database        {database}" in started.stdout  # no password here to mask
