"""The link to the agent core running inside the leader's own process (node ``local``): the
:class:`~berth.cluster.leader.agent_link.AgentLink` calls become direct calls on
:class:`AgentCore`."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

from berth.agent.core import AgentCore
from berth.cluster.leader.agent_link import (
    DEFAULT_PROBE_TIMEOUT_S,
    LOCAL_NODE_ID,
    EngineEndpoint,
    EngineReport,
    NodeInventory,
    ProbeResult,
    SpawnListener,
)
from berth.cluster.protocol.ops import OP_CAPABILITIES, RUNTIME_CAPABILITIES
from berth.errors import BerthError, EngineError
from berth.placement.model_files import FileStamp, ModelFileShape, read_model_file
from berth.runtime.base import EngineExit, ProgressListener
from berth.vocab.agent_policy import AgentPolicy
from berth.vocab.deployment_request import DeploymentRequest
from berth.vocab.engines import EngineName, RuntimeName

#: What node ``local``'s in-process core offers: every op but ``pull`` (the leader's own host
#: runs models from their registered paths) and ``ingress`` (it is reached directly), and
#: both runtimes (whether Docker answers is
#: found when a container starts, and a start that cannot fails with the reason).
LOCAL_CAPABILITIES = frozenset(
    [
        *(c for op, c in OP_CAPABILITIES.items() if op not in ("pull", "ingress")),
        *RUNTIME_CAPABILITIES.values(),
    ]
)


class InProcessLink:
    """The link to the agent core running inside the leader's own process (node ``local``)."""

    def __init__(self, core: AgentCore, node_id: str = LOCAL_NODE_ID) -> None:
        self.node_id = node_id
        self.capabilities = LOCAL_CAPABILITIES
        self._core = core

    @property
    def agent_policy(self) -> AgentPolicy | None:
        return self._core.policy

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

    async def probe(
        self, deployment_id: str, timeout_s: float = DEFAULT_PROBE_TIMEOUT_S
    ) -> ProbeResult:
        return await self._core.probe(deployment_id, timeout_s)

    def last_exit(self, deployment_id: str) -> EngineExit | None:
        return self._core.exit_status(deployment_id)

    async def load_adapter(
        self, deployment_id: str, engine: EngineName, adapter: str, path: str
    ) -> None:
        await self._core.load_adapter(deployment_id, engine, adapter, path)

    async def unload_adapter(self, deployment_id: str, engine: EngineName, adapter: str) -> None:
        await self._core.unload_adapter(deployment_id, engine, adapter)

    async def model_shape(self, path: str, known: FileStamp | None = None) -> ModelFileShape:
        """Read on the leader's own host, as a remote agent reads on its own; its errors are
        ``EngineError`` with their words, as a remote agent's are."""
        try:
            return await asyncio.to_thread(read_model_file, Path(path), known)
        except BerthError as exc:
            raise EngineError(f"node {self.node_id}: {exc}") from exc

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
