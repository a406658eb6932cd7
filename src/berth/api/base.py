"""What every admin API model shares: the base class, timestamps, the error body.

The admin API (``daemon/admin*.py``) answers with these models and the daemon client
(``api/client.py``, used by the CLI and doctor) decodes its answers with the same ones, so
the two cannot drift apart and FastAPI's OpenAPI schema (``/admin/openapi.json``) describes
what is really sent.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Annotated, TypeVar, get_args

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PlainSerializer,
    ValidationInfo,
    WithJsonSchema,
    field_validator,
)

from berth.vocab.engines import ENGINE_NAMES, RUNTIME_NAMES
from berth.vocab.images import IMAGE_REFERENCE_PATTERN

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


def _holds_lone_surrogate(value: object) -> bool:
    """Whether ``value`` (decoded JSON) holds text that is not valid Unicode: a lone UTF-16
    surrogate such as ``"\\ud800"``, which JSON may spell but UTF-8 cannot encode."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return True
        return False
    if isinstance(value, dict):
        return any(_holds_lone_surrogate(k) or _holds_lone_surrogate(v) for k, v in value.items())
    if isinstance(value, list):
        return any(_holds_lone_surrogate(item) for item in value)
    return False


def _whole_numbers_only(annotation: object) -> bool:
    """Whether a field of type ``annotation`` takes ``int`` (alone, optional, or in a list)
    and no ``float``."""
    found: set[type] = set()
    pending = [annotation]
    while pending:
        item = pending.pop()
        if item in (int, float):
            found.add(item)
        pending.extend(get_args(item))
    return found == {int}


def _integral_floats_as_ints(value: object) -> object:
    """``value`` with each float that is a whole number (``5.0``, as JSON may spell 5) made
    an ``int``, at the top or in a list; other values as they are (``True`` stays a bool,
    which a strict integer refuses)."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, list):
        return [_integral_floats_as_ints(item) for item in value]
    return value


class ApiInput(ApiModel):
    """Base of every admin API request body: a field it does not have is refused (400, naming
    the field), not ignored, so that a misspelt limit or setting is never dropped silently;
    text that is not valid Unicode (a lone surrogate) is refused in every field, before it
    can reach the store, a log or an engine's arguments. Patterns are Python's ``re`` (name
    patterns look ahead, which the schema's ECMA-262 dialect has too). Types are strict, as
    the schema states them: ``"5"`` or ``true`` is not a number, ``1`` or ``"yes"`` not a
    boolean; a whole number written as a float (``5.0``) is an integer, as in JSON Schema."""

    model_config = ConfigDict(frozen=True, extra="forbid", regex_engine="python-re", strict=True)

    @field_validator("*", mode="before")
    @classmethod
    def _checked_at_the_edge(cls, value: object, info: ValidationInfo) -> object:
        if _holds_lone_surrogate(value):
            raise ValueError("text must be valid Unicode (a lone surrogate such as \\ud800 is not)")
        field = cls.model_fields.get(info.field_name or "")
        if field is not None and _whole_numbers_only(field.annotation):
            return _integral_floats_as_ints(value)
        return value


def _isoformat(value: datetime) -> str:
    return value.isoformat()


#: A point in time, sent as :meth:`datetime.isoformat` writes it (``+00:00`` for UTC, where
#: pydantic's own JSON would write ``Z``): the admin API's timestamps always looked so.
Timestamp = Annotated[
    datetime,
    PlainSerializer(_isoformat, return_type=str, when_used="json"),
    WithJsonSchema({"type": "string", "format": "date-time"}),
]


def _aware_and_in_range(value: datetime) -> datetime:
    """``value`` checked: it carries a time zone, and it is a time in UTC too (``9999-12-31
    T23:59:59-14:00`` is not: it is past year 9999 there)."""
    if value.tzinfo is None:
        raise ValueError("must carry a time zone (e.g. 2027-01-01T00:00:00+00:00)")
    try:
        value.astimezone(UTC)
    except OverflowError:
        raise ValueError("is out of range: a time in UTC is in year 1 to 9999") from None
    return value


#: An ISO 8601 time with its offset, as the schema states it (``format: date-time`` too).
_TIMESTAMP_PATTERN = r"^[0-9]{4}-.*(Z|z|[+-][0-9]{2}:[0-9]{2})$"


def _iso_text(value: object) -> object:
    """``value`` when it is ISO 8601 text (or a ``datetime``, from the CLI in-process): not a
    number of seconds, which pydantic would read as a Unix time."""
    if isinstance(value, datetime):
        return value
    if not isinstance(value, str) or not re.match(_TIMESTAMP_PATTERN, value):
        raise ValueError("must be an ISO 8601 time with its offset (2027-01-01T00:00:00+00:00)")
    return value


#: A point in time a request gives (an expiry): ISO 8601 text with its offset, in years 1
#: to 9999 in UTC as well as where it was written.
TimestampIn = Annotated[
    datetime,
    Field(strict=False),  # parsed from its text, as JSON carries it
    BeforeValidator(_iso_text),
    AfterValidator(_aware_and_in_range),
    WithJsonSchema(
        {
            "type": "string",
            "format": "date-time",
            "pattern": _TIMESTAMP_PATTERN,
            "examples": ["2027-01-01T00:00:00+00:00"],
        }
    ),
]

#: The largest GPU index a request may name (NVML numbers a host's devices from 0).
MAX_GPU_INDEX = 1023
#: The most GPUs a request may name.
MAX_GPUS = 64
#: A GPU index in a request: a whole number 0 to :data:`MAX_GPU_INDEX`, never ``false``
#: or ``true`` (which Python would read as 0 and 1).
GpuIndex = Annotated[int, Field(strict=True, ge=0, le=MAX_GPU_INDEX)]
#: The longest context a request may ask for, in tokens: 2^31 - 1, what every engine's own
#: integer (llama.cpp's ``n_ctx`` is 32 bits) and the store's column hold. Far above any
#: model's trained context (10M tokens), so a large one is refused by the VRAM estimate,
#: with its reason; 2^63 overflowed the store and 10^12 was launched (issue 38).
MAX_CTX_TOKENS = 2**31 - 1
#: A context length in a request: a whole number of tokens, 1 to :data:`MAX_CTX_TOKENS`.
CtxTokens = Annotated[int, Field(strict=True, gt=0, le=MAX_CTX_TOKENS)]
#: The most and the longest engine arguments a request may give.
MAX_EXTRA_ARGS = 256
MAX_EXTRA_ARG_CHARS = 4096
#: One engine argument: text without NUL (no program argument can hold one).
ExtraArg = Annotated[str, Field(max_length=MAX_EXTRA_ARG_CHARS, pattern=r"^[^\x00]*$")]


#: A container image reference (``vllm/vllm-openai:v0.9.2``): the schema states Docker's
#: grammar (:data:`berth.vocab.images.IMAGE_REFERENCE_PATTERN`); the leader checks it where
#: the image is used, in words that name the form.
DockerImage = Annotated[
    str,
    Field(min_length=1, max_length=512),
    WithJsonSchema(
        {
            "type": "string",
            "minLength": 1,
            "maxLength": 512,
            "pattern": f"^{IMAGE_REFERENCE_PATTERN}$",
            "examples": ["vllm/vllm-openai:v0.9.2"],
        }
    ),
]
#: The most LoRA slots a deployment may ask for (a 32-bit count, as the engines read it).
MAX_ADAPTER_SLOTS = 2**31 - 1


#: An engine's name in a request: ``llamacpp``, ``vllm`` or ``sglang``. Checked where it is
#: used (any case, blanks around: :func:`berth.runtime.engines.parse_engine_name`, whose
#: refusal names the valid ones); the schema lists them.
EngineIn = Annotated[str, WithJsonSchema({"type": "string", "enum": list(ENGINE_NAMES)})]
#: A runtime's name in a request: ``process`` or ``docker``, checked like :data:`EngineIn`.
RuntimeIn = Annotated[str, WithJsonSchema({"type": "string", "enum": list(RUNTIME_NAMES)})]


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

#: Where FastAPI says a field of a request was (the first part of its location).
_LOCATIONS = ("body", "query", "path", "header", "cookie")

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
    not a valid name: …"`` and ``"name"``.  The request part a location starts with
    (``body``, ``query``, ``path``) is left out; ``param`` is ``None`` where the error has
    no location.  A value that does not match a :func:`named_pattern` is described in that
    pattern's words, and pydantic's ``Value error, `` before a validator's own message is
    dropped."""
    location = error.get("loc", ())
    parts = location if isinstance(location, tuple | list) else ()
    # The request part a field is in (``body``, ``query``, ``path``) is left out.
    if parts and parts[0] in _LOCATIONS:
        parts = parts[1:]
    where = ".".join(str(part) for part in parts)
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


#: An absolute path on a node's host: it starts with ``/``, holds no NUL (no file name
#: can), each of its names is at most 255 characters (Linux's ``NAME_MAX``) and the whole
#: at most 4096 (``PATH_MAX``).
ABSOLUTE_PATH_PATTERN = named_pattern(
    r"^(/[^/\x00]{0,255})+$",
    "an absolute path (starting with '/', without NUL, each name at most 255 characters)",
)
AbsolutePath = Annotated[str, Field(min_length=1, max_length=4096, pattern=ABSOLUTE_PATH_PATTERN)]
