"""What the admin app says about itself: its OpenAPI schema and its ``405`` answers.

- The schema (``/admin/openapi.json``) is FastAPI's, with every error answer described as
  what it is: an OpenAI-shaped JSON body (:class:`berth.api.ErrorBody`), also on the routes
  whose success is text (``/metrics``, an engine's log), where FastAPI would label the
  error with the route's own media type.
- A key's ``tier`` is one of this leader's tiers (the built-in ones and its
  ``[tiers.NAME]``): the schema lists them, as the leader knows them when it starts.
- A ``role`` in a key body is for an admin key only: when a body gives one, its ``tier`` is
  ``admin`` (given, in ``POST /admin/keys``, whose default tier is ``standard``), as the leader
  refuses otherwise (:func:`berth.vocab.roles.role_of_tier`).
- Each operation names the role it needs as ``x-berth-role`` (:mod:`berth.admin.roles`).
- A method a path does not have is answered ``405`` with ``Allow`` listing every method the
  resource has, over all of its routes (RFC 9110, section 15.5.6). Starlette's own answer names
  only the methods of the first route that matched the path, and FastAPI makes one route per
  method.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterator
from typing import Any

from fastapi import FastAPI
from starlette.routing import compile_path

from berth.admin.roles import listed_routes, roles_in_schema

#: Where the error body's schema is in the document.
ERROR_BODY_REF = "#/components/schemas/ErrorBody"
#: The answers that carry an :class:`~berth.api.ErrorBody`.
_ERROR_STATUSES = ("4XX", "5XX")
#: The order ``Allow`` lists methods in.
_METHOD_ORDER = ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS")


def _routes(app: FastAPI) -> Iterator[tuple[str, set[str]]]:
    """Each route's path and methods, through included routers."""
    for route in listed_routes(app):
        path, methods = getattr(route, "path", None), getattr(route, "methods", None)
        if isinstance(path, str) and methods:
            yield path, set(methods)


@functools.lru_cache(maxsize=512)
def _path_regex(path: str) -> re.Pattern[str]:
    return compile_path(path)[0]


def allowed_methods(app: FastAPI, path: str) -> list[str]:
    """The methods of the resource at ``path``: of the routes whose path template matches it
    with the fewest parameters (``/admin/nodes/enroll`` is its own resource, not a node
    named ``enroll``), in a fixed order; empty when no template matches."""
    matched: dict[str, set[str]] = {}
    for template, methods in _routes(app):
        if _path_regex(template).match(path):
            matched.setdefault(template, set()).update(methods)
    if not matched:
        return []
    fewest = min(template.count("{") for template in matched)
    chosen = set().union(*(m for t, m in matched.items() if t.count("{") == fewest))
    known = {method: rank for rank, method in enumerate(_METHOD_ORDER)}
    return sorted(chosen, key=lambda m: (known.get(m, len(known)), m))


def _errors_as_json(document: dict[str, Any]) -> None:
    """Every operation's error answers in ``document`` described as JSON error bodies."""
    for operations in document.get("paths", {}).values():
        for operation in operations.values():
            responses = operation.get("responses", {})
            for status in _ERROR_STATUSES:
                if status in responses:
                    responses[status]["content"] = {
                        "application/json": {"schema": {"$ref": ERROR_BODY_REF}}
                    }


def _tiers_listed(document: dict[str, Any], tiers: list[str]) -> None:
    """The ``tier`` of the key bodies in ``document`` as an enum of ``tiers``."""
    schemas = document.get("components", {}).get("schemas", {})
    listed = {"type": "string", "enum": tiers}
    for name in ("KeyIn", "KeyChangeIn"):
        properties = schemas.get(name, {}).get("properties", {})
        if "tier" in properties:
            described = {k: v for k, v in properties["tier"].items() if k in ("title", "default")}
            nullable = name == "KeyChangeIn"
            shape = {"anyOf": [listed, {"type": "null"}]} if nullable else dict(listed)
            properties["tier"] = {**described, **shape}


#: When a new key's body gives a ``role``: it gives the ``admin`` tier.
_ROLE_NEEDS_ADMIN_TIER: dict[str, Any] = {
    "if": {"required": ["role"], "properties": {"role": {"type": "string"}}},
    "then": {"required": ["tier"], "properties": {"tier": {"const": "admin"}}},
}


def _role_for_admin_keys(document: dict[str, Any]) -> None:
    """The rule of :func:`berth.vocab.roles.role_of_tier` in the key bodies of ``document``: a new
    key with a role names the ``admin`` tier (its default is ``standard``); a change giving
    both a role and a tier names ``admin``."""
    schemas = document.get("components", {}).get("schemas", {})
    if "KeyIn" in schemas:
        schemas["KeyIn"].update(_ROLE_NEEDS_ADMIN_TIER)
    if "KeyChangeIn" in schemas:  # a null tier leaves the key's own
        schemas["KeyChangeIn"]["if"] = _ROLE_NEEDS_ADMIN_TIER["if"]
        schemas["KeyChangeIn"]["then"] = {"properties": {"tier": {"enum": ["admin", None]}}}


def install_schema(app: FastAPI, *, tiers: list[str]) -> None:
    """Make ``app.openapi()`` return FastAPI's schema with the changes of the module doc
    (built once, on first use); ``tiers`` are the leader's tier names."""
    build = app.openapi

    def schema() -> dict[str, Any]:
        if app.openapi_schema is None:
            document = build()
            _errors_as_json(document)
            _tiers_listed(document, tiers)
            _role_for_admin_keys(document)
            roles_in_schema(app, document)
            app.openapi_schema = document
        return app.openapi_schema

    app.openapi = schema  # type: ignore[method-assign]
