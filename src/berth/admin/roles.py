"""Who may call which admin route: each route declares the role it needs beside its path.

    @router.post("/admin/deployments", dependencies=[needs(Role.OPERATOR)])

:func:`needs` is a FastAPI dependency that refuses a key whose role is lower with a 403
(:class:`~berth.errors.RoleError`, OpenAI-shaped, naming the role needed and the key's).
Routes open to any caller (``/healthz``, ``/metrics``, the console's sign-in) declare
:data:`OPEN`, so that "no declaration" is never mistaken for "open":
:func:`check_roles_declared` refuses to build an app with an undeclared route, and the schema
names each operation's role as ``x-berth-role``.

The key comes from the leader's listener (:mod:`berth.daemon.app`), which puts what it
authenticated in the request's ASGI state under :data:`KEY_STATE`: an
:class:`~berth.store.ApiKeyRecord` over TCP (its ``role``), a
:class:`~berth.admission.SocketCaller` over the Unix socket (the host's root user: ``admin``),
or :data:`NO_KEY` on a path it let through without one. An app served without that listener
(the in-process tests) has no key in its state and is trusted like the socket.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any, Final

from fastapi import Depends, FastAPI, Request

from berth.errors import AuthError, RoleError
from berth.vocab.records import ApiKeyRecord
from berth.vocab.roles import Role, Tier

#: The key of :attr:`starlette.requests.Request.state` that holds the caller.
KEY_STATE: Final = "berth_caller"
#: The caller of a request the listener let through without a key.
NO_KEY: Final = "no-key"
#: The schema's name for an operation's role.
SCHEMA_FIELD: Final = "x-berth-role"
#: What :data:`OPEN` routes show as their role in the schema.
OPEN_ROLE: Final = "none"


class RoleNeeded:
    """The dependency :func:`needs` declares: ``role`` ``None`` is :data:`OPEN`."""

    def __init__(self, role: Role | None) -> None:
        self.role = role

    async def __call__(self, request: Request) -> None:
        if self.role is not None:
            require_role(request, self.role)

    def __repr__(self) -> str:
        return f"needs({OPEN_ROLE if self.role is None else self.role.value})"


def needs(role: Role | None) -> Any:
    """The dependency a route lists to need ``role`` (``None``: open to any caller)."""
    return Depends(RoleNeeded(role))


#: The declaration of a route any caller may use (its own checks, if any, apply).
OPEN: Final = needs(None)


def caller_role(request: Request) -> Role | None:
    """The role of whoever sent ``request`` (see the module doc): ``None`` for a caller with
    none (no key, or a key outside the admin tier)."""
    caller = request.scope.get("state", {}).get(KEY_STATE, Role.ADMIN)
    if isinstance(caller, ApiKeyRecord):
        if caller.tier != Tier.ADMIN:
            return None
        return caller.role or Role.ADMIN
    if caller == NO_KEY:
        return None
    return Role.ADMIN  # the Unix socket's callers, or an app served without the listener


def require_role(request: Request, role: Role, doing: str = "this endpoint") -> None:
    """Raise :class:`~berth.errors.RoleError` (403) unless the caller's role allows
    ``role``; ``doing`` names what is refused (``"creating an admin key"``)."""
    held = caller_role(request)
    if held is None:
        raise AuthError(f"{doing} needs an admin key", status=403)
    if held.allows(role):
        return
    caller = request.scope.get("state", {}).get(KEY_STATE)
    named = f"key {caller.name!r}" if isinstance(caller, ApiKeyRecord) else "this caller"
    raise RoleError(
        f"{doing} needs the {role.value} role; {named} has the {held.value} role",
        needed=role,
        held=held,
    )


def declared_role(route: Any) -> RoleNeeded | None:
    """The role ``route`` declares (its :class:`RoleNeeded` dependency), or ``None``."""
    for dependency in getattr(route, "dependencies", None) or ():
        call = getattr(dependency, "dependency", None)
        if isinstance(call, RoleNeeded):
            return call
    return None


def listed_routes(app: FastAPI) -> Iterable[Any]:
    """Every route of ``app``, through its included routers (FastAPI 0.120 and later keep
    them behind ``iter_route_contexts``; earlier ones list them in ``app.routes``)."""
    try:
        from fastapi.routing import iter_route_contexts
    except ImportError:  # FastAPI before 0.120
        return app.routes
    return iter_route_contexts(app.routes)


def api_routes(app: FastAPI) -> Iterator[Any]:
    """Each route of ``app`` that FastAPI runs (not the schema's own)."""
    for route in listed_routes(app):
        if getattr(route, "dependencies", None) is not None and getattr(route, "methods", None):
            yield route


def check_roles_declared(app: FastAPI) -> None:
    """Raise ``RuntimeError`` naming every route of ``app`` that declares no role: a route
    added without one must not be served (it would be open to a ``viewer``)."""
    missing = sorted(
        f"{' '.join(sorted(route.methods))} {route.path}"
        for route in api_routes(app)
        if declared_role(route) is None
    )
    if missing:
        raise RuntimeError(
            "admin routes without a declared role (add dependencies=[needs(Role.X)]): "
            + ", ".join(missing)
        )


def roles_in_schema(app: FastAPI, document: dict[str, Any]) -> None:
    """Name each operation's role in ``document`` (``x-berth-role``: ``viewer``,
    ``operator``, ``admin``, or ``none`` for an open route); undeclared ones get nothing."""
    paths = document.get("paths", {})
    for route in api_routes(app):
        declared = declared_role(route)
        operations = paths.get(getattr(route, "path_format", route.path), {})
        if declared is None:
            continue
        shown = OPEN_ROLE if declared.role is None else declared.role.value
        for method in route.methods:
            operation = operations.get(method.lower())
            if operation is not None:
                operation[SCHEMA_FIELD] = shown
