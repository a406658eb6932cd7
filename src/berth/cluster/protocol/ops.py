"""The control operations an agent serves, each tied to its argument and result types.

A :class:`berth.cluster.protocol.frames.Request` names an ``op`` and carries its arguments as
raw JSON; each :class:`Op` here (:data:`START`, :data:`STOP`, ...) says how to encode and decode
them and the op's result, so a caller of ``LinkConnection.call(START, args, ...)`` gets a
:class:`StartResult` that mypy checks. The receiver decodes the arguments itself, so a bad
argument is answered ``invalid`` instead of failing the link. Each op's contract is in
``docs/protocol.md``.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, Literal, TypeVar

import msgspec

from berth.cluster.protocol.errors import ProtocolError
from berth.cluster.protocol.frames import OpName
from berth.cluster.protocol.payloads import EngineState, Inventory
from berth.vocab.deployment_request import DeploymentRequest
from berth.vocab.engines import EngineName, RuntimeName
from berth.vocab.signed_spec import SignedSpec

#: Capabilities of this code's agents, beyond the ops.
STREAM_CAPABILITIES = ("stream.http", "stream.logs")
#: The capability of an agent that checks every start's signed spec
#: (:mod:`berth.cluster.protocol.spec_signing`); a 0.1 agent lacks it.
SPEC_CAPABILITY = "spec.verify"
#: The capability an agent advertises for each runtime it can start engines with now.
RUNTIME_CAPABILITIES: dict[RuntimeName, str] = {
    "process": "runtime.process",
    "docker": "runtime.docker",
}


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
    engine: EngineName
    gpus: list[int] = []
    ctx: int | None = None
    extra_args: list[str] = []
    served_model_name: str | None = None
    health_timeout_s: float = 600.0
    runtime: RuntimeName = "process"
    image: str | None = None
    #: vLLM/SGLang: LoRA enabled with this many slots (sent only to agents with
    #: ``op.load_adapter``); an older agent ignores it and starts the engine without LoRA
    adapter_slots: int | None = None
    max_lora_rank: int | None = None
    lora_target_modules: list[str] = []
    #: llama.cpp: the adapter files (on the agent host) given with ``--lora``, in order
    lora_files: list[str] = []
    #: the spec the cluster signed (canonical JSON, ``docs/protocol.md``), the Ed25519
    #: signature over it (base64) and the signing key's id; an agent that checks specs
    #: refuses a start without them (``spec_refused``), an older one ignores them
    signed_spec: str | None = None
    spec_signature: str | None = None
    spec_key_id: str | None = None

    @classmethod
    def from_request(cls, request: DeploymentRequest, *, health_timeout_s: float) -> StartArgs:
        """The wire form of ``request``, the leader's side (:meth:`to_request` is the agent's).

        The LoRA fields are set only when the request uses adapters
        (:attr:`DeploymentRequest.uses_adapters`), so they stay off the wire otherwise; the
        port, log path and engine key are the agent's to choose and are not sent.
        """
        args = cls(
            deployment_id=request.deployment_id,
            model_name=request.model_name,
            model_path=str(request.model_path),
            engine=request.engine,
            gpus=list(request.gpus),
            ctx=request.ctx,
            extra_args=list(request.extra_args),
            served_model_name=request.served_model_name,
            health_timeout_s=health_timeout_s,
            runtime=request.runtime,
            image=request.image,
        )
        if request.uses_adapters:
            args.adapter_slots = request.adapter_slots
            args.max_lora_rank = request.max_lora_rank
            args.lora_target_modules = list(request.lora_target_modules)
            args.lora_files = [str(path) for path in request.lora_files]
        if request.signed is not None:
            args.signed_spec = request.signed.spec.decode("ascii")
            args.spec_signature = base64.b64encode(request.signed.signature).decode("ascii")
            args.spec_key_id = request.signed.key_id
        return args

    def to_request(self) -> DeploymentRequest:
        """The request these arguments carry, the agent's side: port 0 and an empty log path,
        which the agent core fills in when it starts the engine."""
        return DeploymentRequest(
            deployment_id=self.deployment_id,
            model_name=self.model_name,
            model_path=Path(self.model_path),
            engine=self.engine,
            port=0,
            log_path=Path(),
            gpus=tuple(self.gpus),
            ctx=self.ctx,
            extra_args=tuple(self.extra_args),
            served_model_name=self.served_model_name,
            runtime=self.runtime,
            image=self.image,
            adapter_slots=self.adapter_slots,
            max_lora_rank=self.max_lora_rank,
            lora_target_modules=tuple(self.lora_target_modules),
            lora_files=tuple(Path(path) for path in self.lora_files),
            signed=self._signed(),
        )

    def _signed(self) -> SignedSpec | None:
        """The signed spec these arguments carry (``None``: none, or a signature that is
        not base64, which the agent then refuses as unsigned)."""
        if self.signed_spec is None or self.spec_signature is None or self.spec_key_id is None:
            return None
        try:
            signature = base64.b64decode(self.spec_signature, validate=True)
            spec = self.signed_spec.encode("ascii")
        except ValueError:
            return None
        return SignedSpec(spec, signature, self.spec_key_id)


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
    #: seconds the engine has to answer its health path (older leaders: the agent's 5 s)
    timeout_s: float = 5.0


class ProbeResult(_Args, kw_only=True):
    result: Literal["healthy", "unhealthy", "gone"]
    #: with ``gone``: the engine's exit code, or the signal that killed it (``SIGKILL``),
    #: when the agent knows (older agents send neither)
    exit_code: int | None = None
    exit_signal: str | None = None


class PullArgs(_Args, kw_only=True):
    """Download a Hugging Face repository into the agent's ``$BERTH_HOME/models``."""

    repo_id: str
    revision: str | None = None


class PullResult(_Args, kw_only=True):
    """Where the repository is on the agent's host."""

    path: str


class LoadAdapterArgs(_Args, kw_only=True):
    """Load the LoRA adapter at ``path`` (on the agent host) into the deployment's running
    engine (vLLM or SGLang) under the name ``adapter``."""

    deployment_id: str
    engine: EngineName
    adapter: str
    path: str


class UnloadAdapterArgs(_Args, kw_only=True):
    """Unload the adapter ``adapter`` from the deployment's engine."""

    deployment_id: str
    engine: EngineName
    adapter: str


class IngressArgs(_Args, kw_only=True):
    """Serve the direct data path (``docs/protocol.md``, Direct data path): ``certificate``
    is the ingress's server certificate (PEM, the leaf then the CA) for the agent's own key,
    ``leader_certificate`` the leader's client certificate (PEM), the only client the
    ingress lets in."""

    certificate: str
    leader_certificate: str


class ModelShapeArgs(_Args, kw_only=True):
    """Read the shape of the model at ``path`` (absolute, on the agent's host: a GGUF file, or
    a folder with a ``config.json`` or GGUF parts).  ``known_size_bytes`` and
    ``known_mtime_ns`` are the stamp the leader already has a shape for: when the files
    still have it, the answer carries no shape."""

    path: str
    known_size_bytes: int | None = None
    known_mtime_ns: int | None = None


ModelFormatName = Literal["gguf", "hf"]


class ModelShapeInfo(_Args, kw_only=True):
    """The wire form of :class:`berth.placement.ModelShape` (the field meanings are there;
    ``berth.cluster.wire_forms`` converts both ways): what the VRAM estimate reads of a
    model's files.  ``source`` is the file read, on the agent's host."""

    format: ModelFormatName
    architecture: str
    weights_bytes: int
    block_count: int
    embedding_length: int
    head_count: int
    layer_kv_heads: list[int]
    key_length: int
    value_length: int
    context_length: int | None = None
    vocab_size: int | None = None
    dtype: str | None = None
    source: str


class ModelShapeResult(_Args, kw_only=True):
    """The files' stamp (total size in bytes, newest modification time in ns) and their
    shape; ``shape`` absent: the stamp is the one the request said it knows."""

    size_bytes: int
    mtime_ns: int
    shape: ModelShapeInfo | None = None


class RenewArgs(_Args, kw_only=True):
    """Agent to leader: issue a new client certificate for the key of ``csr_pem`` (a PEM
    PKCS#10 request signed by that new key, its proof of possession).  The link's own
    certificate says which node asks; the CSR's subject is ignored."""

    csr_pem: str


class RenewResult(_Args, kw_only=True):
    """The new certificate (PEM, the leaf alone), when it expires (epoch seconds), and the
    trust bundle the agent should trust from now on (PEM, every root of the cluster CA,
    current first: two during a CA rotation), and the spec signing keys it should trust
    (PEM public keys, current first: two during a rotation; empty from an older leader)."""

    certificate_pem: str
    not_after: float
    ca_bundle_pem: str
    spec_keys_pem: str = ""


class NoArgs(_Args, kw_only=True):
    pass


class EnginesResult(_Args, kw_only=True):
    engines: list[EngineState] = []


InventoryResult = Inventory

A = TypeVar("A", bound=msgspec.Struct)
R = TypeVar("R")
T = TypeVar("T")


@dataclass(frozen=True)
class Op(Generic[A, R]):
    """One control operation: its name on the wire, and its argument and result types.

    ``result`` is ``type(None)`` for an op that answers ``null``.
    """

    name: OpName
    args: type[A]
    result: type[R]

    @property
    def capability(self) -> str:
        """What an agent lists in Hello when it serves this op (``op.<name>``)."""
        return f"op.{self.name}"

    def encode_args(self, args: A) -> msgspec.Raw:
        return encode_payload(args)

    def decode_args(self, raw: msgspec.Raw) -> A:
        """The request's arguments; :class:`ProtocolError` when they are malformed."""
        return decode_payload(raw, self.args, f"{self.name} args")

    def encode_result(self, result: R) -> msgspec.Raw:
        return encode_payload(result)

    def decode_result(self, raw: msgspec.Raw) -> R:
        """The answer's result; :class:`ProtocolError` when it is malformed."""
        return decode_payload(raw, self.result, f"{self.name} result")


START: Op[StartArgs, StartResult] = Op("start", StartArgs, StartResult)
STOP: Op[StopArgs, None] = Op("stop", StopArgs, type(None))
PROBE: Op[ProbeArgs, ProbeResult] = Op("probe", ProbeArgs, ProbeResult)
INVENTORY: Op[NoArgs, Inventory] = Op("inventory", NoArgs, Inventory)
ENGINES: Op[NoArgs, EnginesResult] = Op("engines", NoArgs, EnginesResult)
PULL: Op[PullArgs, PullResult] = Op("pull", PullArgs, PullResult)
LOAD_ADAPTER: Op[LoadAdapterArgs, None] = Op("load_adapter", LoadAdapterArgs, type(None))
UNLOAD_ADAPTER: Op[UnloadAdapterArgs, None] = Op("unload_adapter", UnloadAdapterArgs, type(None))
INGRESS: Op[IngressArgs, None] = Op("ingress", IngressArgs, type(None))
MODEL_SHAPE: Op[ModelShapeArgs, ModelShapeResult] = Op(
    "model_shape", ModelShapeArgs, ModelShapeResult
)

#: The op the leader serves (agents ask it; see ``docs/protocol.md``, Renewal).
RENEW: Op[RenewArgs, RenewResult] = Op("renew", RenewArgs, RenewResult)

#: Every op an agent serves, by name.
OPS: dict[OpName, Op[Any, Any]] = {
    op.name: op
    for op in (
        START,
        STOP,
        PROBE,
        INVENTORY,
        ENGINES,
        PULL,
        LOAD_ADAPTER,
        UNLOAD_ADAPTER,
        INGRESS,
        MODEL_SHAPE,
    )
}
#: The capability an agent advertises in Hello for each op it serves.
OP_CAPABILITIES: dict[OpName, str] = {name: op.capability for name, op in OPS.items()}


def decode_payload(raw: msgspec.Raw | bytes, kind: type[T], what: str) -> T:
    """Decode JSON ``raw`` as ``kind``; :class:`ProtocolError` naming ``what`` when malformed."""
    try:
        return msgspec.json.decode(raw, type=kind)
    except msgspec.DecodeError as exc:
        raise ProtocolError(f"malformed {what}: {exc}") from None


def encode_payload(value: Any) -> msgspec.Raw:
    """``value`` (a struct, list, dict or scalar) as raw JSON for ``args``/``result``/``data``."""
    return msgspec.Raw(msgspec.json.encode(value))
