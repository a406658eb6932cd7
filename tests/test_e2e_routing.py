"""Routing across real nodes with the real engine: a leader and two agents (separate processes
and ``BERTH_HOME``s, real TLS), each running llama.cpp's ``llama-server`` with SmolLM2-135M
under the same model name, checked from the client's side and the leader's metrics.

- requests with one ``X-Session-Id`` all land on one node; a node busy with a request gets
  none of the new sessions, which go to the idle one;
- an agent killed while requests for its session wait at the leader: those requests are served
  by the other node and succeed; the stream flowing from the killed node ends with an error
  event and ``[DONE]``.

Each engine has one slot (``-np 1``), so a second request waits for the first to finish
without a byte of its answer sent: at the leader, whose fair admission holds what is beyond a
deployment's slots (``berth_admission_queue_depth`` shows how many wait); ``--metrics``
shows the engines' own state.
"""

from __future__ import annotations

import json
import signal
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from berth.runtime.bundled import smollm2_gguf
from support.cluster_harness import Agent, Cluster, served_by_node, started_cluster

pytestmark = [pytest.mark.slow, pytest.mark.needs("llama-server", "smollm2")]

MODEL = "shared"
LABELS = ("gpu-a", "gpu-b")
#: One slot, so that requests queue in the engine; metrics, to see them queue; HTTP threads
#: enough for every waiting connection to be read (the default is ``max(np + 2, cores - 1)``).
ENGINE_ARGS = ("-x", "-np", "-x", "1", "-x", "--metrics", "-x", "--threads-http", "-x", "8")
#: A stream that outlasts any test step (SmolLM2 makes tens to hundreds of tokens a second
#: here); it is cut short by the client or the kill, never awaited to its end.
LONG_STREAM = {"max_tokens": 2000, "temperature": 0, "ignore_eos": True, "stream": True}
WAIT_S = 120.0


@pytest.fixture(scope="module")
def real_routing_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    model = smollm2_gguf()
    assert model is not None
    # Not what is tested here: a killed agent's link drops at once (its sockets close), so a
    # generous node timeout loses nothing, and two engines loading on two cores cannot
    # delay heartbeats past it.
    settings = {"BERTH_HEARTBEAT_INTERVAL_S": "1", "BERTH_NODE_TIMEOUT_S": "30"}
    root = tmp_path_factory.mktemp("e2e-routing")
    with started_cluster(root, settings, fake_engine=False) as cluster:
        for label in LABELS:
            agent = cluster.add_agent(label)
            cluster.deploy(MODEL, model, agent, "--ctx", "2048", *ENGINE_ARGS)
        yield cluster


def _served_since(cluster: Cluster, before: Counter[str], total: int) -> Counter[str]:
    """Requests relayed per node since ``before``, once ``total`` of them are counted (the
    leader counts a request after its last byte, which the client may have read already)."""
    served: Counter[str] = Counter()

    def counted() -> bool:
        served.clear()
        served.update(served_by_node(cluster, MODEL) - before)
        return served.total() >= total

    _wait_until(counted, f"{total} requests in the leader's metrics")
    return served


def _chat(cluster: Cluster, session: str, max_tokens: int = 2) -> httpx.Response:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Say hi."}],
        "max_tokens": max_tokens,
        "temperature": 0,
    }
    with cluster.http(timeout_s=WAIT_S) as http:
        return http.post("/v1/chat/completions", json=body, headers={"X-Session-Id": session})


def _content(answer: httpx.Response) -> str:
    assert answer.status_code == 200, answer.text
    text: str = answer.json()["choices"][0]["message"]["content"]
    return text


class Stream(threading.Thread):
    """A long streamed chat completion in the background; ``flowing`` is set once the first
    content has arrived, ``lines`` holds every line the client read."""

    def __init__(self, cluster: Cluster, session: str) -> None:
        super().__init__(daemon=True)
        self.cluster = cluster
        self.session = session
        self.flowing = threading.Event()
        self.stop = threading.Event()
        self.lines: list[str] = []

    def run(self) -> None:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "Count."}],
                **LONG_STREAM}  # fmt: skip
        with (
            self.cluster.http(timeout_s=WAIT_S) as http,
            http.stream("POST", "/v1/chat/completions", json=body,
                        headers={"X-Session-Id": self.session}) as response,
        ):  # fmt: skip
            for line in response.iter_lines():
                self.lines.append(line)
                if '"content"' in line:
                    self.flowing.set()
                if self.stop.is_set():
                    return  # leaving the block closes the connection: the client gave up

    def wait_flowing(self) -> None:
        assert self.flowing.wait(WAIT_S), f"the stream never began: {self.lines}"


def _affinity_node(cluster: Cluster, session: str) -> str:
    node: str = cluster.admin("GET", f"/admin/routing/{MODEL}?session={session}")["affinity_node"]
    return node


def _engine(cluster: Cluster, agent: Agent) -> tuple[int, str]:
    """The port of the agent's ready engine and the API key it was given (from the agent's
    engine journal: the engine answers its ``/metrics`` only with that key)."""
    journal = json.loads((agent.home / "agent-engines.json").read_text())
    for record in cluster.admin("GET", "/admin/deployments"):
        if record["node_id"] == agent.node_id and record["state"] == "ready":
            return int(record["port"]), str(journal[record["id"]]["api_key"])
    raise AssertionError(f"no ready deployment on {agent.label}")


def _engine_metric(engine: tuple[int, str], name: str) -> float:
    """A gauge from the engine's own ``/metrics`` (llama-server's ``--metrics``)."""
    port, key = engine
    headers = {"Authorization": f"Bearer {key}"}
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", headers=headers, timeout=10).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name:
                return sample.value
    raise AssertionError(f"no {name} in the engine's metrics:\n{text}")


def _leader_gauge(cluster: Cluster, name: str) -> float:
    """The sum of the leader's ``name`` samples for :data:`MODEL` (its ``/metrics``)."""
    with cluster.http() as http:
        text = http.get("/metrics").text
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name and sample.labels.get("model") == MODEL
    )


def _wait_until(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"waited {WAIT_S:.0f} s for {what}")
        time.sleep(0.1)


def _agent(cluster: Cluster, node_id: str) -> Agent:
    (found,) = [a for a in cluster.agents.values() if a.node_id == node_id]
    return found


def test_one_session_stays_on_one_node(real_routing_cluster: Cluster) -> None:
    before = served_by_node(real_routing_cluster, MODEL)
    for _ in range(6):
        assert _content(_chat(real_routing_cluster, "conversation-1"))
    pinned = _served_since(real_routing_cluster, before, 6)
    assert len(pinned) == 1 and sum(pinned.values()) == 6, pinned

    explained = real_routing_cluster.admin("GET", f"/admin/routing/{MODEL}?session=conversation-1")
    (node,) = pinned
    assert explained["affinity_node"] == node
    assert explained["candidates"][0]["affinity_hit"] is True
    assert {c["node_id"] for c in explained["candidates"]} == {
        agent.node_id for agent in real_routing_cluster.agents.values()
    }


def test_new_sessions_go_to_the_idle_node(real_routing_cluster: Cluster) -> None:
    before = served_by_node(real_routing_cluster, MODEL)
    busy = Stream(real_routing_cluster, "long-one")
    busy.start()
    busy.wait_flowing()
    busy_node = _affinity_node(real_routing_cluster, "long-one")
    for i in range(4):
        assert _content(_chat(real_routing_cluster, f"session-{i}"))
    busy.stop.set()
    busy.join(WAIT_S)
    served = _served_since(real_routing_cluster, before, 5)
    (idle_node,) = {a.node_id for a in real_routing_cluster.agents.values()} - {busy_node}
    assert served == Counter({busy_node: 1, idle_node: 4}), served
    # The client left: the engine dropped the stream and its slot is free again.
    engine = _engine(real_routing_cluster, _agent(real_routing_cluster, busy_node))
    _wait_until(
        lambda: _engine_metric(engine, "llamacpp:requests_processing") == 0,
        "the engine to drop the stream of a client that left",
    )


def test_a_killed_node_s_queued_requests_succeed_elsewhere(real_routing_cluster: Cluster) -> None:
    session = "doomed"
    assert _content(_chat(real_routing_cluster, session))
    victim = _agent(real_routing_cluster, _affinity_node(real_routing_cluster, session))
    (survivor,) = [a for a in real_routing_cluster.agents.values() if a is not victim]

    stream = Stream(real_routing_cluster, session)
    stream.start()
    stream.wait_flowing()
    # The survivor busy too, so that the next requests wait at the leader (both engines'
    # one slot taken) rather than go straight to the survivor.
    other = Stream(real_routing_cluster, "keeps-the-survivor-busy")
    other.start()
    other.wait_flowing()
    assert _affinity_node(real_routing_cluster, other.session) == survivor.node_id

    answers: list[httpx.Response] = []
    waiters = [
        threading.Thread(
            target=lambda: answers.append(_chat(real_routing_cluster, session, 8)), daemon=True
        )
        for _ in range(3)
    ]
    before = served_by_node(real_routing_cluster, MODEL)
    for thread in waiters:
        thread.start()
    # Deterministic: all three wait at the leader for a slot.
    _wait_until(
        lambda: _leader_gauge(real_routing_cluster, "berth_admission_queue_depth") == 3,
        "three requests waiting at the leader",
    )
    assert not answers

    assert victim.process is not None
    victim.process.send_signal(signal.SIGKILL)
    victim.process.wait()
    stream.join(WAIT_S)
    assert not stream.is_alive()
    other.stop.set()  # the survivor's slot frees: the waiting requests take it in turn
    for thread in [other, *waiters]:
        thread.join(WAIT_S)
        assert not thread.is_alive()

    assert len(answers) == 3
    for answer in answers:
        assert _content(answer)
    served = _served_since(real_routing_cluster, before, 5)
    assert served == Counter({survivor.node_id: 4, victim.node_id: 1}), served

    events = [line for line in stream.lines if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]", events[-3:]
    last: dict[str, Any] = json.loads(events[-2].removeprefix("data: "))
    assert "error" in last, events[-3:]
    assert any('"content"' in line for line in events[:-2]), "nothing streamed before the kill"
    real_routing_cluster.wait_node(victim.node_id, "unreachable")
    victim.process = None
