"""Placement dry runs: ``POST /admin/plan`` (``berth plan``).

A plan says what a deployment of a model or service would need (the VRAM estimate, with
the inputs it was made from) and where it would go, with the reasons, or why it would be
refused.  Nothing changes.
"""

from __future__ import annotations

from typing import Literal

from pydantic import ConfigDict, Field

from berth.api.base import (
    MAX_ADAPTER_SLOTS,
    MAX_EXTRA_ARGS,
    MAX_GPUS,
    ApiInput,
    ApiModel,
    CtxTokens,
    EngineIn,
    ExtraArg,
    GpuIndex,
    RuntimeIn,
)
from berth.vocab.engines import EngineName, RuntimeName

#: A GPU looked at: whether the estimate fits it, or why it was not judged.
GpuVerdict = Literal["fits", "too_small", "no_room", "reserved", "unchecked"]


class PlanIn(ApiInput):
    """``POST /admin/plan``: where a deployment of ``target`` would go.

    ``target`` is a service's name (its profile's model, engine, runtime, GPUs, context,
    extra arguments and node label are used), else a registered model's.  ``node`` (id or
    label), ``engine``, ``runtime``, ``gpus``, ``ctx`` (tokens) and ``extra_args`` replace
    the service's or the defaults (``None``: not given); ``force`` as ``berth run
    --force``; ``max_adapters`` as ``berth run --max-adapters`` (LoRA slots, vLLM/SGLang).
    """

    model_config = ConfigDict(json_schema_extra={"examples": [{"target": "chat", "ctx": 32768}]})

    target: str = Field(min_length=1, max_length=200)
    node: str | None = Field(default=None, min_length=1, max_length=200)
    engine: EngineIn | None = None
    runtime: RuntimeIn | None = None
    gpus: list[GpuIndex] | None = Field(default=None, max_length=MAX_GPUS)
    ctx: CtxTokens | None = None
    extra_args: list[ExtraArg] | None = Field(default=None, max_length=MAX_EXTRA_ARGS)
    force: bool = False
    max_adapters: int | None = Field(default=None, ge=1, le=MAX_ADAPTER_SLOTS)


class EstimateInput(ApiModel):
    """One input of an estimate: ``name`` (``layers``, ``context``, ...) and its value, with
    where it came from."""

    name: str
    value: str


class VramEstimateOut(ApiModel):
    """The VRAM a deployment needs, per GPU, in MiB: ``total_mb`` is weights + KV cache +
    overhead.  ``holds_fraction``: vLLM and SGLang take that fraction of each GPU's total at
    start instead (``None``: llama.cpp takes what it needs); the model must fit inside
    ``budget_fraction`` of it (``budget_flag`` names the engine flag)."""

    engine: EngineName
    weights_mb: int
    kv_cache_mb: int
    overhead_mb: int
    total_mb: int
    gpu_count: int
    ctx: int
    cache_type: str
    budget_fraction: float | None
    budget_flag: str | None
    holds_fraction: float | None
    summary: str
    inputs: list[EstimateInput]
    notes: list[str]


class GpuOptionOut(ApiModel):
    """A GPU placement looked at, its memory in MiB (``free_mb`` as placement counts it:
    what the node reports less berth's own deployments' estimates), the verdict and why."""

    node_id: str
    node_label: str
    index: int
    name: str
    simulated: bool
    total_mb: int
    free_mb: int
    verdict: GpuVerdict
    detail: str


class EvictionOut(ApiModel):
    """Idle deployments whose stop would make room (least recently used first), with a
    reason each; ``needed``: the placement depends on it (else it is the way out of a
    refusal)."""

    deployment_ids: list[str]
    reasons: list[str]
    needed: bool


class Plan(ApiModel):
    """``POST /admin/plan``'s answer: what the deployment needs and where it would go.

    ``kind`` says whether ``target`` named a service or a model.  ``placed``: it would be
    placed, on ``node_id``/``node_label`` with ``gpus`` (empty: none given to the engine),
    ``image`` (docker) and the model from ``model_source``; else ``refusal`` is the message
    and ``refusal_reason`` its code.  ``estimate`` is ``None`` when none could be made
    (``estimate_problem`` says why).  ``adapter_notes`` says what LoRA adapters the
    deployment would start with, and which running deployments of the model need a restart
    to serve adapters registered since they started (``docs/adapters.md``).
    """

    target: str
    kind: Literal["service", "model"]
    model: str
    engine: EngineName
    runtime: RuntimeName
    ctx: int | None
    placed: bool
    node_id: str | None
    node_label: str | None
    gpus: list[int]
    image: str | None
    model_source: str | None
    reasons: list[str]
    refusal: str | None
    refusal_reason: str | None
    estimate: VramEstimateOut | None
    estimate_problem: str | None
    eviction: EvictionOut | None
    considered: list[GpuOptionOut]
    adapter_notes: list[str] = Field(default_factory=list)
