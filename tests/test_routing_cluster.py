"""Routing across real nodes: a leader and two agents serving the same model (real processes,
real TLS, the fake llama-server), checked from the client's side and the leader's metrics.

- requests with one ``X-Session-Id`` all land on one node; different sessions spread;
- an agent killed while requests wait for their first byte: those requests are retried on
  the other node and succeed; a stream already flowing from the killed node ends with an
  error event and ``[DONE]``.
"""

from __future__ import annotations

import json
import signal
import threading
from collections.abc import Iterator

import httpx
import pytest

from support.cluster_harness import Cluster, served_by_node, started_cluster
from support.fake_llama_server import HOLDING
from support.waiting import EVENT_TIMEOUT_S, wait_for

MODEL = "shared"


@pytest.fixture(scope="module")
def routing_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    # Not what is tested here: the killed agent's link drops at once (its sockets close), so
    # generous heartbeats lose nothing and a loaded machine does not drop the other link.
    settings = {
        "BERTH_STOP_GRACE_S": "5",
        "BERTH_HEARTBEAT_INTERVAL_S": "1",
        "BERTH_NODE_TIMEOUT_S": "30",
    }
    with started_cluster(tmp_path_factory.mktemp("routing"), settings) as cluster:
        for label in ("gpu-a", "gpu-b"):
            agent = cluster.add_agent(label)
            cluster.berth("models", "add", MODEL, str(cluster.root / "tiny.gguf"), "--node", label)
            ran = cluster.berth("run", MODEL, "--engine", "llamacpp", "--node", label)
            assert "ready" in ran.stdout, ran.stdout
            assert agent.process is not None
        yield cluster


def _chat(http: httpx.Client, session: str | None = None, **extra: object) -> httpx.Response:
    headers = {"X-Session-Id": session} if session else {}
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **extra}
    return http.post("/v1/chat/completions", json=body, headers=headers)


def test_one_session_stays_on_one_node_and_sessions_spread(routing_cluster: Cluster) -> None:
    before = served_by_node(routing_cluster, MODEL)
    with routing_cluster.http() as http:
        for _ in range(6):
            assert _chat(http, "conversation-1").status_code == 200
    pinned = served_by_node(routing_cluster, MODEL) - before
    assert len(pinned) == 1 and sum(pinned.values()) == 6, pinned

    # Eight new sessions at once, each held a second by its engine: the leader counts them in
    # flight, so they spread by load whatever the nodes' recent latencies (one after another,
    # a node that happened to answer faster on a loaded machine would take them all).
    before = served_by_node(routing_cluster, MODEL)
    statuses: list[int] = []

    def one_session(i: int) -> None:
        with routing_cluster.http(timeout_s=60) as http:
            statuses.append(_chat(http, f"s-{i}", x_head_delay_s=1).status_code)

    threads = [threading.Thread(target=one_session, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert statuses == [200] * 8, statuses
    spread = served_by_node(routing_cluster, MODEL) - before
    assert len(spread) == 2, f"eight sessions all went to one node: {spread}"

    explained = routing_cluster.admin("GET", f"/admin/routing/{MODEL}?session=conversation-1")
    assert explained["candidates"][0]["affinity_hit"] is True
    table = routing_cluster.berth("routing", MODEL, "--session", "conversation-1").stdout
    assert "affinity hit" in table and "no affinity" in table
    # Started without --parallel: llama-server's 4 slots, assumed, held at the leader.
    assert table.count("4, assumed (llama.cpp's default, --parallel auto)") == 2, table
    assert {(c["slots"], c["slots_assumed"]) for c in explained["candidates"]} == {(4, True)}
    assert {c["node_id"] for c in explained["candidates"]} == {
        routing_cluster.agents["gpu-a"].node_id,
        routing_cluster.agents["gpu-b"].node_id,
    }


def test_a_killed_node_s_waiting_requests_succeed_elsewhere(routing_cluster: Cluster) -> None:
    session = "doomed"
    with routing_cluster.http() as http:
        assert _chat(http, session).status_code == 200
    pinned = routing_cluster.admin("GET", f"/admin/routing/{MODEL}?session={session}")[
        "affinity_node"
    ]
    (victim,) = [a for a in routing_cluster.agents.values() if a.node_id == pinned]

    results: list[int] = []
    stream_tail: list[str] = []

    def streaming() -> None:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                "stream": True, "x_events": 400, "x_event_delay_s": 0.05}  # fmt: skip
        with (
            routing_cluster.http(timeout_s=60) as http,
            http.stream("POST", "/v1/chat/completions", json=body,
                        headers={"X-Session-Id": session}) as response,
        ):  # fmt: skip
            for line in response.iter_lines():
                stream_tail.append(line)

    victim_deployment = next(
        r for r in routing_cluster.admin("GET", "/admin/deployments")
        if r["node_id"] == victim.node_id and r["state"] == "ready"
    )  # fmt: skip
    victim_port = victim_deployment["port"]
    victim_log = victim.home / "logs" / f"engine-{victim_deployment['id']}.log"

    def held_by_the_victim() -> int:
        """Requests the victim's engine holds before answering (it logs each one)."""
        return victim_log.read_text().count(HOLDING)

    def waiting() -> None:
        with routing_cluster.http(timeout_s=60) as http:
            answer = _chat(http, session, x_head_delay_s=30, x_head_delay_port=victim_port)
            results.append(answer.status_code)

    streamer = threading.Thread(target=streaming)
    streamer.start()
    wait_for(
        lambda: any(line.startswith("data: ") for line in stream_tail),
        EVENT_TIMEOUT_S,
        "the stream to flow from the victim",
    )
    held_before = held_by_the_victim()
    waiters = [threading.Thread(target=waiting) for _ in range(3)]
    for thread in waiters:
        thread.start()
    wait_for(
        lambda: held_by_the_victim() - held_before == 3,
        EVENT_TIMEOUT_S,
        "three requests to wait for their first byte in the victim's engine",
    )
    assert not results  # none answered yet: each is retried after the kill
    assert victim.process is not None
    victim.process.send_signal(signal.SIGKILL)
    victim.process.wait()
    for thread in [streamer, *waiters]:
        thread.join(timeout=60)

    assert results == [200, 200, 200], results
    events = [line for line in stream_tail if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    assert any('"error"' in line for line in events[-3:]), events[-3:]
    routing_cluster.wait_node(victim.node_id, "unreachable")
    victim.process = None
    # The session now lives where it was retried, and the loss is in the audit log.
    explained = routing_cluster.admin("GET", f"/admin/routing/{MODEL}?session={session}")
    assert explained["affinity_node"] not in (None, victim.node_id)
    audit = (routing_cluster.leader_home / "logs" / "audit.log").read_text().splitlines()
    lost = [json.loads(line) for line in audit if '"node.lost"' in line]
    assert any(e["node_id"] == victim.node_id and e["label"] == victim.label for e in lost)
