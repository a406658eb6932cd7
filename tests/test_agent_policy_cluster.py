"""The agent policy with real agents: a leader and an agent, each its own process, over mTLS
on loopback, the leader told to skip its own policy check (``SKIP_POLICY_CHECK_ENV``), so
every start below reaches the agent, which refuses it naming the rule.  The refusal comes
back on the link as ``policy_refused`` and is what ``berth run`` prints and the deployment
records.  One cluster and one agent serve the whole module.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from berth.daemon.build import SKIP_POLICY_CHECK_ENV
from support.cluster_harness import TINY_GGUF_BYTES, Agent, Cluster, cli, started_cluster

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def policed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Cluster, Agent, Path]]:
    """A cluster whose leader skips its check, and agent ``gpu-a`` whose ``agent.yaml``
    allows models under ``<root>/models`` only and the official vLLM image only."""
    root = tmp_path_factory.mktemp("policy")
    settings = {"BERTH_HEARTBEAT_INTERVAL_S": "1", SKIP_POLICY_CHECK_ENV: "1"}
    with started_cluster(root, settings) as cluster:
        agent = cluster.enroll("gpu-a")
        allowed = root / "models"
        allowed.mkdir()
        document = yaml.safe_load((agent.home / "agent.yaml").read_text())
        document["policy"] = {"model_roots": [str(allowed)], "images": ["vllm/vllm-openai*"]}
        (agent.home / "agent.yaml").write_text(yaml.safe_dump(document))
        cluster.start_agent(agent)
        (allowed / "tiny.gguf").write_bytes(TINY_GGUF_BYTES)
        cluster.berth("models", "add", "tiny", str(allowed / "tiny.gguf"), "--node", "gpu-a")
        yield cluster, agent, root


def _refused_run(cluster: Cluster, *args: str) -> str:
    """Run ``berth run ARGS`` on gpu-a, which must fail; the deployment's failure reason,
    checked to be what ``berth run`` printed."""
    ran = cluster.berth("run", *args, "--node", "gpu-a", check=False)
    assert ran.returncode != 0, ran.stdout
    found = re.search(r"\bd-[0-9a-f]{8}\b", ran.stdout + ran.stderr)
    assert found, ran.stdout + ran.stderr
    record = cluster.deployment(found.group(0))
    assert record["state"] == "failed"
    reason = str(record["failure_reason"])
    assert "refused by the agent policy" in ran.stderr, ran.stderr
    return reason


def test_an_image_outside_the_policy_is_refused_by_the_agent(
    policed: tuple[Cluster, Agent, Path],
) -> None:
    cluster, agent, _root = policed
    if "docker" not in str(cluster.node(agent.node_id).get("capabilities", "")):
        pytest.skip("the agent found no Docker engine (scripts/start_dockerd.sh starts one)")
    reason = _refused_run(cluster, "tiny", "--runtime", "docker", "--image", "example.org/miner:1")
    assert "node " + agent.node_id in reason
    assert "refused by the agent policy (images): image example.org/miner:1 is not allowed " \
        "(images: vllm/vllm-openai*)" in reason  # fmt: skip


def test_trust_remote_code_is_refused_by_the_agent(policed: tuple[Cluster, Agent, Path]) -> None:
    cluster, _agent, _root = policed
    reason = _refused_run(cluster, "tiny", "--engine", "vllm", "--extra-arg=--trust-remote-code")
    assert "refused by the agent policy (engine_args): extra argument --trust-remote-code is " \
        "refused: it runs the Python code shipped in the model folder" in reason  # fmt: skip


def test_a_model_path_outside_the_roots_is_refused_by_the_agent(
    policed: tuple[Cluster, Agent, Path],
) -> None:
    cluster, _agent, root = policed
    outside = root / "elsewhere" / "tiny.gguf"
    outside.parent.mkdir()
    outside.write_bytes(TINY_GGUF_BYTES)
    cluster.berth("models", "add", "stray", str(outside), "--node", "gpu-a")
    reason = _refused_run(cluster, "stray")
    assert (
        f"refused by the agent policy (model_roots): model path {outside} is outside the "
        f"model roots ({root / 'models'})" in reason
    )


def test_a_chat_template_outside_the_roots_is_refused_by_the_agent(
    policed: tuple[Cluster, Agent, Path],
) -> None:
    cluster, _agent, root = policed
    template = root / "agent-gpu-a" / "agent.key"  # what a stolen admin key would ask for
    reason = _refused_run(cluster, "tiny", f"--extra-arg=--chat-template-file={template}")
    assert (
        f"refused by the agent policy (engine_args): extra argument --chat-template-file "
        f"{template}: the file is outside the model roots" in reason
    )


def test_a_malformed_policy_stops_the_agent_naming_the_file(
    policed: tuple[Cluster, Agent, Path],
) -> None:
    cluster, _agent, _root = policed
    agent = cluster.enroll("bad-policy")
    config = agent.home / "agent.yaml"
    document = yaml.safe_load(config.read_text())
    document["policy"] = {"model_roots": ["models"]}
    config.write_text(yaml.safe_dump(document))
    started = cli(agent.home, "agent", "start", env=cluster.env, check=False, timeout_s=60)
    assert started.returncode != 0
    assert f"{config}: policy: model_roots: 'models' is not an absolute path" in (
        started.stdout + started.stderr
    )


def test_the_agent_reports_its_policy_and_nodes_show_prints_it(
    policed: tuple[Cluster, Agent, Path],
) -> None:
    cluster, agent, root = policed
    reported = cluster.node(agent.node_id)["policy"]
    assert (reported["model_roots"], reported["images"]) == (
        [str(root / "models")],
        ["vllm/vllm-openai*"],
    )
    assert "--trust-remote-code" not in reported["allow_args"]
    shown = cluster.berth("nodes", "show", "gpu-a").stdout
    assert f"policy        engines: llamacpp, sglang, vllm; images: vllm/vllm-openai*; model " \
        f"roots: {root / 'models'}; GPUs: all" in shown  # fmt: skip
    # The leader's own node: its [agent_policy] settings (the suite's, here).
    local = cluster.node("local")["policy"]
    assert local is not None and "berth-test/*" in local["images"]
