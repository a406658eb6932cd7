"""The leader's :class:`~berth.cluster.leader.agent_link.AgentLink` to a remote agent, over
its WebSocket.

Control calls become protocol requests (``docs/protocol.md``); ``logs`` and tunneled ``/v1``
exchanges become streams. :class:`TunnelResponse` gives the proxy the same reading interface
as :class:`berth.engine_http.response.UpstreamResponse`, so a request to a remote
deployment is relayed by the same code, with the same error shapes, as a local one.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

import msgspec

from berth.cluster.leader.agent_link import (
    DEFAULT_PROBE_TIMEOUT_S,
    EngineEndpoint,
    EngineReport,
    NodeInventory,
    ProbeResult,
    SpawnListener,
)
from berth.cluster.link.connection import LinkConnection, RemoteOpError
from berth.cluster.link.connection import ProgressListener as OpProgressListener
from berth.cluster.link.tunnel_stream import StreamResetError, TunnelStream
from berth.cluster.protocol.errors import LinkError, SpecRefusedError
from berth.cluster.protocol.frames import Heartbeat, Progress, ResetCode, StreamOpen
from berth.cluster.protocol.ops import (
    ENGINES,
    INGRESS,
    INVENTORY,
    LOAD_ADAPTER,
    MODEL_SHAPE,
    OP_CAPABILITIES,
    PROBE,
    PULL,
    RUNTIME_CAPABILITIES,
    START,
    STOP,
    UNLOAD_ADAPTER,
    IngressArgs,
    LoadAdapterArgs,
    ModelShapeArgs,
    NoArgs,
    Op,
    PreparingEvent,
    ProbeArgs,
    PullArgs,
    SpawnedEvent,
    StartArgs,
    StopArgs,
    UnloadAdapterArgs,
    decode_payload,
)
from berth.cluster.protocol.payloads import ErrorCode, Inventory
from berth.cluster.wire_forms import file_shape_from_wire, gpu_infos
from berth.engine_http.answer import BodySink, read_body
from berth.engine_http.errors import (
    UpstreamConnectError,
    UpstreamDisconnectError,
    UpstreamError,
    UpstreamTimeoutError,
)
from berth.engine_http.origin import Origin
from berth.engine_http.request import EngineRequest
from berth.errors import EngineError, NotFoundError, PolicyError
from berth.placement.model_files import FileStamp, ModelFileShape
from berth.runtime.base import EngineExit, ProgressListener
from berth.vocab.agent_policy import AgentPolicy
from berth.vocab.deployment_request import DeploymentRequest
from berth.vocab.engines import EngineName, RuntimeName

#: Seconds a quick control request (stop excepted) may take before the link counts as stuck.
CONTROL_TIMEOUT_S = 30.0
#: Seconds a probe's answer may take beyond the probe's own timeout (the link's round trip).
PROBE_ANSWER_SLACK_S = 1.0
#: Seconds an agent may take to download a model from the hub.
PULL_TIMEOUT_S = 3600.0
#: Seconds an agent may take to load or unload an adapter (the engine's own wait, and more).
ADAPTER_TIMEOUT_S = 150.0

A = TypeVar("A", bound=msgspec.Struct)
R = TypeVar("R")


@dataclass
class NodeLoad:
    """What the node's last heartbeat said: when, and requests in flight per deployment."""

    heartbeat_at: float = 0.0
    in_flight: dict[str, int] = field(default_factory=dict)


class RemoteLink:
    """Drives one remote agent through its :class:`LinkConnection`.

    ``advertise`` is the address its Hello advertised for the direct data path (empty: none);
    ``certificate_der`` the client certificate it linked with (``None`` when a proxy
    forwarded only its fingerprint); ``agent_policy`` the policy its Hello reported
    (``None``: an agent from before policies, which refuses nothing by policy).
    """

    def __init__(
        self,
        node_id: str,
        conn: LinkConnection,
        inventory: Inventory,
        capabilities: Sequence[str] = tuple(OP_CAPABILITIES.values()),
        *,
        advertise: str = "",
        certificate_der: bytes | None = None,
        agent_policy: AgentPolicy | None = None,
    ) -> None:
        self.node_id = node_id
        self.agent_policy = agent_policy
        self.conn = conn
        self._inventory = inventory
        self.capabilities = frozenset(capabilities)
        self.load = NodeLoad()
        self.advertise = advertise
        self.certificate_der = certificate_der
        #: how each engine a probe found gone ended, as the agent said (by deployment id)
        self._exits: dict[str, EngineExit] = {}

    @property
    def last_inventory(self) -> Inventory:
        """The inventory from Hello, with the GPUs of the latest heartbeat."""
        return self._inventory

    def record_heartbeat(self, heartbeat: Heartbeat, received_at: float) -> None:
        self.load.heartbeat_at = received_at
        self.load.in_flight = {d.deployment_id: d.in_flight for d in heartbeat.deployments}
        self._inventory = msgspec.structs.replace(self._inventory, gpus=heartbeat.gpus)

    # -- AgentLink -------------------------------------------------------------------------

    async def start_deployment(
        self,
        request: DeploymentRequest,
        health_timeout_s: float,
        on_spawned: SpawnListener | None = None,
        on_progress: ProgressListener | None = None,
    ) -> EngineEndpoint:
        timeout_s = health_timeout_s + CONTROL_TIMEOUT_S
        if request.runtime != "process":
            if RUNTIME_CAPABILITIES[request.runtime] not in self.capabilities:
                raise EngineError(
                    f"node {self.node_id} offers no {request.runtime} runtime (its agent found "
                    f"none when it connected; `berth doctor` on that host says why)"
                )
            timeout_s += PULL_TIMEOUT_S  # the agent may pull the image first
        if request.uses_adapters and LOAD_ADAPTER.capability not in self.capabilities:
            raise EngineError(
                f"node {self.node_id}'s agent does not serve LoRA adapters; upgrade it"
            )
        args = StartArgs.from_request(request, health_timeout_s=health_timeout_s)

        spawned = False

        async def progress(frame: Progress) -> None:
            nonlocal spawned
            if frame.event == "spawned" and on_spawned is not None and not spawned:
                spawned = True  # once: a repeating agent must not cost a write per frame
                event = decode_payload(frame.data, SpawnedEvent, "spawned event")
                await on_spawned(event.pid, event.port)
            elif frame.event == "preparing" and on_progress is not None:
                on_progress(decode_payload(frame.data, PreparingEvent, "preparing event").message)

        result = await self._call(START, args, timeout_s, progress)
        return EngineEndpoint(request.deployment_id, "", result.pid, result.port, remote=True)

    async def stop_deployment(self, deployment_id: str, grace_s: float) -> None:
        args = StopArgs(deployment_id=deployment_id, grace_s=grace_s)
        await self._call(STOP, args, grace_s + CONTROL_TIMEOUT_S, engine_of=deployment_id)

    async def reattach(
        self, deployment_id: str, pid: int, port: int, runtime: RuntimeName = "process"
    ) -> EngineEndpoint | None:
        """A remote engine is never re-attached by pid: the agent reports its engines in
        Hello and the leader reconciles (``LifecycleManager.node_connected``)."""
        for engine in await self.engines():
            if engine.deployment_id == deployment_id and engine.alive:
                return EngineEndpoint(deployment_id, "", engine.pid, engine.port, remote=True)
        return None

    async def pull_model(self, repo_id: str, revision: str | None) -> str:
        """Have the agent download ``repo_id`` into its models folder; its path there."""
        args = PullArgs(repo_id=repo_id, revision=revision)
        return (await self._call(PULL, args, PULL_TIMEOUT_S)).path

    async def configure_ingress(
        self, certificate_pem: bytes, leader_certificate_pem: bytes
    ) -> None:
        """Have the agent serve its direct ingress with these certificates (the ``ingress``
        op). Raises ``EngineError`` with the agent's reason when it cannot."""
        args = IngressArgs(
            certificate=certificate_pem.decode(), leader_certificate=leader_certificate_pem.decode()
        )
        await self._call(INGRESS, args, CONTROL_TIMEOUT_S)

    async def probe(
        self, deployment_id: str, timeout_s: float = DEFAULT_PROBE_TIMEOUT_S
    ) -> ProbeResult:
        """The agent probes its engine with ``timeout_s``; its answer may take
        ``PROBE_ANSWER_SLACK_S`` longer to come back over the link."""
        args = ProbeArgs(deployment_id=deployment_id, timeout_s=timeout_s)
        answer = await self._call(
            PROBE, args, timeout_s + PROBE_ANSWER_SLACK_S, engine_of=deployment_id
        )
        if answer.exit_code is not None or answer.exit_signal is not None:
            self._exits[deployment_id] = EngineExit(answer.exit_code, answer.exit_signal)
        return answer.result

    def last_exit(self, deployment_id: str) -> EngineExit | None:
        return self._exits.pop(deployment_id, None)

    async def load_adapter(
        self, deployment_id: str, engine: EngineName, adapter: str, path: str
    ) -> None:
        args = LoadAdapterArgs(
            deployment_id=deployment_id, engine=engine, adapter=adapter, path=path
        )
        await self._call(LOAD_ADAPTER, args, ADAPTER_TIMEOUT_S, engine_of=deployment_id)

    async def unload_adapter(self, deployment_id: str, engine: EngineName, adapter: str) -> None:
        args = UnloadAdapterArgs(deployment_id=deployment_id, engine=engine, adapter=adapter)
        await self._call(UNLOAD_ADAPTER, args, ADAPTER_TIMEOUT_S, engine_of=deployment_id)

    async def model_shape(self, path: str, known: FileStamp | None = None) -> ModelFileShape:
        args = ModelShapeArgs(path=path)
        if known is not None:
            args.known_size_bytes, args.known_mtime_ns = known.size_bytes, known.mtime_ns
        result = await self._call(MODEL_SHAPE, args, CONTROL_TIMEOUT_S)
        return file_shape_from_wire(result, host=self.node_id)

    async def engines(self) -> list[EngineReport]:
        result = await self._call(ENGINES, NoArgs(), CONTROL_TIMEOUT_S)
        return [EngineReport(e.deployment_id, e.pid, e.port, e.alive) for e in result.engines]

    async def inventory(self) -> NodeInventory:
        self._inventory = await self._call(INVENTORY, NoArgs(), CONTROL_TIMEOUT_S)
        return node_inventory(self.node_id, self._inventory)

    async def logs(
        self, deployment_id: str, *, tail_lines: int, follow: bool
    ) -> AsyncIterator[bytes]:
        opening = StreamOpen(
            kind="logs",
            deployment_id=deployment_id,
            tail_lines=tail_lines,
            follow=follow,
            end=True,  # the leader sends nothing more on a logs stream
        )
        stream = self._open(opening)
        try:
            while chunk := await _read(stream):
                yield chunk
        finally:
            stream.release()

    # -- the tunnel --------------------------------------------------------------------------

    async def open_http(
        self, deployment_id: str, request: EngineRequest, read_timeout_s: float | None
    ) -> TunnelResponse:
        """Send ``request`` to the deployment's engine through the agent.

        Returns once the answer's head is in. Raises the errors of
        :meth:`berth.engine_http.pool.UpstreamPool.request`, so the proxy treats both alike:
        ``UpstreamConnectError`` (the link or the engine could not be reached),
        ``UpstreamTimeoutError`` (no head within ``read_timeout_s``).
        """
        origin = Origin(self.node_id, 0)
        limits = self.conn.limits
        body = request.body
        first = body[: min(limits.stream_window_bytes, limits.max_payload_bytes)]
        opening = StreamOpen(
            kind="http",
            deployment_id=deployment_id,
            method=request.method.decode("latin-1"),
            target=request.target.decode("latin-1"),
            headers=request.headers,
            payload=first,
            end=len(first) == len(body),
        )
        try:
            await self.conn.drain()  # STREAM_OPEN carries up to a window of body
            stream = self.conn.open_stream(opening)
        except LinkError as exc:
            raise UpstreamConnectError(origin, f"could not be reached ({exc})") from exc
        try:
            async with asyncio.timeout(read_timeout_s):
                if len(first) < len(body):
                    await stream.write(body[len(first) :], end=True)
                head = await stream.wait_head(None)
        except TimeoutError:
            stream.reset(ResetCode.CANCELLED, "no answer in time")
            raise UpstreamTimeoutError(origin, read_timeout_s or 0.0) from None
        except StreamResetError as exc:
            stream.reset(ResetCode.CANCELLED)
            if exc.reset_code == ResetCode.ENGINE_TIMEOUT:
                raise UpstreamTimeoutError(origin, read_timeout_s or 0.0) from None
            # The agent answered: the engine behind it did not take the request.
            engine_side = exc.reset_code in (ResetCode.ENGINE_UNREACHABLE,
                                             ResetCode.ENGINE_DISCONNECT)  # fmt: skip
            why = f"could not be reached ({exc})"
            raise UpstreamConnectError(origin, why, engine_side=engine_side) from exc
        except BaseException:
            stream.reset(ResetCode.CANCELLED)
            raise
        return TunnelResponse(stream, head.status, head.headers, origin, read_timeout_s)

    # -- internals ---------------------------------------------------------------------------

    def _open(self, opening: StreamOpen) -> TunnelStream:
        try:
            return self.conn.open_stream(opening)
        except LinkError as exc:
            raise EngineError(f"node {self.node_id}: {exc}") from exc

    async def _call(
        self,
        op: Op[A, R],
        args: A,
        timeout_s: float,
        on_progress: OpProgressListener | None = None,
        *,
        engine_of: str | None = None,
    ) -> R:
        """Send ``op``; the agent's errors become ``EngineError`` (with its log tail),
        ``NotFoundError`` for deployment ``engine_of`` when it runs no such engine, or
        ``SpecRefusedError`` when it refused a start's signed spec."""
        if op.capability not in self.capabilities:
            raise EngineError(
                f"node {self.node_id}'s agent does not support {op.name!r}; upgrade it"
            )
        try:
            return await self.conn.call(op, args, timeout_s, on_progress)
        except RemoteOpError as exc:
            if exc.info.code == ErrorCode.NOT_FOUND and engine_of is not None:
                raise NotFoundError("engine", engine_of) from exc
            if exc.info.code == ErrorCode.POLICY_REFUSED:
                raise PolicyError(
                    f"node {self.node_id}: {exc.info.message}",
                    rule=exc.info.rule,
                    node_id=self.node_id,
                ) from exc
            if exc.info.code == ErrorCode.SPEC_REFUSED:  # the agent's own check said no
                deployment = str(getattr(args, "deployment_id", "?"))
                message = f"node {self.node_id}: {exc.info.message}"
                raise SpecRefusedError(message, deployment_id=deployment) from exc
            raise EngineError(
                f"node {self.node_id}: {exc.info.message}", log_tail=exc.info.log_tail
            ) from exc
        except LinkError as exc:
            raise EngineError(f"node {self.node_id}: {exc}") from exc


async def _read(stream: TunnelStream) -> bytes:
    try:
        return await stream.read()
    except StreamResetError as exc:
        if exc.reset_code == ResetCode.NOT_FOUND:
            raise NotFoundError("engine log", str(exc)) from exc
        raise EngineError(str(exc)) from exc


class TunnelResponse:
    """A tunneled answer with :class:`~berth.engine_http.response.UpstreamResponse`'s
    interface: ``status``, ``headers``, ``content_length``, ``read_chunk``, ``read``,
    ``at_eof``, ``close``."""

    def __init__(
        self,
        stream: TunnelStream,
        status: int,
        headers: list[tuple[bytes, bytes]],
        origin: Origin,
        read_timeout_s: float | None,
    ) -> None:
        self._stream = stream
        self.status = status
        self.headers = headers
        self._origin = origin
        self._read_timeout_s = read_timeout_s
        length = self.header(b"content-length")
        self.content_length = int(length) if length is not None and length.isdigit() else None

    def header(self, name: bytes) -> bytes | None:
        for key, value in self.headers:
            if key == name:
                return value
        return None

    @property
    def at_eof(self) -> bool:
        return self._stream.ended

    async def read_chunk(self) -> bytes:
        try:
            return await self._stream.read(self._read_timeout_s)
        except TimeoutError:
            self.close()
            raise UpstreamTimeoutError(self._origin, self._read_timeout_s or 0.0) from None
        except StreamResetError as exc:
            raise UpstreamDisconnectError(self._origin, str(exc), answered=True) from exc

    async def read(self, limit_bytes: int | None = None) -> bytes:
        return await read_body(self, limit_bytes)

    async def wait_for_body(self) -> None:
        """Return once body bytes, the end or a reset have arrived (a
        :class:`~berth.engine_http.answer.TimedAnswer`); takes nothing."""
        await self._stream.wait_readable()

    def set_read_timeout(self, timeout_s: float | None) -> None:
        """The longest silence between two pieces of the body from now on."""
        self._read_timeout_s = timeout_s

    def push_body(self, sink: BodySink) -> None:
        """Push the body to ``sink`` from the link reader, as each data frame arrives (a
        :class:`~berth.engine_http.answer.PushedAnswer`); a reset or a read timeout fails it
        as :meth:`read_chunk` would raise."""
        self._stream.push_to(_TunnelSink(sink, self._origin), self._read_timeout_s)

    def pause_body(self) -> None:
        self._stream.pause_push()

    def resume_body(self) -> None:
        self._stream.resume_push()

    def close(self) -> None:
        """Done with the answer; an unfinished one resets its stream, which cancels the
        agent's request to the engine."""
        self._stream.release()


class _TunnelSink:
    """A tunnel stream's :class:`~berth.cluster.link.tunnel_stream.PayloadSink` over the proxy's
    :class:`~berth.engine_http.answer.BodySink`: payloads as they are, failures as the
    errors :meth:`TunnelResponse.read_chunk` raises."""

    __slots__ = ("_origin", "_sink", "payload_received")

    def __init__(self, sink: BodySink, origin: Origin) -> None:
        self._sink = sink
        self._origin = origin
        self.payload_received = sink.body_received  # each frame: one call, no wrapper

    def stream_aborted(self, error: StreamResetError) -> None:
        self._sink.body_failed(UpstreamDisconnectError(self._origin, str(error), answered=True))

    def read_timed_out(self, timeout_s: float) -> None:
        self._sink.body_failed(UpstreamTimeoutError(self._origin, timeout_s))


__all__ = ["RemoteLink", "TunnelResponse", "UpstreamError"]


def node_inventory(node_id: str, inventory: Inventory) -> NodeInventory:
    """The inventory agent ``node_id`` sent in its Hello, as the link API returns it."""
    return NodeInventory(
        node_id=node_id,
        hostname=inventory.hostname,
        cpu_count=inventory.cpu_count,
        memory_total_mb=inventory.memory_total_mb,
        gpus=gpu_infos(inventory.gpus),
    )
