"""A real cluster on loopback for tests: a leader daemon and agents, each its own process and
``BERTH_HOME``, driven through the real ``berth`` CLI.

``Cluster.add_agent(label)`` enrolls a node (``berth nodes enroll``), registers it
(``berth agent register --uri``) and starts ``berth agent start --verbose`` (with settings of
its own when given, e.g. ``BERTH_SIMULATED_GPUS``); everything is stopped by
:meth:`Cluster.close`.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import ssl
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai
from prometheus_client.parser import text_string_to_metric_families

from berth.runtime.engines import find_free_port
from support import fake_llama_server
from support.processes import wait_gone
from support.test_policy import policy_env
from support.waiting import wait_for

URI_PATTERN = re.compile(r"berth://enroll\?\S+")
FAKE_ENGINE = fake_llama_server.SCRIPT
#: What the fake engine is given as a model: it only checks the file exists.
TINY_GGUF_BYTES = b"GGUF" + bytes(60)


def fake_engine_wrapper(root: Path) -> Path:
    """An executable ``root/bin/llama-server`` that runs the fake engine with this Python
    (point ``BERTH_LLAMA_SERVER_BIN`` at it)."""
    wrapper = root / "bin" / "llama-server"
    wrapper.parent.mkdir(parents=True, exist_ok=True)
    wrapper.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{FAKE_ENGINE}" "$@"\n')
    wrapper.chmod(0o755)
    return wrapper


def served_by_node(cluster: Cluster, model: str) -> Counter[str]:
    """Requests for ``model`` the leader relayed, per node id (``berth_proxy_requests_total``)."""
    with cluster.http() as http:
        text = http.get("/metrics").text
    counts: Counter[str] = Counter()
    for family in text_string_to_metric_families(text):
        if family.name == "berth_proxy_requests":
            for sample in family.samples:
                if sample.name.endswith("_total") and sample.labels.get("model") == model:
                    counts[sample.labels["node"]] += int(sample.value)
    return counts


def clean_env(extra: Mapping[str, str]) -> dict[str, str]:
    """This process's environment without berth's settings, plus the suite's agent policy
    (``support/test_policy.py``) and ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("BERTH_", "HF_"))}
    env["COLUMNS"] = "160"
    env["BERTH_DRAIN_S"] = "0"  # leaders close at once when stopped, unless a test drains
    env.update(policy_env())
    env.update(extra)
    return env


def cli(
    home: Path, *args: str, env: Mapping[str, str], check: bool = True, timeout_s: float = 120
) -> subprocess.CompletedProcess[str]:
    """Run ``berth --home HOME ARGS`` and return the finished process."""
    result = subprocess.run(
        [sys.executable, "-m", "berth", "--home", str(home), *args],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        env=dict(env),
        cwd=home.parent,
    )
    if check and result.returncode != 0:
        raise AssertionError(
            f"berth {' '.join(args)} exited {result.returncode}\n"
            f"stdout: {result.stdout}\nstderr: {result.stderr}"
        )
    return result


@dataclass
class Agent:
    label: str
    home: Path
    node_id: str
    process: subprocess.Popen[bytes] | None = None
    #: settings of this agent's own (``BERTH_*``), over the cluster's environment
    env: dict[str, str] = field(default_factory=dict)

    @property
    def cert(self) -> Path:
        return self.home / "agent.crt"

    @property
    def key(self) -> Path:
        return self.home / "agent.key"

    def status(self, env: Mapping[str, str]) -> dict[str, Any]:
        result = cli(self.home, "agent", "status", "--json", env=env, check=False)
        data: dict[str, Any] = json.loads(result.stdout)
        return data


@dataclass
class Cluster:
    """One leader and its agents; ``env`` is every process's environment."""

    root: Path
    env: dict[str, str]
    public_port: int = field(default_factory=find_free_port)
    cluster_port: int = field(default_factory=find_free_port)
    agents: dict[str, Agent] = field(default_factory=dict)
    api_key: str = ""

    @property
    def leader_home(self) -> Path:
        return self.root / "leader"

    def berth(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return cli(self.leader_home, *args, env=self.env, check=check)

    def start(self) -> None:
        self.leader_home.mkdir(parents=True, exist_ok=True)
        try:
            self.berth("daemon", "start", "--public-port", str(self.public_port),
                       "--cluster-port", str(self.cluster_port))  # fmt: skip
        except AssertionError:
            self.berth("daemon", "stop", check=False)  # it may have come up after all
            raise
        created = self.berth("key", "create", "tests")
        found = re.search(r"sk-berth-\S+", created.stdout)
        assert found, created.stdout
        self.api_key = found.group(0)

    def close(self) -> None:
        """Stop every deployment, every agent and the leader; kill engines left behind.

        Agents leave their engines running when stopped (a restarted agent takes them back),
        so deployments are stopped through the leader first.
        """
        try:
            for record in self.admin("GET", "/admin/deployments"):
                if record["state"] not in ("stopped", "failed"):
                    self.berth("stop", record["id"], check=False)
        except (httpx.HTTPError, OSError):
            pass  # the leader is gone; the journals below still name the engines
        for agent in self.agents.values():
            self.stop_agent(agent)
            journal = agent.home / "agent-engines.json"
            if journal.exists():
                for entry in json.loads(journal.read_text() or "{}").values():
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(int(entry["pid"]), signal.SIGKILL)
        self.berth("daemon", "stop", check=False)
        # Each home's engine warden exits within a second of its owner once nothing of its
        # journal runs (berth.agent.warden); wait for that, so nothing is left behind.
        homes = [self.leader_home, *(agent.home for agent in self.agents.values())]
        with contextlib.suppress(AssertionError):
            wait_for(lambda: not any(any(h.glob("warden-*.pid")) for h in homes),
                     10.0, "the engine wardens to exit")  # fmt: skip

    # -- agents --------------------------------------------------------------------------

    def enroll(self, label: str) -> Agent:
        """Enroll and register a node (its agent is not started)."""
        printed = self.berth("nodes", "enroll", label).stdout
        uri = URI_PATTERN.search(printed)
        assert uri, printed
        home = self.root / f"agent-{label}"
        home.mkdir(parents=True)
        cli(home, "agent", "register", "--uri", uri.group(0), env=self.env)
        node_id = re.search(r"node_id: (\S+)", (home / "agent.yaml").read_text())
        assert node_id, (home / "agent.yaml").read_text()
        agent = Agent(label, home, node_id.group(1).strip("'\""))
        self.agents[label] = agent
        return agent

    def start_agent(self, agent: Agent, *, wait_ready: bool = True) -> None:
        env = {**self.env, **agent.env}
        with (agent.home / "agent.out").open("ab") as log:  # the child keeps its own copy
            agent.process = subprocess.Popen(
                [sys.executable, "-m", "berth", "--home", str(agent.home), "agent", "start",
                 "--verbose"],
                stdout=log, stderr=subprocess.STDOUT, env=env, cwd=agent.home,
                start_new_session=True,
            )  # fmt: skip
        if wait_ready:
            self.wait_node(agent.node_id, "ready")

    def add_agent(self, label: str, env: Mapping[str, str] | None = None) -> Agent:
        """Enroll, register and start an agent; ``env`` holds settings of its own."""
        agent = self.enroll(label)
        agent.env.update(env or {})
        self.start_agent(agent)
        return agent

    def stop_agent(self, agent: Agent, sig: int = signal.SIGTERM) -> None:
        process = agent.process
        if process is None:
            return
        if process.poll() is None:
            process.send_signal(sig)
            try:
                process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        agent.process = None

    # -- state ---------------------------------------------------------------------------

    def admin(self, method: str, path: str, **kwargs: Any) -> Any:
        transport = httpx.HTTPTransport(uds=str(self.leader_home / "berth.sock"))
        with httpx.Client(transport=transport, base_url="http://berth", timeout=60.0) as api:
            response = api.request(method, path, **kwargs)
        response.raise_for_status()
        return response.json()

    def node(self, node_id: str) -> dict[str, Any]:
        found: dict[str, Any] = self.admin("GET", f"/admin/nodes/{node_id}")
        return found

    def wait_node(self, node_id: str, status: str, timeout_s: float = 60) -> dict[str, Any]:
        """The node's record once its status is ``status``; ``AssertionError`` after
        ``timeout_s`` seconds."""
        seen: dict[str, Any] = {}

        def reached() -> bool:
            seen.update(self.node(node_id))
            return seen["status"] == status

        try:
            wait_for(reached, timeout_s, f"node {node_id} to be {status}", interval_s=0.1)
        except AssertionError:
            raise AssertionError(
                f"node {node_id} is {seen.get('status')}, not {status}, after {timeout_s:g} s"
            ) from None
        return seen

    def deploy(self, model: str, path: Path, agent: Agent | None, *extra: str) -> str:
        """Register ``model`` (on the agent's node when given) and run it; the deployment id."""
        node = ["--node", agent.label] if agent else []
        self.berth("models", "add", model, str(path), *node)
        ran = self.berth("run", model, "--engine", "llamacpp", *node, *extra)
        found = re.search(r"\bd-[0-9a-f]{8}\b", ran.stdout)
        assert found and "ready" in ran.stdout, ran.stdout
        return found.group(0)

    def deployment(self, deployment_id: str) -> dict[str, Any]:
        found: dict[str, Any] = self.admin("GET", f"/admin/deployments/{deployment_id}")
        return found

    # -- clients -------------------------------------------------------------------------

    @property
    def base_url(self) -> str:
        return f"https://127.0.0.1:{self.public_port}"

    def tls(self) -> ssl.SSLContext:
        return ssl.create_default_context(cafile=str(self.leader_home / "ca" / "ca.pem"))

    def openai(self) -> openai.OpenAI:
        return openai.OpenAI(
            base_url=f"{self.base_url}/v1",
            api_key=self.api_key,
            http_client=openai.DefaultHttpxClient(verify=self.tls()),
            max_retries=0,
        )

    def served_models(self) -> list[str]:
        """The model ids ``/v1/models`` lists, through the OpenAI SDK."""
        with self.openai() as client:
            return [model.id for model in client.models.list()]

    def http(self, timeout_s: float = 60.0) -> httpx.Client:
        return httpx.Client(
            base_url=self.base_url,
            verify=self.tls(),
            timeout=timeout_s,
            headers={"Authorization": f"Bearer {self.api_key}"},
        )

    def leader_pid(self) -> int:
        return int((self.leader_home / "daemon.pid").read_text())


@contextlib.contextmanager
def started_cluster(
    root: Path, settings: Mapping[str, str] | None = None, *, fake_engine: bool = True
) -> Iterator[Cluster]:
    """A leader started in ``root``, stopped with its agents and engines on exit.

    Every process gets :func:`clean_env` plus ``settings`` (``BERTH_*`` variables). With
    ``fake_engine`` (the default), ``llama-server`` is the fake engine
    (``BERTH_LLAMA_SERVER_BIN``) and ``root / "tiny.gguf"`` is a model file it accepts;
    without it, berth finds the real llama.cpp server as a user's install would.
    """
    extra = dict(settings or {})
    if fake_engine:
        extra.setdefault("BERTH_LLAMA_SERVER_BIN", str(fake_engine_wrapper(root)))
        (root / "tiny.gguf").write_bytes(TINY_GGUF_BYTES)
    cluster = Cluster(root, clean_env(extra))
    cluster.start()
    try:
        yield cluster
    finally:
        cluster.close()


def rss_mb(pid: int) -> float:
    """Resident memory of ``pid`` in MiB (``VmRSS`` of ``/proc/PID/status``)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for pid {pid}")


__all__ = [
    "Agent",
    "Cluster",
    "clean_env",
    "cli",
    "fake_engine_wrapper",
    "rss_mb",
    "served_by_node",
    "started_cluster",
    "wait_gone",
]
