"""The admin API's FastAPI app (``/admin/*`` and the plain endpoints): its routers, its
errors in the OpenAI shape, its schema.

The routers are one module per area: the leader's own state (:mod:`.status`), models
(:mod:`.models`), deployments (:mod:`.deployments`), keys and usage (:mod:`.keys`), nodes
(:mod:`.nodes`), the CA (:mod:`.ca`), metrics (:mod:`.metrics`), routing (:mod:`.routing`),
adapters (:mod:`.adapters`), plans (:mod:`.plans`), pulls from the hub (:mod:`.pulls`),
services and routes (:mod:`.services`) and the console (:mod:`.console`); the schema and the
``Allow`` of a 405 in :mod:`.openapi`.

Served by FastAPI; authentication happens before a request reaches these routes (see
``daemon/app.py``).  Every error is answered in the OpenAI error shape, like ``/v1/*``.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from berth import __version__
from berth.admin.openapi import allowed_methods, install_schema
from berth.api import ErrorBody, describe_invalid
from berth.errors import BerthError
from berth.openai_errors import error_body, error_from_exception

log = logging.getLogger(__name__)

#: Every admin error is an OpenAI-shaped body (``ErrorBody``); FastAPI's own 422 answer is
#: never sent (a bad request body is a 400), so the schema lists the ranges instead.
ERROR_RESPONSES: dict[int | str, dict[str, object]] = {
    "4XX": {
        "model": ErrorBody,
        "description": "refused: bad input (400), unknown name (404), "
        "conflict with current state (409)",
    },
    "5XX": {"model": ErrorBody, "description": "an engine or the leader failed"},
}


def _answer_errors_in_openai_shape(app: FastAPI) -> None:
    """Every error ``app`` answers, in the OpenAI shape: berth's own errors by their status,
    FastAPI's 404/405 as such, and a body that fails validation as a 400 (never a 422)."""

    @app.exception_handler(BerthError)
    async def _berth_error(_request: Request, exc: BerthError) -> Response:
        status, body, headers = error_from_exception(exc)
        return Response(body, status_code=status, headers=headers, media_type="application/json")

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        body = error_body(str(exc.detail), type=kind)
        headers = dict(exc.headers or {})
        if exc.status_code == 405:
            headers["Allow"] = ", ".join(allowed_methods(app, request.url.path))
        return Response(
            body, status_code=exc.status_code, headers=headers, media_type="application/json"
        )

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> Response:
        first = exc.errors()[0] if exc.errors() else {}
        if first.get("type") == "json_invalid":
            body = error_body("request body is not valid JSON", type="invalid_request_error")
            return Response(body, status_code=400, media_type="application/json")
        unread = _unread_body(request, first)
        if unread is not None:
            body = error_body(unread, type="invalid_request_error")
            return Response(body, status_code=400, media_type="application/json")
        message, param = describe_invalid(first)
        body = error_body(message, type="invalid_request_error", param=param)
        return Response(body, status_code=400, media_type="application/json")


def _unread_body(request: Request, error: Mapping[str, object]) -> str | None:
    """What to say when a route's whole body failed validation because FastAPI did not read
    it as JSON: it reads a body as JSON only when its ``content-type`` is JSON's (``/v1``
    reads any body as JSON; here the header keeps the schema's contract)."""
    location = error.get("loc")
    if not isinstance(location, tuple | list) or tuple(location) != ("body",):
        return None
    content_type = request.headers.get("content-type", "")
    if "json" in content_type.lower():
        return None
    sent = f"content-type: {content_type}" if content_type else "no content-type"
    return f"expected content-type: application/json (the request has {sent})"


def build_admin_app(routers: Iterable[APIRouter], *, tiers: Iterable[str]) -> FastAPI:
    """The FastAPI app for everything that is not ``/v1/*``: ``routers`` in the order given
    (the daemon builds each with what it uses: :mod:`berth.daemon.admin_routes`), its errors
    answered in the OpenAI shape, and its schema naming the key ``tiers``.

    Every JSON route declares its answer's model (:mod:`berth.api`), so the schema at
    ``/admin/openapi.json`` (admin key over TCP, like the rest of ``/admin``) describes it.
    """
    app = FastAPI(
        title="berth admin API",
        version=__version__,
        docs_url=None,
        redoc_url=None,
        openapi_url="/admin/openapi.json",
        responses=ERROR_RESPONSES,
    )
    _answer_errors_in_openai_shape(app)
    install_schema(app, tiers=list(tiers))
    for router in routers:
        app.include_router(router)
    return app
