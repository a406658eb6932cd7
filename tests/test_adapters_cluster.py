"""LoRA adapters routed across real nodes: a leader and two agents (real processes, real TLS,
the real link ops), each running a stand-in vLLM that speaks vLLM's adapter API with two
adapter slots (``support/fake_vllm_server.py``), driven through the real ``berth`` CLI and
the OpenAI SDK.

The tests run in order on one cluster, each starting from what the one before left loaded:

1. a new adapter is loaded into a free slot, and the requests after it go to the engine that
   has it (the loaded tier beats every free slot);
2. with both slots taken, the least recently used idle adapter is unloaded first;
3. a failed adapter request is not retried onto an engine that cannot have the adapter
   (while a request for the base model is);
4. bad input is refused with the reason.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from support import fake_vllm_server
from support.cluster_harness import Cluster, started_cluster

pytestmark = pytest.mark.slow  # a leader, two agents and their engines: about two minutes

BASE = "tiny-llama"
LABELS = ("gpu-a", "gpu-b")


def write_base(folder: Path) -> Path:
    """An HF-style model folder (the stand-in engine reads nothing of it)."""
    folder.mkdir(parents=True)
    config = {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4,
              "num_hidden_layers": 2, "intermediate_size": 128}  # fmt: skip
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def write_peft(folder: Path, rank: int = 8) -> Path:
    """A PEFT LoRA folder: ``adapter_config.json`` and a safetensors file with one pair."""
    folder.mkdir(parents=True)
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 16,
              "target_modules": ["q_proj", "v_proj"], "base_model_name_or_path": BASE}  # fmt: skip
    (folder / "adapter_config.json").write_text(json.dumps(config))
    prefix = "base_model.model.model.layers.0.self_attn.q_proj"
    header = {
        f"{prefix}.lora_A.weight": {"dtype": "F32", "shape": [rank, 64], "data_offsets": [0, 0]},
        f"{prefix}.lora_B.weight": {"dtype": "F32", "shape": [64, rank], "data_offsets": [0, 0]},
    }
    raw = json.dumps(header).encode()
    (folder / "adapter_model.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw)
    return folder


@pytest.fixture(scope="module")
def adapter_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    root = tmp_path_factory.mktemp("adapters")
    settings = {"BERTH_VLLM_BIN": str(fake_vllm_server.wrapper(root)), "BERTH_STOP_GRACE_S": "5"}
    base = write_base(root / "models" / BASE)
    with started_cluster(root, settings) as cluster:
        for label in LABELS:
            cluster.add_agent(label)
            cluster.berth("models", "add", BASE, str(base), "--node", label)
        for label in LABELS:
            ran = cluster.berth(
                "run", BASE, "--engine", "vllm", "--node", label, "--max-adapters", "2"
            )
            assert "ready" in ran.stdout, ran.stdout
        yield cluster


def add_adapter(cluster: Cluster, name: str, *labels: str) -> None:
    folder = write_peft(cluster.root / "adapters" / name)
    for label in labels:
        added = cluster.berth("adapters", "add", name, "--base", BASE, "--path", str(folder),
                              "--node", label)  # fmt: skip
        assert f"added adapter {name}" in added.stdout, added.stdout


def engines(cluster: Cluster) -> dict[int, str]:
    """Engine port -> node label of the two deployments."""
    labels = {agent.node_id: label for label, agent in cluster.agents.items()}
    return {
        d["port"]: labels[d["node_id"]]
        for d in cluster.admin("GET", "/admin/deployments?active=true")
    }


def loaded(cluster: Cluster, label: str) -> list[str]:
    """The adapters the stand-in engine on ``label``'s node has loaded (asked directly)."""
    port = next(p for p, node in engines(cluster).items() if node == label)
    names: list[str] = httpx.get(f"http://127.0.0.1:{port}/x/adapters").json()
    return names


def chat(cluster: Cluster, model: str, **extra: Any) -> tuple[str, str]:
    """Ask ``model`` through the OpenAI SDK; (the answer, the node label that gave it)."""
    with cluster.openai() as client:
        answer = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "hi"}], extra_body=extra
        )
    port = answer.model_extra["x_port"] if answer.model_extra else None
    return answer.choices[0].message.content or "", engines(cluster)[int(port)]


def engine_log(cluster: Cluster, label: str) -> list[str]:
    deployment = next(
        d["id"]
        for d in cluster.admin("GET", "/admin/deployments?active=true")
        if d["node_id"] == cluster.agents[label].node_id
    )
    text = cluster.berth("logs", deployment).stdout
    return [line for line in text.splitlines() if line.startswith("fake vllm: ")]


state: dict[str, str] = {}


def test_a_new_adapter_is_loaded_on_a_free_slot_and_then_served_where_it_is(
    adapter_cluster: Cluster,
) -> None:
    add_adapter(adapter_cluster, "chat", *LABELS)
    with adapter_cluster.openai() as client:
        models = {m.id: m for m in client.models.list()}
    assert models["chat"].model_extra == {"parent": BASE}

    content, first = chat(adapter_cluster, "chat")
    assert content == "adapter chat"
    assert loaded(adapter_cluster, first) == ["chat"]
    other = next(label for label in LABELS if label != first)
    assert loaded(adapter_cluster, other) == []
    state["node"] = first
    # Both engines have a free slot, but only one has the adapter: it gets every request.
    served = {chat(adapter_cluster, "chat", user=f"session-{i}")[1] for i in range(6)}
    assert served == {first}
    assert loaded(adapter_cluster, other) == []

    shown = json.loads(adapter_cluster.berth("adapters", "show", "chat", "--json").stdout)
    node_id = adapter_cluster.agents[first].node_id
    assert [x["node_id"] for x in shown["loaded_on"]] == [node_id]
    listed = adapter_cluster.berth("adapters", "ls").stdout
    assert "chat" in listed and BASE in listed


def test_with_the_slots_full_the_least_recently_used_idle_adapter_is_unloaded(
    adapter_cluster: Cluster,
) -> None:
    node = state["node"]  # has "chat" loaded, one slot free
    add_adapter(adapter_cluster, "sql", node)
    add_adapter(adapter_cluster, "math", node)
    assert chat(adapter_cluster, "sql") == ("adapter sql", node)
    assert sorted(loaded(adapter_cluster, node)) == ["chat", "sql"]
    assert chat(adapter_cluster, "chat") == ("adapter chat", node)  # sql is now the oldest
    assert chat(adapter_cluster, "math") == ("adapter math", node)
    assert sorted(loaded(adapter_cluster, node)) == ["chat", "math"]
    events = engine_log(adapter_cluster, node)
    assert events.index(f"{fake_vllm_server.UNLOADED} sql") < events.index(
        f"{fake_vllm_server.LOADED} math"
    )
    # sql comes back on a slot of its own: math was used last, so chat goes.
    assert chat(adapter_cluster, "sql") == ("adapter sql", node)
    assert sorted(loaded(adapter_cluster, node)) == ["math", "sql"]

    with adapter_cluster.http() as http:
        metrics = http.get("/metrics").text
    loads = {
        (s.labels["adapter"], s.labels["outcome"]): s.value
        for family in text_string_to_metric_families(metrics)
        if family.name == "berth_adapter_loads"
        for s in family.samples
        if s.name.endswith("_total")
    }
    assert loads[("sql", "loaded")] == 2 and loads[("math", "loaded")] == 1
    requests = [
        s.labels
        for family in text_string_to_metric_families(metrics)
        if family.name == "berth_proxy_requests"
        for s in family.samples
        if s.name.endswith("_total")
    ]
    assert any(labels["model"] == "math" for labels in requests)  # the adapter is the model
    by_base = {
        (s.labels["adapter"], s.labels["base"]): s.value
        for family in text_string_to_metric_families(metrics)
        if family.name == "berth_adapter_requests"
        for s in family.samples
        if s.name.endswith("_total")
    }
    assert by_base[("math", BASE)] == 1 and by_base[("sql", BASE)] == 2


def test_an_adapter_request_is_not_retried_onto_an_engine_without_the_adapter(
    adapter_cluster: Cluster,
) -> None:
    node = state["node"]
    other = next(label for label in LABELS if label != node)
    port = next(p for p, label in engines(adapter_cluster).items() if label == node)
    before = engine_log(adapter_cluster, other)
    # "math" is only on the first node: its 503 is the client's answer, nothing goes elsewhere.
    with pytest.raises(openai.InternalServerError) as failed:
        chat(adapter_cluster, "math", x_fail_port=port)
    assert failed.value.status_code == 503
    assert engine_log(adapter_cluster, other) == before
    # The base model is on both nodes: the same failure is retried on the other one.
    assert chat(adapter_cluster, BASE, x_fail_port=port) == ("base", other)


def test_bad_adapters_are_refused_with_the_reason(adapter_cluster: Cluster) -> None:
    root = adapter_cluster.root
    folder = write_peft(root / "adapters" / "ok")
    unknown = adapter_cluster.berth("adapters", "add", "x1", "--base", "nope", "--path",
                                    str(folder), check=False)  # fmt: skip
    assert unknown.returncode != 0 and "model 'nope' not found" in unknown.stderr
    taken = adapter_cluster.berth("adapters", "add", BASE, "--base", BASE, "--path",
                                  str(folder), "--node", "gpu-a", check=False)  # fmt: skip
    assert taken.returncode != 0 and "a model's name" in taken.stderr
    gone = adapter_cluster.berth("adapters", "rm", "nothing", check=False)
    assert gone.returncode != 0 and "not found" in gone.stderr
