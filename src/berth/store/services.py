"""Service profiles: the :class:`Store`'s half for how models are deployed.

A **service profile** says how to deploy a model: engine, runtime, GPUs, context length,
extra engine arguments, container image and, optionally, the node (by label) its deployments
run on.  Its deployments serve the profile's name; routes (:mod:`berth.store.routes`) put
profiles behind public names.

Its **scaling settings** (:class:`ScalingSettings`: replicas, idle timeout, pin, priority,
capacity) say how many deployments of it berth keeps and when it starts or stops them;
:func:`check_scaling` is their one check, applied on create and on every change.

:class:`ServiceMethods` is mixed into :class:`berth.store.Store`, like
:class:`berth.store.nodes.NodeMethods`: short sessions, fenced writes (store.lease), records.
Refusals are :class:`NotFoundError` (an unknown model, node or service),
:class:`ConflictError` (a taken name; a profile still in use by a route or deployment) and
:class:`ConfigError` (an invalid setting).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from datetime import datetime

from sqlalchemy import select
from sqlalchemy.orm import Session

from berth.errors import ConfigError, ConflictError, NotFoundError
from berth.store.adapters import refuse_adapter_name
from berth.store.tables import (
    DeploymentRow,
    ModelRow,
    NodeRow,
    RouteTargetRow,
    ServiceProfileRow,
)
from berth.store.values import aware, not_found
from berth.vocab.engines import parse_engine_name, parse_runtime_name
from berth.vocab.policies import (
    DEFAULT_RESTART_POLICY,
    RestartPolicy,
    RoutingPolicy,
    check_restart_policy,
    check_routing_policy,
)
from berth.vocab.records import (
    MAX_STREAM_TIMEOUT_S,
    ScalingSettings,
    ServiceProfileRecord,
    StreamTimeouts,
)
from berth.vocab.states import TERMINAL_STATES, DeploymentState

_ACTIVE_STATES = tuple(s.value for s in DeploymentState if s not in TERMINAL_STATES)
#: The largest replica count, capacity and priority magnitude a service may have (a 32-bit
#: column, and far beyond any fleet).
_MAX_SETTING = 2**31 - 1


def check_scaling(settings: ScalingSettings) -> ScalingSettings:
    """``settings`` when they are valid; :class:`ConfigError` saying why not otherwise.

    Refused: a negative replica count, ``min_replicas`` above ``max_replicas``, an idle
    timeout that is negative or not finite, a capacity under 1, values past 32 bits.
    """
    low, high = settings.min_replicas, settings.max_replicas
    if low < 0 or high < 0:
        raise ConfigError(f"replica counts must not be negative (min {low}, max {high})")
    if low > high:
        raise ConfigError(f"min_replicas ({low}) is above max_replicas ({high})")
    if high > _MAX_SETTING:
        raise ConfigError(f"max_replicas must be at most {_MAX_SETTING}, got {high}")
    idle = settings.idle_timeout_s
    if idle is not None and (not math.isfinite(idle) or idle < 0):
        raise ConfigError(f"the idle timeout must be a positive number of seconds, got {idle}")
    capacity = settings.capacity
    if capacity is not None and not 1 <= capacity <= _MAX_SETTING:
        raise ConfigError(f"capacity must be at least 1 request per replica, got {capacity}")
    if not -_MAX_SETTING <= settings.priority <= _MAX_SETTING:
        raise ConfigError(f"priority must fit in 32 bits, got {settings.priority}")
    return settings


def check_timeouts(timeouts: StreamTimeouts) -> StreamTimeouts:
    """``timeouts`` when each is ``None`` or a number of seconds from 0 (off) to a day;
    :class:`ConfigError` naming the one that is not otherwise."""
    for name, value in (
        ("first_byte_timeout_s", timeouts.first_byte_timeout_s),
        ("stream_idle_timeout_s", timeouts.stream_idle_timeout_s),
    ):
        if value is not None and not (math.isfinite(value) and 0 <= value <= MAX_STREAM_TIMEOUT_S):
            raise ConfigError(
                f"{name} must be 0 (off) to {MAX_STREAM_TIMEOUT_S:g} seconds, got {value}"
            )
    return timeouts


class ServiceMethods:
    """Store methods for service profiles (see the module doc)."""

    _clock: Callable[[], datetime]

    def _read(self) -> AbstractContextManager[Session]:
        raise NotImplementedError

    def _fenced_write(self) -> AbstractContextManager[Session]:
        raise NotImplementedError

    # --- service profiles ----------------------------------------------------------------

    def create_service_profile(
        self,
        name: str,
        model_name: str,
        engine: str,
        runtime: str,
        *,
        gpus: Sequence[int] = (),
        ctx: int | None = None,
        extra_args: Sequence[str] = (),
        image: str | None = None,
        node_label: str | None = None,
        scaling: ScalingSettings | None = None,
        max_adapters: int | None = None,
        restart_policy: RestartPolicy = DEFAULT_RESTART_POLICY,
        timeouts: StreamTimeouts | None = None,
        routing_policy: RoutingPolicy | None = None,
    ) -> ServiceProfileRecord:
        """Record the service profile ``name``; its deployments get ``restart_policy``, its
        requests ``routing_policy`` (``None``: the leader's setting).

        ``engine`` and ``runtime`` are normalised (``"LlamaCpp "`` → ``llamacpp``); ``scaling``
        ``None`` is :class:`ScalingSettings`' defaults (on demand, one replica at most, never
        unloaded for idleness).  Raises :class:`ConflictError` when ``name`` is taken;
        :class:`NotFoundError` for an unknown model or a ``node_label`` no enrolled node has
        (removed nodes included); :class:`ConfigError` for an unknown engine or runtime, a
        negative GPU index, a non-positive ``ctx``, an ``image`` on a runtime other than
        ``docker``, scaling settings :func:`check_scaling` refuses, or a ``max_adapters``
        below 1 or for llama.cpp (which takes its adapters at start), or ``timeouts``
        :func:`check_timeouts` refuses, or an unknown routing policy.
        """
        if routing_policy is not None:
            routing_policy = check_routing_policy(routing_policy)
        scaling = check_scaling(scaling or ScalingSettings())
        timeouts = check_timeouts(timeouts or StreamTimeouts())
        engine_name = parse_engine_name(engine)
        runtime_name = parse_runtime_name(runtime)
        if any(gpu < 0 for gpu in gpus):
            raise ConfigError(f"GPU indexes must not be negative, got {list(gpus)}")
        if ctx is not None and ctx <= 0:
            raise ConfigError(f"ctx must be a positive number of tokens, got {ctx}")
        image = image.strip() if image is not None else None
        if image is not None and runtime_name != "docker":
            raise ConfigError("an image applies to the docker runtime only (--runtime docker)")
        if image == "":
            raise ConfigError("the docker image name is empty")
        _check_max_adapters(max_adapters, engine_name)
        with self._fenced_write() as session:
            if session.get(ServiceProfileRow, name) is not None:
                raise ConflictError(f"service {name!r} already exists")
            if session.get(ModelRow, model_name) is None:
                raise NotFoundError("model", model_name)
            # A service's deployments serve under its name: a model or running deployment of
            # that name would be hidden behind it.
            if session.get(ModelRow, name) is not None or session.scalar(
                select(DeploymentRow.id)
                .where(
                    DeploymentRow.served_model_name == name,
                    DeploymentRow.state.in_(_ACTIVE_STATES),
                )
                .limit(1)
            ):
                raise ConflictError(
                    f"{name!r} is already a model's name or a running deployment's served name: "
                    "name the service differently"
                )
            refuse_adapter_name(session, name, "service")
            if node_label is not None:
                _check_node_label(session, node_label)
            row = ServiceProfileRow(
                name=name,
                model_name=model_name,
                engine=engine_name,
                runtime=runtime_name,
                gpus=list(gpus),
                ctx=ctx,
                extra_args=list(extra_args),
                image=image,
                node_label=node_label,
                created_at=self._clock(),
                min_replicas=scaling.min_replicas,
                max_replicas=scaling.max_replicas,
                idle_timeout_s=scaling.idle_timeout_s,
                pinned=scaling.pinned,
                priority=scaling.priority,
                capacity=scaling.capacity,
                max_adapters=max_adapters,
                restart_policy=check_restart_policy(restart_policy),
                first_byte_timeout_s=timeouts.first_byte_timeout_s,
                stream_idle_timeout_s=timeouts.stream_idle_timeout_s,
                routing_policy=routing_policy,
            )
            session.add(row)
            return _profile_record(row)

    def set_service_restart_policy(
        self, name: str, restart_policy: RestartPolicy
    ) -> ServiceProfileRecord:
        """Set the restart policy of service ``name``'s deployments from now on (those
        running keep theirs until they are started anew).  Raises :class:`NotFoundError`
        for an unknown service and :class:`ConfigError` for an unknown policy."""
        with self._fenced_write() as session:
            row = _profile_row(session, name)
            row.restart_policy = check_restart_policy(restart_policy)
            session.flush()
            return _profile_record(row)

    def set_service_routing_policy(
        self, name: str, routing_policy: RoutingPolicy | None
    ) -> ServiceProfileRecord:
        """Set how the router picks among service ``name``'s deployments (``None``: the
        leader's ``routing_policy`` setting), from the next request on once the leader is
        told (:meth:`berth.deployments.lifecycle.LifecycleManager.set_service_routing_policies`).
        Raises :class:`NotFoundError` for an unknown service and :class:`ConfigError` for
        an unknown policy."""
        policy = None if routing_policy is None else check_routing_policy(routing_policy)
        with self._fenced_write() as session:
            row = _profile_row(session, name)
            row.routing_policy = policy
            session.flush()
            return _profile_record(row)

    def update_service_scaling(
        self, name: str, change: Callable[[ScalingSettings], ScalingSettings]
    ) -> ServiceProfileRecord:
        """Replace the scaling settings of service ``name`` with ``change(current)``, in one
        write transaction (two changes never lose one another), and return the service.

        Raises :class:`NotFoundError` for an unknown service and :class:`ConfigError` when
        the new settings are invalid (:func:`check_scaling`); nothing changes then.
        """
        with self._fenced_write() as session:
            row = _profile_row(session, name)
            settings = check_scaling(change(_scaling_of(row)))
            row.min_replicas = settings.min_replicas
            row.max_replicas = settings.max_replicas
            row.idle_timeout_s = settings.idle_timeout_s
            row.pinned = settings.pinned
            row.priority = settings.priority
            row.capacity = settings.capacity
            session.flush()
            return _profile_record(row)

    def update_service_timeouts(
        self, name: str, change: Callable[[StreamTimeouts], StreamTimeouts]
    ) -> ServiceProfileRecord:
        """Replace the stream timeouts of service ``name`` with ``change(current)`` in one
        write transaction, and return the service. Raises :class:`NotFoundError` for an
        unknown service and :class:`ConfigError` for invalid timeouts (nothing changes)."""
        with self._fenced_write() as session:
            row = _profile_row(session, name)
            timeouts = check_timeouts(change(_timeouts_of(row)))
            row.first_byte_timeout_s = timeouts.first_byte_timeout_s
            row.stream_idle_timeout_s = timeouts.stream_idle_timeout_s
            session.flush()
            return _profile_record(row)

    def get_service_profile(self, name: str) -> ServiceProfileRecord:
        """The service profile ``name``; :class:`NotFoundError` if there is none."""
        with self._read() as session:
            return _profile_record(_profile_row(session, name))

    def list_service_profiles(self) -> list[ServiceProfileRecord]:
        """Every service profile, by name."""
        with self._read() as session:
            rows = session.scalars(select(ServiceProfileRow).order_by(ServiceProfileRow.name))
            return [_profile_record(row) for row in rows]

    def delete_service_profile(self, name: str) -> ServiceProfileRecord:
        """Delete the service profile ``name`` and return what it was.

        Raises :class:`NotFoundError` if unknown, and :class:`ConflictError` while a route
        names it (the message names the routes) or a deployment that is not stopped or
        failed serves it.
        """
        with self._fenced_write() as session:
            row = _profile_row(session, name)
            routes = session.scalars(
                select(RouteTargetRow.public_name)
                .where(RouteTargetRow.profile_name == name)
                .order_by(RouteTargetRow.public_name)
            ).all()
            if routes:
                listed = ", ".join(routes)
                raise ConflictError(
                    f"service {name!r} is used by route(s) {listed}; remove it from them "
                    f"first (berth route rm ROUTE --service {name})"
                )
            active = session.scalars(
                select(DeploymentRow.id)
                .where(DeploymentRow.served_model_name == name)
                .where(DeploymentRow.state.in_(_ACTIVE_STATES))
                .order_by(DeploymentRow.id)
            ).all()
            if active:
                raise ConflictError(
                    f"service {name!r} has active deployment(s) {', '.join(active)}; "
                    "stop them first"
                )
            record = _profile_record(row)
            session.delete(row)
            return record


def models_used_by_services(session: Session, model_name: str) -> list[str]:
    """The service profiles that deploy ``model_name``, by name (the model must stay)."""
    return list(
        session.scalars(
            select(ServiceProfileRow.name)
            .where(ServiceProfileRow.model_name == model_name)
            .order_by(ServiceProfileRow.name)
        ).all()
    )


def _check_max_adapters(max_adapters: int | None, engine: str) -> None:
    if max_adapters is None:
        return
    if max_adapters < 1:
        raise ConfigError(f"max_adapters must be at least 1, not {max_adapters}")
    if engine == "llamacpp":
        raise ConfigError(
            "max_adapters is for vLLM and SGLang: llama.cpp starts with every adapter of its "
            "base on its node"
        )


def _check_node_label(session: Session, label: str) -> None:
    node = session.scalars(select(NodeRow).where(NodeRow.label == label)).first()
    if node is None or node.status == "removed":
        labels = session.scalars(
            select(NodeRow.label).where(NodeRow.status != "removed").order_by(NodeRow.label)
        ).all()
        known = ", ".join(labels) or "none"
        raise not_found("node", label, f"node {label!r} not found (nodes: {known})")


def _profile_row(session: Session, name: str) -> ServiceProfileRow:
    row = session.get(ServiceProfileRow, name)
    if row is None:
        raise NotFoundError("service", name)
    return row


def _profile_record(row: ServiceProfileRow) -> ServiceProfileRecord:
    return ServiceProfileRecord(
        name=row.name,
        model_name=row.model_name,
        engine=row.engine,
        runtime=row.runtime,
        gpus=tuple(row.gpus),
        ctx=row.ctx,
        extra_args=tuple(row.extra_args),
        image=row.image,
        node_label=row.node_label,
        created_at=aware(row.created_at),
        scaling=_scaling_of(row),
        max_adapters=row.max_adapters,
        restart_policy=check_restart_policy(row.restart_policy),
        timeouts=_timeouts_of(row),
        routing_policy=None
        if row.routing_policy is None
        else check_routing_policy(row.routing_policy),
    )


def _timeouts_of(row: ServiceProfileRow) -> StreamTimeouts:
    return StreamTimeouts(
        first_byte_timeout_s=row.first_byte_timeout_s,
        stream_idle_timeout_s=row.stream_idle_timeout_s,
    )


def _scaling_of(row: ServiceProfileRow) -> ScalingSettings:
    return ScalingSettings(
        min_replicas=row.min_replicas,
        max_replicas=row.max_replicas,
        idle_timeout_s=row.idle_timeout_s,
        pinned=bool(row.pinned),
        priority=row.priority,
        capacity=row.capacity,
    )
