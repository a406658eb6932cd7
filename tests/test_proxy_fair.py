"""Fair admission in the proxy, in front of the stand-in engine held busy by the test: a
deployment of 2 slots, one key keeping 50 requests waiting and another sending one at a
time; a client that leaves while queued; the answers of a full queue and of too long a
wait."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Iterable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI

from berth.admission import Admission, SlotGate, UsageLedger
from berth.config import TierTable
from berth.daemon.app import LeaderApp
from berth.desk.leader import LeaderClient, job_request
from berth.gateway.proxy import OpenAIProxy
from berth.observability.metrics import ProxyMetrics
from berth.vocab.limits import LimitOverrides
from berth.vocab.records import ApiKeyRecord, UsageRecord
from support.proxy_fixtures import StaticResolver, running_proxy
from support.standin_engine import Hold, Reply, StandinEngine, chat_completion, json_reply

MESSAGES = [{"role": "user", "content": "hi"}]
#: The engine's answer once the test releases the request.
HELD = Reply((Hold(), *json_reply(chat_completion("hi")).steps))


def key(name: str) -> ApiKeyRecord:
    created = datetime(2025, 1, 1, tzinfo=UTC)
    return ApiKeyRecord(
        f"k-{name}", name, "standard", "sk-berth-x", created, None, LimitOverrides()
    )


KEYS = {name: key(name) for name in ("heavy", "light")}


class NoSink:
    def add_usage(self, batch: Iterable[UsageRecord]) -> int:
        return 0


class KeyedHandler:
    """The proxy behind a stand-in for the listener's auth: ``x-test-key: NAME`` makes the
    request the key ``NAME``'s."""

    def __init__(self, proxy: OpenAIProxy) -> None:
        self.proxy = proxy

    async def __call__(self, request: Any, writer: Any) -> None:
        name = dict(request.headers).get(b"x-test-key", b"").decode()
        await self.proxy.handle(request, writer, KEYS.get(name))


async def until(condition: Callable[[], bool], timeout_s: float = 30.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not condition():
        assert loop.time() < deadline, "condition not met"
        await asyncio.sleep(0.002)


async def post(http: httpx.AsyncClient, name: str, tag: str) -> httpx.Response:
    """A chat completion of the key ``name``; ``tag`` (the body's ``user``) names it at the
    engine."""
    body = {"model": "m", "messages": MESSAGES, "user": tag}
    return await http.post("/v1/chat/completions", json=body, headers={"x-test-key": name})


def tags(engine: StandinEngine, start: int = 0) -> list[str]:
    """The ``user`` of each request the engine received, from the ``start``-th on."""
    return [request.json()["user"] for request in engine.requests[start:]]


def held(engine: StandinEngine) -> list[Any]:
    """The requests the engine holds (not released yet), oldest first."""
    return [request for request in engine.requests if not request.release.is_set()]


@pytest.fixture
def unlimited_admission() -> Admission:
    return Admission(TierTable(), UsageLedger(NoSink()))


@contextlib.asynccontextmanager
async def fair_proxy(
    engine: StandinEngine, metrics: ProxyMetrics, unlimited_admission: Admission, gate: SlotGate
) -> AsyncIterator[httpx.AsyncClient]:
    """The proxy with ``admission`` and ``gate``, model ``m`` on ``engine`` with 2 slots."""
    engine.default = HELD
    resolver = StaticResolver({"m": engine.base_url}, slots=2)
    options: dict[str, Any] = {
        "admission": unlimited_admission,
        "slots": gate,
        "wrap": KeyedHandler,
    }
    limits = httpx.Limits(max_connections=200, max_keepalive_connections=200)
    async with (
        running_proxy(resolver, metrics, **options) as url,
        httpx.AsyncClient(base_url=url, limits=limits, timeout=60) as http,
    ):
        yield http


async def drain(engine: StandinEngine, tasks: list[asyncio.Task[httpx.Response]]) -> None:
    """Release every request until ``tasks`` are answered."""
    while not all(task.done() for task in tasks):
        for request in held(engine):
            request.release.set()
        await asyncio.sleep(0.005)


async def test_a_key_sending_one_at_a_time_waits_one_turn_beside_a_key_with_fifty_waiting(
    engine: StandinEngine, metrics: ProxyMetrics, unlimited_admission: Admission
) -> None:
    gate = SlotGate(max_waiting=100, timeout_s=120)
    async with fair_proxy(engine, metrics, unlimited_admission, gate) as http:
        heavy = [asyncio.create_task(post(http, "heavy", f"heavy-{i}")) for i in range(2)]
        for turn in range(5):
            await until(lambda: len(held(engine)) == 2)
            # The heavy key keeps 50 requests waiting, beside the 2 the engine holds.
            while gate.scheduler.waiting < 50:
                waiting = gate.scheduler.waiting
                heavy.append(asyncio.create_task(post(http, "heavy", f"heavy-{len(heavy)}")))
                await until(lambda n=waiting: gate.scheduler.waiting == n + 1)  # type: ignore[misc]
            start = len(engine.requests)
            light = asyncio.create_task(post(http, "light", f"light-{turn}"))
            await until(lambda: gate.scheduler.waiting == 51)
            # Requests end one at a time; each slot given back goes to the next in turn.
            while f"light-{turn}" not in tags(engine, start):
                arrived = len(engine.requests)
                held(engine)[0].release.set()
                await until(lambda n=arrived: len(engine.requests) == n + 1)  # type: ignore[misc]
            # At most one of the heavy key's requests went first; first come, first served
            # would have sent all 50 before it.
            assert tags(engine, start).index(f"light-{turn}") <= 1
            for request in held(engine):
                if request.json()["user"] == f"light-{turn}":
                    request.release.set()
            assert (await light).status_code == 200
        await drain(engine, heavy)
    assert {(await task).status_code for task in heavy} == {200}
    light_tags = [tag for tag in tags(engine) if tag.startswith("light")]
    assert light_tags == [f"light-{turn}" for turn in range(5)]


async def test_a_client_that_leaves_while_queued_never_reaches_the_engine(
    engine: StandinEngine, metrics: ProxyMetrics, unlimited_admission: Admission
) -> None:
    gate = SlotGate(max_waiting=10, timeout_s=120)
    async with fair_proxy(engine, metrics, unlimited_admission, gate) as http:
        busy = [asyncio.create_task(post(http, "heavy", f"busy-{i}")) for i in range(2)]
        await until(lambda: len(engine.requests) == 2)
        gone = asyncio.create_task(post(http, "light", "gone"))
        await until(lambda: gate.scheduler.waiting == 1)
        gone.cancel()  # the client closes its connection
        await until(lambda: gate.scheduler.waiting == 0)
        assert gate.stats.dropped == {("m", "client_left"): 1}
        await drain(engine, busy)
        after = await asyncio.wait_for(
            asyncio.gather(post(http, "light", "after"), drain_soon(engine)), 30
        )
        assert after[0].status_code == 200
    assert tags(engine) == ["busy-0", "busy-1", "after"]
    assert gate.scheduler.in_use("d-m") == 0
    assert [row.key_id for row in unlimited_admission.ledger.pending].count(
        "k-light"
    ) == 1  # "after"


async def drain_soon(engine: StandinEngine) -> None:
    """Release the next request the engine receives."""
    count = len(engine.requests)
    await until(lambda: len(engine.requests) > count)
    engine.requests[-1].release.set()


async def test_a_full_queue_and_a_wait_too_long_answer_503_with_retry_after(
    engine: StandinEngine, metrics: ProxyMetrics, unlimited_admission: Admission
) -> None:
    gate = SlotGate(max_waiting=1, timeout_s=0.3)
    async with fair_proxy(engine, metrics, unlimited_admission, gate) as http:
        busy = [asyncio.create_task(post(http, "heavy", f"busy-{i}")) for i in range(2)]
        await until(lambda: len(engine.requests) == 2)
        late = asyncio.create_task(post(http, "light", "late"))
        await until(lambda: gate.scheduler.waiting == 1)
        full = await post(http, "light", "full")
        timed_out = await late
        await drain(engine, busy)
    assert full.status_code == 503
    assert full.json()["error"]["code"] == "queue_full"
    assert int(full.headers["retry-after"]) >= 1
    assert timed_out.status_code == 503
    assert timed_out.json()["error"]["code"] == "queue_timeout"
    assert timed_out.json()["error"]["type"] == "server_error"
    assert int(timed_out.headers["retry-after"]) >= 1
    assert tags(engine) == ["busy-0", "busy-1"]
    # Refused before an engine was tried: not in the ledger.
    assert [row.key_id for row in unlimited_admission.ledger.pending] == ["k-heavy"]


class ToServer(httpx.AsyncBaseTransport):
    """The desk worker's client, sent to the test's server instead of the leader's socket."""

    def __init__(self, url: str) -> None:
        self._url = httpx.URL(url)
        self._inner = httpx.AsyncHTTPTransport()

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        request.url = request.url.copy_with(host=self._url.host, port=self._url.port)
        return await self._inner.handle_async_request(request)

    async def aclose(self) -> None:
        await self._inner.aclose()


def socket_and_keys(proxy: OpenAIProxy) -> Callable[[Any, Any], Any]:
    """One server for both listeners: a request with ``x-test-key`` is that key's (the
    public listener's auth, stood in for); any other is served as the leader's Unix socket
    serves it (the real :class:`LeaderApp`, which tells the desk worker by its header)."""
    keyed = KeyedHandler(proxy)
    socket = LeaderApp(proxy, FastAPI(), None, None, None, trusted=True)  # type: ignore[arg-type]

    async def handler(request: Any, writer: Any) -> None:
        if dict(request.headers).get(b"x-test-key") is not None:
            await keyed(request, writer)
        else:
            await socket(request, writer)

    return handler


def tag_of(request: Any) -> str:
    """A request's ``user``, or a desk job's prompt."""
    body = request.json()
    return str(body.get("user") or body["messages"][0]["content"])


async def test_a_flood_of_desk_jobs_waits_behind_an_api_keys_requests(
    engine: StandinEngine, metrics: ProxyMetrics, unlimited_admission: Admission
) -> None:
    # Desk jobs used to come in over the socket at the admin tier's priority: a key's
    # request waited behind every one of them. Now they are the built-in desk tier's (40),
    # below a standard key's (50).
    gate = SlotGate(max_waiting=100, timeout_s=120)
    engine.default = HELD
    resolver = StaticResolver({"m": engine.base_url}, slots=2)
    async with (
        running_proxy(resolver, metrics, admission=unlimited_admission, slots=gate,
                      wrap=socket_and_keys) as url,
        httpx.AsyncClient(base_url=url, timeout=60) as http,
        LeaderClient(Path("berth.sock"), transport=ToServer(url)) as desk,
    ):  # fmt: skip
        jobs = [
            asyncio.create_task(desk.chat(job_request("m", f"desk-{i}", pool_test=False),
                                          timeout_s=120))
            for i in range(20)
        ]  # fmt: skip
        await until(lambda: len(held(engine)) == 2 and gate.scheduler.waiting == 18)
        for turn in range(3):
            start, desks = len(engine.requests), gate.scheduler.waiting
            light = asyncio.create_task(post(http, "light", f"light-{turn}"))
            await until(lambda n=desks: gate.scheduler.waiting == n + 1)  # type: ignore[misc]
            held(engine)[0].release.set()  # a desk job ends: its slot goes to the key
            await until(lambda n=start: len(engine.requests) == n + 1)  # type: ignore[misc]
            assert tag_of(engine.requests[start]) == f"light-{turn}"
            engine.requests[start].release.set()
            assert (await light).status_code == 200
            await until(lambda: len(held(engine)) == 2)  # a desk job took the slot back
        sent = len(engine.requests)
        cli = asyncio.create_task(http.post("/v1/chat/completions", json={
            "model": "m", "messages": MESSAGES, "user": "cli"}))  # fmt: skip
        await until(lambda n=desks: gate.scheduler.waiting == n)  # type: ignore[misc]
        while not (cli.done() and all(job.done() for job in jobs)):
            for request in held(engine):
                request.release.set()
            await asyncio.sleep(0.005)
        assert (await cli).status_code == 200
        assert {job.result().output for job in jobs} == {"hi"}
    # The CLI over the socket still goes first (admin priority): into one of the two slots
    # the next releases free, ahead of the desk jobs still waiting.
    assert [tag_of(r) for r in engine.requests].index("cli") in (sent, sent + 1)
    rows = {row.key_id: row.requests for row in unlimited_admission.ledger.pending}
    assert rows == {"socket:desk": 20, "k-light": 3, "socket:cli": 1}
