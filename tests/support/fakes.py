"""In-memory stand-ins for the leader's I/O seams, for fast tests."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp

from berth.cluster.leader.agent_link import (
    EngineEndpoint,
    EngineReport,
    NodeInventory,
    ProbeResult,
    SpawnListener,
)
from berth.cluster.protocol.ops import OP_CAPABILITIES, RUNTIME_CAPABILITIES
from berth.errors import BerthError, EngineError, NotFoundError
from berth.placement.model_files import FileStamp, ModelFileShape, read_model_file
from berth.runtime.base import EngineExit, ProgressListener
from berth.vocab.agent_policy import AgentPolicy
from berth.vocab.deployment_request import DeploymentRequest


class FakeLink:
    """An ``AgentLink`` whose engines are records in a dict.

    ``base_url`` is what every started engine reports; ``fail_with`` makes the next start
    fail; ``start_delay_s`` keeps a start in loading for a while, and ``start_gate`` (when
    set) until the test sets the event; ``pulled`` maps a hub repository to the path
    ``pull_model`` answers (others fail); ``capabilities`` is every op and runtime unless set.
    """

    def __init__(self, node_id: str = "local", base_url: str = "http://127.0.0.1:9") -> None:
        self.node_id = node_id
        self.base_url = base_url
        self.running: dict[str, EngineEndpoint] = {}
        self.requests: list[DeploymentRequest] = []
        self.fail_with: str | None = None
        #: raised by start_deployment while set (a refusal: PolicyError, SpecRefusedError)
        self.start_error: BerthError | None = None
        self.start_delay_s = 0.0
        self.start_gate: asyncio.Event | None = None
        self.survivors: dict[str, EngineEndpoint] = {}
        self.hung: set[str] = set()
        self.progress_line: str | None = None
        #: raised by reattach while set (a runtime that cannot be asked: Docker down)
        self.reattach_error: EngineError | None = None
        self.capabilities = frozenset([*OP_CAPABILITIES.values(), *RUNTIME_CAPABILITIES.values()])
        #: the agent policy it reports (``None``: none, an older agent)
        self.agent_policy: AgentPolicy | None = None
        self.pulled: dict[str, str] = {}
        self.pulls: list[tuple[str, str | None]] = []
        #: paths model_shape was asked about, in order
        self.shape_reads: list[str] = []
        #: (deployment id, adapter) loaded into each engine, in the order asked
        self.adapter_calls: list[tuple[str, str, str]] = []
        #: how an engine the test removed from ``running`` ended (``last_exit``)
        self.exits: dict[str, EngineExit] = {}

    async def start_deployment(
        self,
        request: DeploymentRequest,
        health_timeout_s: float,
        on_spawned: SpawnListener | None = None,
        on_progress: ProgressListener | None = None,
    ) -> EngineEndpoint:
        self.requests.append(request)
        if on_progress is not None and self.progress_line is not None:
            on_progress(self.progress_line)
        if on_spawned is not None:
            await on_spawned(4242, 9)
        await asyncio.sleep(self.start_delay_s)
        if self.start_gate is not None:
            await self.start_gate.wait()
        if self.start_error is not None:
            raise self.start_error
        if self.fail_with is not None:
            raise EngineError(self.fail_with, deployment_id=request.deployment_id)
        endpoint = EngineEndpoint(request.deployment_id, self.base_url, 4242, 9)
        self.running[request.deployment_id] = endpoint
        return endpoint

    async def stop_deployment(self, deployment_id: str, grace_s: float) -> None:
        if self.running.pop(deployment_id, None) is None:
            raise NotFoundError("engine", deployment_id)

    async def reattach(
        self, deployment_id: str, pid: int, port: int, runtime: str = "process"
    ) -> EngineEndpoint | None:
        if self.reattach_error is not None:
            raise self.reattach_error
        endpoint = self.survivors.pop(deployment_id, None)
        if endpoint is not None:
            self.running[deployment_id] = endpoint
        return endpoint

    async def pull_model(self, repo_id: str, revision: str | None) -> str:
        self.pulls.append((repo_id, revision))
        if repo_id not in self.pulled:
            raise EngineError(f"node {self.node_id}: {repo_id} is not on the hub")
        return self.pulled[repo_id]

    async def load_adapter(self, deployment_id: str, engine: str, adapter: str, path: str) -> None:
        self.adapter_calls.append(("load", deployment_id, adapter))

    async def unload_adapter(self, deployment_id: str, engine: str, adapter: str) -> None:
        self.adapter_calls.append(("unload", deployment_id, adapter))

    async def probe(self, deployment_id: str, timeout_s: float = 5.0) -> ProbeResult:
        if deployment_id not in self.running:
            return "gone"
        return "unhealthy" if deployment_id in self.hung else "healthy"

    def last_exit(self, deployment_id: str) -> EngineExit | None:
        return self.exits.get(deployment_id)

    async def model_shape(self, path: str, known: FileStamp | None = None) -> ModelFileShape:
        """Read on this host (the test's files), as an agent reads on its own."""
        self.shape_reads.append(path)
        try:
            return read_model_file(Path(path), known)
        except BerthError as exc:
            raise EngineError(f"node {self.node_id}: {exc}") from exc

    async def engines(self) -> list[EngineReport]:
        return [EngineReport(d, e.pid, e.port, True) for d, e in self.running.items()]

    async def inventory(self) -> NodeInventory:
        return NodeInventory(self.node_id, "fakehost", 2, 1024)

    async def logs(
        self, deployment_id: str, *, tail_lines: int, follow: bool
    ) -> AsyncIterator[bytes]:
        yield f"log of {deployment_id}\n".encode()


class MemorySocket:
    """One end of an in-memory WebSocket pair (see :func:`memory_socket_pair`): what the
    agent link needs of a WebSocket (pings and pongs included), with no network.

    While ``silent`` is set, whatever this end sends is lost, its close handshake too (which
    then never ends): set it on both ends to black-hole the link. ``pings_sent`` counts.
    """

    def __init__(self) -> None:
        self.inbox: asyncio.Queue[aiohttp.WSMessage] = asyncio.Queue()
        self.peer: MemorySocket | None = None
        self.close_code: int | None = None
        self.silent = False
        self.pings_sent = 0

    def _deliver(self, kind: aiohttp.WSMsgType, data: object, extra: object = None) -> None:
        if self.close_code is not None:
            raise ConnectionResetError("the memory socket is closed")
        assert self.peer is not None
        if not self.silent:
            self.peer.inbox.put_nowait(aiohttp.WSMessage(kind, data, extra))

    async def send_bytes(self, data: bytes) -> None:
        self._deliver(aiohttp.WSMsgType.BINARY, data)

    async def ping(self, message: bytes = b"") -> None:
        self.pings_sent += 1
        self._deliver(aiohttp.WSMsgType.PING, message)

    async def pong(self, message: bytes = b"") -> None:
        self._deliver(aiohttp.WSMsgType.PONG, message)

    async def receive(self, timeout: float | None = None) -> aiohttp.WSMessage:
        return await asyncio.wait_for(self.inbox.get(), timeout)

    async def close(self, *, code: int = 1000, message: bytes = b"") -> bool:
        if self.close_code is not None:
            return False
        self.close_code = code
        closed = aiohttp.WSMessage(aiohttp.WSMsgType.CLOSED, None, None)
        self.inbox.put_nowait(closed)
        assert self.peer is not None
        if self.silent:
            await asyncio.sleep(3600)  # a close handshake into a black hole never ends
        if self.peer.close_code is None:
            self.peer.close_code = code
            frame = aiohttp.WSMessage(aiohttp.WSMsgType.CLOSE, code, message.decode())
            self.peer.inbox.put_nowait(frame)
        return True


def memory_socket_pair() -> tuple[MemorySocket, MemorySocket]:
    """Two connected in-memory WebSocket ends: what one sends, the other receives."""
    left, right = MemorySocket(), MemorySocket()
    left.peer, right.peer = right, left
    return left, right
