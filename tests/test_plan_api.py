"""``POST /admin/plan`` and placement by fit in-process: the real lifecycle manager and admin
routes over in-memory links whose nodes report simulated GPUs, the SmolLM2 GGUF header for
the estimate (1554 MiB at its trained 8192 context), and ``berth plan``'s printing."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import Response

from berth.admin.plans import build_plan_router
from berth.admin.services import build_service_router, load_routes
from berth.api import Plan
from berth.cli.common import console
from berth.cli.plan_cmd import print_plan
from berth.cluster.leader.agent_link import NodeInventory
from berth.cluster.leader.link_registry import LinkRegistry
from berth.deployments.adapters import AdapterManager
from berth.deployments.lifecycle import DeployOptions, LifecycleManager
from berth.errors import BerthError
from berth.openai_errors import error_from_exception
from berth.routing.routes import RouteResolver
from berth.runtime.bundled import smollm2_gguf
from berth.runtime.gpu import SimulatedInventory
from berth.store import Store
from berth.vocab.gpu import parse_simulated_gpus
from support.fakes import FakeLink
from support.lora_gguf import write_lora_gguf

pytestmark = pytest.mark.needs("smollm2")


class GpuLink(FakeLink):
    """A fake link whose node reports simulated GPUs of ``sizes`` (``"2GiB,2GiB"``)."""

    def __init__(self, node_id: str, sizes: str) -> None:
        super().__init__(node_id)
        self.gpus = SimulatedInventory(parse_simulated_gpus(sizes)).read()

    async def inventory(self) -> NodeInventory:
        return NodeInventory(self.node_id, "simhost", 2, 1024, tuple(self.gpus))


@dataclass
class Leader:
    admin: httpx.AsyncClient
    store: Store
    lifecycle: LifecycleManager
    agent_id: str
    adapters: AdapterManager

    async def post(self, path: str, status: int = 200, **body: Any) -> Any:
        response = await self.admin.post(path, json=body)
        assert response.status_code == status, response.text
        return response.json()

    async def plan(self, **body: Any) -> Plan:
        return Plan.model_validate(await self.post("/admin/plan", **body))


def app_for(
    store: Store, lifecycle: LifecycleManager, routes: RouteResolver, adapters: AdapterManager
) -> FastAPI:
    app = FastAPI()

    @app.exception_handler(BerthError)
    async def _berth_error(_request: Request, exc: BerthError) -> Response:
        status, body, headers = error_from_exception(exc)
        return Response(body, status_code=status, headers=headers, media_type="application/json")

    app.include_router(
        build_plan_router(
            store, lifecycle, default_runtime="process", leader_only=False, adapters=adapters
        )
    )
    app.include_router(build_service_router(store, lifecycle, routes, default_runtime="process"))
    return app


async def leader_with(store: Store, sizes: Sequence[str]) -> tuple[Leader, RouteResolver]:
    gguf = smollm2_gguf()
    assert gguf is not None
    agent_id = store.enroll_node("gpu-b", "cd" * 32).id
    store.add_model("smol", str(gguf))
    store.set_model_location("smol", agent_id, str(gguf))
    links = [GpuLink("local", sizes[0])]
    if len(sizes) > 1:
        links.append(GpuLink(agent_id, sizes[1]))
    registry = LinkRegistry(links)
    adapters = AdapterManager(registry)
    lifecycle = LifecycleManager(
        store, registry, health_timeout_s=5, stop_grace_s=1, on_state=adapters.deployment_changed
    )
    await lifecycle.start()
    routes = RouteResolver(lifecycle)
    await load_routes(store, routes)
    transport = httpx.ASGITransport(app=app_for(store, lifecycle, routes, adapters))
    admin = httpx.AsyncClient(transport=transport, base_url="http://berth")
    return Leader(admin, store, lifecycle, agent_id, adapters), routes


@pytest.fixture
async def plan_leader(store: Store) -> AsyncIterator[Leader]:
    found, _routes = await leader_with(store, ["2GiB,2GiB"])
    try:
        yield found
    finally:
        await found.admin.aclose()
        await found.lifecycle.shutdown()


@pytest.fixture
async def two_nodes(store: Store) -> AsyncIterator[Leader]:
    found, _routes = await leader_with(store, ["4GiB", "4GiB"])
    try:
        yield found
    finally:
        await found.admin.aclose()
        await found.lifecycle.shutdown()


def printed(answer: Plan) -> list[str]:
    with console.capture() as captured:
        print_plan(answer)
    return captured.get().splitlines()


async def test_a_plan_gives_the_estimate_and_where_it_would_go(plan_leader: Leader) -> None:
    answer = await plan_leader.plan(target="smol")
    assert (answer.kind, answer.placed, answer.node_id, answer.gpus) == (
        "model",
        True,
        "local",
        [0],
    )
    assert answer.estimate is not None and answer.estimate.total_mb == 1554
    lines = printed(answer)
    assert lines[:2] == [
        "plan for model smol on llamacpp (process)",
        "estimate: 1.52 GiB (weights 94 MiB + KV cache 180 MiB + overhead 1.25 GiB at ctx "
        "8192, f16)",
    ]
    assert "  KV heads          3" in lines
    assert lines[lines.index("why:") + 1 :][:1] == ["  - node local is connected and offers the "
                                                   "process runtime"]  # fmt: skip
    assert any(line.startswith("would run on node local GPU 0 (model at /") for line in lines)
    assert plan_leader.store.list_deployments() == []  # a dry run


async def test_a_service_is_planned_with_its_own_settings(plan_leader: Leader) -> None:
    await plan_leader.post("/admin/services", 201, name="chat", model="smol", ctx=2048)
    answer = await plan_leader.plan(target="chat")
    assert (answer.kind, answer.model, answer.ctx) == ("service", "smol", 2048)
    assert answer.estimate is not None and answer.estimate.kv_cache_mb == 45  # a quarter
    # a context given to plan replaces the service's
    wider = await plan_leader.plan(target="chat", ctx=4096)
    assert wider.estimate is not None and wider.estimate.kv_cache_mb == 90


async def test_full_gpus_refuse_and_force_places_anyway(plan_leader: Leader) -> None:
    await plan_leader.post("/admin/services", 201, name="chat", model="smol")
    for _ in range(2):
        record = await plan_leader.post("/admin/services/chat/deploy", 201)
        await plan_leader.lifecycle.wait_settled(record["id"], 5)
    answer = await plan_leader.plan(target="chat")
    assert (answer.placed, answer.refusal_reason) == (False, "vram_no_room")
    assert answer.refusal is not None and "the most free VRAM seen is 494 MiB" in answer.refusal
    lines = printed(answer)
    assert lines[2 + len(answer.estimate.inputs if answer.estimate else [])].startswith(
        "refused (vram_no_room): no GPU can take model smol"
    )
    refused = await plan_leader.admin.post("/admin/services/chat/deploy", json={})
    assert refused.status_code == 409
    assert refused.json()["error"]["message"].startswith("no GPU can take model smol")
    forced = await plan_leader.post("/admin/services/chat/deploy", 201, force=True)
    assert forced["gpus"] == [0]  # the GPU with the most free VRAM (a tie: the first)
    assert len(plan_leader.store.list_deployments(active_only=True)) == 3


async def test_unknown_targets_are_404_and_nothing_changes(plan_leader: Leader) -> None:
    response = await plan_leader.admin.post("/admin/plan", json={"target": "nothing"})
    assert response.status_code == 404
    assert response.json()["error"]["message"] == (
        "no service or model named 'nothing' (berth service ls, berth models ls)"
    )


async def test_replicas_of_a_service_spread_over_nodes_first(two_nodes: Leader) -> None:
    await two_nodes.post("/admin/services", 201, name="chat", model="smol")
    placed = []
    for _ in range(3):
        record = await two_nodes.post("/admin/services/chat/deploy", 201)
        placed.append((record["node_id"], record["gpus"]))
    # each 4 GiB GPU holds two: first one per node, then the node with fewest again
    assert placed == [("local", [0]), (two_nodes.agent_id, [0]), ("local", [0])]
    answer = await two_nodes.plan(target="chat")
    assert (answer.node_id, answer.gpus) == (two_nodes.agent_id, [0])
    assert "replicas of this service per node: local 2, gpu-b 1; the fewest first" in (
        answer.reasons
    )


async def test_a_deployment_without_a_node_goes_where_it_fits(two_nodes: Leader) -> None:
    lifecycle = two_nodes.lifecycle
    first = await lifecycle.deploy(DeployOptions("smol", "llamacpp", served_model_name="a"))
    second = await lifecycle.deploy(DeployOptions("smol", "llamacpp", served_model_name="b"))
    # different services: no spread rule, the most free VRAM after it; ties by node order
    assert (first.node_id, second.node_id) == ("local", two_nodes.agent_id)


async def test_a_plan_says_what_adapters_it_starts_with_and_which_need_a_restart(
    plan_leader: Leader, tmp_path: Path
) -> None:
    leader = plan_leader
    running = await leader.lifecycle.deploy(DeployOptions("smol", "llamacpp"))
    await leader.lifecycle.wait_settled(running.id, 5)
    gguf = smollm2_gguf()
    assert gguf is not None
    late = write_lora_gguf(gguf, tmp_path / "late.gguf")
    leader.store.add_adapter("late", "smol", "local", str(late), format="gguf", rank=8)
    leader.adapters.load_registry(leader.store.list_adapters())

    answer = await leader.plan(target="smol")
    assert answer.adapter_notes == [
        "starts with adapters late (--lora; each request for one applies it)",
        f"running deployment {running.id} needs a restart to serve adapter late",
    ]
    assert f"adapters: running deployment {running.id} needs a restart to serve adapter late" in (
        printed(answer)
    )
    refused = await leader.admin.post("/admin/plan", json={"target": "smol", "max_adapters": 2})
    assert refused.status_code == 400
    assert "--max-adapters is for vLLM and SGLang" in refused.json()["error"]["message"]

    # A service's LoRA slots are its own setting; plan --max-adapters replaces it.
    await leader.post("/admin/services", 201, name="chat", model="smol", engine="vllm",
                      max_adapters=3)  # fmt: skip
    service = await leader.plan(target="chat", force=True)  # vLLM's estimate needs --force
    assert "starts with LoRA on: 3 adapter slots, loaded on demand" in service.adapter_notes
    one = await leader.plan(target="chat", max_adapters=1, force=True)
    assert "starts with LoRA on: 1 adapter slot, loaded on demand" in one.adapter_notes
    deployed = await leader.post("/admin/services/chat/deploy", 201, force=True)
    assert leader.store.get_deployment(deployed["id"]).adapter_slots == 3
    bad = await leader.admin.post(
        "/admin/services", json={"name": "c2", "model": "smol", "max_adapters": 2}
    )
    assert bad.status_code == 400 and "llama.cpp starts with every adapter" in bad.text
