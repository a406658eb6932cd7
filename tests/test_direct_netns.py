"""The direct data path across a real network: the agent in its own network namespace behind
a veth pair, the leader on the host, the agent's ingress port blocked and unblocked with
iptables inside the namespace while a client keeps asking.

What a user would see: the node's requests go direct while the ingress answers (packets
counted at its port), through the tunnel within a few seconds of the port going dark, with
no request failing that had not begun its answer, and direct again once it is open. Needs
root and ``ip netns``/``iptables``; skipped, with the reason, elsewhere. The namespace and
veth names start with ``direct`` and carry this process's id.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest

from support.cluster_harness import Agent, Cluster, clean_env, cli, fake_engine_wrapper

pytestmark = pytest.mark.slow

_ID = os.getpid() % 100000
NAMESPACE = f"direct{_ID}"
HOST_VETH, NS_VETH = f"direct{_ID}h", f"direct{_ID}n"
SUBNET = f"10.177.{_ID % 200}"
HOST_ADDRESS, AGENT_ADDRESS = f"{SUBNET}.1", f"{SUBNET}.2"
INGRESS_PORT = 11502
MODEL = "tiny-direct"


def _why_no_namespaces() -> str | None:
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "iptables"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed"
    probe = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"ip netns does not work here: {probe.stderr.strip()}"
    return None


def _run(*command: str) -> str:
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise AssertionError(f"{' '.join(command)} exited {done.returncode}: {done.stderr}")
    return done.stdout


def _in_namespace(*command: str) -> str:
    return _run("ip", "netns", "exec", NAMESPACE, *command)


@contextlib.contextmanager
def _namespace() -> Iterator[None]:
    """The agent's namespace, joined to the host by a veth pair on ``SUBNET``.0/24."""
    subprocess.run(["ip", "netns", "del", NAMESPACE], capture_output=True)  # a leftover
    _run("ip", "netns", "add", NAMESPACE)
    try:
        _run("ip", "link", "add", HOST_VETH, "type", "veth", "peer", "name", NS_VETH)
        _run("ip", "link", "set", NS_VETH, "netns", NAMESPACE)
        _run("ip", "addr", "add", f"{HOST_ADDRESS}/24", "dev", HOST_VETH)
        _run("ip", "link", "set", HOST_VETH, "up")
        _in_namespace("ip", "addr", "add", f"{AGENT_ADDRESS}/24", "dev", NS_VETH)
        _in_namespace("ip", "link", "set", NS_VETH, "up")
        _in_namespace("ip", "link", "set", "lo", "up")
        yield
    finally:
        subprocess.run(["ip", "link", "del", HOST_VETH], capture_output=True)
        subprocess.run(["ip", "netns", "del", NAMESPACE], capture_output=True)


def _ingress_rule(action: str, *target: str) -> list[str]:
    return ["iptables", action, "INPUT", "-p", "tcp", "--dport", str(INGRESS_PORT), *target]


def _ingress_packets() -> int:
    """Packets that reached the ingress port (the counting rule's counter)."""
    listing = _in_namespace("iptables", "-L", "INPUT", "-v", "-x", "-n")
    for line in listing.splitlines():
        if f"dpt:{INGRESS_PORT}" in line and "DROP" not in line:
            return int(line.split()[0])
    raise AssertionError(f"no counting rule in:\n{listing}")


@dataclass
class Load:
    """Clients asking the leader for completions until stopped; every outcome kept."""

    cluster: Cluster
    workers: int = 4
    ok: int = 0
    lost: list[str] = field(default_factory=list)  # failed before any byte of the answer
    cut: list[str] = field(default_factory=list)  # failed after the answer had begun
    _stop: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def start(self) -> None:
        for number in range(self.workers):
            thread = threading.Thread(target=self._work, args=(number,), daemon=True)
            thread.start()
            self._threads.append(thread)

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(60)

    def _work(self, number: int) -> None:
        body: dict[str, Any] = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
        if number % 2:
            body["x_head_delay_s"] = 0.5  # waits in the engine: some wait for a head at the cut
        with self.cluster.http(timeout_s=60.0) as http:
            while not self._stop.is_set():
                begun = False
                try:
                    with http.stream("POST", "/v1/chat/completions", json=body) as answer:
                        for _chunk in answer.iter_bytes():
                            begun = True
                        failed = answer.status_code != 200
                        why = f"status {answer.status_code}"
                except httpx.HTTPError as exc:
                    failed, why = True, f"{type(exc).__name__}: {exc}"
                with self._lock:
                    if not failed:
                        self.ok += 1
                    else:
                        (self.cut if begun else self.lost).append(why)


def _node(cluster: Cluster, agent: Agent) -> dict[str, Any]:
    return cluster.node(agent.node_id)


def _wait_path(cluster: Cluster, agent: Agent, path: str, timeout_s: float = 30.0) -> float:
    """Seconds until the node's data path is ``path``."""
    begun = time.monotonic()
    while True:
        node = _node(cluster, agent)
        if node["data_path"] == path:
            return time.monotonic() - begun
        if time.monotonic() - begun > timeout_s:
            raise AssertionError(f"data path still {node['data_path']}: {node['data_path_reason']}")
        time.sleep(0.05)


def _wait_ok(load: Load, more: int, timeout_s: float = 30.0) -> None:
    target = load.ok + more
    deadline = time.monotonic() + timeout_s
    while load.ok < target:
        if time.monotonic() > deadline:
            raise AssertionError(f"only {load.ok} of {target} requests answered: {load.lost}")
        time.sleep(0.05)


@pytest.fixture(scope="module")
def direct_netns_cluster(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[Cluster, Agent]]:
    why = _why_no_namespaces()
    if why is not None:
        pytest.skip(why)
    root = tmp_path_factory.mktemp("direct-netns")
    (root / "tiny.gguf").write_bytes(b"GGUF" + bytes(60))
    env = clean_env(
        {
            "BERTH_LLAMA_SERVER_BIN": str(fake_engine_wrapper(root)),
            "BERTH_STOP_GRACE_S": "5",
            "BERTH_HEARTBEAT_INTERVAL_S": "0.5",
            "BERTH_CLUSTER_HOST": HOST_ADDRESS,
            "BERTH_CLUSTER_BIND": HOST_ADDRESS,
        }
    )
    with _namespace():
        cluster = Cluster(root, env)
        cluster.start()
        agent = cluster.enroll("gpu-ns")
        try:
            with (agent.home / "agent.out").open("ab") as log:
                agent.process = subprocess.Popen(
                    ["ip", "netns", "exec", NAMESPACE, sys.executable, "-m", "berth", "--home",
                     str(agent.home), "agent", "start", "--verbose", "--advertise",
                     f"{AGENT_ADDRESS}:{INGRESS_PORT}"],
                    stdout=log, stderr=subprocess.STDOUT, env=env, cwd=agent.home,
                    start_new_session=True,
                )  # fmt: skip
            cluster.wait_node(agent.node_id, "ready")
            _in_namespace(*_ingress_rule("-A"))  # counts what reaches the ingress
            cluster.deploy(MODEL, root / "tiny.gguf", agent)
            yield cluster, agent
        finally:
            cluster.close()
            if agent.process is not None and agent.process.poll() is None:
                agent.process.send_signal(signal.SIGKILL)


def _nodes_table(cluster: Cluster) -> str:
    return cli(cluster.leader_home, "nodes", "ls", env=cluster.env).stdout


def test_reachable_direct_blocked_tunnel_unblocked_direct(
    direct_netns_cluster: tuple[Cluster, Agent],
) -> None:
    cluster, agent = direct_netns_cluster
    _wait_path(cluster, agent, "direct")
    node = _node(cluster, agent)
    assert node["advertised_address"] == f"{AGENT_ADDRESS}:{INGRESS_PORT}"
    assert "answers probes" in node["data_path_reason"]
    table = _nodes_table(cluster)
    assert re.search(r"gpu-ns\s+ready\s+direct", table), table
    shown = cli(cluster.leader_home, "nodes", "show", "gpu-ns", env=cluster.env).stdout
    assert f"direct: its ingress at {AGENT_ADDRESS}:{INGRESS_PORT} answers probes" in shown
    print(f"\n{table}")

    load = Load(cluster)
    load.start()
    try:
        before = _ingress_packets()
        _wait_ok(load, 40)
        assert _ingress_packets() > before, "requests did not reach the ingress"

        _in_namespace(*_ingress_rule("-I", "-j", "DROP"))  # the port goes dark
        to_tunnel_s = _wait_path(cluster, agent, "tunnel")
        blocked = _node(cluster, agent)
        _wait_ok(load, 40)  # answered through the tunnel meanwhile

        _in_namespace(*_ingress_rule("-D", "-j", "DROP"))
        to_direct_s = _wait_path(cluster, agent, "direct")
        reopened = _ingress_packets()
        _wait_ok(load, 40)
        assert _ingress_packets() > reopened, "requests did not go direct again"
    finally:
        load.stop()
        subprocess.run(["ip", "netns", "exec", NAMESPACE, *_ingress_rule("-D", "-j", "DROP")],
                       capture_output=True)  # fmt: skip
    print(
        f"blocked -> tunnel after {to_tunnel_s:.2f} s ({blocked['data_path_reason']}); "
        f"unblocked -> direct after {to_direct_s:.2f} s; {load.ok} requests answered, "
        f"{len(load.lost)} lost before their answer began, {len(load.cut)} cut off after"
    )
    print(json.dumps({k: blocked[k] for k in ("data_path", "data_path_reason")}))
    assert load.lost == []
    assert load.cut == []  # none here streams for long; a cut one would be allowed
