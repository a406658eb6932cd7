"""Scaling in an in-process leader: the real store, lifecycle manager, route table, router,
proxy (served by uvicorn on loopback), admin API and scaling controller, over an in-memory
link whose engines all answer through one stand-in engine.

A cold service loads at its first request, a burst starts one deployment, a client that
leaves is dropped from the wait, a load that takes too long is a 503 with its progress; idle
replicas stop, sustained load starts another, min_replicas are kept, a lowered max stops the
surplus; bad settings are refused and change nothing.  Times that matter are on a clock the
test moves, with the controller's looks called by the test (``tick``), so nothing here waits
for a timer.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response

from berth.admin.services import build_service_router, load_routes
from berth.api import describe_invalid
from berth.cluster.leader.link_registry import LinkRegistry
from berth.cluster.pki.enrollment import AuditLog
from berth.deployments.fleet import LeaderFleet
from berth.deployments.lifecycle import LifecycleManager
from berth.errors import BerthError
from berth.observability.metrics import ProxyMetrics
from berth.openai_errors import error_body, error_from_exception
from berth.routing.router import Router
from berth.routing.routes import RouteResolver
from berth.routing.signals import SignalBoard
from berth.scaling import ScalingController, ScalingMetrics, ScalingPolicy, route_services
from berth.store import Store
from berth.vocab.agent_policy import AgentPolicy
from berth.vocab.records import DeploymentRecord
from berth.vocab.states import DeploymentState
from support.fakes import FakeLink
from support.proxy_fixtures import running_proxy, sample
from support.standin_engine import StandinEngine
from support.waiting import EVENT_TIMEOUT_S, wait_for_async

pytestmark = pytest.mark.store_models(("tiny", "tiny.gguf"))

CHAT = {"messages": [{"role": "user", "content": "hi"}]}
_STARTING = (DeploymentState.PENDING, DeploymentState.LOADING)


class Clock:
    """Monotonic seconds the test moves (the controller's and the signal board's)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@dataclass
class Leader:
    admin: httpx.AsyncClient
    v1: httpx.AsyncClient
    store: Store
    link: FakeLink
    lifecycle: LifecycleManager
    scaling: ScalingController
    signals: SignalBoard
    metrics: ProxyMetrics
    engine: StandinEngine
    audit_path: Path
    #: the last state the controller was told of, by deployment id
    told: dict[str, DeploymentState]

    async def ok(self, method: str, path: str, **kwargs: Any) -> Any:
        response = await self.admin.request(method, path, **kwargs)
        assert response.status_code < 300, response.text
        return response.json()

    async def service(self, name: str, route: str | None = None, **settings: Any) -> None:
        """Create service ``name`` of model ``tiny`` and put it behind ``route`` (its name
        with ``-route`` by default)."""
        await self.ok("POST", "/admin/services", json={"name": name, "model": "tiny", **settings})
        body = {"name": route or f"{name}-route", "service": name}
        await self.ok("POST", "/admin/routes", json=body)

    async def chat(self, model: str, **extra: Any) -> httpx.Response:
        return await self.v1.post("/v1/chat/completions", json={"model": model, **CHAT, **extra})

    def active(self, service: str) -> list[DeploymentRecord]:
        return [
            d
            for d in self.store.list_deployments(active_only=True)
            if d.served_model_name == service
        ]

    async def settle(self, deployment_id: str) -> DeploymentRecord:
        """Wait until the controller has been told the deployment left pending/loading; its
        record.  Not ``lifecycle.wait_settled``: the store has a state before the
        controller hears of it."""
        await wait_for_async(
            lambda: self.told.get(deployment_id) not in (None, *_STARTING),
            EVENT_TIMEOUT_S,
            f"the controller to hear {deployment_id} settle",
        )
        return self.store.get_deployment(deployment_id)

    def audit(self) -> list[dict[str, Any]]:
        if not self.audit_path.exists():
            return []
        return [json.loads(line) for line in self.audit_path.read_text().splitlines()]


def admin_app(router_args: dict[str, Any]) -> FastAPI:
    """The service router with the admin app's error translation (400 for a bad body)."""
    app = FastAPI()

    @app.exception_handler(BerthError)
    async def _berth_error(_request: Request, exc: BerthError) -> Response:
        status, body, headers = error_from_exception(exc)
        return Response(body, status_code=status, headers=headers, media_type="application/json")

    @app.exception_handler(RequestValidationError)
    async def _invalid(_request: Request, exc: RequestValidationError) -> Response:
        message, param = describe_invalid(exc.errors()[0])
        body = error_body(message, type="invalid_request_error", param=param)
        return Response(body, status_code=400, media_type="application/json")

    app.include_router(build_service_router(**router_args))
    return app


@contextlib.asynccontextmanager
async def leader(
    store: Store,
    engine: StandinEngine,
    metrics: ProxyMetrics,
    tmp_path: Path,
    *,
    policy: ScalingPolicy,
    clock: Clock | None = None,
) -> AsyncIterator[Leader]:
    link = FakeLink(base_url=engine.base_url)
    scaling: ScalingController | None = None
    told: dict[str, DeploymentState] = {}

    def on_state(record: DeploymentRecord) -> None:
        assert scaling is not None
        scaling.deployment_changed(record)
        told[record.id] = record.state

    lifecycle = LifecycleManager(
        store, LinkRegistry([link]), health_timeout_s=5, stop_grace_s=1, on_state=on_state
    )
    await lifecycle.start()
    routes = RouteResolver(lifecycle)
    signals = SignalBoard(clock=clock) if clock else SignalBoard()
    audit = AuditLog(tmp_path / "audit.log")
    scaling = ScalingController(
        LeaderFleet(lifecycle),
        signals,
        route_services=lambda model: route_services(routes.table, model),
        policy=policy,
        metrics=ScalingMetrics(metrics.registry),
        audit=audit.append,
        **({"clock": clock} if clock else {}),
    )
    await load_routes(store, routes, scaling)
    scaling.start(store.list_service_profiles(), [])
    app = admin_app(
        {
            "store": store,
            "lifecycle": lifecycle,
            "routes": routes,
            "default_runtime": "process",
            "scaling": scaling,
        }
    )
    router = Router(routes, signals=signals)
    try:
        async with (
            httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://b") as a,
            running_proxy(routes, metrics, router=router, on_demand=scaling.stage) as url,  # type: ignore[arg-type]
            httpx.AsyncClient(base_url=url, timeout=EVENT_TIMEOUT_S) as v1,
        ):
            yield Leader(
                a,
                v1,
                store,
                link,
                lifecycle,
                scaling,
                signals,
                metrics,
                engine,
                tmp_path / "audit.log",
                told,
            )
    finally:
        await scaling.close()
        for record in store.list_deployments(active_only=True):
            with contextlib.suppress(BerthError):
                await lifecycle.stop(record.id)
        await lifecycle.shutdown()


#: Looks only when the test calls tick(): the loop's interval is longer than any test.
MANUAL = ScalingPolicy(interval_s=3600.0, scale_out_after_s=10.0, failed_load_hold_s=30.0)


@pytest.fixture
async def cold(
    store: Store, engine: StandinEngine, metrics: ProxyMetrics, tmp_path: Path
) -> AsyncIterator[Leader]:
    async with leader(store, engine, metrics, tmp_path, policy=MANUAL) as started:
        yield started


def queue_depth(leader: Leader, service: str) -> float:
    return sample(leader.metrics, "berth_on_demand_queue_depth", service=service)


# -- loading on demand -------------------------------------------------------------------------


async def test_a_cold_service_loads_at_its_first_request_and_answers_it(cold: Leader) -> None:
    await cold.service("chat", route="public")
    assert cold.active("chat") == []

    answer = await cold.chat("public")

    assert answer.status_code == 200, answer.text
    assert cold.engine.requests[-1].json()["model"] == "chat"  # the service's served name
    (replica,) = cold.active("chat")
    assert replica.state is DeploymentState.READY
    labels = {"service": "chat", "outcome": "ready"}
    assert sample(cold.metrics, "berth_on_demand_wait_seconds_count", **labels) == 1
    assert (
        sample(cold.metrics, "berth_service_loads_total", service="chat", reason="on_demand") == 1
    )
    assert sample(cold.metrics, "berth_service_replicas", service="chat", state="ready") == 1
    shown = await cold.ok("GET", "/admin/services/chat")
    assert shown["last_decision"]["action"] == "start"
    assert shown["last_decision"]["reason"] == "on demand: 1 request(s) wait and none is ready"


async def test_a_burst_of_50_on_a_cold_service_starts_one_deployment_and_all_are_answered(
    cold: Leader,
) -> None:
    await cold.service("chat")
    cold.link.start_gate = asyncio.Event()  # the engine loads until the test says
    burst = [asyncio.create_task(cold.chat("chat-route")) for _ in range(49)]
    request = cold.v1.build_request(
        "POST", "/v1/chat/completions", json={"model": "chat-route", "stream": True, **CHAT}
    )
    stream = asyncio.create_task(cold.v1.send(request, stream=True))

    await wait_for_async(lambda: queue_depth(cold, "chat") == 50, EVENT_TIMEOUT_S, "50 waiting")
    await wait_for_async(lambda: cold.link.requests, EVENT_TIMEOUT_S, "the engine to start")
    assert len(cold.link.requests) == 1  # one start for the whole burst
    assert len(cold.active("chat")) == 1
    assert not stream.done()  # no head before the engine answers: nothing was sent yet
    assert cold.engine.requests == []

    cold.link.start_gate.set()
    answers = await asyncio.gather(*burst)
    streamed = await stream
    try:
        assert streamed.status_code == 200
        assert streamed.headers["content-type"].startswith("application/json")  # as scripted
        await streamed.aread()
    finally:
        await streamed.aclose()

    assert [a.status_code for a in answers] == [200] * 49
    assert len(cold.link.requests) == 1 and len(cold.active("chat")) == 1
    assert len(cold.engine.requests) == 50
    assert queue_depth(cold, "chat") == 0
    waited = sample(
        cold.metrics, "berth_on_demand_wait_seconds_count", service="chat", outcome="ready"
    )
    assert waited == 50


async def test_a_client_that_leaves_is_dropped_from_the_wait_at_once(cold: Leader) -> None:
    await cold.service("chat")
    cold.link.start_gate = asyncio.Event()
    leaving = asyncio.create_task(cold.chat("chat-route"))
    staying = asyncio.create_task(cold.chat("chat-route"))
    await wait_for_async(lambda: queue_depth(cold, "chat") == 2, EVENT_TIMEOUT_S, "2 waiting")

    leaving.cancel()  # httpx closes its connection: the proxy sees the client go
    await wait_for_async(lambda: queue_depth(cold, "chat") == 1, EVENT_TIMEOUT_S, "1 left")
    gone = sample(
        cold.metrics, "berth_on_demand_wait_seconds_count", service="chat", outcome="client_gone"
    )
    assert gone == 1

    cold.link.start_gate.set()
    assert (await staying).status_code == 200
    assert len(cold.engine.requests) == 1  # the one that left never reached the engine


async def test_a_load_past_load_wait_s_is_a_503_with_retry_after_and_its_progress(
    store: Store, engine: StandinEngine, metrics: ProxyMetrics, tmp_path: Path
) -> None:
    policy = ScalingPolicy(interval_s=3600.0, load_wait_s=0.2)
    async with leader(store, engine, metrics, tmp_path, policy=policy) as started:
        await started.service("chat")
        started.link.start_gate = asyncio.Event()
        started.link.progress_line = "pulling ghcr.io/x/llama: 1.2 GB of 8.3 GB"

        refused = await started.chat("chat-route")

        assert refused.status_code == 503
        assert refused.headers["retry-after"] == "5"
        error = refused.json()["error"]
        assert error["code"] == "model_loading" and error["type"] == "server_error"
        (replica,) = started.active("chat")
        assert error["message"] == (
            f"model 'chat-route' is not ready after 0.2 s: deployment {replica.id} on node "
            "local is loading (pulling ghcr.io/x/llama: 1.2 GB of 8.3 GB)"
        )
        labels = {"service": "chat", "outcome": "timeout"}
        assert sample(started.metrics, "berth_on_demand_wait_seconds_count", **labels) == 1
        started.link.start_gate.set()
        assert (await started.settle(replica.id)).state is DeploymentState.READY
        assert (await started.chat("chat-route")).status_code == 200  # the same replica


async def test_a_full_queue_answers_503_at_once(
    store: Store, engine: StandinEngine, metrics: ProxyMetrics, tmp_path: Path
) -> None:
    policy = ScalingPolicy(interval_s=3600.0, load_queue_max=2)
    async with leader(store, engine, metrics, tmp_path, policy=policy) as started:
        await started.service("chat")
        started.link.start_gate = asyncio.Event()
        waiting = [asyncio.create_task(started.chat("chat-route")) for _ in range(2)]
        await wait_for_async(lambda: queue_depth(started, "chat") == 2, EVENT_TIMEOUT_S, "full")

        refused = await started.chat("chat-route")

        assert refused.status_code == 503 and refused.headers["retry-after"] == "5"
        assert refused.json()["error"]["code"] == "load_queue_full"
        assert (
            "2 requests already wait for service 'chat' to load (load_queue_max 2)"
            in (refused.json()["error"]["message"])
        )
        started.link.start_gate.set()
        assert [(await w).status_code for w in waiting] == [200, 200]


async def test_a_start_that_fails_answers_its_waiters_and_is_not_tried_again_at_once(
    cold: Leader,
) -> None:
    await cold.service("chat")
    cold.link.fail_with = "llama-server exited 1: unknown model architecture"

    refused = await cold.chat("chat-route")

    assert refused.status_code == 503
    error = refused.json()["error"]
    assert error["code"] == "load_failed"
    assert "service 'chat' could not be loaded: deployment d-" in error["message"]
    assert "unknown model architecture" in error["message"]
    again = await cold.chat("chat-route")  # within failed_load_hold_s: the same answer
    assert again.status_code == 503 and again.json()["error"]["code"] == "load_failed"
    assert len(cold.link.requests) == 1
    # nor does the controller, even when min_replicas asks for one
    shown = await cold.ok("PATCH", "/admin/services/chat", json={"min_replicas": 1})
    assert len(cold.link.requests) == 1
    assert shown["decision"]["action"] == "hold"
    assert shown["decision"]["reason"].startswith(
        "0 replica(s) running, below min_replicas 1; the last start failed, next try in 30 s: "
        "deployment d-"
    )


async def test_a_start_the_agent_policy_refuses_is_not_tried_again_on_a_timer(
    timed: Leader, manual_clock: Clock
) -> None:
    await timed.service("warm")
    timed.link.agent_policy = AgentPolicy(engines=frozenset({"vllm"}))  # changed since
    await timed.ok("PATCH", "/admin/services/warm", json={"min_replicas": 1})
    await wait_for_async(
        lambda: timed.scaling.board.failure("warm"), EVENT_TIMEOUT_S, "the refusal"
    )
    refused = sample(timed.metrics, "berth_service_loads_total", service="warm", reason="refused")
    manual_clock.now += 10 * 60  # far past failed_load_hold_s
    timed.scaling.tick()
    shown = await timed.ok("GET", "/admin/services/warm")
    assert shown["decision"]["action"] == "hold"
    reason = shown["decision"]["reason"]
    assert "refused by the agent policy, not tried again until the service changes or a " \
        "request asks for it: node " in reason, reason  # fmt: skip
    assert "engine llamacpp is not allowed (engines: vllm)" in reason
    assert timed.active("warm") == [] and timed.link.requests == []
    again = sample(timed.metrics, "berth_service_loads_total", service="warm", reason="refused")
    assert again == refused


async def test_a_service_the_agent_policy_refuses_everywhere_is_refused_at_create(
    cold: Leader,
) -> None:
    cold.link.agent_policy = AgentPolicy(engines=frozenset({"vllm"}))
    answer = await cold.admin.post("/admin/services", json={"name": "chat", "model": "tiny"})
    assert answer.status_code == 403, answer.text
    error = answer.json()["error"]
    assert error["code"] == "policy_refused"
    assert "engine llamacpp is not allowed (engines: vllm)" in error["message"]
    assert cold.store.list_service_profiles() == []
    cold.link.agent_policy = None
    await cold.service("chat")  # a policy that allows it: created


async def test_a_request_for_a_name_that_is_no_route_is_not_held(cold: Leader) -> None:
    answer = await cold.chat("nothing-here")
    assert answer.status_code == 404
    assert cold.link.requests == []


# -- idle unload, min and max replicas, scale out --------------------------------------------------


@pytest.fixture
def manual_clock() -> Clock:
    return Clock()


@pytest.fixture
async def timed(
    store: Store, engine: StandinEngine, metrics: ProxyMetrics, tmp_path: Path, manual_clock: Clock
) -> AsyncIterator[Leader]:
    async with leader(
        store, engine, metrics, tmp_path, policy=MANUAL, clock=manual_clock
    ) as started:
        yield started


async def test_an_idle_replica_stops_after_its_idle_timeout_and_says_why(
    timed: Leader, manual_clock: Clock
) -> None:
    await timed.service("chat", idle_timeout="10m")
    assert (await timed.chat("chat-route")).status_code == 200
    (replica,) = timed.active("chat")

    manual_clock.now += 9 * 60
    timed.scaling.tick()
    assert (await timed.chat("chat-route")).status_code == 200  # used again: 10 more minutes
    manual_clock.now += 9 * 60
    timed.scaling.tick()
    assert timed.active("chat") == [replica] or timed.active("chat")[0].id == replica.id

    manual_clock.now += 61
    timed.scaling.tick()
    await wait_for_async(lambda: not timed.active("chat"), EVENT_TIMEOUT_S, "the replica to stop")

    assert timed.store.get_deployment(replica.id).state is DeploymentState.STOPPED
    shown = await timed.ok("GET", "/admin/services/chat")
    assert shown["last_decision"]["action"] == "stop"
    assert shown["last_decision"]["deployment_ids"] == [replica.id]
    assert shown["last_decision"]["reason"] == (
        "no request for 10m1s (idle timeout 10m); 0 left (min_replicas 0)"
    )
    (entry,) = await wait_for_async(timed.audit, EVENT_TIMEOUT_S, "the audit line")
    assert entry["event"] == "deployment_unloaded" and entry["deployment"] == replica.id
    assert entry["service"] == "chat" and entry["outcome"] == "stopped"
    assert (
        entry["reason"] == "idle: no request for 10m1s (idle timeout 10m); 0 left (min_replicas 0)"
    )
    assert sample(timed.metrics, "berth_service_unloads_total", service="chat", reason="idle") == 1
    # and the next request loads it again
    assert (await timed.chat("chat-route")).status_code == 200
    assert len(timed.active("chat")) == 1


async def test_min_replicas_are_started_without_a_request_and_kept(timed: Leader) -> None:
    await timed.service("warm", min_replicas=1, max_replicas=2, idle_timeout="1s")
    timed.scaling.tick()
    (replica,) = await wait_for_async(lambda: timed.active("warm"), EVENT_TIMEOUT_S, "a replica")
    assert (await timed.settle(replica.id)).state is DeploymentState.READY
    assert timed.engine.requests == []  # no request started it
    shown = await timed.ok("GET", "/admin/services/warm")
    assert shown["last_decision"]["reason"] == "0 replica(s) running, below min_replicas 1"
    timed.scaling.tick()
    assert [d.id for d in timed.active("warm")] == [replica.id]  # at min: never idle-stopped
    assert timed.scaling.usage(replica.id).protected  # nor evicted for another service


async def test_sustained_load_starts_another_replica_then_idle_ones_go_back_to_zero(
    timed: Leader, manual_clock: Clock
) -> None:
    await timed.service("chat", max_replicas=2, capacity=2, idle_timeout="30s")
    assert (await timed.chat("chat-route")).status_code == 200
    (first,) = timed.active("chat")
    for _ in range(2):  # two requests in flight: its capacity
        timed.signals.started(first.id, first.node_id)

    timed.scaling.tick()
    shown = await timed.ok("GET", "/admin/services/chat")
    assert shown["decision"]["action"] == "hold"
    assert "another starts after 10s" in shown["decision"]["reason"]
    manual_clock.now += 10
    timed.scaling.tick()
    await wait_for_async(lambda: len(timed.active("chat")) == 2, EVENT_TIMEOUT_S, "a second")
    shown = await timed.ok("GET", "/admin/services/chat")
    assert shown["last_decision"]["action"] == "start"
    assert shown["last_decision"]["reason"] == (
        "every replica had its capacity (2) in flight or queued for 10s: 2 in flight, "
        "0 queued over 1 replica(s)"
    )
    second = next(d for d in timed.active("chat") if d.id != first.id)
    assert (await timed.settle(second.id)).state is DeploymentState.READY
    use = timed.scaling.usage(first.id)  # what the eviction choice is told
    assert use.in_flight == 2 and use.last_request_at is not None and not use.protected
    manual_clock.now += 60
    timed.scaling.tick()
    assert len(timed.active("chat")) == 2  # still busy: nothing stops
    assert (
        sample(timed.metrics, "berth_service_loads_total", service="chat", reason="scale_out") == 1
    )

    for _ in range(2):
        timed.signals.finished(first.id, first.node_id)
    manual_clock.now += 31
    timed.scaling.tick()
    await wait_for_async(lambda: not timed.active("chat"), EVENT_TIMEOUT_S, "back to zero")
    # each unload is audited once its stop has returned
    await wait_for_async(lambda: len(timed.audit()) == 2, EVENT_TIMEOUT_S, "two unloads")
    assert {e["deployment"] for e in timed.audit()} == {first.id, second.id}


async def test_a_lowered_max_stops_the_least_recently_used_surplus(
    timed: Leader, manual_clock: Clock
) -> None:
    await timed.service("chat", min_replicas=2, max_replicas=2)
    timed.scaling.tick()
    await wait_for_async(lambda: len(timed.active("chat")) == 1, EVENT_TIMEOUT_S, "one")
    assert (await timed.settle(timed.active("chat")[0].id)).state is DeploymentState.READY
    timed.scaling.tick()
    await wait_for_async(lambda: len(timed.active("chat")) == 2, EVENT_TIMEOUT_S, "two")
    _older, newer = sorted(timed.active("chat"), key=lambda d: d.created_at)
    # ready as the controller sees it: one still starting would be the first surplus stopped
    assert (await timed.settle(newer.id)).state is DeploymentState.READY
    manual_clock.now += 5
    timed.signals.started(newer.id, newer.node_id)  # the newer one was used last
    timed.signals.finished(newer.id, newer.node_id)

    scaled = await timed.ok(
        "PATCH", "/admin/services/chat", json={"min_replicas": 0, "max_replicas": 1}
    )

    assert scaled["scaling"]["max_replicas"] == 1
    await wait_for_async(lambda: len(timed.active("chat")) == 1, EVENT_TIMEOUT_S, "the surplus")
    assert [d.id for d in timed.active("chat")] == [newer.id]
    shown = await timed.ok("GET", "/admin/services/chat")
    assert shown["last_decision"]["reason"] == "2 replica(s), above max_replicas 1"


# -- bad input -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"min_replicas": 2, "max_replicas": 1}, "min_replicas (2) is above max_replicas (1)"),
        ({"min_replicas": -1}, "min_replicas: Input should be greater than or equal to 0"),
        ({"max_replicas": -3}, "max_replicas: Input should be greater than or equal to 0"),
        ({"idle_timeout": "10 min"}, "'10 min' is not a duration: use a number and a unit"),
        ({"capacity": 0}, "capacity: Input should be greater than or equal to 1"),
    ],
)
async def test_bad_scaling_settings_are_refused_and_change_nothing(
    cold: Leader, body: dict[str, Any], message: str
) -> None:
    await cold.service("chat", min_replicas=0, max_replicas=2, idle_timeout="5m")
    before = await cold.ok("GET", "/admin/services")

    created = await cold.admin.post("/admin/services", json={"name": "x", "model": "tiny", **body})
    scaled = await cold.admin.patch("/admin/services/chat", json=body)

    for refused in (created, scaled):
        assert refused.status_code == 400, refused.text
        assert message in refused.json()["error"]["message"]
    assert await cold.ok("GET", "/admin/services") == before
    assert cold.link.requests == []
