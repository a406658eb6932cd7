"""The ``AgentLink`` interface: how the leader drives one node's agent core.

The leader's own host is node ``local``; its agent core runs in-process behind
:class:`InProcessLink`.  Remote agents (next issue) sit behind a link that carries the same
calls over the mTLS WebSocket.  The lifecycle manager only ever sees this interface, so local
and remote deployments share one code path.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Protocol

from berth.agent.core import AgentCore, EngineReport, ProbeResult, SpawnListener
from berth.cluster.protocol.ops import OP_CAPABILITIES, RUNTIME_CAPABILITIES
from berth.errors import EngineError
from berth.runtime.base import ProgressListener, RuntimeName
from berth.runtime.engines import DeploymentRequest
from berth.runtime.gpu import GpuInfo

LOCAL_NODE_ID = "local"
#: What node ``local``'s in-process core offers: every op but ``pull`` (the leader's own host
#: runs models from their registered paths) and both runtimes (whether Docker answers is
#: found when a container starts, and a start that cannot fails with the reason).
LOCAL_CAPABILITIES = frozenset(
    [*(c for op, c in OP_CAPABILITIES.items() if op != "pull"), *RUNTIME_CAPABILITIES.values()]
)


@dataclass(frozen=True)
class EngineEndpoint:
    """Where a healthy engine answers, as seen from the leader."""

    deployment_id: str
    base_url: str
    pid: int
    port: int


@dataclass(frozen=True)
class NodeInventory:
    """A node's hardware, reported by its agent."""

    node_id: str
    hostname: str
    cpu_count: int
    memory_total_mb: int
    gpus: tuple[GpuInfo, ...] = field(default_factory=tuple)


class AgentLink(Protocol):
    """Commands the leader sends to one node's agent core.

    Every method may raise :class:`berth.errors.EngineError`; a link to a node that is gone
    raises it too, with the node in the message.
    """

    node_id: str

    @property
    def capabilities(self) -> frozenset[str]:
        """What the node's agent offers, in the protocol's capability names
        (``docs/protocol.md``): ``op.<name>`` per operation it serves (``op.pull``: it
        downloads models from the hub), ``runtime.<name>`` per runtime it can start engines
        with.  Fixed for the life of the link (a remote agent says it in Hello)."""
        ...

    async def start_deployment(
        self,
        request: DeploymentRequest,
        health_timeout_s: float,
        on_spawned: SpawnListener | None = None,
        on_progress: ProgressListener | None = None,
    ) -> EngineEndpoint:
        """Start an engine and return once it answers health, or raise ``EngineError``.

        ``on_spawned(pid, port)`` is awaited once the engine process exists;
        ``on_progress(line)`` hears what is being prepared before (an image pull).
        """
        ...

    async def stop_deployment(self, deployment_id: str, grace_s: float) -> None:
        """Stop a deployment's engine (SIGTERM, then SIGKILL after ``grace_s`` seconds)."""
        ...

    async def reattach(
        self, deployment_id: str, pid: int, port: int, runtime: RuntimeName = "process"
    ) -> EngineEndpoint | None:
        """Take an engine that survived a leader restart back under management.

        Returns ``None`` when no such engine runs any more.
        """
        ...

    async def pull_model(self, repo_id: str, revision: str | None) -> str:
        """Have the node download ``repo_id`` (at ``revision``; ``None``: the default
        branch) from the hub into its models folder; returns the model's path there.

        Raises ``EngineError`` when the download fails, or when the node lacks ``op.pull``.
        """
        ...

    async def probe(self, deployment_id: str) -> ProbeResult:
        """Whether the deployment's engine is healthy, running but unhealthy, or gone."""
        ...

    async def engines(self) -> list[EngineReport]:
        """Every engine the agent core manages right now."""
        ...

    async def inventory(self) -> NodeInventory:
        """The node's CPUs, memory and GPUs."""
        ...

    def logs(self, deployment_id: str, *, tail_lines: int, follow: bool) -> AsyncIterator[bytes]:
        """The engine's log: the last ``tail_lines`` lines, then new output while ``follow``."""
        ...


class InProcessLink:
    """The link to the agent core running inside the leader's own process (node ``local``)."""

    def __init__(self, core: AgentCore, node_id: str = LOCAL_NODE_ID) -> None:
        self.node_id = node_id
        self.capabilities = LOCAL_CAPABILITIES
        self._core = core

    async def start_deployment(
        self,
        request: DeploymentRequest,
        health_timeout_s: float,
        on_spawned: SpawnListener | None = None,
        on_progress: ProgressListener | None = None,
    ) -> EngineEndpoint:
        handle = await self._core.start(request, health_timeout_s, on_spawned, on_progress)
        return EngineEndpoint(request.deployment_id, handle.base_url, handle.pid, handle.port)

    async def stop_deployment(self, deployment_id: str, grace_s: float) -> None:
        await self._core.stop(deployment_id, grace_s)

    async def reattach(
        self, deployment_id: str, pid: int, port: int, runtime: RuntimeName = "process"
    ) -> EngineEndpoint | None:
        handle = await self._core.reattach(deployment_id, pid, port, runtime)
        if handle is None:
            return None
        return EngineEndpoint(deployment_id, handle.base_url, handle.pid, handle.port)

    async def pull_model(self, repo_id: str, revision: str | None) -> str:
        raise EngineError(
            f"node {self.node_id} does not download models from the hub (no op.pull): "
            f"register {repo_id} with a path on this host"
        )

    async def probe(self, deployment_id: str) -> ProbeResult:
        return await self._core.probe(deployment_id)

    async def engines(self) -> list[EngineReport]:
        return self._core.engines()

    async def inventory(self) -> NodeInventory:
        facts = self._core.host_facts()
        return NodeInventory(
            node_id=self.node_id,
            hostname=facts.hostname,
            cpu_count=facts.cpu_count,
            memory_total_mb=facts.memory_total_mb,
            gpus=tuple(self._core.gpus()),
        )

    def logs(self, deployment_id: str, *, tail_lines: int, follow: bool) -> AsyncIterator[bytes]:
        return self._core.logs(deployment_id, tail_lines=tail_lines, follow=follow)
