"""A streamed answer's timeouts, with real engines (the stand-in) behind the real proxy on
loopback: its first byte within ``first_byte_timeout_s`` (else the silent engine's exchange
is closed and the request goes to another deployment), its silence within
``stream_idle_timeout_s`` (else an error event ends it); a non-streamed request is bounded
by ``read_timeout_s`` alone. Also through an agent's tunnel (the ``linked`` fixture)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence

import httpx
import pytest

from berth.cluster.leader.link_registry import LinkRegistry
from berth.deployments.lifecycle import DeployOptions, LifecycleManager
from berth.errors import NotFoundError
from berth.gateway.proxy import OpenAIProxy
from berth.observability.metrics import ProxyMetrics
from berth.routing.resolver import Upstream
from berth.routing.router import Router
from berth.routing.waiting import WaitingAttempts
from berth.store import Store
from berth.vocab.records import StreamTimeouts
from berth.vocab.states import DeploymentState
from support.fakes import FakeLink
from support.link_pair import DEPLOYMENT, Linked, OneLink
from support.proxy_fixtures import running_proxy, sample, serve_berth
from support.standin_engine import (
    Head,
    Hold,
    Reply,
    Stall,
    StandinEngine,
    Write,
    chat_chunks,
    chat_completion,
    json_reply,
    sse_reply,
)
from support.waiting import EVENT_TIMEOUT_S, wait_for_async

MODEL = "m"
STREAM = {"model": MODEL, "stream": True, "messages": [{"role": "user", "content": "hi"}]}
PLAIN = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
#: Accepted, then silent: before the head (llama-server holds it until the first token), or
#: after it (vLLM sends it at once, then nothing until prefill is done).
SILENT_BEFORE_HEAD = Reply((Hold(), Head(200, "text/event-stream")))
SILENT_AFTER_HEAD = Reply((Head(200, "text/event-stream"), Hold()))


class Ranked:
    """An ``UpstreamResolver`` giving ``upstreams`` (the router ranks the first first, as
    the test tells it)."""

    def __init__(self, upstreams: Sequence[Upstream]) -> None:
        self.upstreams = list(upstreams)

    def candidates(self, model: str) -> list[Upstream]:
        if model != MODEL:
            raise NotFoundError("model", model)
        return list(self.upstreams)

    def models(self) -> list[str]:
        return [MODEL]


def _router(resolver: Ranked) -> Router:
    router = Router(resolver)
    # The first upstream ranks first, as a quiet node whose p95 is known would.
    router.signals.observe(resolver.upstreams[0].deployment_id, 0.001)
    for upstream in resolver.upstreams[1:]:
        router.signals.observe(upstream.deployment_id, 5.0)
    return router


def _local(engine: StandinEngine, name: str, **extra: object) -> Upstream:
    return Upstream(engine.base_url, f"d-{name}", f"n-{name}", MODEL, **extra)


async def _post_stream(url: str, payload: object = STREAM) -> tuple[int, bytes]:
    async with (
        httpx.AsyncClient(base_url=url, timeout=EVENT_TIMEOUT_S) as client,
        client.stream("POST", "/v1/chat/completions", json=payload) as response,
    ):
        return response.status_code, await response.aread()


@pytest.mark.parametrize(
    "silence", [SILENT_BEFORE_HEAD, SILENT_AFTER_HEAD], ids=["before-head", "after-head"]
)
async def test_a_silent_engine_past_the_first_byte_timeout_is_closed_and_another_answers(
    silence: Reply,
) -> None:
    healthy_events = chat_chunks(["from the healthy one"])
    async with (
        StandinEngine(silence) as silent,
        StandinEngine(sse_reply(healthy_events)) as healthy,
    ):
        resolver = Ranked([_local(silent, "silent"), _local(healthy, "healthy")])
        metrics = ProxyMetrics()
        options = {"router": _router(resolver), "first_byte_timeout_s": 0.3}
        async with running_proxy(resolver, metrics, **options) as url:
            status, body = await _post_stream(url)
        assert status == 200
        assert body == b"".join(healthy_events)  # nothing of the silent one reached it
        received = silent.requests[0]
        # The engine nobody waits for any more saw its client go away: it stops generating.
        await asyncio.wait_for(received.disconnected.wait(), EVENT_TIMEOUT_S)
        assert not received.completed
    retried = "berth_proxy_retries_total"
    left = {"model": MODEL, "deployment": "d-silent", "node": "n-silent"}
    assert sample(metrics, retried, reason="first_byte_timeout", **left) == 1
    served = {"model": MODEL, "deployment": "d-healthy", "node": "n-healthy", "status_class": "2xx"}
    assert sample(metrics, "berth_proxy_requests_total", **served) == 1


async def test_a_silent_replica_past_the_first_byte_timeout_hands_over_to_one_on_its_node() -> None:
    # Two replicas on one host: the silence is the deployment's, not the node's, so the
    # replica beside it answers (a failure that may be the node's would bar the node).
    healthy_events = chat_chunks(["from the replica beside it"])
    async with (
        StandinEngine(SILENT_BEFORE_HEAD) as silent,
        StandinEngine(sse_reply(healthy_events)) as healthy,
    ):
        one_node = [
            Upstream(silent.base_url, "d-silent", "n-one", MODEL),
            Upstream(healthy.base_url, "d-healthy", "n-one", MODEL),
        ]
        resolver = Ranked(one_node)
        options = {"router": _router(resolver), "first_byte_timeout_s": 0.3}
        async with running_proxy(resolver, ProxyMetrics(), **options) as url:
            status, body = await _post_stream(url)
        assert status == 200
        assert body == b"".join(healthy_events)


async def test_the_request_log_names_the_first_byte_timeout_as_a_retry() -> None:
    async with (
        StandinEngine(SILENT_AFTER_HEAD) as silent,
        StandinEngine(sse_reply(chat_chunks(["ok"]))) as healthy,
    ):
        resolver = Ranked([_local(silent, "silent"), _local(healthy, "healthy")])
        metrics = ProxyMetrics()
        proxy = OpenAIProxy(resolver, metrics, router=_router(resolver), first_byte_timeout_s=0.3)
        await proxy.startup()
        try:
            async with serve_berth(proxy.handle) as url:
                status, _ = await _post_stream(url)
        finally:
            await proxy.shutdown()
    assert status == 200
    (entry,) = proxy.request_log.after(0)
    assert entry.deployment_id == "d-healthy"
    assert entry.retries == ("first_byte_timeout",)


async def test_with_nowhere_else_to_go_the_first_byte_timeout_answers_504() -> None:
    async with StandinEngine(SILENT_AFTER_HEAD) as silent:
        resolver = Ranked([_local(silent, "silent")])
        metrics = ProxyMetrics()
        async with running_proxy(resolver, metrics, first_byte_timeout_s=0.3) as url:
            status, body = await _post_stream(url)
        await asyncio.wait_for(silent.requests[0].disconnected.wait(), EVENT_TIMEOUT_S)
    assert status == 504
    error = json.loads(body)["error"]
    assert error["code"] == "first_byte_timeout"
    assert "no first byte of its answer within 0.3 s" in error["message"]


async def test_a_stream_queued_behind_others_on_a_busy_engine_is_not_cut_by_the_timeout() -> None:
    # The engine holds one stream's first byte for three first-byte periods while it answers
    # others: that stream is queued, not hung, so it waits and gets its answer (a retry
    # would only queue it again elsewhere); nowhere else to go would have made it a 504.
    quick_events = chat_chunks(["quick"])
    quick = sse_reply(quick_events)
    held_events = chat_chunks(["held"])
    async with StandinEngine(quick) as busy:
        busy.script(Reply((Hold(), *sse_reply(held_events).steps)))
        resolver = Ranked([_local(busy, "busy")])
        metrics = ProxyMetrics()
        async with running_proxy(resolver, metrics, first_byte_timeout_s=0.3) as url:
            held = asyncio.create_task(_post_stream(url))
            received = await busy.wait_for_request()
            loop = asyncio.get_running_loop()
            until = loop.time() + 0.9
            while loop.time() < until:
                assert await _post_stream(url) == (200, b"".join(quick_events))
                await asyncio.sleep(0.05)
            received.release.set()
            status, body = await held
    assert (status, body) == (200, b"".join(held_events))
    left = {"model": MODEL, "deployment": "d-busy", "node": "n-busy"}
    assert sample(metrics, "berth_proxy_retries_total", reason="first_byte_timeout", **left) == 0


async def test_a_non_streamed_request_is_not_cut_by_the_stream_timeouts() -> None:
    # Its answer comes whole once generated: slower than both stream timeouts, well within
    # the read timeout.
    async with StandinEngine(
        Reply((Stall(0.8), *json_reply(chat_completion("all of it")).steps))
    ) as slow:
        resolver = Ranked([_local(slow, "slow")])
        metrics = ProxyMetrics()
        options = {"first_byte_timeout_s": 0.2, "stream_idle_timeout_s": 0.2}
        async with (
            running_proxy(resolver, metrics, **options) as url,
            httpx.AsyncClient(base_url=url, timeout=EVENT_TIMEOUT_S) as client,
        ):
            answer = await client.post("/v1/chat/completions", json=PLAIN)
    assert answer.status_code == 200
    assert answer.json()["choices"][0]["message"]["content"] == "all of it"


async def test_a_slow_stream_within_its_timeouts_is_relayed_whole() -> None:
    events = chat_chunks(["one two three"])
    steps = (Stall(0.3), Head(200, "text/event-stream"),
             *(Write(event, 0.1) for event in events))  # fmt: skip
    async with StandinEngine(Reply(steps)) as engine:
        resolver = Ranked([_local(engine, "e")])
        options = {"first_byte_timeout_s": 5.0, "stream_idle_timeout_s": 5.0}
        async with running_proxy(resolver, ProxyMetrics(), **options) as url:
            status, body = await _post_stream(url)
    assert (status, body) == (200, b"".join(events))


async def test_a_service_s_own_first_byte_timeout_holds_for_its_deployments() -> None:
    # The proxy's setting is off; the silent deployment's service sets its own.
    own = StreamTimeouts(first_byte_timeout_s=0.3)
    async with (
        StandinEngine(SILENT_AFTER_HEAD) as silent,
        StandinEngine(sse_reply(chat_chunks(["ok"]))) as healthy,
    ):
        resolver = Ranked([_local(silent, "silent", timeouts=own), _local(healthy, "healthy")])
        metrics = ProxyMetrics()
        options = {"router": _router(resolver), "first_byte_timeout_s": None}
        async with running_proxy(resolver, metrics, **options) as url:
            status, _ = await _post_stream(url)
    assert status == 200
    left = {"model": MODEL, "deployment": "d-silent", "node": "n-silent"}
    assert sample(metrics, "berth_proxy_retries_total", reason="first_byte_timeout", **left) == 1


@pytest.mark.parametrize("server", ["berth", "uvicorn"])
async def test_a_service_s_own_idle_timeout_ends_a_silent_stream(server: str) -> None:
    events = chat_chunks(["a b"])[:2]
    silent_mid = Reply((Head(200, "text/event-stream"), *map(Write, events), Hold()))
    async with StandinEngine(silent_mid) as engine:
        own = StreamTimeouts(stream_idle_timeout_s=0.3)
        resolver = Ranked([_local(engine, "e", timeouts=own)])
        async with running_proxy(resolver, ProxyMetrics(), server=server) as url:
            status, body = await _post_stream(url)
        await asyncio.wait_for(engine.requests[0].disconnected.wait(), EVENT_TIMEOUT_S)
    assert status == 200
    head, tail = body[: len(b"".join(events))], body[len(b"".join(events)) :]
    assert head == b"".join(events)
    error_event, done, rest = tail.split(b"\n\n")
    assert json.loads(error_event.removeprefix(b"data: "))["error"]["code"] == (
        "stream_idle_timeout"
    )
    assert (done, rest) == (b"data: [DONE]", b"")


# -- through an agent's tunnel ------------------------------------------------------------------


def _tunneled() -> Upstream:
    return Upstream("", DEPLOYMENT, "n-1", MODEL, remote=True)


@pytest.mark.parametrize(
    "silence", [SILENT_BEFORE_HEAD, SILENT_AFTER_HEAD], ids=["before-head", "after-head"]
)
async def test_through_the_tunnel_a_silent_engine_is_reset_and_another_answers(
    linked: Linked, silence: Reply
) -> None:
    linked.engine.script(silence)
    healthy_events = chat_chunks(["from the local one"])
    async with StandinEngine(sse_reply(healthy_events)) as healthy:
        resolver = Ranked([_tunneled(), _local(healthy, "healthy")])
        metrics = ProxyMetrics()
        options = {
            "router": _router(resolver),
            "tunnels": OneLink(linked),
            "first_byte_timeout_s": 0.3,
        }
        async with running_proxy(resolver, metrics, **options) as url:
            status, body = await _post_stream(url)
    assert status == 200
    assert body == b"".join(healthy_events)
    # The agent was told (the stream reset), and closed its exchange with the engine.
    received = linked.engine.requests[0]
    await asyncio.wait_for(received.disconnected.wait(), EVENT_TIMEOUT_S)
    meter = linked.service.meter
    await wait_for_async(lambda: meter.stats(DEPLOYMENT).in_flight == 0, 10, "the relay ended")
    left = {"model": MODEL, "deployment": DEPLOYMENT, "node": "n-1"}
    assert sample(metrics, "berth_proxy_retries_total", reason="first_byte_timeout", **left) == 1


async def test_through_the_tunnel_a_stream_silent_past_its_idle_timeout_ends_with_an_error(
    linked: Linked,
) -> None:
    events = chat_chunks(["a b"])[:2]
    linked.engine.script(Reply((Head(200, "text/event-stream"), *map(Write, events), Hold())))
    resolver = Ranked([_tunneled()])
    options = {"tunnels": OneLink(linked), "stream_idle_timeout_s": 0.3}
    async with running_proxy(resolver, ProxyMetrics(), **options) as url:
        status, body = await _post_stream(url)
    assert status == 200
    assert body.startswith(b"".join(events))
    error_event, done, rest = body[len(b"".join(events)) :].split(b"\n\n")
    assert json.loads(error_event.removeprefix(b"data: "))["error"]["code"] == (
        "stream_idle_timeout"
    )
    assert (done, rest) == (b"data: [DONE]", b"")
    await asyncio.wait_for(linked.engine.requests[0].disconnected.wait(), EVENT_TIMEOUT_S)


# -- a stop wakes the requests waiting on the deployment ----------------------------------------


@pytest.mark.store_models((MODEL, "m.gguf"))
async def test_stopping_a_deployment_sends_its_waiting_request_to_another_at_once(
    store: Store,
) -> None:
    node = store.enroll_node("gpu-a", "ab" * 32)
    store.set_model_location(MODEL, node.id, "/agent/m.gguf")
    healthy_events = chat_chunks(["from the other node"])
    async with (
        StandinEngine(SILENT_AFTER_HEAD) as silent,
        StandinEngine(sse_reply(healthy_events)) as healthy,
    ):
        local, agent = FakeLink(base_url=silent.base_url), FakeLink(node.id, healthy.base_url)
        waiting = WaitingAttempts()
        manager = LifecycleManager(
            store, LinkRegistry([local, agent]), health_timeout_s=5, stop_grace_s=1,
            waiting=waiting,
        )  # fmt: skip
        await manager.start()
        try:
            stopping = await manager.deploy(DeployOptions(MODEL, "llamacpp", "local"))
            other = await manager.deploy(DeployOptions(MODEL, "llamacpp", "gpu-a"))
            for record in (stopping, other):
                assert (await manager.wait_settled(record.id, 5)).state is DeploymentState.READY
            router = Router(manager, waiting=waiting)
            router.signals.observe(stopping.id, 0.001)  # it ranks first
            router.signals.observe(other.id, 5.0)
            metrics = ProxyMetrics()
            # No first-byte timeout: only the stop can move the request on.
            options = {"router": router, "first_byte_timeout_s": None}
            async with running_proxy(manager, metrics, **options) as url:
                asking = asyncio.create_task(_post_stream(url))
                received = await silent.wait_for_request(EVENT_TIMEOUT_S)
                assert len(waiting) == 1
                assert (await manager.stop(stopping.id)).state is DeploymentState.STOPPED
                status, body = await asking
            # The stand-in is not stopped by the fake link: the proxy closed the exchange.
            await asyncio.wait_for(received.disconnected.wait(), EVENT_TIMEOUT_S)
        finally:
            await manager.shutdown()
    assert status == 200
    assert body == b"".join(healthy_events)
    left = {"model": MODEL, "deployment": stopping.id, "node": "local"}
    assert sample(metrics, "berth_proxy_retries_total", reason="given_up", **left) == 1
