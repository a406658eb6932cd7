"""Failure detection across real network namespaces, under steady load (issue 12).

A leader in the root namespace and two agents, each in a network namespace of its own behind
a veth pair on one bridge, serve one model (the fake llama-server on each node; real TLS,
real processes, default detection settings). Client threads keep streaming chat completions
through the leader while one node fails:

- its engine is stopped with SIGSTOP (the process lives, its socket accepts, nothing
  answers), then resumed;
- its agent's link is black-holed (iptables DROP on the namespace's veth, both ways), then
  restored.

Each test asserts that no request failed that had not started streaming when the fault began,
that the failing node served nothing meanwhile (the other node did), and that the worst delay
beyond a request's own duration stays under the issue's bound of 10 s: seconds, not tens of
seconds. It prints the measured delays and detection times (``pytest -s`` shows them).

Needs root, ``ip netns`` and ``iptables``; skipped with the reason otherwise.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import statistics
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field

import httpx
import pytest

from support.cluster_harness import (
    TINY_GGUF_BYTES,
    Agent,
    Cluster,
    clean_env,
    cli,
    fake_engine_wrapper,
    served_by_node,
)
from support.netns import Namespaces, run

pytestmark = [
    pytest.mark.slow,
    # Each asserts a bound in seconds on how long a fault holds requests, with its own load of
    # clients: other workers' processes on the same cores would be its noise.
    pytest.mark.serial("a bound in seconds under a load of its own"),
]

MODEL = "shared"
LABELS = ("a", "b")
#: Client threads keeping the cluster busy.
CLIENTS = 6
#: Seconds the engine takes before the head of each answer.
PREFILL_S = 0.3
#: Events in each streamed answer, 50 ms apart.
EVENTS = 4
#: Seconds an answer's bytes may take from the engine to the client (leader, TLS, client
#: thread): a first line that arrives this soon after the fault left the engine before it.
RELAY_DELAY_S = 0.2
#: The issue's bound on the delay beyond a request's own duration.
BOUND_S = 10.0


@pytest.fixture(scope="module")
def netns() -> Namespaces:
    """This process's namespaces for agents ``a`` and ``b``: names and a subnet no other test
    process uses (``Namespaces.unique``)."""
    return Namespaces.unique("fo", "10.231", LABELS)


@pytest.fixture(scope="module")
def netns_cluster(netns: Namespaces, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """A leader in the root namespace and agents ``a`` and ``b`` in namespaces of their own,
    each serving the model, for the tests of this module."""
    reason = netns.why_not(iptables=True)
    if reason is not None:
        pytest.skip(reason)
    root = tmp_path_factory.mktemp("failover")
    wrapper = fake_engine_wrapper(root)
    (root / "shared.gguf").write_bytes(TINY_GGUF_BYTES)
    env = clean_env(
        {
            "BERTH_LLAMA_SERVER_BIN": str(wrapper),
            "BERTH_CLUSTER_HOST": netns.host_ip,
            "BERTH_CLUSTER_BIND": netns.host_ip,
            "BERTH_STOP_GRACE_S": "2",
        }
    )
    netns.setup()
    cluster = Cluster(root, env)
    try:
        cluster.start()
        for label in LABELS:
            agent = cluster.enroll(label)
            netns.start_agent(cluster, agent, label)
        _ready_deployments(cluster)
        yield cluster
    finally:
        try:
            cluster.close()
        finally:
            netns.teardown()


def _ready_deployments(cluster: Cluster) -> dict[str, dict[str, object]]:
    """Node label -> its ready deployment of the model, started (through the admin API, all
    at once) where there is none."""

    def ready() -> dict[str, dict[str, object]]:
        records = cluster.admin("GET", "/admin/deployments")
        return {label: r for label, agent in cluster.agents.items() for r in records
                if r["node_id"] == agent.node_id and r["state"] == "ready"}  # fmt: skip

    found = ready()
    started = []
    for label in cluster.agents:
        if label not in found:
            path = str(cluster.root / "shared.gguf")  # its path on that node, the same here
            cluster.admin("POST", "/admin/models", json={"name": MODEL, "path": path,
                                                           "node": label})  # fmt: skip
            body = {"model": MODEL, "engine": "llamacpp", "node": label}
            started.append(cluster.admin("POST", "/admin/deployments", json=body)["id"])
    deadline = time.monotonic() + 60
    while started and len(found := ready()) < len(cluster.agents):
        states = {d: cluster.deployment(d)["state"] for d in started}
        assert "failed" not in states.values(), states
        assert time.monotonic() < deadline, f"deployments not ready: {states}"
        time.sleep(0.2)
    return found


# -- load ----------------------------------------------------------------------------------------


@dataclass
class Outcome:
    began: float
    ended: float
    first_byte: float | None
    ok: bool
    detail: str = ""

    @property
    def duration_s(self) -> float:
        return self.ended - self.began


@dataclass
class Load:
    """Client threads streaming chat completions through the leader until :meth:`stop`."""

    cluster: Cluster
    outcomes: list[Outcome] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)

    def start(self) -> None:
        for _ in range(CLIENTS):
            thread = threading.Thread(target=self._client, daemon=True)
            thread.start()
            self._threads.append(thread)

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=90)

    def _client(self) -> None:
        # One conversation per client: its requests stick to the node that served it first
        # (session affinity), so a failing node keeps getting the requests of its clients
        # until the leader gives it up, as a chat front-end's would.
        session = uuid.uuid4().hex
        with self.cluster.http(timeout_s=90) as http:
            while not self._stop.is_set():
                self.outcomes.append(self.one(http, session))

    def send_at_once(self, session: str, count: int) -> list[threading.Thread]:
        """``count`` requests of ``session`` now, each from a thread of its own."""
        threads = [threading.Thread(target=self._single, args=(session,)) for _ in range(count)]
        for thread in threads:
            thread.start()
        return threads

    def _single(self, session: str) -> None:
        with self.cluster.http(timeout_s=90) as http:
            self.outcomes.append(self.one(http, session))

    @staticmethod
    def one(http: httpx.Client, session: str) -> Outcome:
        # The engine waits before its head (a prefill), then streams: at any moment some
        # requests wait for their first byte and some are streaming.
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                "stream": True, "x_head_delay_s": PREFILL_S, "x_events": EVENTS,
                "x_event_delay_s": 0.05}  # fmt: skip
        headers = {"X-Session-Id": session}
        began = time.monotonic()
        first_byte: float | None = None
        lines: list[str] = []
        try:
            with http.stream("POST", "/v1/chat/completions", json=body, headers=headers) as r:
                for line in r.iter_lines():
                    if first_byte is None:
                        first_byte = time.monotonic()
                    lines.append(line)
                status = r.status_code
        except httpx.HTTPError as exc:
            return Outcome(began, time.monotonic(), first_byte, False, f"{type(exc).__name__}")
        events = [line for line in lines if line.startswith("data: ")]
        # The fake engine's slow stream is its events and nothing else; a stream broken off
        # ends with an error event (and [DONE]) from the leader.
        ok = status == 200 and len(events) >= EVENTS
        ok = ok and not any('"error"' in line for line in events)
        return Outcome(began, time.monotonic(), first_byte, ok, f"{status} {events[-2:]}")


@dataclass
class Report:
    worst_delay_s: float
    baseline_s: float
    requests: int
    streaming_at_fault: int


def _judge(load: Load, fault_at: float, scenario: str) -> Report:
    """Assert the issue's facts for the requests of a run with a fault at ``fault_at``."""
    before = [o.duration_s for o in load.outcomes if o.ended < fault_at and o.ok]
    assert len(before) >= 5, f"too few requests before the fault: {load.outcomes[:4]}"
    baseline_s = statistics.median(before)
    # Streaming when the fault began (their first line reached the client within the
    # relay's own delay of it): those may fail or be held.
    streaming = [o for o in load.outcomes if o.began < fault_at < o.ended and
                 o.first_byte is not None and o.first_byte < fault_at + RELAY_DELAY_S]  # fmt: skip
    judged = [o for o in load.outcomes if o.ended >= fault_at and o not in streaming]
    failed = [o for o in judged if not o.ok]
    assert not failed, f"{scenario}: requests failed before streaming: {failed}"
    worst = max(o.duration_s - baseline_s for o in judged)
    held = sorted((round(o.duration_s, 2) for o in streaming), reverse=True)
    print(f"\n{scenario}: {len(judged)} requests from the fault on, none failed; own duration "
          f"{baseline_s:.2f} s; worst delay beyond it {worst:.2f} s; {len(streaming)} were "
          f"streaming when it began (durations {held}, "
          f"{sum(not o.ok for o in streaming)} ended with an error)")  # fmt: skip
    assert worst < BOUND_S, f"{scenario}: a request was held {worst:.1f} s beyond its duration"
    return Report(worst, baseline_s, len(judged), len(streaming))


def _pinned_conversation(cluster: Cluster, load: Load) -> tuple[str, Agent, Agent]:
    """A conversation the leader has routed (its affinity), the agent whose node it went to
    (the scenario's victim) and the other one. The scorer picks the node: a test that named
    its victim beforehand failed when, on a loaded machine, 40 conversations in a row went
    to the other node."""
    by_node = {a.node_id: a for a in cluster.agents.values()}
    deadline = time.monotonic() + 30
    while True:
        # The nodes settle first: a link the previous scenario left half-dead may end (and
        # its node's affinity be forgotten) a moment after a conversation was routed.
        for node_id in by_node:
            cluster.wait_node(node_id, "ready", timeout_s=45)
        with cluster.http(timeout_s=30) as http:
            session = uuid.uuid4().hex
            assert load.one(http, session).ok
        routing = cluster.admin("GET", f"/admin/routing/{MODEL}?session={session}")
        if routing["affinity_node"] in by_node:
            break
        assert time.monotonic() < deadline, f"no conversation kept its node: {routing}"
        time.sleep(1)
    victim = by_node[routing["affinity_node"]]
    (survivor,) = [a for a in cluster.agents.values() if a is not victim]
    return session, victim, survivor


def _retries(cluster: Cluster) -> int:
    log = (cluster.leader_home / "logs" / "daemon.log").read_text()
    # "trying another node", "... deployment" or "... candidate": each line is one retry
    return sum("; trying another " in line for line in log.splitlines())


@contextlib.contextmanager
def _watch_state(cluster: Cluster, agent: Agent) -> Iterator[dict[str, float]]:
    """When the leader first said the node is unreachable and the agent first said it is
    disconnected (``time.monotonic()`` values, polled every 0.1 s)."""
    seen: dict[str, float] = {}
    done = threading.Event()

    def poll() -> None:
        status_file = agent.home / "agent-status.json"
        while not done.is_set():
            now = time.monotonic()
            if "leader" not in seen and cluster.node(agent.node_id)["status"] == "unreachable":
                seen["leader"] = now
            with contextlib.suppress(OSError, ValueError):
                if "agent" not in seen and not json.loads(status_file.read_text())["connected"]:
                    seen["agent"] = now
            time.sleep(0.1)

    watcher = threading.Thread(target=poll, daemon=True)
    watcher.start()
    try:
        yield seen
    finally:
        done.set()
        watcher.join(timeout=10)


# -- the scenarios -------------------------------------------------------------------------------


def test_a_sigstopped_engine_delays_requests_by_seconds(netns_cluster: Cluster) -> None:
    cluster = netns_cluster
    deployments = _ready_deployments(cluster)
    load = Load(cluster)
    load.start()
    waiters: list[threading.Thread] = []
    pid = 0
    try:
        pinned, victim, survivor = _pinned_conversation(cluster, load)
        pid = int(str(deployments[victim.label]["pid"]))
        time.sleep(2)  # the undisturbed duration of a request
        retried = _retries(cluster)
        fault_at = time.monotonic()
        os.kill(pid, signal.SIGSTOP)
        # Requests that will wait for their first byte on the stopped engine, for sure.
        waiters = load.send_at_once(pinned, 3)
        time.sleep(0.5)  # what the engine had written reaches its clients
        served = served_by_node(cluster, MODEL)
        time.sleep(8.5)  # two probe rounds: suspect, not yet failed (three in a row)
        during = served_by_node(cluster, MODEL) - served
        os.kill(pid, signal.SIGCONT)
        time.sleep(2)
    finally:
        if pid:  # 0: the victim was not chosen yet
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        load.stop()
        for thread in waiters:
            thread.join(timeout=90)
    _judge(load, fault_at, "SIGSTOPped engine")
    assert _retries(cluster) >= retried + 3, "the waiting requests were not sent elsewhere"
    assert during[victim.node_id] == 0, during  # nothing came from the stopped engine
    assert during[survivor.node_id] > 0, during  # the other node served meanwhile
    log = (cluster.leader_home / "logs" / "daemon.log").read_text()
    assert "failed a health probe" in log


def test_a_black_holed_link_delays_requests_by_seconds(
    netns_cluster: Cluster, netns: Namespaces
) -> None:
    cluster = netns_cluster
    _ready_deployments(cluster)
    load = Load(cluster)
    load.start()
    waiters: list[threading.Thread] = []
    ns, rules = "", []  # set once the victim is known; the finally block lifts them
    try:
        pinned, victim, survivor = _pinned_conversation(cluster, load)
        ns, inner = netns.namespace(victim.label), netns.veth(victim.label)[1]
        rules = [["INPUT", "-i", inner, "-j", "DROP"], ["OUTPUT", "-o", inner, "-j", "DROP"]]
        time.sleep(2)
        retried = _retries(cluster)
        with _watch_state(cluster, victim) as seen:
            for rule in rules:
                run("ip", "netns", "exec", ns, "iptables", "-I", *rule)
            fault_at = time.monotonic()  # in force from here on
            waiters = load.send_at_once(pinned, 3)
            time.sleep(0.5)
            served = served_by_node(cluster, MODEL)
            time.sleep(12.5)  # long enough for the agent to dial into the black hole once
            during = served_by_node(cluster, MODEL) - served
            shown = cli(victim.home, "agent", "status", env=cluster.env, check=False).stdout
            for rule in rules:
                run("ip", "netns", "exec", ns, "iptables", "-D", *rule)
            lifted_at = time.monotonic()
            time.sleep(2)
    finally:
        for rule in rules:
            run("ip", "netns", "exec", ns, "iptables", "-D", *rule, check=False)
        load.stop()
        for thread in waiters:
            thread.join(timeout=90)
    report = _judge(load, fault_at, "black-holed link")
    assert _retries(cluster) >= retried + 3, "the waiting requests were not sent elsewhere"
    # Only the answers it was streaming can have ended there (with an error, once the link
    # was found dead); everything else went to the other node.
    assert during[victim.node_id] <= report.streaming_at_fault, during
    assert during[survivor.node_id] > 0, during
    assert "leader" in seen, "the leader never marked the node unreachable"
    assert "agent" in seen, "the agent's status file never said disconnected"
    assert "disconnected" in shown.splitlines()[0], shown
    print("black-holed link: `berth agent status` meanwhile:\n" + shown)
    print(f"black-holed link: the leader gave the node up after {seen['leader'] - fault_at:.1f} s,"
          f" the agent said disconnected after {seen['agent'] - fault_at:.1f} s")  # fmt: skip
    agent_log = (victim.home / "logs" / "agent.log").read_text()
    dials = [line for line in agent_log.splitlines() if "no answer within" in line]
    dials = [d.partition("cannot reach the leader")[2] or d for d in dials]
    print("black-holed link: dials into it: " + ("; ".join(dials) or "none"))
    cluster.wait_node(victim.node_id, "ready", timeout_s=45)
    print(f"black-holed link: node ready again {time.monotonic() - lifted_at:.1f} s after it "
          "was lifted")  # fmt: skip
