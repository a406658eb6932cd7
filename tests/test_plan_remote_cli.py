"""Placement by fit where the models live, with real processes: a leader with no GPUs of its
own and an agent simulating one 4 GiB GPU, each its own process and ``BERTH_HOME``, driven
through the real ``berth`` CLI.  The model's file is in the agent's home, registered with
``--node``, so the leader does not read it: the agent reads its header (``op.model_shape``).

``berth plan`` prints the same estimate for it as for the same file on the leader, and its
exit code says the verdict: 0 would place, 3 refused (``--json`` too).
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from berth.api import ModelDetail, Plan
from support.cluster_harness import Agent, Cluster, started_cluster
from support.model_gguf import write_model_gguf

pytestmark = pytest.mark.slow  # a leader, an agent and a CLI process per command


@pytest.fixture(scope="module")
def remote_models(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Cluster, Agent]]:
    root = tmp_path_factory.mktemp("plan-remote")
    settings = {"BERTH_HEARTBEAT_INTERVAL_S": "1", "BERTH_NODE_TIMEOUT_S": "30"}
    with started_cluster(root, settings) as cluster:
        agent = cluster.add_agent("gpu-a", {"BERTH_SIMULATED_GPUS": "4GiB"})
        on_leader = write_model_gguf(root / "leader-models" / "m.gguf")
        on_agent = write_model_gguf(agent.home / "models" / "m.gguf")
        for name, path, node in (("on-leader", on_leader, None), ("on-agent", on_agent, "gpu-a")):
            body = {"name": name, "path": str(path), "node": node}
            cluster.admin("POST", "/admin/models", json=body)
        yield cluster, agent


def estimate_lines(printed: str) -> list[str]:
    """The estimate line and its inputs, where it was read from left out."""
    lines = printed.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("estimate: "))
    block = [lines[start]]
    for line in lines[start + 1 :]:
        if not line.startswith("  "):
            break
        if not line.lstrip().startswith("read from"):
            block.append(line)
    return block


def test_a_model_only_on_an_agent_is_estimated_as_the_same_file_on_the_leader(
    remote_models: tuple[Cluster, Agent],
) -> None:
    cluster, agent = remote_models
    placed = cluster.berth("plan", "on-agent", check=False)
    assert placed.returncode == 0, (placed.stdout, placed.stderr)
    assert "would run on node gpu-a GPU 0" in placed.stdout, placed.stdout
    path = agent.home / "models" / "m.gguf"
    assert f"read from         GGUF header: {path} on node gpu-a" in placed.stdout

    # the same file on the leader: the same estimate, but no copy on the node with a GPU
    leader = cluster.berth("plan", "on-leader", check=False)
    assert leader.returncode == 3, (leader.stdout, leader.stderr)
    assert "refused (no_node)" in leader.stdout
    assert estimate_lines(placed.stdout) == estimate_lines(leader.stdout)
    assert estimate_lines(placed.stdout)[0] == (
        "estimate: 1.52 GiB (weights 96 MiB + KV cache 180 MiB + overhead 1.25 GiB at ctx "
        "8192, f16)"
    )

    shown = ModelDetail.model_validate(cluster.admin("GET", "/admin/models/on-agent"))
    (copy,) = shown.copies
    assert (copy.node_label, copy.path, copy.problem) == ("gpu-a", str(path), None)
    assert copy.shape is not None and copy.shape.block_count == 30
    assert copy.estimate is not None and copy.estimate.total_mb == 96 + 180 + 1280
    printed = cluster.berth("models", "show", "on-agent").stdout
    assert f"node gpu-a: {path}" in printed
    assert "  estimate (llamacpp): 1.52 GiB (weights 96 MiB" in printed


def test_a_refused_plan_exits_3_with_its_reasons_in_json(
    remote_models: tuple[Cluster, Agent],
) -> None:
    cluster, _agent = remote_models
    as_json = cluster.berth("plan", "on-agent", "--ctx", "1048576", "--json", check=False)
    assert as_json.returncode == 3, as_json.stderr
    answer = Plan.model_validate(json.loads(as_json.stdout))
    assert (answer.placed, answer.refusal_reason) == (False, "vram_too_large")
    assert answer.refusal is not None and "no GPU can take model on-agent" in answer.refusal
    assert answer.estimate is not None and answer.estimate.ctx == 1048576
