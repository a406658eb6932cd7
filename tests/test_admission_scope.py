"""What admission takes is given back on every way out of a request (issue 38).

A key's request in flight, its token reservation and its body bytes, the fair queue's slot
at the deployment, the router's count of the deployment's requests in flight and the
proxy's in-flight gauge: a failure injected at each stage after admission (a bug: a
``RuntimeError`` where the stage runs), the client leaving mid-answer and a retry that ends
at another deployment each leave every counter back at zero, and the key, limited to one
request at a time, is served at once afterwards. The proxy runs on berth's HTTP server in
front of the scripted stand-in engine, both on loopback; the stages are the real ones, and
the failures are injected with ``monkeypatch`` at the names the request path calls.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import httpx
import pytest

from berth.admission import Admission, ManualClock, SlotGate, UsageLedger
from berth.config import TierTable
from berth.gateway import completions, stages
from berth.gateway.engine_client import EngineClient
from berth.gateway.proxy import OpenAIProxy
from berth.gateway.relay import AnswerRelay
from berth.observability.metrics import ProxyMetrics
from berth.observability.request_log import RequestLog
from berth.routing.resolver import Upstream
from berth.vocab.limits import LimitOverrides
from berth.vocab.records import ApiKeyRecord, UsageRecord
from support.proxy_fixtures import StaticResolver, running_proxy, sample
from support.standin_engine import Head, Hold, Reply, StandinEngine, Write, chat_chunks, sse_reply
from support.waiting import EVENT_TIMEOUT_S, wait_for_async

TPM = 10_000_000
KEY = ApiKeyRecord(
    "k-scope",
    "scope",
    "standard",
    "sk-berth-scope",
    datetime(2025, 1, 1, tzinfo=UTC),
    None,
    LimitOverrides(max_concurrency=1, rpm=10_000, tpm=TPM),
)
#: A stream that asks for usage itself but not all of it: the usage rewriter writes it again.
STREAM = {
    "model": "m",
    "messages": [{"role": "user", "content": "hi"}],
    "stream": True,
    "stream_options": {"include_usage": False},
}
EVENTS = chat_chunks(["one two"])
#: The first event of a stream, then nothing until the test releases it.
HELD = Reply((Head(200, "text/event-stream"), Write(EVENTS[0]), Hold()))


class NoSink:
    def add_usage(self, batch: Iterable[UsageRecord]) -> int:
        return 0


@dataclass
class Scope:
    """The proxy under test, its parts, and an HTTP client of the key ``KEY``."""

    http: httpx.AsyncClient
    proxy: OpenAIProxy
    admission: Admission
    gate: SlotGate
    metrics: ProxyMetrics
    engine: StandinEngine

    def counters(self, deployments: Iterable[str] = ("d-m",)) -> dict[str, int]:
        """Everything a request holds while it is served, each 0 when none is."""
        use = self.admission.use_of(KEY.id)
        held = {
            "key requests in flight": use.in_flight,
            # the bucket (never refilled: the clock stands still) less what was settled
            "key tokens reserved": TPM - (use.tokens_remaining or 0) - use.day_tokens,
            "key body bytes": use.body_bytes,
        }
        for deployment in deployments:
            held[f"{deployment} slots taken"] = self.gate.scheduler.in_use(deployment)
            held[f"{deployment} in flight (router)"] = self.proxy.router.signals.in_flight(
                deployment
            )
            model = deployment.removeprefix("d-")
            labels = {"model": model, "deployment": deployment, "node": "local"}
            gauge = sample(self.metrics, "berth_proxy_in_flight_requests", **labels)
            held[f"{deployment} in flight (metrics)"] = int(gauge)
        return held

    async def all_given_back(self, deployments: Iterable[str] = ("d-m",)) -> None:
        """Wait until every counter is back at zero (the proxy's ``finally`` clauses run
        just after the answer's last byte)."""
        names = tuple(deployments)
        await wait_for_async(
            lambda: not any(self.counters(names).values()),
            EVENT_TIMEOUT_S,
            f"every counter at zero: {self.counters(names)}",
        )

    async def served_at_once(self) -> None:
        """The key (one request at a time) is served: 200, the whole stream."""
        answer = await self.http.post("/v1/chat/completions", json=STREAM)
        assert answer.status_code == 200, answer.text
        assert answer.content.endswith(b"data: [DONE]\n\n")
        await self.all_given_back()


@contextlib.asynccontextmanager
async def running_scope(
    resolver_routes: Callable[[StandinEngine], StaticResolver] | None = None,
) -> AsyncIterator[Scope]:
    async with StandinEngine(default=sse_reply(EVENTS)) as engine:
        admission = Admission(
            TierTable(),
            UsageLedger(NoSink()),
            clock=ManualClock(),
            max_body_bytes_per_key=1024 * 1024,
        )
        admission.update(KEY)
        gate = SlotGate()
        metrics = ProxyMetrics()
        resolver = (
            resolver_routes(engine)
            if resolver_routes is not None
            else StaticResolver({"m": engine.base_url}, slots=2)
        )
        built: list[OpenAIProxy] = []

        def keyed(proxy: OpenAIProxy) -> Callable[[Any, Any], Any]:
            built.append(proxy)

            async def handle(request: Any, writer: Any) -> None:
                await proxy.handle(request, writer, KEY, key_name=KEY.name)

            return handle

        async with (
            running_proxy(resolver, metrics, admission=admission, slots=gate, wrap=keyed) as url,
            httpx.AsyncClient(base_url=url, timeout=EVENT_TIMEOUT_S) as http,
        ):
            yield Scope(http, built[0], admission, gate, metrics, engine)


class Injected(RuntimeError):
    """The failure a test injects (a bug where the stage runs)."""


def first_call_fails(real: Callable[..., Any], stage: str) -> Callable[..., Any]:
    """``real`` (a function or method the request path calls), failing on its first call
    only, so that the next request goes through."""
    calls = 0

    def maybe_fail(*args: Any, **kwargs: Any) -> Any:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise Injected(f"injected in {stage}")
        return real(*args, **kwargs)

    return maybe_fail


#: Each stage after admission, in the order a request meets them, and where a failure is
#: injected: the object and the name the request path calls there.
STAGES: dict[str, tuple[Any, str]] = {
    # the usage rewriter writes the body again
    "usage rewrite": (completions, "ask_usage"),
    "routing": (stages.Routing, "route"),
    # the slot at the deployment taken, then the attempts fail before any
    "attempts, slot taken": (completions, "first_answer"),
    # the engine client fails as it sends the request
    "attempt": (EngineClient, "open"),
    # the engine's answer is open (its connection, the router's count), the relay fails
    "relay": (AnswerRelay, "relay"),
    # the answer went out whole; recording it fails before the ticket is settled
    "records": (RequestLog, "add"),
}


@pytest.mark.parametrize("stage", list(STAGES))
async def test_a_failure_at_any_stage_after_admission_gives_everything_back(
    stage: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    owner, name = STAGES[stage]
    monkeypatch.setattr(owner, name, first_call_fails(getattr(owner, name), stage))
    async with running_scope() as scope:
        if stage == "relay":  # the engine holds its answer open until berth closes it
            scope.engine.script(HELD)
        answer = await scope.http.post("/v1/chat/completions", json=STREAM)
        # a bug is a 500; the records' failure comes after the whole answer
        assert answer.status_code == (200 if stage == "records" else 500)
        if stage == "relay":
            (held,) = scope.engine.requests
            await wait_for_async(
                held.disconnected.is_set, EVENT_TIMEOUT_S, "the engine's exchange closed"
            )
        await scope.all_given_back()
        await scope.served_at_once()


async def test_a_client_that_leaves_mid_answer_gives_everything_back() -> None:
    async with running_scope() as scope:
        scope.engine.script(HELD)
        async with scope.http.stream("POST", "/v1/chat/completions", json=STREAM) as answer:
            assert answer.status_code == 200
            async for _ in answer.aiter_bytes():
                break  # the first event came: leave
        held = scope.engine.requests[0]
        await wait_for_async(
            held.disconnected.is_set, EVENT_TIMEOUT_S, "the engine's exchange closed"
        )
        await scope.all_given_back()
        await scope.served_at_once()


async def test_a_retry_that_ends_at_another_deployment_gives_both_back() -> None:
    def two_deployments(engine: StandinEngine) -> StaticResolver:
        return Unreachable(engine)

    async with running_scope(two_deployments) as scope:
        answer = await scope.http.post("/v1/chat/completions", json=STREAM)
        assert answer.status_code == 200
        assert len(scope.engine.requests) == 1  # the first deployment refused to connect
        await scope.all_given_back(("d-m", "d-dead"))
        await scope.served_at_once()


class Unreachable(StaticResolver):
    """Model ``m`` on two nodes: ``d-dead`` first (a port nothing listens on), then the
    engine's ``d-m``; two slots each."""

    def __init__(self, engine: StandinEngine) -> None:
        super().__init__({"m": engine.base_url}, slots=2)

    def candidates(self, model: str) -> list[Upstream]:
        dead = Upstream("http://127.0.0.1:9", "d-dead", "gone", model, slots=2)
        return [dead, *super().candidates(model)]


async def test_a_lone_surrogate_is_refused_400_and_the_key_served_at_once() -> None:
    # It was a 500 (UnicodeEncodeError writing the usage rewrite) after admission, and the
    # key's one request at a time stayed taken until a restart.
    body = (
        b'{"model":"m","stream":true,"stream_options":{"include_usage":false},'
        b'"messages":[{"role":"user","content":"\\ud800"}]}'
    )
    async with running_scope() as scope:
        answer = await scope.http.post(
            "/v1/chat/completions", content=body, headers={"content-type": "application/json"}
        )
        assert answer.status_code == 400
        error = answer.json()["error"]
        assert error["code"] == "invalid_json"
        assert "lone surrogate \\ud800" in error["message"]
        assert not scope.engine.requests
        await scope.all_given_back()
        await scope.served_at_once()


async def test_a_key_over_its_body_bytes_in_flight_is_refused_429_until_one_ends() -> None:
    async with running_scope() as scope:
        scope.engine.script(HELD)
        big = {**STREAM, "messages": [{"role": "user", "content": "x" * 700_000}]}
        async with scope.http.stream("POST", "/v1/chat/completions", json=big) as first:
            assert first.status_code == 200
            assert scope.admission.use_of(KEY.id).body_bytes > 700_000
            second = await scope.http.post("/v1/chat/completions", json=big)
            assert second.status_code == 429
            error = second.json()["error"]
            assert error["code"] == "body_bytes_exceeded"
            assert "max_body_bytes_per_key" in error["message"]
            assert second.headers["retry-after"] == "1"
            scope.engine.requests[0].release.set()
            await first.aread()
        assert len(scope.engine.requests) == 1
        await scope.all_given_back()
        await scope.served_at_once()


async def test_a_refusal_after_admission_gives_the_ticket_back_before_its_answer() -> None:
    # The key may make one request at a time: each refusal must have given its ticket back
    # by the time the client reads it, or the next request is refused 429.
    async with running_scope() as scope:
        for _ in range(3):
            again = await scope.http.post("/v1/chat/completions", json={**STREAM, "model": "nope"})
            assert again.status_code == 404
        await scope.all_given_back()
        await scope.served_at_once()
