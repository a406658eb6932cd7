"""A real Prometheus scrapes a real leader: the cluster series exist and pass ``promtool``.

One leader with a deployment on node ``local`` and one on a real agent (fake llama-server
engines), plus a simulated agent that dials with an enrolled node's certificate and reports
GPUs in its heartbeats (this machine may have none). Prometheus (Debian's package) scrapes the
public listener over TLS with an API key; every cluster series must come back from its query
API, and ``promtool check metrics`` must find nothing to say about ``/metrics``.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import httpx
import pytest

from berth.cluster.protocol.frames import PROTOCOL_MAX, PROTOCOL_MIN, Heartbeat, Hello, encode_frame
from berth.cluster.protocol.payloads import GpuState, Inventory
from berth.runtime.engines import find_free_port
from support.cluster_harness import Agent, Cluster, started_cluster

PROMETHEUS = Path("/usr/bin/prometheus")
PROMTOOL = Path("/usr/bin/promtool")
SERIES = (
    "berth_node_gpu_util_pct",
    "berth_node_gpu_mem_used_bytes",
    "berth_deployment_in_flight",
    "berth_deployment_requests_total",
    "berth_deployment_latency_p50_seconds",
    "berth_deployment_latency_p95_seconds",
    "berth_deployment_errors_total",
    "berth_event_loop_lag_seconds_bucket",
)

pytestmark = [
    pytest.mark.slow,
    pytest.mark.needs("prometheus"),  # /usr/bin/prometheus and /usr/bin/promtool
]


class SimulatedGpuAgent:
    """Dials the leader as an enrolled node and sends heartbeats with two GPUs, in a thread."""

    def __init__(self, cluster: Cluster, agent: Agent) -> None:
        self._url = f"wss://127.0.0.1:{cluster.cluster_port}/cluster/agent"
        self._tls = ssl.create_default_context(cafile=str(cluster.leader_home / "ca" / "ca.pem"))
        self._tls.load_cert_chain(str(agent.cert), str(agent.key))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)

    def __enter__(self) -> SimulatedGpuAgent:
        self._thread.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    async def _run(self) -> None:
        gpus = [
            GpuState(index=i, name="Simulated GPU", memory_total_mb=81_559,
                     memory_used_mb=20_000 + i, utilization_pct=40 + i)
            for i in range(2)
        ]  # fmt: skip
        hello = Hello(
            protocol_min=PROTOCOL_MIN,
            protocol_max=PROTOCOL_MAX,
            agent_version="0-sim",
            inventory=Inventory(hostname="sim", gpus=gpus),
        )
        async with (
            aiohttp.ClientSession() as http,
            http.ws_connect(self._url, ssl=self._tls, max_msg_size=0) as ws,
        ):
            await ws.send_bytes(encode_frame(hello))
            while not self._stop.is_set():
                await ws.send_bytes(encode_frame(Heartbeat(sent_at=time.time(), gpus=gpus)))
                with contextlib.suppress(TimeoutError):
                    await ws.receive(timeout=0.5)  # Welcome, requests: not answered
        await asyncio.sleep(0.25)  # let the TLS transport shut down before the loop closes


@pytest.fixture(scope="module")
def scraped_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    root = tmp_path_factory.mktemp("scrape")
    settings = {
        "BERTH_STOP_GRACE_S": "5",
        "BERTH_HEARTBEAT_INTERVAL_S": "0.5",
        "BERTH_NODE_TIMEOUT_S": "5",
    }
    with started_cluster(root, settings) as cluster:
        agent = cluster.add_agent("gpu-a")
        cluster.deploy("tiny-remote", root / "tiny.gguf", agent)
        cluster.deploy("tiny-local", root / "tiny.gguf", None)
        yield cluster


@pytest.fixture(scope="module")
def simulated(scraped_cluster: Cluster) -> Iterator[Agent]:
    agent = scraped_cluster.enroll("gpu-sim")
    with SimulatedGpuAgent(scraped_cluster, agent):
        scraped_cluster.wait_node(agent.node_id, "ready")
        yield agent


@pytest.fixture(scope="module")
def prometheus(
    scraped_cluster: Cluster, simulated: Agent, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    """A Prometheus on 127.0.0.1 scraping the leader every second; its base URL."""
    root = tmp_path_factory.mktemp("prometheus")
    config = root / "prometheus.yml"
    ca = scraped_cluster.leader_home / "ca" / "ca.pem"
    config.write_text(
        "global:\n"
        "  scrape_interval: 1s\n"
        "  evaluation_interval: 1s\n"
        "scrape_configs:\n"
        "  - job_name: berth\n"
        "    scheme: https\n"
        "    metrics_path: /metrics\n"
        f"    authorization: {{credentials: '{scraped_cluster.api_key}'}}\n"
        f"    tls_config: {{ca_file: '{ca}'}}\n"
        "    static_configs:\n"
        f"      - targets: ['127.0.0.1:{scraped_cluster.public_port}']\n"
    )
    port = find_free_port()
    with (root / "prometheus.log").open("wb") as log:
        process = subprocess.Popen(
            [str(PROMETHEUS), f"--config.file={config}", f"--storage.tsdb.path={root / 'data'}",
             f"--web.listen-address=127.0.0.1:{port}"],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        process.terminate()
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def query(base_url: str, promql: str) -> list[dict[str, object]]:
    response = httpx.get(f"{base_url}/api/v1/query", params={"query": promql}, timeout=5)
    response.raise_for_status()
    body = response.json()
    assert body["status"] == "success", body
    result: list[dict[str, object]] = body["data"]["result"]
    return result


def wait_query(base_url: str, promql: str, timeout_s: float = 60) -> list[dict[str, object]]:
    """The first non-empty answer to ``promql`` within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        with contextlib.suppress(httpx.HTTPError):  # Prometheus may still be starting
            result = query(base_url, promql)
            if result:
                return result
        if time.monotonic() > deadline:
            raise AssertionError(f"Prometheus returned nothing for {promql!r}")
        time.sleep(0.5)


def send_traffic(cluster: Cluster) -> None:
    with cluster.openai() as client:
        for model in ("tiny-remote", "tiny-local"):
            for _ in range(3):
                client.chat.completions.create(
                    model=model, messages=[{"role": "user", "content": "hi"}]
                )


def test_prometheus_scrapes_every_cluster_series(
    scraped_cluster: Cluster, simulated: Agent, prometheus: str
) -> None:
    send_traffic(scraped_cluster)
    up = wait_query(prometheus, 'up{job="berth"} == 1')
    assert up, "the leader's /metrics is not scraped"
    agent = scraped_cluster.agents["gpu-a"]
    for name in SERIES:
        assert wait_query(prometheus, name), name
    for node in (agent.node_id, "local"):
        found = wait_query(prometheus, f'berth_deployment_requests_total{{node="{node}"}} >= 3')
        (sample,) = found
        assert sample["metric"]["model"] in ("tiny-remote", "tiny-local")  # type: ignore[index]
    for node in (agent.node_id, "local"):  # the leader's own loop, and the agent's
        assert wait_query(prometheus, f'berth_event_loop_lag_seconds_count{{node="{node}"}} > 0')
    gpus = wait_query(prometheus, f'berth_node_gpu_util_pct{{node="{simulated.node_id}"}}')
    assert sorted(s["metric"]["gpu"] for s in gpus) == ["0", "1"]  # type: ignore[index]
    send_traffic(scraped_cluster)  # more requests while Prometheus watches: a rate above zero
    rate = wait_query(prometheus, "sum(rate(berth_deployment_requests_total[1m])) > 0")
    assert rate


def test_promtool_finds_nothing_to_say_about_metrics(
    scraped_cluster: Cluster, simulated: Agent
) -> None:
    send_traffic(scraped_cluster)
    deadline = time.monotonic() + 30
    with scraped_cluster.http() as http:
        while True:
            text = http.get("/metrics").text
            if all(name in text for name in SERIES) or time.monotonic() > deadline:
                break
            time.sleep(0.5)
    assert all(name in text for name in SERIES), text
    checked = subprocess.run(
        [str(PROMTOOL), "check", "metrics"], input=text, capture_output=True, text=True, timeout=30
    )
    assert (checked.returncode, checked.stdout + checked.stderr) == (0, "")


def test_the_snapshot_has_every_node_with_short_series(
    scraped_cluster: Cluster, simulated: Agent
) -> None:
    send_traffic(scraped_cluster)
    agent = scraped_cluster.agents["gpu-a"]
    deadline = time.monotonic() + 30
    while True:
        snapshot = scraped_cluster.admin("GET", "/admin/metrics/snapshot")
        nodes = {n["node"]: n for n in snapshot["nodes"]}
        # every node, and the agent's first heartbeat after the traffic (one each 0.5 s)
        if {"local", agent.node_id, simulated.node_id} <= nodes.keys() and any(
            d["requests_total"] >= 3 for d in nodes[agent.node_id]["latest"]["deployments"]
        ):
            break
        assert time.monotonic() < deadline, snapshot
        time.sleep(0.5)
    assert snapshot["window_s"] == 60.0
    remote = nodes[agent.node_id]
    (deployment,) = remote["latest"]["deployments"]
    assert deployment["model"] == "tiny-remote"
    assert deployment["requests_total"] >= 3
    assert deployment["latency_p95_ms"] > 0
    assert len(remote["series"]["at"]) >= 2
    sim = nodes[simulated.node_id]
    assert sim["series"]["gpus"]["1"]["util_pct"][-1] == 41
