"""``berth plan`` and placement by fit through the real CLI and a real leader whose own host
simulates two 2 GiB GPUs (``BERTH_SIMULATED_GPUS``); engines are the fake llama-server,
the model the SmolLM2 GGUF (its header gives the estimate: 1554 MiB at its 8192 context)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator

import pytest

from berth.api import Plan
from berth.runtime.bundled import smollm2_gguf
from support.cluster_harness import Cluster, clean_env, fake_engine_wrapper

pytestmark = [
    pytest.mark.slow,  # a real leader and a CLI process per command (3 s each on a busy host)
    pytest.mark.needs("smollm2"),
]


@pytest.fixture(scope="module")
def plan_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Cluster, str]]:
    root = tmp_path_factory.mktemp("plan")
    env = clean_env({
        "BERTH_LLAMA_SERVER_BIN": str(fake_engine_wrapper(root)),
        "BERTH_SIMULATED_GPUS": "2GiB,2GiB",
        "BERTH_STOP_GRACE_S": "5",
    })  # fmt: skip
    cluster = Cluster(root, env)
    cluster.leader_home.mkdir(parents=True)
    banner = cluster.berth("daemon", "start", "--public-port", str(cluster.public_port),
                           "--cluster-port", str(cluster.cluster_port)).stdout  # fmt: skip
    try:
        cluster.berth("models", "add", "smol", str(smollm2_gguf()))
        yield cluster, banner
    finally:
        cluster.close()


def test_the_start_banner_says_the_gpus_are_simulated(plan_cluster: tuple[Cluster, str]) -> None:
    _cluster, banner = plan_cluster
    assert re.search(
        r"GPUs\s+simulated: 2048 MiB, 2048 MiB \(simulated_gpus, a testing aid: NVML is not "
        r"asked; engines run on the CPU\)",
        banner,
    ), banner


def test_plan_fills_the_gpus_then_refuses_with_the_estimate(
    plan_cluster: tuple[Cluster, str],
) -> None:
    cluster, _banner = plan_cluster
    printed = cluster.berth("plan", "smol").stdout
    lines = printed.splitlines()
    assert lines[0] == "plan for model smol on llamacpp (process)"
    assert lines[1] == (
        "estimate: 1.52 GiB (weights 94 MiB + KV cache 180 MiB + overhead 1.25 GiB at ctx "
        "8192, f16)"
    )
    assert "  layers            30" in lines
    assert "  context           8192 (the model's trained context)" in lines
    assert any(line.startswith("would run on node local GPU 0 (model at ") for line in lines)
    assert "fits, takes 1.52 GiB of 2.00 GiB free" in printed
    assert cluster.admin("GET", "/admin/deployments") == []  # a dry run

    answer = Plan.model_validate(json.loads(cluster.berth("plan", "smol", "--json").stdout))
    assert (answer.placed, answer.node_id, answer.gpus) == (True, "local", [0])
    assert answer.estimate is not None
    assert (answer.estimate.weights_mb, answer.estimate.kv_cache_mb) == (94, 180)
    assert answer.estimate.total_mb == 1554
    assert [(o.index, o.free_mb, o.verdict) for o in answer.considered] == [
        (0, 2048, "fits"),
        (1, 2048, "fits"),
    ]

    ran = [cluster.berth("run", "smol", "--served-name", f"smol-{n}").stdout for n in (1, 2)]
    assert "GPU 0)" in ran[0] and "GPU 1)" in ran[1], ran

    refusal = cluster.berth("plan", "smol", check=False)
    assert refusal.returncode == 3, refusal.stderr  # a refused plan: exit 3, the reasons printed
    refused = refusal.stdout
    assert "refused (vram_no_room): no GPU can take model smol: it needs 1.52 GiB" in refused
    assert "the most free VRAM seen is 494 MiB (node local GPU 0)" in refused
    # the two are younger than the minimum residency, so no eviction would make room
    assert "no eviction makes room" in refused and "under the minimum residency of 1m" in refused

    third = cluster.berth("run", "smol", "--served-name", "smol-3", check=False)
    assert third.returncode == 2 and third.stdout == ""
    assert third.stderr.startswith(
        "error: no GPU can take model smol: it needs 1.52 GiB (weights 94 MiB + KV cache 180 "
        "MiB + overhead 1.25 GiB at ctx 8192, f16); the most free VRAM seen is 494 MiB"
    ), third.stderr
    assert len(cluster.admin("GET", "/admin/deployments")) == 2  # nothing created


@pytest.mark.parametrize(
    ("args", "error"),
    [
        (["plan", "nothing"], "error: no service or model named 'nothing' (berth service ls, "
                              "berth models ls)"),
        (["run", "smol", "--ctx", "100000000"], "error: no GPU can take model smol: it needs "),
        (["plan", "smol", "-x", "-ctk", "-x", "q3"], "error: unknown llama.cpp cache type 'q3'"),
    ],
    ids=["unknown target", "context too large", "cache type"],
)  # fmt: skip
def test_bad_input_is_refused_with_the_reason(
    plan_cluster: tuple[Cluster, str], args: list[str], error: str
) -> None:
    cluster, _banner = plan_cluster
    before = cluster.admin("GET", "/admin/deployments")
    result = cluster.berth(*args, check=False)
    assert result.returncode == 2, (result.stdout, result.stderr)
    assert result.stderr.startswith(error), result.stderr
    assert cluster.admin("GET", "/admin/deployments") == before


def test_a_context_that_is_not_a_positive_integer_is_refused(
    plan_cluster: tuple[Cluster, str],
) -> None:
    cluster, _banner = plan_cluster
    result = cluster.berth("plan", "smol", "--ctx", "0", check=False)
    assert result.returncode == 2 and "--ctx" in result.stderr, result.stderr
    transport_answer = cluster_admin_status(cluster, {"target": "smol", "ctx": 0})
    assert transport_answer == (400, "ctx: Input should be greater than 0")


def cluster_admin_status(cluster: Cluster, body: dict[str, object]) -> tuple[int, str]:
    import httpx

    transport = httpx.HTTPTransport(uds=str(cluster.leader_home / "berth.sock"))
    with httpx.Client(transport=transport, base_url="http://berth") as api:
        answer = api.post("/admin/plan", json=body)
    return answer.status_code, answer.json()["error"]["message"]
