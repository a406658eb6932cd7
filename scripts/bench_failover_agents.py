"""Kill the active leader ten times, then hand over with step-down, with agents under load.

Real processes, set up with the tests' harnesses: a throwaway PostgreSQL server
(``tests/support/postgres.py``); two leader daemons on one database of it
(``scripts/bench_failover.py``'s pair: ``leader_only``, ``leader_ha``, one CA and key
pepper), both in the root namespace with their cluster listeners on a bridge; two agents,
each in a network namespace of its own behind a veth pair on that bridge
(``tests/support/netns.py``), enrolled with both leaders' cluster addresses, each serving one
deployment of a model of its own on the stand-in engine (``tests/support/fake_llama_server.py``).

The load: client threads (half of them streaming: a 0.2 s prefill, then 5 events 0.1 s
apart; the others plain JSON answers), each sending one request after another for one of the
two models, to either leader's public address. A client that gets 503, a refused
connection or one reset before the answer's head tries the other leader 50 ms later, as a
client behind a load balancer would, for up to 60 s; every attempt is recorded. A request
ends as

- ``ok``: a 200 with the whole answer (a stream: every event, no error event);
- ``lost in flight``: the answer's head had come, then it broke off (a stream through the
  killed leader: expected);
- ``lost``: no answer within 60 s of retries, or a status other than 200 and 503 (what
  must not happen).

Kill rounds: SIGKILL to the active leader; the round's takeover is the time from the kill to
the first 200 answered by the other leader, the new active (its head arriving at the
client). Step-down rounds: ``berth leader step-down`` on the active, timed from the
command's answer (the leader was told to hand the lease back), the requests counted from
before the command started. The old leader is started again (a standby now), and the next
round waits until both agents are connected to the active, their nodes ready, and both
models answered through it.

At the end the engines' pids (the agents' journals and the deployments' records) and their
start counts (the stand-in prints one "listening" line per start into the agent's
``engine-<deployment>.log``) are compared with the start.

Run as root: ``PYTHONPATH=$PWD/src .venv/bin/python scripts/bench_failover_agents.py``
(seven to ten minutes with the default 5 s lease, 10 kills and 3 step-downs).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import statistics
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import httpx

# bench_failover puts tests/ on the path, for the harnesses below.
from bench_failover import ha_env, start_leader_pair

from support.cluster_harness import (
    TINY_GGUF_BYTES,
    Agent,
    Cluster,
    fake_engine_wrapper,
)
from support.fake_llama_server import LISTENING
from support.netns import Namespaces
from support.postgres import PostgresServer
from support.processes import alive, wait_gone

LABELS = ("a", "b")
#: This benchmark's own prefix and subnet: other users' namespaces never collide with them.
NETNS = Namespaces("habench", "10.231.25", LABELS)
#: Events in a streamed answer, this far apart, after this prefill.
EVENTS, EVENT_DELAY_S, PREFILL_S = 5, 0.1, 0.2
#: A client's pause before it tries the other leader, and how long it keeps trying.
RETRY_PAUSE_S = 0.05
REQUEST_BOUND_S = 60.0
#: How long a round may take to settle before the benchmark gives up.
SETTLE_BOUND_S = 90.0
#: Seconds of undisturbed load before each fault.
STEADY_S = 3.0

Outcome = Literal["ok", "lost in flight", "lost"]


@dataclass
class Attempt:
    """One try of a request at one leader (``leader``: index in the leader list)."""

    leader: int
    began: float
    #: when the answer's head arrived (``None``: it did not)
    head_at: float | None = None
    status: int | None = None
    error: str = ""


@dataclass
class Request:
    client: int
    model: str
    stream: bool
    began: float
    ended: float = 0.0
    outcome: Outcome = "lost"
    detail: str = ""
    attempts: list[Attempt] = field(default_factory=list)


def _chat_body(model: str, stream: bool) -> dict[str, Any]:
    body: dict[str, Any] = {"model": model, "messages": [{"role": "user", "content": "hi"}]}
    if stream:
        body.update(stream=True, x_head_delay_s=PREFILL_S, x_events=EVENTS,
                    x_event_delay_s=EVENT_DELAY_S)  # fmt: skip
    return body


def _one_try(http: httpx.Client, request: Request, attempt: Attempt) -> bool:
    """Send ``request`` once; ``True`` when it is settled (ok, lost in flight or lost),
    ``False`` when it should be tried at the other leader."""
    body = _chat_body(request.model, request.stream)
    try:
        with http.stream("POST", "/v1/chat/completions", json=body) as reply:
            attempt.head_at, attempt.status = time.monotonic(), reply.status_code
            if reply.status_code == 503:
                reply.read()
                return False
            if reply.status_code != 200:
                request.outcome, request.detail = "lost", f"{reply.status_code} {reply.read()!r}"
                return True
            try:
                text = reply.read().decode()
            except httpx.HTTPError as exc:
                request.outcome, request.detail = "lost in flight", type(exc).__name__
                return True
    except httpx.HTTPError as exc:  # before the head: refused, reset, timed out
        attempt.error = type(exc).__name__
        return False
    if request.stream:
        events = [line for line in text.splitlines() if line.startswith("data: ")]
        # The stand-in's slow stream is its events alone; one broken off by berth ends
        # with an error event.
        if len(events) < EVENTS or any('"error"' in line for line in events):
            request.outcome, request.detail = "lost in flight", f"{events[-2:]}"
            return True
    elif "choices" not in json.loads(text):
        request.outcome, request.detail = "lost", text[:200]
        return True
    request.outcome = "ok"
    return True


@dataclass
class Load:
    """Client threads sending requests to either of ``leaders`` until :meth:`stop`."""

    leaders: list[Cluster]
    key: str
    models: tuple[str, ...]
    clients: int
    requests: list[Request] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)

    def start(self) -> None:
        for index in range(self.clients):
            thread = threading.Thread(target=self._client, args=(index,), daemon=True)
            thread.start()
            self._threads.append(thread)

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=REQUEST_BOUND_S + 30)

    def _client(self, index: int) -> None:
        stream = index % 2 == 1
        model = self.models[(index // 2) % len(self.models)]
        headers = {"Authorization": f"Bearer {self.key}"}
        timeout = httpx.Timeout(30.0, connect=5.0)
        with contextlib.ExitStack() as stack:
            https = [stack.enter_context(httpx.Client(base_url=leader.base_url, timeout=timeout,
                     verify=leader.tls(), headers=headers)) for leader in self.leaders]  # fmt: skip
            at = index % len(self.leaders)
            while not self._stop.is_set():
                request = Request(index, model, stream, time.monotonic())
                while True:
                    attempt = Attempt(at, time.monotonic())
                    request.attempts.append(attempt)
                    if _one_try(https[at], request, attempt):
                        break
                    at = (at + 1) % len(self.leaders)
                    if time.monotonic() - request.began > REQUEST_BOUND_S:
                        request.outcome = "lost"
                        request.detail = f"no answer in {REQUEST_BOUND_S:g} s of retries"
                        break
                    time.sleep(RETRY_PAUSE_S)
                request.ended = time.monotonic()
                self.requests.append(request)

    def first_answer(self, leader: int, after: float, model: str | None = None) -> float | None:
        """When the first 200 from ``leader`` (for ``model``, or any) arrived after
        ``after``, else ``None``."""
        heads = [attempt.head_at for request in list(self.requests) for attempt in request.attempts
                 if attempt.leader == leader and attempt.status == 200 and attempt.head_at
                 and attempt.head_at > after and model in (None, request.model)]  # fmt: skip
        return min(heads) if heads else None

    def between(self, start: float, end: float) -> list[Request]:
        """The requests that ended in [start, end)."""
        return [r for r in list(self.requests) if start <= r.ended < end]


# -- the cluster -----------------------------------------------------------------------------


def _cluster_url(leader: Cluster) -> str:
    return f"https://{NETNS.host_ip}:{leader.cluster_port}"


def _role(leader: Cluster) -> str:
    try:
        return str(leader.admin("GET", "/admin/leader")["role"])
    except (httpx.HTTPError, OSError):
        return "down"


def _on(agent: Agent, leader: Cluster) -> bool:
    """Whether the agent's status file says it is connected to ``leader``."""
    try:
        status = json.loads((agent.home / "agent-status.json").read_text())
    except (OSError, ValueError):
        return False
    return bool(status.get("connected")) and status.get("leader_url") == _cluster_url(leader)


def _engine_pids(agents: list[Agent]) -> dict[str, int]:
    pids = {}
    for agent in agents:
        journal = json.loads((agent.home / "agent-engines.json").read_text() or "{}")
        pids.update({name: int(entry["pid"]) for name, entry in journal.items()})
    return pids


def _engine_starts(agents: list[Agent]) -> dict[str, int]:
    """Deployment id -> how many times the stand-in engine started for it."""
    starts = {}
    for agent in agents:
        for log in (agent.home / "logs").glob("engine-*.log"):
            starts[log.stem.removeprefix("engine-")] = log.read_text().count(LISTENING)
    return starts


def _wait(what: str, check: Any, bound_s: float = SETTLE_BOUND_S) -> float:
    """Poll ``check()`` every 50 ms until it is true; the time it became so."""
    deadline = time.monotonic() + bound_s
    while not check():
        if time.monotonic() > deadline:
            raise SystemExit(f"gave up waiting {bound_s:g} s for {what}")
        time.sleep(0.05)
    return time.monotonic()


def _settle(load: Load, leaders: list[Cluster], agents: list[Agent], active: int) -> None:
    """Wait until the other leader is up as a standby, both agents are on ``active`` and
    ready there, and both models were answered through it."""
    other = leaders[1 - active]
    _wait("the restarted leader to be a standby", lambda: _role(other) == "standby")
    _wait("the agents to be on the active", lambda: all(_on(a, leaders[active]) for a in agents))
    for agent in agents:
        leaders[active].wait_node(agent.node_id, "ready", timeout_s=SETTLE_BOUND_S)
    since = time.monotonic()
    for model in load.models:
        _wait(f"{model} answered by the active",
              lambda m=model: load.first_answer(active, since, m) is not None)  # fmt: skip


@dataclass
class Round:
    kind: str
    number: int
    killed: str
    takeover_s: float
    both_models_s: float
    agents_s: float
    counts: Counter[str]
    retried: int
    worst_wait_s: float


def _judge(load: Load, kind: str, number: int, killed: str, began: float, fault_at: float,
           new: int, agents_at: float, settled_at: float) -> Round:  # fmt: skip
    """The round's numbers: times from ``fault_at``, requests that ended between ``began``
    (just before the fault was set off) and ``settled_at``."""
    # ``new`` was a standby until the fault: each 200 it gave since came after its takeover.
    first = load.first_answer(new, began)
    both = [load.first_answer(new, began, model) for model in load.models]
    assert first is not None and all(both)
    ended = load.between(began, settled_at)
    counts = Counter(request.outcome for request in ended)
    retried = [r for r in ended if len(r.attempts) > 1]
    worst = max((r.ended - r.began for r in retried), default=0.0)
    return Round(kind, number, killed, first - fault_at, max(b or 0 for b in both) - fault_at,
                 agents_at - fault_at, counts, len(retried), worst)  # fmt: skip


def _print_table(rounds: list[Round]) -> None:
    print("\n| round | leader | first 200 from the new active (s) | both models (s) | "
          "agents on it (s) | requests ok | lost in flight | lost | retried | "
          "longest retried request (s) |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rounds:
        c = r.counts
        print(f"| {r.kind} {r.number} | {r.killed} | {r.takeover_s:.2f} | {r.both_models_s:.2f} "
              f"| {r.agents_s:.2f} | {c['ok']} | {c['lost in flight']} | {c['lost']} "
              f"| {r.retried} | {r.worst_wait_s:.2f} |")  # fmt: skip


def _stop_all(leaders: list[Cluster], agents: list[Agent]) -> None:
    """Stop the deployments through the active, the agents, their engines, the leaders."""
    live = [leader for leader in leaders if _role(leader) == "active"] or leaders[:1]
    keeper = live[0]
    keeper.agents = {agent.label: agent for agent in agents}
    for leader in leaders:
        if leader is not keeper:
            leader.agents = {}
    keeper.close()
    for leader in leaders:
        leader.berth("daemon", "stop", check=False)


def main(rounds: int, step_downs: int, lease_s: float, clients: int, keep: bool) -> None:
    reason = NETNS.why_not()
    if reason is not None:
        raise SystemExit(reason)
    print(f"load average at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)
    server = PostgresServer.start()
    folder = Path(tempfile.mkdtemp(prefix="berth-bench-failover-agents-"))
    wrapper = fake_engine_wrapper(folder)
    (folder / "tiny.gguf").write_bytes(TINY_GGUF_BYTES)
    leaders: list[Cluster] = []
    agents: list[Agent] = []
    load: Load | None = None
    NETNS.setup()
    try:
        extra = {"BERTH_LLAMA_SERVER_BIN": str(wrapper), "BERTH_CLUSTER_HOST": NETNS.host_ip,
                 "BERTH_CLUSTER_BIND": NETNS.host_ip}  # fmt: skip
        leaders += start_leader_pair(folder, ha_env(server.create_database(), lease_s, extra))
        a = leaders[0]
        models = tuple(f"tiny-{label}" for label in LABELS)
        for label, model in zip(LABELS, models, strict=True):
            agent = a.enroll(label)
            agents.append(agent)
            NETNS.start_agent(a, agent, label)
            a.deploy(model, folder / "tiny.gguf", agent)
        pids = _engine_pids(agents)
        records = {d["id"]: d for d in a.admin("GET", "/admin/deployments")}
        print(f"deployments {sorted(records)}, engine pids {pids}", flush=True)
        load = Load(leaders, a.api_key, models, clients)
        load.start()
        active = 0
        _settle(load, leaders, agents, active)
        results: list[Round] = []
        for kind, count in (("kill", rounds), ("step-down", step_downs)):
            for number in range(1, count + 1):
                time.sleep(STEADY_S)
                old, new = leaders[active], leaders[1 - active]
                pid = old.leader_pid()
                began = fault_at = time.monotonic()
                if kind == "kill":
                    os.kill(pid, signal.SIGKILL)
                else:
                    # Times from the command's answer (202: the lease is handed back): its
                    # own start-up takes seconds on a loaded machine.
                    old.berth("leader", "step-down")
                    fault_at = time.monotonic()
                    print(f"  step-down {number}: the command took {fault_at - began:.2f} s")
                agents_at = _wait("the agents to reach the new active",
                                  lambda n=new: all(_on(x, n) for x in agents))  # fmt: skip
                if not wait_gone(pid, SETTLE_BOUND_S):
                    raise SystemExit(f"{kind} {number}: leader {pid} did not exit")
                old.start()  # back as a standby
                active = 1 - active
                _settle(load, leaders, agents, active)
                results.append(_judge(load, kind, number, old.root.name, began, fault_at, active,
                                      agents_at, time.monotonic()))  # fmt: skip
                r = results[-1]
                print(f"{kind} {number} ({r.killed}): first 200 from the new active "
                      f"{r.takeover_s:.2f} s, both models {r.both_models_s:.2f} s, agents "
                      f"{r.agents_s:.2f} s; {dict(r.counts)}", flush=True)  # fmt: skip
        time.sleep(STEADY_S)
        load.stop()
        _report(load, results, leaders[active], agents, pids, records)
    finally:
        if load is not None:
            load.stop()
        with contextlib.suppress(Exception):
            _stop_all(leaders, agents)
        NETNS.teardown()
        server.stop()
        print(f"load average at end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
        if keep:
            print(f"homes and logs kept in {folder}")
        else:
            shutil.rmtree(folder, ignore_errors=True)


def _report(load: Load, results: list[Round], active: Cluster, agents: list[Agent],
            pids: dict[str, int], records: dict[str, Any]) -> None:  # fmt: skip
    _print_table(results)
    now = {d["id"]: d for d in active.admin("GET", "/admin/deployments")}
    same_pids = _engine_pids(agents) == pids and all(alive(p) for p in pids.values())
    same_records = {k: (d["pid"], d["state"]) for k, d in now.items()} == {
        k: (d["pid"], "ready") for k, d in records.items()
    }
    starts = _engine_starts(agents)
    restarts = {k: d.get("restart_count", 0) for k, d in now.items()}
    print(f"\nengine pids unchanged (journals, alive): {same_pids}; deployments' records "
          f"(pid, ready, none added): {same_records}")  # fmt: skip
    print(f"engine starts per deployment: {starts}; restart counts: {restarts}")
    for kind in ("kill", "step-down"):
        mine = [r for r in results if r.kind == kind]
        if not mine:
            continue
        total: Counter[str] = Counter()
        for r in mine:
            total.update(r.counts)
        takeovers = sorted(r.takeover_s for r in mine)
        print(f"{kind}: {len(mine)} rounds, first 200 from the new active p50 "
              f"{statistics.median(takeovers):.2f} s, worst {takeovers[-1]:.2f} s; requests "
              f"ok {total['ok']}, lost in flight {total['lost in flight']}, lost "
              f"{total['lost']}")  # fmt: skip
    lost = [r for r in load.requests if r.outcome != "ok"]
    kinds = Counter((r.outcome, "stream" if r.stream else "plain", r.detail[:60]) for r in lost)
    print(f"not ok, by kind: {dict(kinds)}")
    for request in lost[:20]:
        tries = [(t.leader, t.status, t.error) for t in request.attempts[-4:]]
        print(f"  {request.outcome}: client {request.client} {request.model} stream="
              f"{request.stream} {request.detail} tries {tries}")  # fmt: skip
    print(f"all requests: {Counter(r.outcome for r in load.requests)}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10, help="kills of the active")
    parser.add_argument("--step-downs", type=int, default=3)
    parser.add_argument("--lease-s", type=float, default=5.0)
    parser.add_argument("--clients", type=int, default=6)
    parser.add_argument("--keep", action="store_true", help="keep the homes and their logs")
    args = parser.parse_args()
    main(args.rounds, args.step_downs, args.lease_s, args.clients, args.keep)
