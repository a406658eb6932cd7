"""Routes: the public model names clients use, resolved to the deployments of service profiles.

A route (:mod:`berth.store.routes`) names one or more service profiles, each with a
priority, and optionally a fallback route.  A request for a route goes to the ready
deployments of its highest-priority targets that have any; targets of equal priority are
merged, so the scorer balances them; when no target has a ready deployment, the fallback
route is tried the same way, then its fallback, and so on (each route once).

:class:`RouteResolver` is the proxy's and the router's ``UpstreamResolver``: it answers route
names from an in-memory :class:`RouteTable` (swapped whole by :meth:`RouteResolver.load`
when the admin API changes routes or services, so a request never reads the database) and
passes every other name to the lifecycle manager's table of ready deployments, so
deployments made without a service keep their names.  A service's own name is not a public
name: its deployments are reached through routes.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Final

from berth.errors import NotFoundError
from berth.routing.errors import NoReadyDeploymentError

if TYPE_CHECKING:
    from berth.routing.resolver import Upstream, UpstreamResolver
    from berth.vocab.records import RouteRecord

#: Seconds a client is told to wait (``Retry-After``) when nothing behind a route is ready
#: and no service reported its own estimate (the lifecycle's loading wait).
ROUTE_RETRY_AFTER_S: Final = 5.0


class UnroutedServiceError(NotFoundError):
    """A request named a service profile that no route of that name serves (404,
    ``model_not_found``): services are reached through routes."""

    def __init__(self, service: str) -> None:
        super().__init__("model", service)
        self.args = (
            f"model {service!r} not found: it is a service, which clients reach through a "
            f"route (berth route create NAME --service {service})",
        )


@dataclass(frozen=True)
class RouteTable:
    """An immutable snapshot of the routes and the service names.

    ``tiers`` maps a route to its targets' service names grouped by priority, highest first
    (names sorted within a tier); ``fallbacks`` maps a route to its fallback route.
    """

    tiers: Mapping[str, tuple[tuple[str, ...], ...]] = field(default_factory=dict)
    fallbacks: Mapping[str, str | None] = field(default_factory=dict)
    services: frozenset[str] = frozenset()

    @classmethod
    def build(cls, routes: Iterable[RouteRecord], services: Iterable[str]) -> RouteTable:
        """The table of ``routes`` (as the store returns them) and the service names."""
        tiers: dict[str, tuple[tuple[str, ...], ...]] = {}
        fallbacks: dict[str, str | None] = {}
        for route in routes:
            grouped: dict[int, list[str]] = {}
            for target in route.targets:
                grouped.setdefault(target.priority, []).append(target.service)
            tiers[route.name] = tuple(
                tuple(sorted(grouped[priority])) for priority in sorted(grouped, reverse=True)
            )
            fallbacks[route.name] = route.fallback
        return cls(tiers, fallbacks, frozenset(services))

    def chain(self, name: str) -> list[str]:
        """``name`` and the routes it falls back to, in order, each once."""
        walked: list[str] = []
        current: str | None = name
        while current is not None and current in self.tiers and current not in walked:
            walked.append(current)
            current = self.fallbacks.get(current)
        return walked


class RouteResolver:
    """The ``UpstreamResolver`` of the proxy and the router: routes first, then ``direct``
    (the lifecycle manager) for every other name.

    Nothing here blocks or touches the database: call :meth:`load` with the store's routes
    and service names at start-up and after every change.
    """

    def __init__(self, direct: UpstreamResolver, table: RouteTable | None = None) -> None:
        self._direct = direct
        self._table = table or RouteTable()

    @property
    def table(self) -> RouteTable:
        """The routes in force."""
        return self._table

    def load(self, routes: Iterable[RouteRecord], services: Iterable[str]) -> None:
        """Swap in the table of ``routes`` and the service names ``services``."""
        self._table = RouteTable.build(routes, services)

    def candidates(self, model: str) -> list[Upstream]:
        """The deployments that serve ``model`` now (the router ranks them); never empty.

        For a route: the ready deployments of its highest-priority targets that have any
        (equal priorities merged), else its fallback's, and so on; each comes back with
        ``model`` set to the route and ``engine_model`` to the service the engine serves.
        Raises :class:`NoReadyDeploymentError` (503, ``Retry-After``) when nothing behind
        the route is ready, :class:`UnroutedServiceError` (404) for a service's name that is
        not also a route, and for any other name what the lifecycle manager raises
        (:class:`NotFoundError` for a name berth does not know).
        """
        table = self._table
        if model in table.tiers:
            return self._route(table, model)
        if model in table.services:
            raise UnroutedServiceError(model)
        return self._direct.candidates(model)

    def models(self) -> list[str]:
        """Public model names: every route (ready or not: routes are the names promised to
        clients), and the names of ready deployments not made from a service."""
        table = self._table
        direct = (name for name in self._direct.models() if name not in table.services)
        return sorted({*table.tiers, *direct})

    def _route(self, table: RouteTable, name: str) -> list[Upstream]:
        tried: list[str] = []
        retry_after_s: float | None = None
        for route in table.chain(name):
            why_not: list[str] = []
            for tier in table.tiers[route]:
                found: list[Upstream] = []
                for service in tier:
                    try:
                        found.extend(self._direct.candidates(service))
                    except NoReadyDeploymentError as exc:
                        why = str(exc).partition("has no ready deployment")[2].lstrip(": ")
                        why_not.append(f"{service} ({why or 'none ready'})")
                        retry_after_s = min(retry_after_s or exc.retry_after_s, exc.retry_after_s)
                    except NotFoundError:
                        why_not.append(f"{service} (not deployed)")
                if found:
                    return [_as_route(upstream, name) for upstream in found]
            where = "services" if route == name else f"fallback route {route!r}"
            tried.append(f"{where}: {', '.join(why_not)}")
        raise NoReadyDeploymentError(
            name,
            retry_after_s=retry_after_s or ROUTE_RETRY_AFTER_S,
            detail="; ".join(tried),
        )


def _as_route(upstream: Upstream, name: str) -> Upstream:
    """``upstream`` as an answer to a request for the route ``name``."""
    if upstream.model == name:
        return upstream
    return replace(upstream, model=name, engine_model=upstream.engine_model or upstream.model)
