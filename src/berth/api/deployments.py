"""Deployments (a model served by an engine on a node): ``/admin/deployments``."""

from __future__ import annotations

from pydantic import ConfigDict, Field, field_validator

from berth.api.base import (
    MAX_ADAPTER_SLOTS,
    MAX_EXTRA_ARGS,
    MAX_GPUS,
    ApiInput,
    ApiModel,
    CtxTokens,
    DockerImage,
    EngineIn,
    ExtraArg,
    GpuIndex,
    RuntimeIn,
    Timestamp,
)
from berth.api.models import MODEL_NAME_PATTERN, no_parent_segments
from berth.vocab.engines import EngineName, RuntimeName
from berth.vocab.policies import DEFAULT_RESTART_POLICY, RestartPolicy
from berth.vocab.states import DeploymentState


class DeploymentIn(ApiInput):
    """``POST /admin/deployments``: run ``model`` on ``engine`` on ``node`` (an id or label;
    ``None``: where its VRAM estimate fits, or the leader's host when no node has GPUs).

    ``engine`` and ``runtime`` are names as a user typed them (``llamacpp``, ``docker``),
    checked by the lifecycle manager, which names the valid ones; ``runtime`` ``None`` is the
    leader's ``default_runtime`` setting.  ``gpus`` are device indexes (empty: chosen by
    fit), ``ctx`` the context length in tokens (``None``: the engine's default), ``image`` a
    ``docker`` deployment's container image (``None``: the engine's image setting).
    ``force``: place GPUs asked for (or the GPU with the most free memory) even where the
    estimate does not fit. ``max_adapters`` is a vLLM or SGLang engine's LoRA slot count
    (``None``: 1 when the model has adapters, else LoRA off).  ``restart`` is when its engine
    is started again after it ended (``docs/fleet.md``, Restarts).
    """

    model_config = ConfigDict(
        json_schema_extra={
            "examples": [
                {
                    "model": "llama-3.1-8b-q4",
                    "engine": "llamacpp",
                    "gpus": [0],
                    "ctx": 8192,
                    "served_model_name": "chat",
                }
            ]
        }
    )

    model: str = Field(min_length=1, max_length=200)
    engine: EngineIn = "llamacpp"
    node: str | None = Field(default=None, min_length=1, max_length=200)
    runtime: RuntimeIn | None = None
    gpus: list[GpuIndex] = Field(default_factory=list, max_length=MAX_GPUS)
    ctx: CtxTokens | None = None
    extra_args: list[ExtraArg] = Field(default_factory=list, max_length=MAX_EXTRA_ARGS)
    #: the name clients ask for (``None``: the model's): the rules of model names
    served_model_name: str | None = Field(default=None, pattern=MODEL_NAME_PATTERN)
    image: DockerImage | None = None
    max_adapters: int | None = Field(default=None, strict=True, ge=1, le=MAX_ADAPTER_SLOTS)
    force: bool = False
    restart: RestartPolicy = DEFAULT_RESTART_POLICY

    _served_model_name = field_validator("served_model_name")(no_parent_segments)


class Deployment(ApiModel):
    """One deployment as last written.

    ``port`` and ``pid`` are the engine's once started (``None`` before); ``failure_reason``
    is kept once it failed (with the engine's log tail); ``progress`` says what a loading
    one is busy with (an image pull), ``None`` otherwise.  ``restart_count`` is how many
    times the restart policy started its engine again; ``last_exit`` how the engine last
    ended (``exit code 1``, ``killed by SIGKILL``, ``stopped after 3 failed health probes``)
    and ``last_exit_log`` the engine log's last lines then.
    """

    id: str
    model_name: str
    engine: EngineName
    runtime: RuntimeName
    node_id: str
    state: DeploymentState
    port: int | None
    pid: int | None
    gpus: list[int]
    ctx: int | None
    extra_args: list[str]
    served_model_name: str
    failure_reason: str | None
    created_at: Timestamp
    updated_at: Timestamp
    image: str | None
    progress: str | None
    restart_policy: RestartPolicy = DEFAULT_RESTART_POLICY
    restart_count: int = 0
    last_exit: str | None = None
    last_exit_log: str | None = None


class ListedDeployment(Deployment):
    """A row of ``GET /admin/deployments``: with its node's label, whether that node is
    connected (a ready deployment on an unreachable node is not routed to), and the service
    it is a replica of (``None``: deployed on its own, not from a service)."""

    node_label: str
    node_connected: bool
    service: str | None = None
