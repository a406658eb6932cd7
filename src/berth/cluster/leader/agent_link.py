"""The ``AgentLink`` interface: how the leader drives one node's agent core.

The leader's own host is node ``local``; its agent core runs in-process behind
:class:`berth.agent.in_process_link.InProcessLink`.  Remote agents sit behind
:class:`berth.cluster.leader.remote_link.RemoteLink`, which carries the same calls over the mTLS
WebSocket.  The lifecycle manager only ever sees this interface, so local and remote
deployments share one code path.  The values the calls return are defined here, with the
interface, so its users need no implementation.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Literal, Protocol

from berth.placement.model_files import FileStamp, ModelFileShape
from berth.runtime.base import EngineExit, ProgressListener
from berth.vocab.agent_policy import AgentPolicy
from berth.vocab.deployment_request import DeploymentRequest
from berth.vocab.engines import EngineName, RuntimeName
from berth.vocab.gpu import GpuInfo

LOCAL_NODE_ID = "local"
#: Seconds an engine has to answer a health probe when the caller names no limit (the
#: leader's ``probe_timeout_s`` setting is passed on every probe it sends).
DEFAULT_PROBE_TIMEOUT_S = 5.0

#: Called with ``(pid, port)`` once an engine process exists.
SpawnListener = Callable[[int, int], Awaitable[None]]


@dataclass(frozen=True)
class EngineReport:
    """One engine as the agent core sees it."""

    deployment_id: str
    pid: int
    port: int
    alive: bool


#: What one liveness probe found: the engine answers health, runs but does not answer, or is
#: not running at all.
ProbeResult = Literal["healthy", "unhealthy", "gone"]


@dataclass(frozen=True)
class EngineEndpoint:
    """Where a healthy engine answers, as seen from the leader."""

    deployment_id: str
    #: ``http://HOST:PORT`` of a local engine; empty for a remote one, which the leader
    #: reaches through its node's agent, at no URL of its own
    base_url: str
    pid: int
    port: int
    #: on a remote node: reached through its agent (``port`` and ``pid`` are on that host)
    remote: bool = False


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
    def agent_policy(self) -> AgentPolicy | None:
        """What the node's agent lets the leader start there, as it reported it (``None``:
        an agent from before policies).  Placement leaves out a node whose policy would
        refuse; the agent checks again at every start."""
        ...

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

    async def probe(
        self, deployment_id: str, timeout_s: float = DEFAULT_PROBE_TIMEOUT_S
    ) -> ProbeResult:
        """Whether the deployment's engine is healthy, running but unhealthy (no 200 from its
        health path within ``timeout_s`` seconds), or gone.

        Raises ``EngineError`` when the node cannot tell (its runtime or its link failed).
        """
        ...

    def last_exit(self, deployment_id: str) -> EngineExit | None:
        """How the deployment's engine ended (its exit code or signal), as the last
        :meth:`probe` that found it ``gone`` learnt; ``None`` when the node could not tell
        (an older agent, an engine it re-attached to)."""
        ...

    async def load_adapter(
        self, deployment_id: str, engine: EngineName, adapter: str, path: str
    ) -> None:
        """Have the deployment's running engine (vLLM, SGLang) load the LoRA adapter at
        ``path`` on the node's host, under the name ``adapter``.

        Raises ``EngineError`` when the engine refuses or the node lacks
        ``op.load_adapter``, ``NotFoundError`` when the node runs no such engine.
        """
        ...

    async def unload_adapter(self, deployment_id: str, engine: EngineName, adapter: str) -> None:
        """Have the deployment's engine unload the adapter ``adapter`` (one it does not have
        counts as unloaded). Raises as :meth:`load_adapter`."""
        ...

    async def model_shape(self, path: str, known: FileStamp | None = None) -> ModelFileShape:
        """The stamp and shape of the model at ``path`` on the node's host (the shape left
        out when the stamp is ``known``), read there by its agent.

        Raises ``EngineError`` when the node lacks ``op.model_shape`` or its files cannot be
        read (no such path, a header that is not a model's; the message says which).
        """
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
