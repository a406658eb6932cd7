"""API keys: ``/admin/keys``.

A key's limits in a request body: a number (0 to :data:`berth.vocab.limits.MAX_LIMIT`) sets the
key's own value, ``null`` sets "no limit" (``models``: any model), and a field left out takes
the tier's (on create) or keeps the key's (on change). ``clear`` names limits that go back
to the tier's.
"""

from __future__ import annotations

from typing import Annotated, Literal, cast

from pydantic import ConfigDict, Field, WithJsonSchema, field_validator

from berth.api.base import ApiInput, ApiModel, Timestamp, TimestampIn
from berth.errors import ConfigError
from berth.keys import MAX_KEY_NAME_CHARS
from berth.vocab.limits import (
    INHERIT,
    MAX_LIMIT,
    MAX_MODEL_NAME_CHARS,
    NUMERIC_LIMITS,
    KeyLimits,
    LimitName,
    LimitOverrides,
    OverrideFields,
    check_models,
)

#: An admin key's role (:class:`berth.vocab.roles.Role`) as the API states it.
RoleName = Literal["viewer", "operator", "admin"]


def role_name(role: str) -> RoleName:
    """``role`` (a :class:`berth.vocab.roles.Role`, already checked) as the API names it."""
    return cast(RoleName, str(role))


#: A limit in a request body: a whole number (never text or a fraction), or ``null``.
LimitIn = Annotated[int, Field(ge=0, le=MAX_LIMIT, strict=True)] | None
#: A name in a key's ``models`` as the schema states it (:func:`berth.vocab.limits.check_models`
#: checks it, printable characters only besides, which JSON Schema has no class for): no
#: comma, no blank at either end, no control character.
_MODEL_ITEM_PATTERN = (
    r"^[^\s,\x00-\x1f\x7f-\x9f](?:[^,\x00-\x1f\x7f-\x9f]*[^\s,\x00-\x1f\x7f-\x9f])?$"
)
#: A key's name as the schema states it (:func:`berth.keys.validate_key_name` checks it,
#: printable characters only besides): no ``/``, no space at either end, no control
#: character.
KEY_NAME_PATTERN = r"^[^ /\x00-\x1f\x7f-\x9f](?:[^/\x00-\x1f\x7f-\x9f]*[^ /\x00-\x1f\x7f-\x9f])?$"
ModelNames = Annotated[
    list[str],
    WithJsonSchema(
        {
            "type": "array",
            "minItems": 1,
            "items": {
                "type": "string",
                "minLength": 1,
                "maxLength": MAX_MODEL_NAME_CHARS,
                "pattern": _MODEL_ITEM_PATTERN,
            },
            "examples": [["llama-3.1-8b", "qwen2.5-7b"], ["*"]],
        }
    ),
]


class _LimitsIn(ApiInput):
    """The limit fields shared by :class:`KeyIn` and :class:`KeyChangeIn`."""

    rpm: LimitIn = None
    tpm: LimitIn = None
    max_concurrency: LimitIn = None
    daily_tokens: LimitIn = None
    monthly_tokens: LimitIn = None
    models: ModelNames | None = None

    @field_validator("models")
    @classmethod
    def _models(cls, value: list[str] | None) -> list[str] | None:
        if value is None:
            return None
        try:
            return sorted(check_models(value, where="models"))
        except ConfigError as exc:  # as a ValueError pydantic reports it like its own checks
            raise ValueError(str(exc).removeprefix("models: ")) from None

    def overrides(self) -> LimitOverrides:
        """The limits this body sets (the fields it gives, ``null`` ones included)."""
        given = self.model_fields_set
        values: OverrideFields = {}
        for name in NUMERIC_LIMITS:
            numeric: int | None = getattr(self, name)
            values[name] = numeric if name in given else INHERIT
        if "models" in given:
            values["models"] = None if self.models is None else frozenset(self.models)
        return LimitOverrides(**values)


class KeyIn(_LimitsIn):
    """``POST /admin/keys``: a key labelled ``name`` in ``tier`` (``admin``, ``standard``
    or one of the leader's ``[tiers.NAME]``, any case), with its own limits and an expiry
    (aware; ``null``: never) when given. ``role`` is for admin keys only (``viewer``,
    ``operator`` or ``admin``; left out: ``admin``)."""

    model_config = ConfigDict(
        json_schema_extra={
            "examples": [
                {
                    "name": "ci-runner",
                    "tier": "standard",
                    "rpm": 60,
                    "models": ["chat"],
                    "expires_at": "2030-01-01T00:00:00+00:00",
                }
            ]
        }
    )

    name: Annotated[
        str,
        Field(min_length=1, max_length=MAX_KEY_NAME_CHARS),
        WithJsonSchema(
            {
                "type": "string",
                "minLength": 1,
                "maxLength": MAX_KEY_NAME_CHARS,
                "pattern": KEY_NAME_PATTERN,
                "examples": ["ci-runner"],
            }
        ),
    ]
    tier: str = "standard"
    expires_at: TimestampIn | None = None
    role: RoleName | None = None


class KeyChangeIn(_LimitsIn):
    """``PATCH /admin/keys/{name or id}``: what to change; fields left out stay as they are.
    ``expires_at: null`` removes the expiry; ``clear`` puts limits back to the tier's;
    ``role`` is an admin key's new role."""

    tier: str | None = None
    role: RoleName | None = None
    expires_at: TimestampIn | None = None
    clear: list[LimitName] = Field(default_factory=list)

    @property
    def changes_expiry(self) -> bool:
        """Whether the body gives ``expires_at`` (``null`` included)."""
        return "expires_at" in self.model_fields_set


class KeyLimitsOut(ApiModel):
    """Limits a key works under (its tier's with its own put in); ``null``: no limit."""

    rpm: int | None = None
    tpm: int | None = None
    max_concurrency: int | None = None
    daily_tokens: int | None = None
    monthly_tokens: int | None = None
    models: list[str] | None = None

    @classmethod
    def of(cls, limits: KeyLimits) -> KeyLimitsOut:
        """The API form of ``limits`` (``models`` sorted)."""
        return cls(
            rpm=limits.rpm,
            tpm=limits.tpm,
            max_concurrency=limits.max_concurrency,
            daily_tokens=limits.daily_tokens,
            monthly_tokens=limits.monthly_tokens,
            models=None if limits.models is None else sorted(limits.models),
        )


class KeyUseOut(ApiModel):
    """What a key uses now: requests in flight, tokens of the UTC day and month so far, and
    what its per-minute limits have left (``null``: no such limit)."""

    in_flight: int = 0
    day_tokens: int = 0
    month_tokens: int = 0
    requests_remaining: int | None = None
    tokens_remaining: int | None = None


class ApiKey(ApiModel):
    """A key's metadata: ``prefix`` is the start of its secret, for recognising it; the
    secret itself is never stored.  ``revoked_at`` is set once revoked; from ``expires_at``
    on it no longer authenticates.  ``limits`` are what it works under, ``overridden`` the
    ones it sets itself (the rest are its tier's), ``use`` what it uses now. ``role`` is
    an admin key's role on the admin API (``null`` for other tiers)."""

    id: str
    name: str
    tier: str
    role: RoleName | None = None
    prefix: str
    created_at: Timestamp
    revoked_at: Timestamp | None
    expires_at: Timestamp | None = None
    limits: KeyLimitsOut = KeyLimitsOut()
    overridden: list[LimitName] = Field(default_factory=list)
    use: KeyUseOut = KeyUseOut()


class CreatedApiKey(ApiKey):
    """``POST /admin/keys`` (201): the new key with its secret, shown this once."""

    secret: str
