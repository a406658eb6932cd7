"""The control operations an agent serves, with their typed arguments and results.

A :class:`berth.cluster.protocol.frames.Request` names an ``op`` and carries its arguments as
raw JSON; the receiver decodes them here, so an unknown op can be answered ``unsupported``
instead of failing the link. Each op's contract is in ``docs/protocol.md``.
"""

from __future__ import annotations

from typing import Any, Literal, TypeVar

import msgspec

from berth.cluster.protocol.errors import ProtocolError
from berth.cluster.protocol.frames import EngineState, Inventory

OpName = Literal["start", "stop", "probe", "inventory", "engines", "pull"]
#: The capability an agent advertises in Hello for each op it serves.
OP_CAPABILITIES: dict[str, str] = {
    "start": "op.start",
    "stop": "op.stop",
    "probe": "op.probe",
    "inventory": "op.inventory",
    "engines": "op.engines",
    "pull": "op.pull",
}
#: Capabilities of this code's agents, beyond the ops.
STREAM_CAPABILITIES = ("stream.http", "stream.logs")
#: The capability an agent advertises for each runtime it can start engines with now.
RUNTIME_CAPABILITIES: dict[str, str] = {"process": "runtime.process", "docker": "runtime.docker"}


class _Args(msgspec.Struct, kw_only=True, omit_defaults=True):
    pass


class StartArgs(_Args, kw_only=True):
    """Start an engine for a deployment on the agent's host.

    ``model_path`` is a path on the agent's host (GGUF file or HF-style directory);
    ``runtime`` is ``process`` or ``docker`` (sent only to agents advertising
    ``runtime.docker``), ``image`` the container image for ``docker``.
    """

    deployment_id: str
    model_name: str
    model_path: str
    engine: str
    gpus: list[int] = []
    ctx: int | None = None
    extra_args: list[str] = []
    served_model_name: str | None = None
    health_timeout_s: float = 600.0
    runtime: Literal["process", "docker"] = "process"
    image: str | None = None


class StartResult(_Args, kw_only=True):
    pid: int
    port: int


class SpawnedEvent(_Args, kw_only=True):
    """The ``spawned`` progress event of a start: the engine process exists."""

    pid: int
    port: int


class PreparingEvent(_Args, kw_only=True):
    """The ``preparing`` progress event of a start: a line on what is being prepared (an
    image pull), sent about once a second while it lasts."""

    message: str


class StopArgs(_Args, kw_only=True):
    deployment_id: str
    grace_s: float = 10.0


class ProbeArgs(_Args, kw_only=True):
    deployment_id: str


class ProbeResult(_Args, kw_only=True):
    result: Literal["healthy", "unhealthy", "gone"]


class PullArgs(_Args, kw_only=True):
    """Download a Hugging Face repository into the agent's ``$BERTH_HOME/models``."""

    repo_id: str
    revision: str | None = None


class PullResult(_Args, kw_only=True):
    """Where the repository is on the agent's host."""

    path: str


class NoArgs(_Args, kw_only=True):
    pass


class EnginesResult(_Args, kw_only=True):
    engines: list[EngineState] = []


InventoryResult = Inventory

ARGS_TYPES: dict[str, type[_Args]] = {
    "start": StartArgs,
    "stop": StopArgs,
    "probe": ProbeArgs,
    "inventory": NoArgs,
    "engines": NoArgs,
    "pull": PullArgs,
}

T = TypeVar("T")


def decode_payload(raw: msgspec.Raw | bytes, kind: type[T], what: str) -> T:
    """Decode JSON ``raw`` as ``kind``; :class:`ProtocolError` naming ``what`` when malformed."""
    try:
        return msgspec.json.decode(raw, type=kind)
    except msgspec.DecodeError as exc:
        raise ProtocolError(f"malformed {what}: {exc}") from None


def encode_payload(value: Any) -> msgspec.Raw:
    """``value`` (a struct, list, dict or scalar) as raw JSON for ``args``/``result``/``data``."""
    return msgspec.Raw(msgspec.json.encode(value))
