"""``GET /admin/routing/MODEL`` and ``berth routing MODEL`` say each candidate's slots at the
leader's fair admission queue and where they came from: known (a service's capacity, an
engine's flag) or assumed (an engine's default, the ``default_slots`` setting for an adopted
endpoint). The admin route is served in-process over the real ready table and router."""

from __future__ import annotations

from datetime import UTC, datetime

from fastapi import FastAPI
from fastapi.testclient import TestClient

from berth.admin.routing import build_routing_router
from berth.api import RoutingExplanation
from berth.cli.routing_cmd import slots_text
from berth.cluster.leader.agent_link import EngineEndpoint
from berth.cluster.protocol.payloads import AdoptedState
from berth.deployments.ready_table import ReadyTable
from berth.routing.router import Router
from berth.vocab.records import DeploymentRecord
from berth.vocab.states import DeploymentState

NOW = datetime(2026, 1, 1, tzinfo=UTC)


def deployment(deployment_id: str, engine: str, args: tuple[str, ...] = ()) -> DeploymentRecord:
    return DeploymentRecord(
        deployment_id, "chat", engine, "process", "local", DeploymentState.READY,
        8080, 1, (), None, args, "chat", None, NOW, NOW,
    )  # fmt: skip


def explained(table: ReadyTable) -> RoutingExplanation:
    app = FastAPI()
    app.include_router(build_routing_router(Router(table)))
    with TestClient(app) as http:
        answer = http.get("/admin/routing/chat")
    assert answer.status_code == 200, answer.text
    return RoutingExplanation.model_validate_json(answer.content)


def test_the_routing_explanation_says_which_slots_are_known_and_which_assumed() -> None:
    table = ReadyTable(default_slots=8)
    table.set_service_capacities({"chat": None})
    for record in (
        deployment("d-flag", "llamacpp", ("--parallel", "2")),
        deployment("d-auto", "llamacpp"),
        deployment("d-vllm", "vllm"),
    ):
        table.mark_ready(record, EngineEndpoint(record.id, "http://127.0.0.1:8080", 1, 8080))
    state = AdoptedState(name="box", served_model_name="chat", engine_model="chat",
                         host="127.0.0.1", port=9000, alive=True)  # fmt: skip
    table.adopted_reported("local", [state])

    slots = {c.deployment_id: slots_text(c) for c in explained(table).candidates}

    assert slots == {
        "d-flag": "2 (--parallel 2)",
        "d-auto": "4, assumed (llama.cpp's default, --parallel auto)",
        "d-vllm": "256, assumed (vLLM's default --max-num-seqs)",
        "adopted:box": "8, assumed (default_slots: an adopted endpoint does not say)",
    }
    table.set_service_capacities({"chat": 3})  # `berth service scale chat --capacity 3`
    slots = {c.deployment_id: slots_text(c) for c in explained(table).candidates}
    assert slots["d-vllm"] == "3 (the service's capacity setting)"
    assert slots["adopted:box"].startswith("8, assumed")  # no service's replica
    (vllm,) = [c for c in explained(table).candidates if c.deployment_id == "d-vllm"]
    assert (vllm.slots, vllm.slots_assumed) == (3, False)
