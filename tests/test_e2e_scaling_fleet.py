"""Fleet scaling end to end: a leader daemon and two agents, each agent with one simulated
2 GiB GPU (``BERTH_SIMULATED_GPUS``), the fake llama-server as the engine and the SmolLM2
GGUF for the VRAM estimate (1.52 GiB at its default context: one deployment per GPU).

A burst of 50 requests on a cold service starts exactly one deployment and all are
answered; sustained load starts a second replica on the other node; after the idle timeout
the service is back to zero.  With both GPUs full (one pinned, one busy) a third service's
start is refused naming what was kept; once the busy one is idle, the third evicts it (never
the pinned one) and the eviction is in the audit log.  A deployment that fits nowhere is
refused with the estimate.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from berth.runtime.bundled import smollm2_gguf
from support.cluster_harness import Cluster, started_cluster
from support.fake_llama_server import HOLDING
from support.waiting import wait_for

pytestmark = [pytest.mark.slow, pytest.mark.needs("smollm2")]

CHAT = [{"role": "user", "content": "hi"}]
LEADER_SETTINGS = {
    "BERTH_STOP_GRACE_S": "5",
    "BERTH_HEARTBEAT_INTERVAL_S": "1",
    "BERTH_NODE_TIMEOUT_S": "30",
    "BERTH_SCALING_INTERVAL_S": "0.2",
    "BERTH_SCALE_OUT_AFTER_S": "1",
    "BERTH_MIN_RESIDENCY_S": "1",
    "BERTH_LOAD_WAIT_S": "60",
}
ONE_GPU = {"BERTH_SIMULATED_GPUS": "2GiB"}


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[Cluster]:
    gguf = smollm2_gguf()
    assert gguf is not None
    with started_cluster(tmp_path, LEADER_SETTINGS) as cluster:
        cluster.berth("models", "add", "smol", str(gguf))  # the leader reads its header
        for label in ("gpu-a", "gpu-b"):
            cluster.add_agent(label, ONE_GPU)
            cluster.berth("models", "add", "smol", str(gguf), "--node", label)
        yield cluster


def active(cluster: Cluster, service: str) -> list[dict[str, Any]]:
    records: list[dict[str, Any]] = cluster.admin("GET", "/admin/deployments?active=true")
    return [r for r in records if r["service"] == service]


def chat(http: httpx.Client, model: str, **extra: Any) -> httpx.Response:
    return http.post("/v1/chat/completions", json={"model": model, "messages": CHAT, **extra})


def service(cluster: Cluster, name: str, *settings: str) -> None:
    cluster.berth("service", "create", name, "--model", "smol", *settings)
    cluster.berth("route", "create", f"{name}-route", "--service", name)


def audit(cluster: Cluster) -> list[dict[str, Any]]:
    lines = (cluster.leader_home / "logs" / "audit.log").read_text().splitlines()
    return [json.loads(line) for line in lines]


def in_background(http: httpx.Client, model: str, delay_s: float) -> threading.Thread:
    """A request the engine holds ``delay_s`` seconds before answering (in flight)."""

    def run() -> None:
        assert chat(http, model, x_head_delay_s=delay_s).status_code == 200

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_services_load_on_demand_scale_out_unload_and_evict_across_two_agents(
    fleet: Cluster,
) -> None:
    nodes = {a.node_id for a in fleet.agents.values()}
    # Idle for 10 minutes while the test looks at the replicas (a loaded machine's CLI calls
    # outlasted a 3 s timeout between the scale-out and `service show`); 1 s once it has.
    service(fleet, "a", "--max-replicas", "1", "--idle-timeout", "10m", "--capacity", "1")

    # a burst of 50 on the cold service: one start, every request answered
    limits = httpx.Limits(max_connections=60, max_keepalive_connections=60)
    with fleet.http() as http, httpx.Client(
        base_url=fleet.base_url, verify=fleet.tls(), timeout=60, limits=limits,
        headers={"Authorization": f"Bearer {fleet.api_key}"},
    ) as burst:  # fmt: skip
        with ThreadPoolExecutor(50) as pool:
            answers = list(pool.map(lambda _i: chat(burst, "a-route"), range(50)))
        assert [r.status_code for r in answers] == [200] * 50, answers[0].text
        (first,) = active(fleet, "a")
        assert first["state"] == "ready" and first["node_id"] in nodes

        # sustained load (its capacity in flight for longer than scale_out_after_s) starts
        # a second replica, on the other node
        fleet.berth("service", "scale", "a", "--max", "2")
        slow = in_background(http, "a-route", 2.0)
        wait_for(lambda: len(active(fleet, "a")) == 2, 30, "a second replica of a")
        second = next(r for r in active(fleet, "a") if r["id"] != first["id"])
        assert second["node_id"] != first["node_id"]
        shown = fleet.berth("service", "show", "a").stdout
        assert "last decision: start" in shown and "every replica had its capacity" in shown
        slow.join(30)
        fleet.berth("service", "scale", "a", "--idle-timeout", "1s")

        # after the idle timeout: back to zero, each unload audited with its reason
        wait_for(lambda: not active(fleet, "a"), 60, "service a back to zero")
        unloaded = [e for e in audit(fleet) if e.get("event") == "deployment_unloaded"]
        assert {first["id"], second["id"]} <= {e["deployment"] for e in unloaded}
        assert all(e["service"] == "a" and e["reason"].startswith("idle: ") for e in unloaded)

        # both GPUs full: p pinned, q busy; r's start finds nothing it may evict
        service(fleet, "p", "--pin", "--idle-timeout", "10m")
        service(fleet, "q", "--idle-timeout", "10m")
        service(fleet, "r", "--idle-timeout", "10m")
        assert chat(http, "p-route").status_code == 200
        assert chat(http, "q-route").status_code == 200
        (p,), (q,) = active(fleet, "p"), active(fleet, "q")
        assert {p["node_id"], q["node_id"]} == nodes
        busy = in_background(http, "q-route", 10.0)  # outlasts a slow machine's steps
        wait_for(lambda: HOLDING in fleet.berth("logs", q["id"]).stdout, 10, "q's request held")
        refused = chat(http, "r-route")
        assert refused.status_code == 503, refused.text
        assert "retry-after" in refused.headers
        message = refused.json()["error"]["message"]
        assert "no eviction makes room" in message, message
        # placement names what kept the first GPU it looked at: pinned p, or busy q
        assert f"{p['id']}: pinned" in message or f"{q['id']}: 1 request(s) in flight" in message
        assert not active(fleet, "r")
        busy.join(30)

        # q is idle now: r evicts it (the least recently used idle one), never pinned p
        assert chat(http, "r-route").status_code == 200
        (r,) = active(fleet, "r")
        assert r["node_id"] == q["node_id"] and not active(fleet, "q")
        assert [d["id"] for d in active(fleet, "p")] == [p["id"]]
        (evicted,) = [e for e in audit(fleet) if e.get("event") == "deployment_evicted"]
        assert evicted["deployment"] == q["id"] and evicted["service"] == "q"
        assert evicted["reason"].startswith(f"to make room for service r: stop {q['id']} (q)")
        shown = fleet.berth("service", "show", "q").stdout
        assert "last decision: stop" in shown and "evicted for service r" in shown

    # a deployment by hand never evicts: it fits nowhere and is refused with the estimate
    run = fleet.berth("run", "smol", check=False)
    assert run.returncode != 0
    assert "no GPU can take model smol: it needs 1.52 GiB" in run.stderr, run.stderr
    ps = json.loads(fleet.berth("ps", "--json").stdout)
    assert sorted(d["service"] for d in ps if d["state"] == "ready") == ["p", "r"]
