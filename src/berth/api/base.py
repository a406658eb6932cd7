"""What every admin API model shares: the base class, timestamps, the error body.

The admin API (``daemon/admin*.py``) answers with these models and the daemon client
(``api/client.py``, used by the CLI and doctor) decodes its answers with the same ones, so
the two cannot drift apart and FastAPI's OpenAPI schema (``/admin/openapi.json``) describes
what is really sent.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime
from typing import Annotated, TypeVar

from pydantic import BaseModel, ConfigDict, PlainSerializer, WithJsonSchema

_Extended = TypeVar("_Extended", bound="ApiModel")


class ApiModel(BaseModel):
    """Base of every admin API body: immutable values.

    Unknown fields are ignored when decoding, so a CLI reads the answers of a newer daemon
    that added fields.  (Not ``defer_build``: FastAPI wraps body models in ``Annotated``
    type adapters, which then cannot find the deferred schema.)
    """

    model_config = ConfigDict(frozen=True)

    def extended(self, model: type[_Extended], **fields: object) -> _Extended:
        """This body as ``model``, a subclass that adds ``fields`` (validated like any input:
        a missing or mistyped field raises pydantic's ``ValidationError``)."""
        return model.model_validate({**dict(self), **fields})


def _isoformat(value: datetime) -> str:
    return value.isoformat()


#: A point in time, sent as :meth:`datetime.isoformat` writes it (``+00:00`` for UTC, where
#: pydantic's own JSON would write ``Z``): the admin API's timestamps always looked so.
Timestamp = Annotated[
    datetime,
    PlainSerializer(_isoformat, return_type=str, when_used="json"),
    WithJsonSchema({"type": "string", "format": "date-time"}),
]


class ErrorDetail(ApiModel):
    """One error, in the shape the OpenAI API reference documents for errors."""

    message: str
    #: ``invalid_request_error``, ``not_found_error``, ``authentication_error``,
    #: ``permission_error``, ``rate_limit_error``, ``server_error``, ``engine_error``, …
    type: str
    #: The request field at fault, where one is.
    param: str | None = None
    #: A stable machine-readable name, e.g. ``model_not_found``.
    code: str | None = None


class ErrorBody(ApiModel):
    """Every admin API error: ``{"error": {"message", "type", "param", "code"}}``."""

    error: ErrorDetail


def describe_invalid(error: Mapping[str, object]) -> tuple[str, str | None]:
    """A validation error (one of pydantic's ``ValidationError.errors()`` or FastAPI's
    ``RequestValidationError.errors()``) as ``(message, param)``: ``"name: String should
    match pattern …"`` and ``"name"``.  The leading ``body`` of a request body's location is
    left out; ``param`` is ``None`` where the error has no location."""
    location = error.get("loc", ())
    parts = location if isinstance(location, tuple | list) else ()
    where = ".".join(str(part) for part in parts if part != "body")
    text = str(error.get("msg", "invalid request"))
    return (f"{where}: {text}" if where else "invalid request"), (where or None)
