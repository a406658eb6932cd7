"""``POST /admin/plan``: where a deployment of a model or service would go, and why.

A dry run of the lifecycle manager's own planning (:meth:`LifecycleManager.plan`): the same
facts, estimate and placement a real deployment would act on, turned into
:class:`berth.api.Plan`.  A refused placement is a plan too (200, ``placed: false``); bad
input is a 400 (a context that is not a positive integer, an unknown engine) or 404 (no such
model, service or node), and nothing changes either way.
"""

from __future__ import annotations

import asyncio

from fastapi import APIRouter

from berth.admin.adapters import plan_notes
from berth.admin.roles import needs
from berth.api import (
    EstimateInput,
    EvictionOut,
    GpuOptionOut,
    Plan,
    PlanIn,
    VramEstimateOut,
)
from berth.cluster.leader.agent_link import LOCAL_NODE_ID
from berth.deployments.adapters import AdapterManager
from berth.deployments.lifecycle import DeployOptions, LifecycleManager, PlannedDeployment
from berth.errors import ConfigError, ConflictError, NotFoundError
from berth.placement import ModelAt, Placement, VramEstimate
from berth.store import Store
from berth.vocab.records import ServiceProfileRecord
from berth.vocab.roles import Role


def build_plan_router(
    store: Store,
    lifecycle: LifecycleManager,
    *,
    default_runtime: str,
    leader_only: bool,
    adapters: AdapterManager | None = None,
) -> APIRouter:
    """The endpoint of the module docstring over explicit dependencies; with ``adapters``,
    a plan says what LoRA adapters the deployment starts with (:func:`plan_notes`)."""
    router = APIRouter()

    @router.post("/admin/plan", dependencies=[needs(Role.VIEWER)])
    async def plan(body: PlanIn) -> Plan:
        service = await _service_or_none(store, body.target)
        if service is not None:
            node = body.node or service.node_label
            if body.node and service.node_label:
                chosen = await asyncio.to_thread(store.lookup_node, body.node)
                if chosen.label != service.node_label:
                    raise ConfigError(
                        f"service {service.name!r} runs on node {service.node_label} (its "
                        f"node_label), not {chosen.label}"
                    )
            options = DeployOptions(
                model_name=service.model_name,
                engine=service.engine if body.engine is None else body.engine,
                node_id=node,
                runtime=service.runtime if body.runtime is None else body.runtime,
                gpus=tuple(service.gpus if body.gpus is None else body.gpus),
                ctx=body.ctx if body.ctx is not None else service.ctx,
                extra_args=tuple(
                    service.extra_args if body.extra_args is None else body.extra_args
                ),
                served_model_name=service.name,
                image=service.image,
                force=body.force,
                max_adapters=body.max_adapters or service.max_adapters,
            )
        else:
            try:
                await asyncio.to_thread(store.get_model, body.target)
            except NotFoundError:
                raise NotFoundError(
                    "model or service",
                    body.target,
                    message=f"no service or model named {body.target!r} (berth service ls, "
                    "berth models ls)",
                ) from None
            options = DeployOptions(
                model_name=body.target,
                engine="llamacpp" if body.engine is None else body.engine,
                node_id=body.node,
                runtime=default_runtime if body.runtime is None else body.runtime,
                gpus=tuple(body.gpus or ()),
                ctx=body.ctx,
                extra_args=tuple(body.extra_args or ()),
                force=body.force,
                max_adapters=body.max_adapters,
            )
        if leader_only and (options.node_id == LOCAL_NODE_ID):
            raise ConflictError(
                "this leader runs no engines (leader_only is set): plan for an agent with "
                "--node LABEL"
            )
        planned = await lifecycle.plan(options)
        view = plan_view(body.target, "service" if service else "model", options, planned)
        if adapters is not None:
            notes = await plan_notes(store, adapters, options, planned)
            view = view.model_copy(update={"adapter_notes": notes})
        return view

    return router


async def _service_or_none(store: Store, name: str) -> ServiceProfileRecord | None:
    try:
        return await asyncio.to_thread(store.get_service_profile, name)
    except NotFoundError:
        return None


def plan_view(target: str, kind: str, options: DeployOptions, planned: PlannedDeployment) -> Plan:
    """A planned deployment for the admin API."""
    result = planned.result
    estimate = planned.estimate.estimate
    placed = isinstance(result, Placement)
    eviction = result.eviction
    source = None
    if isinstance(result, Placement):
        model = result.model
        source = f"at {model.path}" if isinstance(model, ModelAt) else f"pull {model.repo_id}"
    label = result.label if isinstance(result, Placement) else None
    return Plan(
        target=target,
        kind="service" if kind == "service" else "model",
        model=planned.model.name,
        engine=planned.engine,
        runtime=planned.runtime,
        ctx=options.ctx,
        placed=placed,
        node_id=result.node_id,
        node_label=label,
        gpus=list(result.gpus) if isinstance(result, Placement) else [],
        image=result.image if isinstance(result, Placement) else None,
        model_source=source,
        reasons=list(result.reasons) if isinstance(result, Placement) else [],
        refusal=None if isinstance(result, Placement) else result.message,
        refusal_reason=None if isinstance(result, Placement) else result.reason,
        estimate=None if estimate is None else estimate_view(estimate),
        estimate_problem=planned.estimate.problem,
        eviction=None
        if eviction is None
        else EvictionOut(
            deployment_ids=list(eviction.deployment_ids),
            reasons=list(eviction.reasons),
            needed=placed,
        ),
        considered=[
            GpuOptionOut(
                node_id=o.node_id,
                node_label=o.label,
                index=o.index,
                name=o.name,
                simulated=o.simulated,
                total_mb=o.total_mb,
                free_mb=o.free_mb,
                verdict=o.verdict,
                detail=o.detail,
            )
            for o in result.considered
        ],
    )


def estimate_view(estimate: VramEstimate) -> VramEstimateOut:
    """An estimate for the admin API."""
    return VramEstimateOut(
        engine=estimate.engine,
        weights_mb=estimate.weights_mb,
        kv_cache_mb=estimate.kv_cache_mb,
        overhead_mb=estimate.overhead_mb,
        total_mb=estimate.need_mb,
        gpu_count=estimate.gpu_count,
        ctx=estimate.ctx,
        cache_type=estimate.cache_type,
        budget_fraction=estimate.budget_fraction,
        budget_flag=estimate.budget_flag,
        holds_fraction=estimate.holds_fraction,
        summary=estimate.summary(),
        inputs=[EstimateInput(name=name, value=value) for name, value in estimate.inputs],
        notes=list(estimate.notes),
    )
