"""The agent link in one process, for fast tests: the leader's ``RemoteLink`` and an agent's
``AgentService`` joined by an in-memory WebSocket pair (:func:`support.fakes.memory_socket_pair`),
with a real stand-in engine on loopback behind the agent (the ``linked`` fixture)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

from berth.agent.host import HostFacts
from berth.agent.service import AgentService
from berth.cluster.leader.agent_link import EngineReport
from berth.cluster.leader.remote_link import RemoteLink
from berth.cluster.link.connection import LinkConnection
from berth.cluster.link.tunnel_stream import TunnelStream
from berth.cluster.protocol.frames import Heartbeat, Request
from berth.cluster.protocol.handshake import WelcomeTerms
from berth.cluster.protocol.limits import LinkLimits
from berth.cluster.protocol.session import Role
from berth.engine_http.answer import EngineAnswer
from berth.engine_http.auth import bearer_header
from berth.engine_http.request import EngineRequest
from berth.errors import NotFoundError
from berth.vocab.deployment_request import DeploymentRequest
from support.fakes import memory_socket_pair
from support.standin_engine import StandinEngine

#: The one deployment the fake core runs.
DEPLOYMENT = "d-00000001"
#: The stand-in engine's API key, which the agent's relay must add.
ENGINE_KEY = "berth-ek-link-test"


class FakeCore:
    """The agent core's surface the service uses, over one stand-in engine."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.start_delay_s = 0.0
        self.stopped: list[str] = []
        self.requests: list[DeploymentRequest] = []
        #: who hears an engine end (the agent service): the test calls them as a runtime would
        self.end_listeners: list[Any] = []

    adopted = None
    #: the agent policy the service reports in Hello (``None``: none)
    policy = None

    def on_engine_end(self, listener: Any) -> None:
        self.end_listeners.append(listener)

    def engine_auth(self, deployment_id: str) -> tuple[bytes, bytes] | None:
        return bearer_header(ENGINE_KEY) if deployment_id == DEPLOYMENT else None

    def engine_origin(self, deployment_id: str) -> tuple[str, int]:
        if deployment_id != DEPLOYMENT:
            raise NotFoundError("engine", deployment_id)
        return "127.0.0.1", self.port

    def host_facts(self) -> HostFacts:
        return HostFacts("gpu-host", 8, 32000)

    def gpus(self) -> list[Any]:
        return []

    def engines(self) -> list[EngineReport]:
        return [EngineReport(DEPLOYMENT, 4321, self.port, True)]

    async def start(
        self, request: DeploymentRequest, timeout_s: float, on_spawned: Any, on_progress: Any
    ) -> Any:
        self.requests.append(request)
        on_progress(f"pulling {request.image}: 3/7 layers done")
        await on_spawned(4321, self.port)
        await asyncio.sleep(self.start_delay_s)
        return SimpleNamespace(pid=4321, port=self.port)

    async def stop(self, deployment_id: str, grace_s: float) -> None:
        self.stopped.append(deployment_id)

    async def probe(self, deployment_id: str, timeout_s: float = 5.0) -> str:
        return "healthy"

    def exit_status(self, deployment_id: str) -> None:
        return None

    async def logs(
        self, deployment_id: str, *, tail_lines: int, follow: bool
    ) -> AsyncIterator[bytes]:
        yield b"engine line 1\n"
        yield b"engine line 2\n"


class LeaderSide:
    """The leader's handler of a link's traffic, doing nothing (the tests call the link)."""

    def on_heartbeat(self, conn: LinkConnection, heartbeat: Heartbeat) -> None:
        pass

    async def on_request(self, conn: LinkConnection, request: Request) -> None:
        pass

    async def on_stream(self, conn: LinkConnection, stream: TunnelStream) -> None:
        pass


@dataclass
class Linked:
    """Both ends of a link in one process, and what stands behind the agent."""

    link: RemoteLink
    engine: StandinEngine
    core: FakeCore
    leader: LinkConnection
    agent: LinkConnection
    service: AgentService


@contextlib.asynccontextmanager
async def linked_in_memory(**service_options: Any) -> AsyncIterator[Linked]:
    """The leader's :class:`RemoteLink` to an :class:`AgentService` over an in-memory
    WebSocket pair, both ends past the handshake and running; a :class:`FakeCore` over a
    stand-in engine behind the agent. Closed (code 1000) on exit. ``service_options`` go to
    the agent service (its ``tracer``)."""
    limits = LinkLimits(stream_window_bytes=64 * 1024)
    async with StandinEngine(api_key=ENGINE_KEY) as engine:
        core = FakeCore(engine.port)
        service = AgentService(core, read_timeout_s=5.0, **service_options)  # type: ignore[arg-type]
        agent_ws, leader_ws = memory_socket_pair()
        agent = LinkConnection(Role.AGENT, agent_ws, service, peer="leader", limits=limits)
        leader = LinkConnection(Role.LEADER, leader_ws, LeaderSide(), peer="n-1", limits=limits)
        terms = WelcomeTerms(node_id="n-1", leader_version="test")
        _welcome, hello = await asyncio.gather(
            agent.handshake(service.hello(), timeout_s=5.0),
            leader.handshake(terms, timeout_s=5.0),
        )
        tasks = [asyncio.create_task(agent.run()), asyncio.create_task(leader.run())]
        link = RemoteLink("n-1", leader, service.inventory(), hello.capabilities)
        try:
            yield Linked(link, engine, core, leader, agent, service)
        finally:
            await leader.close(1000, "test over")
            await asyncio.gather(*tasks)
            await service.close()


class OneLink:
    """The leader's ``HttpOpener`` over the one link of the ``linked`` fixture (every
    node's deployments are reached through it)."""

    def __init__(self, linked: Linked) -> None:
        self.link = linked.link

    async def open_http(
        self, node_id: str, deployment_id: str, request: EngineRequest, read_timeout_s: float | None
    ) -> EngineAnswer:
        return await self.link.open_http(deployment_id, request, read_timeout_s)
