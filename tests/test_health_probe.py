"""Health probes share one HTTP client and load no CA bundle (a TLS context built per probe,
loading the bundle on the event loop, was the leader's periodic stall of issue 13), and each
probe leaves no connection open at the engine. Against a real HTTP server on loopback that
counts what it sees."""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from berth.agent.adopted import AdoptedEndpoint, AdoptedWatcher, save_adopted
from berth.runtime.base import EngineHandle
from berth.runtime.engines import find_free_port
from berth.runtime.health import HealthProber, bearer_headers
from berth.runtime.process import ProcessRuntime
from support.waiting import EVENT_TIMEOUT_S, wait_for_async


class CountingEngine:
    """Answers every request with ``status``; counts connections opened and closed and the
    requests that asked for ``Connection: close``."""

    def __init__(self, status: int = 200) -> None:
        self.status = status
        self.opened = 0
        self.closed = 0
        self.asked_to_close = 0
        self.requests = 0
        self.port = 0
        self.heads: list[bytes] = []

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.opened += 1
        try:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except (asyncio.IncompleteReadError, ConnectionError):
                    return
                self.requests += 1
                self.heads.append(head)
                close = b"\r\nconnection: close\r\n" in head.lower()
                self.asked_to_close += close
                writer.write(b"HTTP/1.1 %d X\r\ncontent-length: 2\r\n\r\nok" % self.status)
                await writer.drain()
                if close:
                    return
        finally:
            self.closed += 1
            writer.close()

    def url(self, path: str = "/health") -> str:
        return f"http://127.0.0.1:{self.port}{path}"


@contextlib.asynccontextmanager
async def engine(status: int = 200) -> AsyncIterator[CountingEngine]:
    counting = CountingEngine(status)
    server = await asyncio.start_server(counting.handle, "127.0.0.1", 0)
    counting.port = server.sockets[0].getsockname()[1]
    try:
        yield counting
    finally:
        server.close()
        await server.wait_closed()


@pytest.fixture
def default_contexts_made(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the TLS contexts built with ``ssl.create_default_context``, the ones that load
    the CA bundle (what httpx does for each client made with its defaults); the list's one
    item is the count."""
    made = [0]
    original = ssl.create_default_context

    def counting(*args: Any, **kwargs: Any) -> ssl.SSLContext:
        made[0] += 1
        return original(*args, **kwargs)

    monkeypatch.setattr(ssl, "create_default_context", counting)
    return made


async def test_probes_reuse_one_client_and_leave_no_connection_open(
    default_contexts_made: list[int],
) -> None:
    prober = HealthProber()
    async with engine() as counting:
        results = [await prober.probe(counting.url(), 2.0) for _ in range(10)]
        await wait_for_async(
            lambda: counting.closed == counting.opened == 10, EVENT_TIMEOUT_S, "10 closed"
        )

    assert results == [True] * 10
    assert default_contexts_made[0] == 0
    assert counting.asked_to_close == counting.requests == 10


async def test_probes_started_together_all_get_their_answer(
    default_contexts_made: list[int],
) -> None:
    prober = HealthProber()
    async with engine() as counting:
        results = await asyncio.gather(*(prober.probe(counting.url(), 2.0) for _ in range(8)))

    assert results == [True] * 8
    assert default_contexts_made[0] == 0


async def test_a_runtime_probes_its_engines_through_one_client(
    default_contexts_made: list[int],
) -> None:
    runtime = ProcessRuntime()
    async with engine() as counting:
        handle = EngineHandle(deployment_id="d-0000aaaa", pid=0, port=counting.port)
        for _ in range(5):
            assert await runtime.check_health(handle, "/health", 2.0)

        async def alive() -> bool:
            return True

        waited = await HealthProber().wait(
            counting.url(), 5.0, alive=alive, poll_interval_s=0.01, probe_timeout_s=1.0
        )

    assert waited == "healthy"
    assert default_contexts_made[0] == 0


async def test_the_adopted_watcher_probes_through_one_client(
    default_contexts_made: list[int], tmp_path: Path
) -> None:
    async with engine() as counting:
        endpoint = AdoptedEndpoint("vllm-a", "127.0.0.1", counting.port, "m", "m")
        save_adopted(tmp_path / "adopted.yaml", [endpoint])
        watcher = AdoptedWatcher(tmp_path / "adopted.yaml", probe_interval_s=0.0)
        for _ in range(4):
            await watcher.check_once()
        assert [s.alive for s in watcher.states()] == [True]
        assert counting.requests == 4

    assert default_contexts_made[0] == 0


@pytest.mark.parametrize("status", [503, 404])
async def test_an_answer_other_than_200_is_unhealthy(status: int) -> None:
    async with engine(status) as counting:
        assert not await HealthProber().probe(counting.url(), 2.0)


async def test_nothing_listening_is_unhealthy_not_an_error() -> None:
    assert not await HealthProber().probe(f"http://127.0.0.1:{find_free_port()}/health", 2.0)


async def test_only_plain_http_is_probed() -> None:
    with pytest.raises(ValueError, match="plain HTTP"):
        await HealthProber().probe("https://127.0.0.1:8443/health", 2.0)


async def test_an_engines_key_goes_with_each_probe() -> None:
    prober = HealthProber()
    async with engine() as counting:
        assert await prober.probe(counting.url(), 2.0, headers=bearer_headers("k-123"))
        assert await prober.probe(counting.url(), 2.0, headers=bearer_headers(None))

    with_key, without = (head.lower() for head in counting.heads)
    assert b"\r\nauthorization: bearer k-123\r\n" in with_key
    assert b"authorization" not in without
