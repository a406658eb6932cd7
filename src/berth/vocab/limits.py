"""What a key may use: its limits (:class:`KeyLimits`) and a key's overrides of its tier's
(:class:`LimitOverrides`), with the one set of rules every input of a limit passes.

A tier (``[tiers.NAME]`` in ``config.toml``, :mod:`berth.config.tiers`) gives a
:class:`KeyLimits`; a key takes its tier's and overrides any of them
(:meth:`LimitOverrides.apply`). Every limit is either a number or ``None``, "no limit":

* ``rpm``: requests per minute; ``tpm``: tokens per minute (prompt + completion);
* ``max_concurrency``: requests in flight at once;
* ``daily_tokens`` / ``monthly_tokens``: tokens per UTC calendar day / month;
* ``models``: the public names (models or routes) the key may ask for.

A number is a whole number from 0 to :data:`MAX_LIMIT`; 0 allows nothing, which pauses a key
without revoking it. Text (a flag, the admin API's ``unlimited``) is read by
:func:`parse_limit`, a model list by :func:`parse_models`; both raise :class:`ConfigError`
with the reason.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, fields, replace
from typing import Final, Literal, TypedDict, get_args

from berth.errors import ConfigError

#: A numeric limit's name, as ``config.toml``, the admin API and the CLI spell it.
NumericLimit = Literal["rpm", "tpm", "max_concurrency", "daily_tokens", "monthly_tokens"]
#: Every limit's name.
LimitName = Literal["rpm", "tpm", "max_concurrency", "daily_tokens", "monthly_tokens", "models"]
NUMERIC_LIMITS: Final[tuple[NumericLimit, ...]] = get_args(NumericLimit)
LIMIT_NAMES: Final[tuple[LimitName, ...]] = get_args(LimitName)

#: The largest number a limit may be (10^15: far beyond any real budget, well inside int64).
MAX_LIMIT: Final = 10**15
#: What a number limit is set to, as text, to mean "no limit".
UNLIMITED_WORD: Final = "unlimited"
#: What ``models`` is set to, as text, to mean "every model".
ANY_MODEL_WORD: Final = "*"
#: Longest model or route name a list may hold, in characters (the store's name columns).
MAX_MODEL_NAME_CHARS: Final = 255

_SUFFIXES: Final = {"k": 10**3, "m": 10**6, "g": 10**9}


class Inherit(enum.Enum):
    """Type of :data:`INHERIT`, "take the tier's value"."""

    INHERIT = enum.auto()


#: An override that is not set: the key takes its tier's value.
INHERIT: Final = Inherit.INHERIT


def numeric_limit(name: str) -> NumericLimit | None:
    """``name`` as a :data:`NumericLimit` when it is one (exactly as spelt), else ``None``."""
    for known in NUMERIC_LIMITS:
        if name == known:
            return known
    return None


class LimitFields(TypedDict, total=False):
    """Some of a key's limits by name: keyword arguments of :class:`KeyLimits` (``None``: no
    limit)."""

    rpm: int | None
    tpm: int | None
    max_concurrency: int | None
    daily_tokens: int | None
    monthly_tokens: int | None
    models: frozenset[str] | None


class OverrideFields(TypedDict, total=False):
    """Some of a key's overrides by name: keyword arguments of :class:`LimitOverrides`
    (:data:`INHERIT`: the tier's)."""

    rpm: int | Inherit | None
    tpm: int | Inherit | None
    max_concurrency: int | Inherit | None
    daily_tokens: int | Inherit | None
    monthly_tokens: int | Inherit | None
    models: frozenset[str] | Inherit | None


@dataclass(frozen=True, slots=True)
class KeyLimits:
    """One set of limits (a tier's, or a key's after its overrides); ``None``: no limit."""

    rpm: int | None = None
    tpm: int | None = None
    max_concurrency: int | None = None
    daily_tokens: int | None = None
    monthly_tokens: int | None = None
    models: frozenset[str] | None = None

    @property
    def unlimited(self) -> bool:
        """Whether none of the limits is set."""
        return all(getattr(self, f.name) is None for f in fields(self))


@dataclass(frozen=True, slots=True)
class LimitOverrides:
    """A key's own values, each replacing its tier's; :data:`INHERIT` leaves the tier's.

    In JSON (the store, the admin API) an override is a number, ``null`` for "no limit", or a
    list of names for ``models``; an absent name inherits (:meth:`to_json`,
    :meth:`from_json`).
    """

    rpm: int | Inherit | None = INHERIT
    tpm: int | Inherit | None = INHERIT
    max_concurrency: int | Inherit | None = INHERIT
    daily_tokens: int | Inherit | None = INHERIT
    monthly_tokens: int | Inherit | None = INHERIT
    models: frozenset[str] | Inherit | None = INHERIT

    def apply(self, base: KeyLimits) -> KeyLimits:
        """``base`` with every override that is set put in."""
        changes = self.set_fields()
        return replace(base, **changes) if changes else base

    def overridden(self) -> tuple[LimitName, ...]:
        """The names this key sets itself, in :data:`LIMIT_NAMES` order."""
        return tuple(name for name in LIMIT_NAMES if name in self.set_fields())

    def updated(self, changes: LimitOverrides, clear: Iterable[LimitName] = ()) -> LimitOverrides:
        """These overrides with each one ``changes`` sets replaced, then ``clear`` inherited."""
        merged = replace(self, **changes.set_fields())
        cleared = {name: INHERIT for name in clear}
        return replace(merged, **cleared) if cleared else merged

    def to_json(self) -> dict[str, object]:
        """The set overrides as JSON values (``models`` sorted)."""
        out: dict[str, object] = {}
        for name, value in self.set_fields().items():
            out[name] = sorted(value) if isinstance(value, frozenset) else value
        return out

    @classmethod
    def from_json(cls, data: Mapping[str, object] | None, *, where: str) -> LimitOverrides:
        """Read what :meth:`to_json` wrote (``None``: no overrides); :class:`ConfigError`
        starting with ``where`` for an unknown name or a value :func:`check_limit` or
        :func:`check_models` refuses."""
        if not data:
            return cls()
        values: OverrideFields = {}
        for name, raw in data.items():
            numeric = numeric_limit(name)
            if name == "models":
                values["models"] = None if raw is None else check_models(raw, where=where)
            elif numeric is not None:
                values[numeric] = None if raw is None else check_limit(name, raw, where=where)
            else:
                raise ConfigError(f"{where}: unknown limit {name!r}; limits: {_names()}")
        return cls(**values)

    def set_fields(self) -> LimitFields:
        """The overrides this key sets, by name, in :data:`LIMIT_NAMES` order."""
        fields: LimitFields = {}
        for name in NUMERIC_LIMITS:
            value: int | Inherit | None = getattr(self, name)
            if not isinstance(value, Inherit):
                fields[name] = value
        if not isinstance(self.models, Inherit):
            fields["models"] = self.models
        return fields


def _names() -> str:
    return ", ".join(LIMIT_NAMES)


def parse_limit_name(text: str) -> LimitName:
    """``text`` as a limit's name (``-`` read as ``_``); :class:`ConfigError` listing them."""
    name = text.strip().lower().replace("-", "_")
    for known in LIMIT_NAMES:
        if name == known:
            return known
    raise ConfigError(f"unknown limit {text!r}; limits: {_names()}")


def check_limit(name: str, value: object, *, where: str) -> int:
    """``value`` if it is a whole number from 0 to :data:`MAX_LIMIT`; else
    :class:`ConfigError` ``"{where}: {name} must be ..."`` (``True`` is not a number here)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{where}: {name} must be a whole number, got {value!r}")
    if value < 0:
        raise ConfigError(f"{where}: {name} must not be negative, got {value}")
    if value > MAX_LIMIT:
        raise ConfigError(f"{where}: {name} must be at most {MAX_LIMIT}, got {value}")
    return value


def parse_limit(name: str, text: str, *, where: str | None = None) -> int | None:
    """A number limit typed by a user: a whole number, optionally with ``k`` (10^3), ``m``
    (10^6) or ``g`` (10^9) after it (``200k``), or ``unlimited`` (``None``).

    ``where`` starts the error message (default the ``--flag`` of ``name``). Raises
    :class:`ConfigError` for anything else, a negative number, or one over :data:`MAX_LIMIT`.
    """
    where = where or "--" + name.replace("_", "-")
    word = text.strip().lower()
    if word == UNLIMITED_WORD:
        return None
    factor = 1
    if word and word[-1] in _SUFFIXES:
        factor = _SUFFIXES[word[-1]]
        word = word[:-1]
    digits = word.removeprefix("-")
    if not digits.isascii() or not digits.isdigit():
        raise ConfigError(
            f"{where}: {name} must be a whole number (e.g. 600 or 200k) or "
            f"{UNLIMITED_WORD!r}, got {text!r}"
        )
    return check_limit(name, int(word) * factor, where=where)


def check_models(value: object, *, where: str) -> frozenset[str]:
    """A list of model or route names: non-empty printable names without edge spaces or
    commas, at most :data:`MAX_MODEL_NAME_CHARS` characters; :class:`ConfigError` otherwise.
    An empty list is refused: it would allow nothing (use 0 for ``rpm`` to pause a key)."""
    if isinstance(value, str) or not isinstance(value, list | tuple | frozenset | set):
        raise ConfigError(f"{where}: models must be a list of model names, got {value!r}")
    names: set[str] = set()
    for item in value:
        if not isinstance(item, str):
            raise ConfigError(f"{where}: models must be a list of model names, got {item!r}")
        if not item or item != item.strip() or "," in item or not item.isprintable():
            raise ConfigError(f"{where}: invalid model name {item!r} in models")
        if len(item) > MAX_MODEL_NAME_CHARS:
            raise ConfigError(f"{where}: model name {item[:40]!r}… is too long")
        names.add(item)
    if not names:
        raise ConfigError(f"{where}: models must name at least one model ({ANY_MODEL_WORD!r}: any)")
    return frozenset(names)


def parse_models(text: str, *, where: str = "--models") -> frozenset[str] | None:
    """A comma-separated list of model or route names typed by a user (``a,b``), or ``*`` for
    every model (``None``); :class:`ConfigError` for an empty or invalid name."""
    if text.strip() == ANY_MODEL_WORD:
        return None
    return check_models([part.strip() for part in text.split(",")], where=where)


def describe_limit(value: int | frozenset[str] | None) -> str:
    """A limit as ``berth key ls`` shows it: the number, the names, or ``-`` for none."""
    if value is None:
        return "-"
    if isinstance(value, frozenset):
        return ",".join(sorted(value))
    return f"{value:,}"
