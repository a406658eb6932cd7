"""The scaling controller's :class:`~berth.scaling.Fleet` over the leader's lifecycle
manager: how a replica of a service is started and stopped.

A replica is a deployment with the service's settings, serving the service's name, on its
``node_label`` when it has one.  ``berth service deploy`` goes through
:func:`deploy_options` too, so a replica the controller starts and one started by hand are
the same deployment.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from berth.deployments.lifecycle import DEFAULT_MIN_RESIDENCY_S, DeployOptions, LifecycleManager
from berth.errors import ConflictError, NotFoundError
from berth.placement import EvictionPolicy
from berth.routing.errors import NoReadyDeploymentError
from berth.scaling.fleet import EvictionNote, ProgressNote
from berth.vocab.records import ServiceProfileRecord

log = logging.getLogger(__name__)


def deploy_options(
    service: ServiceProfileRecord, node: str | None, *, force: bool = False
) -> DeployOptions:
    """A deployment of ``service`` on ``node`` (an id or label; ``None``: where placement
    finds room by fit): its model, engine, runtime,
    GPUs, context, arguments, image and LoRA slots, serving the service's name; ``force``
    places its GPUs even where the VRAM estimate does not fit."""
    return DeployOptions(
        model_name=service.model_name,
        engine=service.engine,
        node_id=node,
        runtime=service.runtime,
        gpus=service.gpus,
        ctx=service.ctx,
        extra_args=service.extra_args,
        served_model_name=service.name,
        image=service.image,
        force=force,
        max_adapters=service.max_adapters,
        restart_policy=service.restart_policy,
    )


def leader_only_refusal(service: str) -> ConflictError:
    """Why a deployment of ``service`` cannot run on a leader that runs no engines."""
    return ConflictError(
        f"this leader runs no engines (leader_only is set): deploy service {service} on an "
        "agent with --node LABEL, or give the service a node label"
    )


class LeaderFleet:
    """Starts and stops replicas through ``lifecycle`` (see the module docstring).

    A replica may evict idle deployments of other services to make room (placement's
    choice, with ``min_residency_s`` as its minimum residency); ``wall_clock`` gives epoch
    seconds for that choice.  The lifecycle manager places one deployment at a time, so the
    VRAM one placement takes is seen by the next.
    """

    def __init__(
        self,
        lifecycle: LifecycleManager,
        *,
        min_residency_s: float = DEFAULT_MIN_RESIDENCY_S,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self._lifecycle = lifecycle
        self._min_residency_s = min_residency_s
        self._wall_clock = wall_clock

    async def start_replica(
        self, service: ServiceProfileRecord, note: ProgressNote, evicted: EvictionNote
    ) -> str:
        """Deploy one replica of ``service`` on its node label, else where placement finds
        room (evicting idle deployments when it must, each told to ``evicted`` before it is
        stopped); its id (pending).  Raises what :meth:`LifecycleManager.deploy` raises."""
        note(f"placing a replica of service {service.name}")

        def evicting(deployment_id: str, reason: str) -> None:
            note(f"evicting deployment {deployment_id} to make room: {reason}")
            evicted(deployment_id, reason)

        record = await self._lifecycle.deploy(
            deploy_options(service, service.node_label),
            eviction=EvictionPolicy(self._wall_clock(), self._min_residency_s, allowed=True),
            on_evict=evicting,
        )
        return record.id

    async def stop_replica(self, deployment_id: str) -> None:
        await self._lifecycle.stop(deployment_id)

    def progress(self, deployment_id: str) -> str | None:
        return self._lifecycle.progress(deployment_id)

    def routable(self, service: str) -> frozenset[str]:
        try:
            upstreams = self._lifecycle.candidates(service)
        except (NotFoundError, NoReadyDeploymentError):
            return frozenset()
        return frozenset(u.deployment_id for u in upstreams)
