"""Key tiers: ``[tiers.NAME]`` tables of ``config.toml``, with ``admin``, ``standard`` and
``desk`` (the desk worker's jobs, :data:`DESK_TIER`) built in.

A tier names a set of limits (:class:`berth.vocab.limits.KeyLimits`) every key of the tier takes
unless the key overrides them, and a ``priority``: where the tier's requests stand in the
leader's admission queue (higher first)::

    [tiers.free]
    priority = 10
    rpm = 3                     # requests per minute
    tpm = "20k"                 # tokens per minute (prompt + completion)
    max_concurrency = 2         # requests in flight at once
    daily_tokens = 100000       # tokens per UTC calendar day
    monthly_tokens = "2m"       # tokens per UTC calendar month
    models = ["smollm2"]        # the models or routes its keys may use (absent: any)

A number may be written as text with ``k``/``m``/``g`` after it, or as ``"unlimited"``; an
absent limit is no limit. ``[tiers.admin]``, ``[tiers.standard]`` and ``[tiers.desk]`` may
be given to set limits or a priority on the built-in tiers. Only ``admin`` keys reach
``/admin/*``.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from berth.config_toml import locate_line, parse_toml
from berth.errors import ConfigError
from berth.vocab.limits import (
    LIMIT_NAMES,
    KeyLimits,
    LimitFields,
    check_models,
    numeric_limit,
    parse_limit,
)
from berth.vocab.roles import Tier, parse_tier

#: The section of ``config.toml`` holding the tiers.
TIERS_SECTION = "tiers"
#: Priorities run from 0 to this (higher first).
MAX_PRIORITY = 1000
#: The tier ``berth desk serve``'s jobs run under unless the ``desk_tier`` setting names
#: another: built in, below ``standard``, so a key's waiting request goes before a
#: marketplace job's (``[tiers.desk]`` may give it limits or another priority).
DESK_TIER = "desk"
#: The built-in tiers' priorities: admin keys' requests go first, desk jobs after keys'.
BUILTIN_PRIORITIES: Mapping[str, int] = {
    Tier.ADMIN.value: 100,
    Tier.STANDARD.value: 50,
    DESK_TIER: 40,
}


@dataclass(frozen=True)
class TierDef:
    """One tier: its ``name``, admission ``priority`` (0-:data:`MAX_PRIORITY`, higher first)
    and the ``limits`` its keys take."""

    name: str
    priority: int
    limits: KeyLimits = field(default_factory=KeyLimits)


class TierTable(Mapping[str, TierDef]):
    """Every tier a leader knows, by name: the built-in three and those of ``config.toml``."""

    def __init__(self, tiers: Mapping[str, TierDef] | None = None) -> None:
        table = {name: TierDef(name, p) for name, p in BUILTIN_PRIORITIES.items()}
        table.update(tiers or {})
        self._tiers = dict(sorted(table.items(), key=lambda item: (-item[1].priority, item[0])))

    def __getitem__(self, name: str) -> TierDef:
        return self._tiers[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._tiers)

    def __len__(self) -> int:
        return len(self._tiers)

    def require(self, text: str) -> TierDef:
        """The tier ``text`` names (see :func:`berth.vocab.roles.parse_tier`); :class:`ConfigError`
        when the name is invalid or no tier has it (listing the tiers)."""
        name = parse_tier(text)
        found = self._tiers.get(name)
        if found is None:
            raise ConfigError(
                f"unknown tier {text.strip()!r}; tiers: {', '.join(self._tiers)} "
                f"(define others as [{TIERS_SECTION}.NAME] in config.toml)"
            )
        return found


def read_tiers(path: Path) -> TierTable:
    """The tiers of ``config.toml`` at ``path`` (a missing file: the built-in three).

    Raises :class:`ConfigError` with the file and line for a TOML syntax error, a
    ``[tiers]`` entry that is not a table, an invalid tier name, an unknown key in a tier,
    a priority that is not a whole number from 0 to :data:`MAX_PRIORITY`, or a limit that is
    negative, not a whole number, or (``models``) not a list of names.
    """
    document, text = parse_toml(path)
    section = document.get(TIERS_SECTION)
    if section is None:
        return TierTable()
    if not isinstance(section, dict):
        line = locate_line(text, None, TIERS_SECTION)
        raise ConfigError(
            f"{TIERS_SECTION} must be a table of tiers ([{TIERS_SECTION}.NAME])",
            path=path,
            line=line,
        )
    tiers: dict[str, TierDef] = {}
    for name, table in section.items():
        header = f"{TIERS_SECTION}.{name}"
        line = locate_line(text, header, None) or locate_line(text, TIERS_SECTION, name)
        if not isinstance(table, dict):
            raise ConfigError(
                f"{header} must be a table ([{header}]), got {table!r}", path=path, line=line
            )
        try:
            tier_name = parse_tier(name)
        except ConfigError as exc:
            raise ConfigError(str(exc), path=path, line=line) from None
        if tier_name != name:
            raise ConfigError(
                f"tier names are lower case: write [{TIERS_SECTION}.{tier_name}]",
                path=path,
                line=line,
            )
        tiers[name] = _read_tier(name, table, text, path)
    return TierTable(tiers)


def _read_tier(name: str, table: Mapping[str, object], text: str, path: Path) -> TierDef:
    header = f"{TIERS_SECTION}.{name}"
    priority = BUILTIN_PRIORITIES.get(name, 0)
    limits: LimitFields = {}
    for key, raw in table.items():
        line = locate_line(text, header, key)
        where = f"[{header}]"
        numeric = numeric_limit(key)
        try:
            if key == "priority":
                priority = _priority(raw, where)
            elif key == "models":
                limits["models"] = check_models(raw, where=where)
            elif numeric is not None:
                limits[numeric] = _limit(key, raw, where)
            else:
                valid = ", ".join(("priority", *LIMIT_NAMES))
                raise ConfigError(f"{where}: unknown key {key!r}; valid keys: {valid}")
        except ConfigError as exc:
            raise ConfigError(str(exc), path=path, line=line) from None
    return TierDef(name, priority, KeyLimits(**limits))


def _priority(raw: object, where: str) -> int:
    if isinstance(raw, bool) or not isinstance(raw, int) or not 0 <= raw <= MAX_PRIORITY:
        raise ConfigError(
            f"{where}: priority must be a whole number from 0 to {MAX_PRIORITY}, got {raw!r}"
        )
    return raw


def _limit(name: str, raw: object, where: str) -> int | None:
    if isinstance(raw, str):
        return parse_limit(name, raw, where=where)
    if isinstance(raw, bool) or not isinstance(raw, int):
        raise ConfigError(f"{where}: {name} must be a whole number, got {raw!r}")
    return parse_limit(name, str(raw), where=where)
