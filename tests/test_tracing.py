"""OpenTelemetry traces of a request, from the leader through the agent to the engine, as a
collector receives them: a real OTLP/HTTP endpoint on loopback (decoding
``ExportTraceServiceRequest`` with opentelemetry-proto) fed by the SDK's own exporter, the
real proxy on loopback, its first node refusing connections, and the agent link in one
process (``support/link_pair.py``) with the stand-in engine behind the agent. The leader and
the agent each have their own tracer provider, so the agent's span can only find its parent
through the ``traceparent`` the tunnel carried."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

import httpx
import pytest
from aiohttp import web
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span, Status
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from berth.admission import SlotGate
from berth.errors import NotFoundError
from berth.observability.metrics import ProxyMetrics
from berth.observability.tracing import Tracing, build_tracing
from berth.observability.tracing_config import TracingConfig
from berth.routing.resolver import Upstream
from berth.routing.router import Router
from support.link_pair import DEPLOYMENT, OneLink, linked_in_memory
from support.proxy_fixtures import running_proxy
from support.standin_engine import Reply, Stall, StandinEngine, chat_chunks, json_reply, sse_reply
from support.waiting import EVENT_TIMEOUT_S

MODEL = "m"
STREAM = {"model": MODEL, "stream": True, "messages": [{"role": "user", "content": "hi"}]}
#: The caller's own trace context (W3C Trace Context, section 3.2): the leader's span is its child.
CALLER_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CALLER_SPAN = "00f067aa0ba902b7"


@dataclass(frozen=True)
class ReceivedSpan:
    """A span as the collector got it, with the ``service.name`` of its process."""

    service: str
    span: Span

    @property
    def attributes(self) -> dict[str, object]:
        return _attributes(self.span.attributes)


def _value(value: AnyValue) -> object:
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return [_value(item) for item in value.array_value.values]
    return getattr(value, kind) if kind else None


def _attributes(pairs: Sequence[KeyValue]) -> dict[str, object]:
    return {pair.key: _value(pair.value) for pair in pairs}


class OtlpReceiver:
    """An OTLP/HTTP traces endpoint (``POST /v1/traces``, binary protobuf) on loopback."""

    def __init__(self) -> None:
        self.spans: list[ReceivedSpan] = []
        self.port = 0

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1/traces"

    async def _export(self, request: web.Request) -> web.Response:
        assert request.content_type == "application/x-protobuf"
        export = ExportTraceServiceRequest()
        export.ParseFromString(await request.read())
        for resource_spans in export.resource_spans:
            service = _attributes(resource_spans.resource.attributes)["service.name"]
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    self.spans.append(ReceivedSpan(str(service), span))
        answer = ExportTraceServiceResponse().SerializeToString()
        return web.Response(body=answer, content_type="application/x-protobuf")

    @contextlib.asynccontextmanager
    async def serving(self) -> AsyncIterator[OtlpReceiver]:
        app = web.Application()
        app.router.add_post("/v1/traces", self._export)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        self.port = runner.addresses[0][1]
        try:
            yield self
        finally:
            await runner.cleanup()

    def named(self, name: str) -> list[ReceivedSpan]:
        return [received for received in self.spans if received.span.name == name]


class Ranked:
    """An ``UpstreamResolver`` giving ``upstreams``, ranked by the router as given."""

    def __init__(self, upstreams: Sequence[Upstream]) -> None:
        self.upstreams = list(upstreams)

    def candidates(self, model: str) -> list[Upstream]:
        if model != MODEL:
            raise NotFoundError("model", model)
        return list(self.upstreams)

    def models(self) -> list[str]:
        return [MODEL]


def _refusing_url() -> str:
    """A loopback URL nobody listens at (its port was free a moment ago): connections to it
    are refused, as to a node whose engine is down."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    return f"http://127.0.0.1:{port}"


def _tracing(receiver: OtlpReceiver, service: str) -> Tracing:
    return build_tracing(TracingConfig(endpoint=receiver.endpoint, service_name=service))


async def _flush(*tracings: Tracing) -> None:
    for tracing in tracings:  # the exporter posts from its thread to the loop's receiver
        assert await asyncio.to_thread(tracing.force_flush, EVENT_TIMEOUT_S)


@pytest.fixture
async def otlp_receiver() -> AsyncIterator[OtlpReceiver]:
    """An in-process OTLP/HTTP collector on loopback."""
    async with OtlpReceiver().serving() as receiver:
        yield receiver


async def test_a_streamed_request_through_the_tunnel_is_one_trace_from_the_caller_to_the_engine(
    otlp_receiver: OtlpReceiver,
) -> None:
    leader_tracing = _tracing(otlp_receiver, "berth-leader")
    agent_tracing = _tracing(otlp_receiver, "berth-agent")
    events = chat_chunks(["traced through the tunnel"], usage=(7, 5))
    try:
        async with linked_in_memory(tracer=agent_tracing.relays("n-1")) as linked:
            linked.engine.script(sse_reply(events))
            down = Upstream(_refusing_url(), "d-down", "n-down", MODEL)
            tunneled = Upstream("", DEPLOYMENT, "n-1", MODEL, remote=True)
            resolver = Ranked([down, tunneled])
            router = Router(resolver)
            router.signals.observe("d-down", 0.001)  # the node that is down ranks first
            router.signals.observe(DEPLOYMENT, 5.0)
            options = {
                "router": router,
                "tunnels": OneLink(linked),
                "tracer": leader_tracing.requests(),
            }
            async with running_proxy(resolver, ProxyMetrics(), **options) as url:
                caller = {"traceparent": f"00-{CALLER_TRACE}-{CALLER_SPAN}-01"}
                async with (
                    httpx.AsyncClient(base_url=url, timeout=EVENT_TIMEOUT_S) as client,
                    client.stream(
                        "POST", "/v1/chat/completions", json=STREAM, headers=caller
                    ) as response,
                ):
                    body = await response.aread()
            assert response.status_code == 200
            assert body == b"".join(events)
            engine_headers = linked.engine.requests[-1].headers
        await _flush(leader_tracing, agent_tracing)
    finally:
        leader_tracing.shutdown()
        agent_tracing.shutdown()

    spans = otlp_receiver.spans
    assert {received.span.trace_id.hex() for received in spans} == {CALLER_TRACE}
    (server,) = otlp_receiver.named("POST /v1/chat/completions")
    assert server.service == "berth-leader"
    assert server.span.kind == Span.SPAN_KIND_SERVER
    assert server.span.parent_span_id.hex() == CALLER_SPAN
    assert server.attributes["gen_ai.request.model"] == MODEL
    assert server.attributes["gen_ai.operation.name"] == "chat"
    assert server.attributes["http.route"] == "/v1/chat/completions"
    assert server.attributes["http.response.status_code"] == 200
    assert server.attributes["gen_ai.usage.input_tokens"] == 7
    assert server.attributes["gen_ai.usage.output_tokens"] == 5
    assert server.attributes["berth.attempts"] == 2
    assert (server.attributes["berth.node"], server.attributes["berth.deployment"]) == (
        "n-1",
        DEPLOYMENT,
    )
    assert [event.name for event in server.span.events] == ["berth.first_byte"]
    assert server.attributes["berth.route.candidates"] == ["d-down", DEPLOYMENT]
    assert server.attributes["berth.route.reason"]  # the scorer's words

    # Both attempts, children of the request's span: the first failed, the retry answered.
    attempts = sorted(
        otlp_receiver.named("berth.attempt"), key=lambda r: r.span.start_time_unix_nano
    )
    assert [a.attributes["berth.attempt"] for a in attempts] == [1, 2]
    assert all(a.span.parent_span_id == server.span.span_id for a in attempts)
    first, retry = attempts
    assert (first.attributes["berth.node"], first.attributes["berth.deployment"]) == (
        "n-down",
        "d-down",
    )
    assert first.attributes["berth.attempt.outcome"] == "engine_unreachable"
    assert first.span.status.code == Status.STATUS_CODE_ERROR
    assert retry.attributes["berth.node"] == "n-1"
    assert retry.attributes["berth.attempt.outcome"] == "status 200"
    assert retry.span.status.code != Status.STATUS_CODE_ERROR

    # The agent's relay, in its own process's spans, under the retry that went through it.
    (relay,) = otlp_receiver.named("berth.agent.relay")
    assert relay.service == "berth-agent"
    assert relay.span.parent_span_id == retry.span.span_id
    assert relay.attributes["berth.deployment"] == DEPLOYMENT
    assert relay.attributes["berth.relay.outcome"] == "status 200"
    # ... and the engine was handed the relay's span as its parent (an engine that traces
    # joins the trace there).
    version, trace_id, parent_id, _flags = engine_headers["traceparent"].split("-")
    assert (version, trace_id, parent_id) == ("00", CALLER_TRACE, relay.span.span_id.hex())

    (stream,) = otlp_receiver.named("berth.stream")
    assert stream.span.parent_span_id == server.span.span_id
    assert stream.attributes["berth.events"] == len(events)


async def test_a_request_without_a_traceparent_starts_a_trace_and_hands_it_to_the_engine(
    otlp_receiver: OtlpReceiver,
) -> None:
    tracing = _tracing(otlp_receiver, "berth-leader")
    try:
        async with linked_in_memory() as linked:  # the agent does not trace: the engine
            tunneled = Upstream("", DEPLOYMENT, "n-1", MODEL, remote=True)
            resolver = Ranked([tunneled])
            options = {"tunnels": OneLink(linked), "tracer": tracing.requests()}
            async with (
                running_proxy(resolver, ProxyMetrics(), **options) as url,
                httpx.AsyncClient(base_url=url, timeout=EVENT_TIMEOUT_S) as client,
            ):
                plain = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
                response = await client.post("/v1/chat/completions", json=plain)
            assert response.status_code == 200
            engine_headers = linked.engine.requests[-1].headers
        await _flush(tracing)
    finally:
        tracing.shutdown()
    (server,) = otlp_receiver.named("POST /v1/chat/completions")
    assert server.span.parent_span_id == b""  # a root
    (attempt,) = otlp_receiver.named("berth.attempt")
    _version, trace_id, parent_id, _flags = engine_headers["traceparent"].split("-")
    assert (trace_id, parent_id) == (server.span.trace_id.hex(), attempt.span.span_id.hex())
    assert otlp_receiver.named("berth.answer")  # a whole answer, not a stream


async def test_a_caller_s_unsampled_trace_is_followed_and_nothing_is_recorded(
    otlp_receiver: OtlpReceiver,
) -> None:
    leader_tracing = _tracing(otlp_receiver, "berth-leader")
    agent_tracing = _tracing(otlp_receiver, "berth-agent")
    try:
        async with linked_in_memory(tracer=agent_tracing.relays("n-1")) as linked:
            tunneled = Upstream("", DEPLOYMENT, "n-1", MODEL, remote=True)
            resolver = Ranked([tunneled])
            options = {"tunnels": OneLink(linked), "tracer": leader_tracing.requests()}
            unsampled = {"traceparent": f"00-{CALLER_TRACE}-{CALLER_SPAN}-00"}
            async with (
                running_proxy(resolver, ProxyMetrics(), **options) as url,
                httpx.AsyncClient(base_url=url, timeout=EVENT_TIMEOUT_S) as client,
            ):
                plain = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
                response = await client.post("/v1/chat/completions", json=plain, headers=unsampled)
            assert response.status_code == 200
            engine_headers = linked.engine.requests[-1].headers
        await _flush(leader_tracing, agent_tracing)
    finally:
        leader_tracing.shutdown()
        agent_tracing.shutdown()
    assert otlp_receiver.spans == []
    # The engine still gets the trace, not sampled: it records nothing either.
    _version, trace_id, parent_id, flags = engine_headers["traceparent"].split("-")
    assert (trace_id, flags) == (CALLER_TRACE, "00")
    assert parent_id != CALLER_SPAN  # the agent's (unrecorded) span, not the caller's


async def test_a_request_that_waited_for_a_slot_shows_its_queue_wait(
    otlp_receiver: OtlpReceiver,
) -> None:
    tracing = _tracing(otlp_receiver, "berth-leader")
    slow = json_reply({"id": "x", "object": "chat.completion", "choices": []})
    try:
        async with StandinEngine(Reply((Stall(0.3), *slow.steps))) as engine:
            one_slot = Upstream(engine.base_url, "d-one", "local", MODEL, slots=1)
            options = {"slots": SlotGate(), "tracer": tracing.requests()}
            async with (
                running_proxy(Ranked([one_slot]), ProxyMetrics(), **options) as url,
                httpx.AsyncClient(base_url=url, timeout=EVENT_TIMEOUT_S) as client,
            ):
                plain = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
                answers = await asyncio.gather(
                    *(client.post("/v1/chat/completions", json=plain) for _ in range(2))
                )
            assert [a.status_code for a in answers] == [200, 200]
        await _flush(tracing)
    finally:
        tracing.shutdown()
    servers = otlp_receiver.named("POST /v1/chat/completions")
    (wait,) = otlp_receiver.named("berth.queue_wait")  # the second waited for the first's slot
    assert wait.span.parent_span_id in {server.span.span_id for server in servers}
    assert wait.span.status.code != Status.STATUS_CODE_ERROR


@pytest.mark.parametrize(
    ("status", "completed", "withdrawn", "outcome", "error"),
    [
        (200, True, False, "status 200", False),
        (None, False, False, "engine_unreachable", True),
        (200, False, False, "engine_disconnect", True),
        (503, True, False, "status 503", True),
        (None, True, True, "withdrawn", False),
    ],
    ids=["answered", "unreachable", "cut-off", "engine-5xx", "withdrawn"],
)
def test_the_agent_s_relay_span_says_how_the_relay_ended(
    status: int | None, completed: bool, withdrawn: bool, outcome: str, error: bool
) -> None:
    memory = InMemorySpanExporter()
    tracing = build_tracing(TracingConfig(endpoint="http://unused:4318/v1/traces"), exporter=memory)
    try:
        parent = [(b"traceparent", f"00-{CALLER_TRACE}-{CALLER_SPAN}-01".encode())]
        relay = tracing.relays("n-1").begin(DEPLOYMENT, b"POST", b"/v1/chat/completions", parent)
        relay.end(status, completed=completed, withdrawn=withdrawn)
        assert tracing.force_flush()
    finally:
        tracing.shutdown()
    (span,) = memory.get_finished_spans()
    assert span.parent is not None and f"{span.parent.span_id:016x}" == CALLER_SPAN
    assert span.attributes is not None and span.attributes["berth.relay.outcome"] == outcome
    assert (span.status.status_code.name == "ERROR") is error
    # the engine is sent the relay's own span as parent
    (sent,) = [value for name, value in relay.headers if name == b"traceparent"]
    assert sent.decode().split("-")[2] == f"{span.context.span_id:016x}"
