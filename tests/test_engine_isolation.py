"""Engines only berth can reach, and whole process trees stopped, through a real leader and a
real agent (each its own process and home, real TLS), with the fake llama-server, which
checks its key as llama-server does and can start a helper whose child calls ``setsid``.

- an engine asked without its key answers 401 (completions, ``/props``, ``/slots``), through
  berth it answers, and it sees its own key, never the client's berth key;
- the key is in no answer of ``berth ps --json`` or the admin API, in no log, on no command
  line, and a remote engine's key never reaches the leader's home at all;
- adopted servers are told their key;
- a ``setsid`` grandchild is gone after ``berth stop`` (local and remote) and after the
  leader, restarted, reconciles an engine no active deployment owns.
"""

from __future__ import annotations

import json
import os
import re
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from berth.runtime.engines import find_free_port
from support.cluster_harness import FAKE_ENGINE, Agent, Cluster, clean_env, cli, fake_engine_wrapper
from support.fake_llama_server import AUTH_SEEN
from support.processes import alive, wait_gone

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


@pytest.fixture(scope="module")
def isolated_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    root = tmp_path_factory.mktemp("isolation")
    (root / "tiny.gguf").write_bytes(b"GGUF" + bytes(60))
    env = clean_env(
        {"BERTH_LLAMA_SERVER_BIN": str(fake_engine_wrapper(root)), "BERTH_STOP_GRACE_S": "5"}
    )
    isolated_cluster = Cluster(root, env)
    isolated_cluster.start()
    try:
        isolated_cluster.add_agent("gpu-a")
        yield isolated_cluster
    finally:
        isolated_cluster.close()


def _deploy(
    isolated_cluster: Cluster, model: str, agent: Agent | None, pidfile: Path
) -> dict[str, object]:
    deployment_id = isolated_cluster.deploy(
        model,
        isolated_cluster.root / "tiny.gguf",
        agent,
        "-x",
        "--x-setsid-grandchild",
        "-x",
        str(pidfile),
    )
    return isolated_cluster.deployment(deployment_id)


def _grandchild(pidfile: Path) -> int:
    deadline = time.monotonic() + 10
    while not pidfile.exists():
        assert time.monotonic() < deadline, "the grandchild never wrote its pid"
        time.sleep(0.02)
    pid = int(pidfile.read_text())
    assert alive(pid)
    return pid


def _journal_key(journal: Path, deployment_id: str) -> str:
    assert stat.S_IMODE(journal.stat().st_mode) == 0o600
    key = json.loads(journal.read_text())[deployment_id]["api_key"]
    assert isinstance(key, str) and key
    return key


def _files_holding(root: Path, needle: str, *, skip: tuple[Path, ...] = ()) -> list[Path]:
    found = []
    for path in root.rglob("*"):
        wanted = path.is_file() and not path.is_socket() and path not in skip
        if wanted and needle.encode() in path.read_bytes():
            found.append(path)
    return found


def _engine_refuses_without_its_key(port: int, model: str) -> None:
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", trust_env=False) as engine:
        assert engine.get("/health").status_code == 200
        for path in ("/props", "/slots", "/v1/models"):
            assert engine.get(path).status_code == 401, path
        refused = engine.post("/v1/chat/completions", json={"model": model, **CHAT})
        assert refused.status_code == 401
        assert refused.json()["error"]["type"] == "authentication_error"
        as_client = engine.post(
            "/v1/chat/completions",
            json={"model": model, **CHAT},
            headers={"Authorization": "Bearer sk-berth-not-the-engines-key"},
        )
        assert as_client.status_code == 401


@pytest.mark.parametrize("where", ["local", "remote"])
def test_an_engine_answers_berth_only_and_its_tree_goes_with_berth_stop(
    isolated_cluster: Cluster, where: str
) -> None:
    agent = isolated_cluster.agents["gpu-a"] if where == "remote" else None
    pidfile = isolated_cluster.root / f"grandchild-{where}.pid"
    model = f"tiny-{where}"
    record = _deploy(isolated_cluster, model, agent, pidfile)
    deployment_id, port, pid = str(record["id"]), int(record["port"]), int(record["pid"])
    grandchild = _grandchild(pidfile)
    home = agent.home if agent else isolated_cluster.leader_home
    journal = home / ("agent-engines.json" if agent else "local-engines.json")
    key = _journal_key(journal, deployment_id)

    _engine_refuses_without_its_key(port, model)
    with isolated_cluster.http() as http:
        answered = http.post("/v1/chat/completions", json={"model": model, **CHAT})
        assert answered.status_code == 200, answered.text
        admin = json.dumps(
            [
                http.get("/admin/deployments").json(),
                http.get(f"/admin/deployments/{deployment_id}").json(),
            ]
        )
    engine_log = (home / "logs" / f"engine-{deployment_id}.log").read_text()
    assert f"{AUTH_SEEN} <the engine's key>" in engine_log
    assert isolated_cluster.api_key not in engine_log  # the client's berth key never reached it
    ps = isolated_cluster.berth("ps", "--all", "--json").stdout
    assert key not in ps and key not in admin
    assert key.encode() not in Path(f"/proc/{pid}/cmdline").read_bytes()
    assert _files_holding(home, key, skip=(journal,)) == []  # no log, no key file left
    if agent is not None:  # made on the agent, used there: it never reached the leader
        assert _files_holding(isolated_cluster.leader_home, key) == []

    isolated_cluster.berth("stop", deployment_id)

    assert wait_gone(pid, 15)
    assert wait_gone(grandchild, 15), "the setsid grandchild outlived berth stop"
    assert deployment_id not in json.loads(journal.read_text())


def test_an_adopted_server_is_told_its_key(isolated_cluster: Cluster) -> None:
    port = find_free_port()
    log = isolated_cluster.root / "outside.log"
    env = {**os.environ, "LLAMA_API_KEY": "sk-outside-key-1"}
    with log.open("ab") as out:
        outside = subprocess.Popen(
            [sys.executable, str(FAKE_ENGINE), "-m", "x.gguf", "--port", str(port),
             "--alias", "outside-model"],
            stdout=out, stderr=subprocess.STDOUT, env=env,
        )  # fmt: skip
    try:
        key_file = isolated_cluster.root / "outside.key"
        key_file.write_text("sk-outside-key-1\n")
        _wait_health(port)
        adopt = ("agent", "adopt", "--port", str(port), "--model", "outside-model")
        refused = cli(isolated_cluster.leader_home, *adopt, env=isolated_cluster.env, check=False)
        assert refused.returncode != 0 and "401" in refused.stderr

        cli(
            isolated_cluster.leader_home,
            *adopt,
            "--api-key-file",
            str(key_file),
            env=isolated_cluster.env,
        )

        kept = isolated_cluster.leader_home / "adopted-keys" / "outside-model.key"
        assert stat.S_IMODE(kept.stat().st_mode) == 0o600
        assert "sk-outside-key-1" not in (isolated_cluster.leader_home / "adopted.yaml").read_text()
        deadline = time.monotonic() + 30
        with isolated_cluster.http() as http:
            while True:
                answered = http.post(
                    "/v1/chat/completions", json={"model": "outside-model", **CHAT}
                )
                if answered.status_code == 200 or time.monotonic() > deadline:
                    break
                time.sleep(0.25)
        assert answered.status_code == 200, answered.text
        assert f"{AUTH_SEEN} <the engine's key>" in log.read_text()
        cli(
            isolated_cluster.leader_home,
            "agent",
            "unadopt",
            "outside-model",
            env=isolated_cluster.env,
        )
        assert not kept.exists()
    finally:
        outside.terminate()
        outside.wait()


def test_a_restarted_leader_stops_an_orphan_and_its_whole_tree(isolated_cluster: Cluster) -> None:
    pidfile = isolated_cluster.root / "grandchild-orphan.pid"
    record = _deploy(isolated_cluster, "tiny-orphan", None, pidfile)
    deployment_id, pid = str(record["id"]), int(record["pid"])
    grandchild = _grandchild(pidfile)
    leader = isolated_cluster.leader_pid()
    os.kill(leader, signal.SIGKILL)  # a crash: the engine runs on
    assert wait_gone(leader, 30)
    assert alive(pid) and alive(grandchild)
    # While the leader was down, the deployment was given up: its engine is now an orphan.
    _mark_failed(isolated_cluster.leader_home, deployment_id)

    isolated_cluster.berth("daemon", "start", "--public-port", str(isolated_cluster.public_port),
                  "--cluster-port", str(isolated_cluster.cluster_port))  # fmt: skip

    assert wait_gone(pid, 30), "the orphaned engine was not stopped"
    assert wait_gone(grandchild, 15), "the orphan's setsid grandchild survived reconcile"
    daemon_log = (isolated_cluster.leader_home / "logs" / "daemon.log").read_text()
    assert re.search(rf"runs engine {deployment_id} .* no active deployment owns", daemon_log)


def _mark_failed(home: Path, deployment_id: str) -> None:
    script = (
        "import sys\n"
        "from berth.store import Store\n"
        "from berth.vocab.states import DeploymentState\n"
        "store = Store(sys.argv[1])\n"
        "store.transition_deployment(sys.argv[2], DeploymentState.FAILED,"
        " failure_reason='given up while the leader was down')\n"
        "store.close()\n"
    )
    url = f"sqlite:///{home / 'berth.db'}"
    subprocess.run([sys.executable, "-c", script, url, deployment_id], check=True)


def _wait_health(port: int) -> None:
    deadline = time.monotonic() + 10
    with httpx.Client(trust_env=False) as client:
        while True:
            try:
                if client.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                    return
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "the outside server never answered"
            time.sleep(0.05)
