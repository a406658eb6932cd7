"""Routes: the :class:`Store`'s half for the public model names clients ask for.

A **route** is a public model name.  It has one or more targets (service profiles, each with
a priority: the highest priority with a ready deployment answers, equal priorities share the
load) and an optional fallback: another route, tried when none of its targets has a ready
deployment.  Fallbacks never form a cycle (:func:`fallback_cycle`, pure).

:class:`RouteMethods` is mixed into :class:`berth.store.Store`, like
:class:`berth.store.services.ServiceMethods` (the profiles routes name): short sessions,
fenced writes (store.lease), records.  Refusals are :class:`NotFoundError` (an unknown
service, route or target), :class:`ConflictError` (a service already behind the route, a
route another falls back to, an adapter's name) and :class:`ConfigError` (a fallback that
would loop).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from datetime import datetime

from sqlalchemy import select
from sqlalchemy.orm import Session

from berth.errors import ConfigError, ConflictError, NotFoundError
from berth.store.adapters import refuse_adapter_name
from berth.store.tables import RouteRow, RouteTargetRow, ServiceProfileRow
from berth.store.values import aware, not_found
from berth.vocab.records import RouteRecord, RouteTarget


class RouteMethods:
    """Store methods for routes (see the module doc)."""

    _clock: Callable[[], datetime]

    def _read(self) -> AbstractContextManager[Session]:
        raise NotImplementedError

    def _fenced_write(self) -> AbstractContextManager[Session]:
        raise NotImplementedError

    def add_route(
        self, name: str, service: str, *, priority: int = 0, fallback: str | None = None
    ) -> RouteRecord:
        """Put the service profile ``service`` behind the route ``name`` with ``priority``,
        creating the route if it is new; return the route.

        ``fallback``, when given, becomes the route's fallback (a route has one; giving
        another replaces it).  Raises :class:`NotFoundError` for an unknown service or
        fallback route, :class:`ConflictError` when ``service`` is already behind ``name``,
        and :class:`ConfigError` when the fallback is the route itself or would lead back
        to it.
        """
        with self._fenced_write() as session:
            if session.get(ServiceProfileRow, service) is None:
                raise NotFoundError("service", service)
            route = session.get(RouteRow, name)
            if route is None:
                refuse_adapter_name(session, name, "route")
                route = RouteRow(public_name=name, fallback=None, created_at=self._clock())
                session.add(route)
            elif session.get(RouteTargetRow, (name, service)) is not None:
                raise ConflictError(f"service {service!r} is already behind route {name!r}")
            if fallback is not None:
                _check_fallback(session, name, fallback)
                route.fallback = fallback
            session.add(
                RouteTargetRow(
                    public_name=name,
                    profile_name=service,
                    priority=priority,
                    created_at=self._clock(),
                )
            )
            session.flush()
            return _route_record(session, route)

    def set_route_fallback(self, name: str, fallback: str | None) -> RouteRecord:
        """Set (or, with ``None``, clear) the fallback of the route ``name``; return it.

        Raises :class:`NotFoundError` for an unknown route or fallback route and
        :class:`ConfigError` when the fallback would lead back to ``name``.
        """
        with self._fenced_write() as session:
            route = _route_row(session, name)
            if fallback is not None:
                _check_fallback(session, name, fallback)
            route.fallback = fallback
            session.flush()
            return _route_record(session, route)

    def get_route(self, name: str) -> RouteRecord:
        """The route ``name``; :class:`NotFoundError` if there is none."""
        with self._read() as session:
            return _route_record(session, _route_row(session, name))

    def list_routes(self) -> list[RouteRecord]:
        """Every route, by public name."""
        with self._read() as session:
            routes = session.scalars(select(RouteRow).order_by(RouteRow.public_name)).all()
            targets = session.scalars(select(RouteTargetRow)).all()
            by_route: dict[str, list[RouteTargetRow]] = {}
            for target in targets:
                by_route.setdefault(target.public_name, []).append(target)
            return [_route_record_of(row, by_route.get(row.public_name, [])) for row in routes]

    def remove_route(self, name: str, service: str | None = None) -> RouteRecord | None:
        """Take ``service`` out of the route ``name``, or with ``service=None`` remove the
        whole route; return what is left of the route, ``None`` once it is gone.

        A route whose last target goes is removed.  Raises :class:`NotFoundError` for an
        unknown route or a service that is not behind it, and :class:`ConflictError` when
        the route would go while another route falls back to it (the message names them).
        """
        with self._fenced_write() as session:
            route = _route_row(session, name)
            targets = _targets_of(session, name)
            if service is not None:
                target = next((t for t in targets if t.profile_name == service), None)
                if target is None:
                    message = f"service {service!r} is not behind route {name!r}"
                    raise not_found("service", service, message)
                if len(targets) > 1:
                    session.delete(target)
                    session.flush()
                    return _route_record(session, route)
            users = session.scalars(
                select(RouteRow.public_name)
                .where(RouteRow.fallback == name)
                .order_by(RouteRow.public_name)
            ).all()
            if users:
                raise ConflictError(
                    f"route {name!r} is the fallback of route(s) {', '.join(users)}; "
                    "change their fallback first"
                )
            for target in targets:
                session.delete(target)
            session.flush()
            session.delete(route)
            return None


def fallback_cycle(
    fallbacks: Mapping[str, str | None], name: str, fallback: str
) -> tuple[str, ...] | None:
    """The loop that making ``fallback`` the fallback of route ``name`` would close, as the
    route names walked (``("a", "b", "a")``), or ``None`` when there is none.

    ``fallbacks`` maps every route's name to its current fallback (``None``: none).
    """
    path = [name]
    seen: set[str] = set()
    current: str | None = fallback
    while current is not None and current not in seen:
        path.append(current)
        if current == name:
            return tuple(path)
        seen.add(current)
        current = fallbacks.get(current)
    return None


def _check_fallback(session: Session, name: str, fallback: str) -> None:
    if session.get(RouteRow, fallback) is None:
        raise NotFoundError("route", fallback)
    rows = session.execute(select(RouteRow.public_name, RouteRow.fallback)).all()
    fallbacks = {route: route_fallback for route, route_fallback in rows}
    cycle = fallback_cycle(fallbacks, name, fallback)
    if cycle is not None:
        raise ConfigError(
            f"route {name!r} cannot fall back to {fallback!r}: it would loop ({' -> '.join(cycle)})"
        )


def _route_row(session: Session, name: str) -> RouteRow:
    row = session.get(RouteRow, name)
    if row is None:
        raise NotFoundError("route", name)
    return row


def _targets_of(session: Session, name: str) -> list[RouteTargetRow]:
    return list(
        session.scalars(select(RouteTargetRow).where(RouteTargetRow.public_name == name)).all()
    )


def _route_record(session: Session, row: RouteRow) -> RouteRecord:
    return _route_record_of(row, _targets_of(session, row.public_name))


def _route_record_of(row: RouteRow, targets: Sequence[RouteTargetRow]) -> RouteRecord:
    ordered = sorted(targets, key=lambda t: (-t.priority, t.profile_name))
    return RouteRecord(
        name=row.public_name,
        targets=tuple(RouteTarget(t.profile_name, t.priority) for t in ordered),
        fallback=row.fallback,
        created_at=aware(row.created_at),
    )
