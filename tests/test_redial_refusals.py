"""How soon an agent redials (``berth.agent.dialer``, ``berth.agent.leaders``): while leaders
answer but refuse it (``NOT_LEADER``: no active yet, as during a database outage), each
redial stays short (at most 2 s) and jittered; the backoff grows only while no leader
answers at all (issue 37: the refusals doubled it, and an agent reached the active elected
after an outage up to 12.6 s late).

The leaders are real TLS WebSocket servers on loopback that refuse every agent with close
code 4421; a leader that does not answer is a closed port.  The dialer's backoff is given a
stand-in that records the delay the real one (``berth.backoff.jittered_delay_s`` from the
dialer's first delay) would wait and waits a moment instead, so the test runs in a fraction
of a second.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest
from aiohttp import web

from berth.agent.dialer import BACKOFF_BASE_S, REDIAL_MAX_S, AgentDialer, AgentStatus
from berth.agent.leaders import LeaderList
from berth.backoff import jittered_delay_s
from berth.cluster.pki.ca import CertificateAuthority
from berth.cluster.protocol.errors import CloseCode, not_leader_reason
from berth.cluster.protocol.frames import PROTOCOL_MAX, PROTOCOL_MIN, Hello
from berth.cluster.protocol.payloads import Inventory
from berth.paths import BerthHome
from support.waiting import EVENT_TIMEOUT_S, wait_for_async
from test_failover import NoRuntimes, _identity

#: Redials watched per case.
REDIALS = 12


class HelloOnly(NoRuntimes):
    """What the dialer asks of the agent's service before a leader answers its Hello."""

    def hello(self) -> Hello:
        return Hello(
            protocol_min=PROTOCOL_MIN,
            protocol_max=PROTOCOL_MAX,
            agent_version="test",
            inventory=Inventory(hostname="gpu-1"),
        )


@pytest.fixture
async def refusing_leaders(tmp_path: Path) -> AsyncIterator[list[str]]:
    """Two standby leaders' cluster URLs: each closes every agent's WebSocket with
    ``NOT_LEADER`` and no active named, as leaders do while none holds the lease."""
    ca = CertificateAuthority.load_or_create(tmp_path / "ca")
    cert, key = tmp_path / "leader.pem", tmp_path / "leader.key"
    ca.issue_server_certificate(["127.0.0.1"], cert, key)
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert, key)

    async def refuse(request: web.Request) -> web.WebSocketResponse:
        ws = web.WebSocketResponse()
        await ws.prepare(request)
        await ws.close(code=CloseCode.NOT_LEADER, message=not_leader_reason(None).encode())
        return ws

    app = web.Application()
    app.router.add_get("/cluster/agent", refuse)
    runner = web.AppRunner(app)
    await runner.setup()
    urls = []
    for _ in range(2):
        site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=context)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        urls.append(f"https://127.0.0.1:{port}")
    try:
        yield urls
    finally:
        await runner.cleanup()


def _closed_port() -> str:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return f"https://127.0.0.1:{probe.getsockname()[1]}"  # closed once this returns


async def _delays(
    tmp_path: Path, home: BerthHome, leaders: list[str]
) -> tuple[list[float], AgentStatus]:
    """The delays the real backoff chose for the first :data:`REDIALS` redials of an agent
    that knows ``leaders``."""
    delays: list[float] = []

    def recording(attempt: int) -> float:
        delays.append(jittered_delay_s(attempt, first_s=BACKOFF_BASE_S, cap_s=REDIAL_MAX_S))
        return 0.001

    status = AgentStatus(leaders[0], "n-1", "gpu-1", path=home.agent_status_file)
    dialer = AgentDialer(
        _identity(tmp_path, leaders[0]),
        HelloOnly(),  # type: ignore[arg-type]
        status,
        backoff=recording,
        dial_timeout_s=2.0,
        renew=False,
        leaders=LeaderList(leaders, leaders[0]),
    )
    running = asyncio.create_task(dialer.run())
    try:
        enough: Callable[[], bool] = lambda: len(delays) >= REDIALS  # noqa: E731
        await wait_for_async(enough, EVENT_TIMEOUT_S, f"{REDIALS} redials")
    finally:
        await dialer.stop()
        assert await asyncio.wait_for(running, EVENT_TIMEOUT_S) == 0
    return delays[:REDIALS], status


async def test_while_leaders_refuse_the_redial_stays_short_and_jittered(
    tmp_path: Path, home: BerthHome, refusing_leaders: list[str]
) -> None:
    delays, status = await _delays(tmp_path, home, refusing_leaders)
    print("redial delays while refused:", [round(d, 2) for d in delays])
    assert all(1.0 <= delay < 2.0 for delay in delays), delays
    assert len({round(delay, 3) for delay in delays}) > REDIALS // 2, "not jittered"
    assert "code 4421: not leader" in status.last_error


async def test_the_backoff_grows_only_while_no_leader_answers(
    tmp_path: Path, home: BerthHome
) -> None:
    delays, _status = await _delays(tmp_path, home, [_closed_port(), _closed_port()])
    print("redial delays while no leader answers:", [round(d, 2) for d in delays])
    steps = [min(REDIAL_MAX_S, 2.0**attempt) for attempt in range(REDIALS)]
    assert all(step / 2 <= d < step for d, step in zip(delays, steps, strict=True)), delays
    assert delays[-1] >= REDIAL_MAX_S / 2


async def test_a_refusal_starts_the_backoff_over(
    tmp_path: Path, home: BerthHome, refusing_leaders: list[str]
) -> None:
    # A dead leader between two that answer: each refusal brings it back to the first steps.
    leaders = [refusing_leaders[0], _closed_port(), refusing_leaders[1]]
    delays, _status = await _delays(tmp_path, home, leaders)
    print("redial delays with one leader dead:", [round(d, 2) for d in delays])
    assert max(delays) < 2.0, delays
