"""``/metrics`` across a leader restart and an agent restart, with a real agent serving.

One leader and one agent (the fake llama-server engine), a handful of requests. Scraped
before and after ``berth daemon stop; berth daemon start``, and again after the agent
restarts: each scrape passes ``promtool check metrics``; the deployment's series keep their
label sets (the model label is restored from the store, not left empty); no counter is lower
than before except by a clean reset to zero, and none grew by more than the requests made.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from support.cluster_harness import Agent, Cluster, clean_env, fake_engine_wrapper
from support.installed import stop_for_missing

PROMTOOL = Path("/usr/bin/promtool")

pytestmark = pytest.mark.slow

#: A scrape as ``{(sample name, sorted label pairs): value}``.
Scrape = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def promtool() -> Path:
    """Debian's promtool; the test skips without it, and fails under ``CI=true``, where
    ``scripts/setup.sh`` installs it."""
    if PROMTOOL.exists():
        return PROMTOOL
    reason = (
        "needs promtool (/usr/bin/promtool): apt-get install prometheus, "
        "or run scripts/setup.sh as root"
    )
    stop_for_missing("prometheus", reason)  # a skip here, a failure under CI=true


@pytest.fixture
def restart_cluster(tmp_path: Path) -> Iterator[Cluster]:
    promtool()
    env = clean_env(
        {
            "BERTH_LLAMA_SERVER_BIN": str(fake_engine_wrapper(tmp_path)),
            "BERTH_STOP_GRACE_S": "5",
            "BERTH_HEARTBEAT_INTERVAL_S": "0.5",
            "BERTH_NODE_TIMEOUT_S": "5",
        }
    )
    (tmp_path / "tiny.gguf").write_bytes(b"GGUF" + bytes(60))
    cluster = Cluster(tmp_path, env)
    cluster.start()
    try:
        yield cluster
    finally:
        cluster.close()


def scrape(cluster: Cluster) -> tuple[str, Scrape]:
    """``/metrics`` as text, checked by promtool, and its samples."""
    with cluster.http() as http:
        text = http.get("/metrics").text
    checked = subprocess.run(
        [str(promtool()), "check", "metrics"], input=text, capture_output=True, text=True,
        timeout=30,
    )  # fmt: skip
    assert (checked.returncode, checked.stdout + checked.stderr) == (0, ""), text
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }
    return text, samples


def wait_requests(cluster: Cluster, deployment: str, expected: float) -> Scrape:
    """A scrape once the agent has reported ``expected`` requests for ``deployment``."""
    deadline = time.monotonic() + 30
    while True:
        _text, samples = scrape(cluster)
        found = requests_total(samples, deployment)
        if found == expected or time.monotonic() > deadline:
            assert found == expected, f"berth_deployment_requests_total is {found}"
            return samples
        time.sleep(0.25)


def requests_total(samples: Scrape, deployment: str) -> float | None:
    for (name, labels), value in samples.items():
        if name == "berth_deployment_requests_total" and ("deployment", deployment) in labels:
            return value
    return None


def of_deployment(samples: Scrape, deployment: str) -> Scrape:
    return {key: v for key, v in samples.items() if ("deployment", deployment) in key[1]}


def is_request_count(name: str) -> bool:
    """Samples that count requests (not tokens or seconds)."""
    return name.endswith(("requests_total", "errors_total", "_count", "_bucket"))


def assert_continuous(before: Scrape, after: Scrape, requests_made: int) -> None:
    """Every request-count sample in both scrapes either grew by at most ``requests_made``
    or restarted from zero and counted at most ``requests_made`` since."""
    for key, old in before.items():
        if key not in after or not is_request_count(key[0]):
            continue
        new = after[key]
        grew = old <= new <= old + requests_made
        reset = new <= requests_made
        assert grew or reset, f"{key}: {old} before, {new} after {requests_made} requests"


def chat(cluster: Cluster, model: str, count: int) -> None:
    with cluster.openai() as client:
        for _ in range(count):
            client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": "hi"}]
            )


def restart_leader(cluster: Cluster, agent: Agent, deployment: str) -> None:
    cluster.berth("daemon", "stop")
    cluster.berth("daemon", "start", "--public-port", str(cluster.public_port),
                  "--cluster-port", str(cluster.cluster_port))  # fmt: skip
    wait_linked(cluster, agent, deployment)


def wait_linked(cluster: Cluster, agent: Agent, deployment: str) -> None:
    """Until the agent's link is up, the deployment ready and its first report in."""
    cluster.wait_node(agent.node_id, "ready", timeout_s=60)
    deadline = time.monotonic() + 30
    while cluster.deployment(deployment)["state"] != "ready" or (
        requests_total(scrape(cluster)[1], deployment) is None
    ):
        assert time.monotonic() < deadline, cluster.deployment(deployment)
        time.sleep(0.25)


def test_series_keep_their_labels_and_counters_never_go_back(
    restart_cluster: Cluster, tmp_path: Path
) -> None:
    agent = restart_cluster.add_agent("gpu-a")
    deployment = restart_cluster.deploy("tiny-remote", tmp_path / "tiny.gguf", agent)
    chat(restart_cluster, "tiny-remote", 4)
    before = of_deployment(wait_requests(restart_cluster, deployment, 4), deployment)
    assert before, "no series of the deployment before the restart"

    restart_leader(restart_cluster, agent, deployment)
    chat(restart_cluster, "tiny-remote", 3)
    after = of_deployment(wait_requests(restart_cluster, deployment, 3), deployment)
    assert sorted(after) == sorted(before)  # the same label sets, model="tiny-remote" included
    assert {dict(labels).get("model") for _name, labels in after} == {"tiny-remote"}
    assert_continuous(before, after, 3)

    restart_cluster.stop_agent(agent)  # its engine keeps running; the new agent counts from 0
    restart_cluster.start_agent(agent)
    wait_linked(restart_cluster, agent, deployment)
    chat(restart_cluster, "tiny-remote", 2)
    again = of_deployment(wait_requests(restart_cluster, deployment, 5), deployment)
    assert sorted(again) == sorted(after)
    assert_continuous(after, again, 2)
    for key, old in after.items():
        if is_request_count(key[0]):
            assert again[key] >= old, key  # no reset: the leader did not restart
