"""What an agent does with the leader's requests and streams: runs them on its agent core.

Control ops (``start``, ``stop``, ``probe``, ``inventory``, ``engines``, ``pull``,
``load_adapter``, ``unload_adapter``, ``ingress``, ``model_shape``) each run in their own
task, so a long engine start never holds up the link (``model_shape`` reads a model's header
on this host for the leader's VRAM estimate). ``http`` streams are relayed to the deployment's
engine on this host by :class:`~berth.agent.relay.EngineRelay` (the one relay the agent's
direct ingress uses too, :mod:`berth.agent.ingress`); when the leader resets a stream, its
task is cancelled and the engine connection closed, so the engine stops generating. ``logs``
streams send the engine's log file.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, assert_never

import msgspec

from berth import __version__
from berth.agent.core import AgentCore
from berth.agent.host import RuntimeStatus
from berth.agent.node_sampler import core_heartbeat
from berth.agent.relay import MAX_REQUEST_BODY_BYTES, EngineRelay
from berth.cluster.link.connection import LinkConnection
from berth.cluster.link.tunnel_stream import StreamResetError, TunnelStream
from berth.cluster.protocol.errors import ProtocolError, SpecRefusedError
from berth.cluster.protocol.frames import (
    PROTOCOL_MAX,
    PROTOCOL_MIN,
    Heartbeat,
    Hello,
    Request,
    ResetCode,
)
from berth.cluster.protocol.ops import (
    ENGINES,
    INGRESS,
    INVENTORY,
    LOAD_ADAPTER,
    MODEL_SHAPE,
    OPS,
    PROBE,
    PULL,
    RUNTIME_CAPABILITIES,
    SPEC_CAPABILITY,
    START,
    STOP,
    STREAM_CAPABILITIES,
    UNLOAD_ADAPTER,
    EnginesResult,
    IngressArgs,
    PreparingEvent,
    ProbeResult,
    PullArgs,
    PullResult,
    SpawnedEvent,
    StartArgs,
    StartResult,
    encode_payload,
)
from berth.cluster.protocol.payloads import (
    EngineEnded,
    EngineState,
    ErrorCode,
    ErrorInfo,
    Inventory,
    policy_state,
)
from berth.cluster.wire_forms import file_shape_to_wire, gpu_states
from berth.engine_http.request import EngineRequest
from berth.errors import BerthError, EngineError, NotFoundError, PolicyError
from berth.observability.loop_lag import LagHistogram
from berth.observability.window import RequestMeter
from berth.placement.model_files import FileStamp, read_model_file
from berth.runtime.base import EngineExit
from berth.vocab.gpu import GpuInfo

if TYPE_CHECKING:  # imported only where tracing is on (berth.agent.runner builds it)
    from berth.observability.relay_tracing import RelayTracer

log = logging.getLogger(__name__)

ActivityListener = Callable[[str], None]
#: Seconds the agent waits for its runtimes (Docker) to say whether they work, before dialing.
RUNTIME_CHECK_TIMEOUT_S = 5.0


class IngressControl(Protocol):
    """The agent's direct ingress as the link's ``ingress`` op sees it
    (:class:`berth.agent.ingress.AgentIngress`): where it is advertised, and starting it
    with the certificates the leader sent."""

    @property
    def advertise(self) -> str: ...

    async def configure(self, args: IngressArgs) -> None: ...


class AgentService:
    """The agent's :class:`~berth.cluster.link.connection.LinkHandler` over an :class:`AgentCore`.

    ``on_activity`` hears one line per operation (for the status panel). ``meter`` counts
    the tunneled requests this agent serves, and ``loop_lag`` reads the agent's event-loop
    lag histogram; both are reported in each heartbeat. ``tracer``, when tracing is on, traces
    each relay to an engine (:mod:`berth.observability.tracing`).
    """

    def __init__(
        self,
        core: AgentCore,
        *,
        read_timeout_s: float = 600.0,
        on_activity: ActivityListener | None = None,
        models_dir: Path | None = None,
        meter: RequestMeter | None = None,
        loop_lag: Callable[[], LagHistogram] | None = None,
        tracer: RelayTracer | None = None,
    ) -> None:
        self._core = core
        self._loop_lag = loop_lag
        self._gpus: list[GpuInfo] | None = None
        self._models_dir = models_dir
        self.meter = meter if meter is not None else RequestMeter()
        #: the relay of ``http`` streams, and of the direct ingress's exchanges
        self.relay = EngineRelay(core, self.meter, read_timeout_s=read_timeout_s, tracer=tracer)
        self._on_activity = on_activity or (lambda _line: None)
        self._runtimes: list[RuntimeStatus] = [RuntimeStatus("process", True, "")]
        self._ingress: IngressControl | None = None
        #: engines that ended by themselves since the last heartbeat (sent at once)
        self._ended: list[EngineEnded] = []
        #: set when a heartbeat should go now, not at the next interval
        self.report_due = asyncio.Event()
        core.on_engine_end(self._engine_ended)

    def _engine_ended(self, deployment_id: str, exited: EngineExit | None) -> None:
        """An engine ended by itself: the leader hears it in a heartbeat sent at once."""
        self._ended.append(
            EngineEnded(
                deployment_id=deployment_id,
                exit_code=exited.code if exited is not None else None,
                exit_signal=exited.signal if exited is not None else None,
            )
        )
        self._on_activity(f"the engine of {deployment_id} ended by itself; telling the leader")
        self.report_due.set()

    def use_ingress(self, ingress: IngressControl) -> None:
        """Advertise ``ingress`` in Hello and start it when the leader sends ``ingress``."""
        self._ingress = ingress

    async def close(self) -> None:
        await self.relay.close()

    # -- what the agent says -------------------------------------------------------------

    async def read_gpus(self) -> list[GpuInfo]:
        """Read the host's GPUs now, on a worker thread; :meth:`hello`, :meth:`inventory` and
        :meth:`heartbeat` report this reading. NVML calls block for milliseconds per device
        (far longer for the first one on a driver without persistence mode), which on the
        loop would hold up every stream this agent relays."""
        self._gpus = await asyncio.to_thread(self._core.gpus)
        return self._gpus

    def _gpu_reading(self) -> list[GpuInfo]:
        if self._gpus is None:  # nothing read yet (no read_gpus before): read now, once
            self._gpus = self._core.gpus()
        return self._gpus

    def inventory(self) -> Inventory:
        facts = self._core.host_facts()
        return Inventory(
            hostname=facts.hostname,
            cpu_count=facts.cpu_count,
            memory_total_mb=facts.memory_total_mb,
            gpus=gpu_states(self._gpu_reading()),
        )

    def engine_states(self) -> list[EngineState]:
        return [
            EngineState(deployment_id=e.deployment_id, pid=e.pid, port=e.port, alive=e.alive)
            for e in self._core.engines()
        ]

    async def check_runtimes(self) -> list[RuntimeStatus]:
        """Ask which runtimes work now (Docker may have started or stopped since the last
        connection), and take back engines a Docker engine that was down kept from
        :meth:`AgentCore.restore`; :meth:`hello` advertises the runtimes.  A runtime that
        does not answer within :data:`RUNTIME_CHECK_TIMEOUT_S` counts as unavailable."""
        try:
            self._runtimes = await asyncio.wait_for(
                self._core.runtime_status(), RUNTIME_CHECK_TIMEOUT_S
            )
            restored = await asyncio.wait_for(
                self._core.retry_unresolved(), RUNTIME_CHECK_TIMEOUT_S
            )
        except TimeoutError:
            waited = f"did not answer within {RUNTIME_CHECK_TIMEOUT_S:g} s"
            self._runtimes = [
                RuntimeStatus("process", True, ""),
                RuntimeStatus("docker", False, f"the Docker engine {waited}"),
            ]
            restored = []
        if restored:
            self._on_activity(f"re-attached engines: {', '.join(restored)}")
        for runtime in self._runtimes:
            verdict = "available" if runtime.available else "unavailable"
            log.info("runtime %s %s: %s", runtime.name, verdict, runtime.detail)
        return self._runtimes

    def hello(self) -> Hello:
        return Hello(
            protocol_min=PROTOCOL_MIN,
            protocol_max=PROTOCOL_MAX,
            agent_version=__version__,
            capabilities=[
                *(op.capability for op in OPS.values() if self._serves(op.name)),
                *STREAM_CAPABILITIES,
                SPEC_CAPABILITY,  # the core refuses a start the cluster did not sign
                *(RUNTIME_CAPABILITIES[r.name] for r in self._runtimes if r.available),
            ],
            inventory=self.inventory(),
            engines=self.engine_states(),
            adopted=self._core.adopted.states() if self._core.adopted is not None else [],
            advertise=self._ingress.advertise if self._ingress is not None else "",
            policy=policy_state(self._core.policy) if self._core.policy is not None else None,
        )

    def _serves(self, op: str) -> bool:
        if op == PULL.name:
            return self._models_dir is not None
        if op == INGRESS.name:
            return self._ingress is not None
        return True

    def heartbeat(self, now: float) -> Heartbeat:
        """The heartbeat for ``now`` (epoch seconds), with the last :meth:`read_gpus` and
        the engines that ended since the last one (handed over: not sent twice)."""
        lag = self._loop_lag() if self._loop_lag is not None else None
        beat = core_heartbeat(self._core, self.meter, now, self._gpu_reading(), loop_lag=lag)
        beat.ended, self._ended = self._ended, []
        self.report_due.clear()
        return beat

    # -- LinkHandler ---------------------------------------------------------------------

    def on_heartbeat(self, conn: LinkConnection, heartbeat: Heartbeat) -> None:
        # Agents send heartbeats; the session refuses one from the leader before this.
        log.debug("ignoring a heartbeat from the leader")

    async def on_request(self, conn: LinkConnection, request: Request) -> None:
        try:
            result = await self._run_op(conn, request)
        except asyncio.CancelledError:
            # A stop cancelled this start (or the link is closing): the leader gets an answer.
            message = f"{request.op} was cancelled (the deployment was stopped)"
            conn.respond(request.id, error=ErrorInfo(code=ErrorCode.ENGINE_ERROR, message=message))
            raise
        except _Unsupported as exc:
            conn.respond(request.id, error=ErrorInfo(code=ErrorCode.UNSUPPORTED, message=str(exc)))
        except ProtocolError as exc:
            conn.respond(request.id, error=ErrorInfo(code=ErrorCode.INVALID, message=str(exc)))
        except NotFoundError as exc:
            conn.respond(request.id, error=ErrorInfo(code=ErrorCode.NOT_FOUND, message=str(exc)))
        except EngineError as exc:
            info = ErrorInfo(
                code=ErrorCode.ENGINE_ERROR, message=str(exc), log_tail=exc.log_tail or ""
            )
            conn.respond(request.id, error=info)
        except PolicyError as exc:
            log.warning("request %s (%s) refused: %s", request.id, request.op, exc)
            info = ErrorInfo(code=ErrorCode.POLICY_REFUSED, message=str(exc), rule=exc.rule)
            conn.respond(request.id, error=info)
        except SpecRefusedError as exc:
            log.error("refused a start: %s", exc)
            info = ErrorInfo(code=ErrorCode.SPEC_REFUSED, message=str(exc))
            conn.respond(request.id, error=info)
        except BerthError as exc:
            conn.respond(request.id, error=ErrorInfo(code=ErrorCode.INVALID, message=str(exc)))
        except Exception as exc:  # the leader must get an answer; the log keeps the bug
            log.exception("request %s (%s) failed", request.id, request.op)
            error = ErrorInfo(code=ErrorCode.INTERNAL, message=f"{type(exc).__name__}: {exc}")
            conn.respond(request.id, error=error)
        else:
            conn.respond(request.id, result=result)

    async def _run_op(self, conn: LinkConnection, request: Request) -> msgspec.Raw:
        """Serve ``request``; its result as raw JSON of the op's result type."""
        match request.op:
            case "start":
                args = START.decode_args(request.args)
                return START.encode_result(await self._start(conn, request.id, args))
            case "stop":
                stop = STOP.decode_args(request.args)
                self._on_activity(f"stopping {stop.deployment_id}")
                await self._core.stop(stop.deployment_id, stop.grace_s)
                self.meter.forget(stop.deployment_id)
                self._on_activity(f"stopped {stop.deployment_id}")
                return STOP.encode_result(None)
            case "probe":
                probe = PROBE.decode_args(request.args)
                result = await self._core.probe(probe.deployment_id, probe.timeout_s)
                ended = self._core.exit_status(probe.deployment_id) if result == "gone" else None
                return PROBE.encode_result(
                    ProbeResult(
                        result=result,
                        exit_code=ended.code if ended is not None else None,
                        exit_signal=ended.signal if ended is not None else None,
                    )
                )
            case "inventory":
                await self.read_gpus()
                return INVENTORY.encode_result(self.inventory())
            case "engines":
                return ENGINES.encode_result(EnginesResult(engines=self.engine_states()))
            case "pull":
                if self._models_dir is None:
                    raise _Unsupported(request.op)
                pulled = await self._pull(PULL.decode_args(request.args), self._models_dir)
                return PULL.encode_result(pulled)
            case "load_adapter":
                load = LOAD_ADAPTER.decode_args(request.args)
                self._on_activity(f"loading adapter {load.adapter} into {load.deployment_id}")
                await self._core.load_adapter(
                    load.deployment_id, load.engine, load.adapter, load.path
                )
                return LOAD_ADAPTER.encode_result(None)
            case "unload_adapter":
                unload = UNLOAD_ADAPTER.decode_args(request.args)
                self._on_activity(f"unloading adapter {unload.adapter} from {unload.deployment_id}")
                await self._core.unload_adapter(unload.deployment_id, unload.engine, unload.adapter)
                return UNLOAD_ADAPTER.encode_result(None)
            case "ingress":
                if self._ingress is None:
                    raise _Unsupported(request.op)
                await self._ingress.configure(INGRESS.decode_args(request.args))
                self._on_activity(f"direct ingress serving on {self._ingress.advertise}")
                return INGRESS.encode_result(None)
            case "model_shape":
                ask = MODEL_SHAPE.decode_args(request.args)
                known = None
                if ask.known_size_bytes is not None and ask.known_mtime_ns is not None:
                    known = FileStamp(ask.known_size_bytes, ask.known_mtime_ns)
                found = await asyncio.to_thread(read_model_file, Path(ask.path), known)
                return MODEL_SHAPE.encode_result(file_shape_to_wire(found))
            case "renew":  # the leader's op: agents ask it, never serve it
                raise _Unsupported(request.op)
            case _:
                assert_never(request.op)

    async def _start(self, conn: LinkConnection, request_id: int, args: StartArgs) -> StartResult:
        self._on_activity(f"starting {args.deployment_id} ({args.model_name})")

        async def spawned(pid: int, port: int) -> None:
            conn.progress(request_id, "spawned", encode_payload(SpawnedEvent(pid=pid, port=port)))

        def preparing(line: str) -> None:
            self._on_activity(f"{args.deployment_id}: {line}")
            conn.progress(request_id, "preparing", encode_payload(PreparingEvent(message=line)))

        handle = await self._core.start(
            args.to_request(), args.health_timeout_s, spawned, preparing
        )
        self._on_activity(f"{args.deployment_id} ready on port {handle.port}")
        return StartResult(pid=handle.pid, port=handle.port)

    async def _pull(self, pull: PullArgs, models_dir: Path) -> PullResult:
        from berth.runtime.hf_pull import pull_model  # huggingface_hub: ~18 MiB, when needed

        self._on_activity(f"pulling {pull.repo_id} from the hub")
        path = await asyncio.to_thread(
            pull_model,
            pull.repo_id,
            revision=pull.revision,
            models_dir=models_dir,
            progress=False,
        )
        self._on_activity(f"pulled {pull.repo_id} into {path}")
        return PullResult(path=str(path))

    async def on_stream(self, conn: LinkConnection, stream: TunnelStream) -> None:
        opening = stream.opening
        assert opening is not None
        try:
            if opening.kind == "http":
                await self._relay_http(stream)
            else:
                await self._send_logs(stream)
        except StreamResetError:
            pass  # the leader gave up on it, or the link is gone
        except NotFoundError as exc:
            stream.reset(ResetCode.NOT_FOUND, str(exc))
        except Exception as exc:  # the leader must hear the stream is over; the log keeps why
            log.exception("stream %s (%s) failed", stream.id, opening.kind)
            stream.reset(ResetCode.INTERNAL, f"{type(exc).__name__}: {exc}"[:200])
        finally:
            conn.forget_stream(stream.id)

    async def _relay_http(self, stream: TunnelStream) -> None:
        opening = stream.opening
        assert opening is not None
        self._core.engine_origin(opening.deployment_id)  # NotFoundError before the body
        body = await stream.read_all(MAX_REQUEST_BODY_BYTES)
        request = EngineRequest.from_target(
            opening.method.encode("latin-1"), opening.target.encode("latin-1"),
            opening.headers, body,
        )  # fmt: skip
        await self.relay.relay_exchange(opening.deployment_id, request, stream)

    async def _send_logs(self, stream: TunnelStream) -> None:
        opening = stream.opening
        assert opening is not None
        logs = self._core.logs(
            opening.deployment_id, tail_lines=opening.tail_lines, follow=opening.follow
        )
        async for chunk in logs:
            await stream.write(chunk)
        await stream.write(b"", end=True)


class _Unsupported(BerthError):
    def __init__(self, op: str) -> None:
        super().__init__(f"operation {op[:40]!r} is not supported by this agent")
