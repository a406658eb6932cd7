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
    that added fields; request bodies are :class:`ApiInput`, which refuses them.  (Not
    ``defer_build``: FastAPI wraps body models in ``Annotated`` type adapters, which then
    cannot find the deferred schema.)
    """

    model_config = ConfigDict(frozen=True)

    def extended(self, model: type[_Extended], **fields: object) -> _Extended:
        """This body as ``model``, a subclass that adds ``fields`` (validated like any input:
        a missing or mistyped field raises pydantic's ``ValidationError``)."""
        return model.model_validate({**dict(self), **fields})


class ApiInput(ApiModel):
    """Base of every admin API request body: a field it does not have is refused (400, naming
    the field), not ignored, so that a misspelt limit or setting is never dropped silently."""

    model_config = ConfigDict(frozen=True, extra="forbid")


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


#: What each field pattern means, in words a user reads (pattern → words); see
#: :func:`named_pattern`.
_PATTERN_WORDS: dict[str, str] = {}

#: What pydantic puts before the message of an exception a validator raised
#: (``"Value error, '5 minutes' is not a duration …"``): its name, not the user's concern.
_VALIDATOR_PREFIXES = ("Value error, ", "Assertion failed, ")


def named_pattern(pattern: str, words: str) -> str:
    """``pattern``, remembered with ``words`` (``"a Hugging Face repository id, ORG/NAME"``)
    so that a value that does not match it is refused in those words, not with the
    regular expression."""
    _PATTERN_WORDS[pattern] = words
    return pattern


def describe_invalid(error: Mapping[str, object]) -> tuple[str, str | None]:
    """A validation error (one of pydantic's ``ValidationError.errors()`` or FastAPI's
    ``RequestValidationError.errors()``) as ``(message, param)``: ``"name: 'bad name' is
    not a valid name: …"`` and ``"name"``.  The leading ``body`` of a request body's
    location is left out; ``param`` is ``None`` where the error has no location.  A value
    that does not match a :func:`named_pattern` is described in that pattern's words, and
    pydantic's ``Value error, `` before a validator's own message is dropped."""
    location = error.get("loc", ())
    parts = location if isinstance(location, tuple | list) else ()
    where = ".".join(str(part) for part in parts if part != "body")
    text = str(error.get("msg", "invalid request"))
    for prefix in _VALIDATOR_PREFIXES:
        text = text.removeprefix(prefix)
    context = error.get("ctx")
    if error.get("type") == "extra_forbidden":
        text = "no such field in this request"
    if error.get("type") == "string_pattern_mismatch" and isinstance(context, Mapping):
        words = _PATTERN_WORDS.get(str(context.get("pattern")))
        if words is not None:
            text = f"{error.get('input')!r} is not {words}"
    return (f"{where}: {text}" if where else "invalid request"), (where or None)
