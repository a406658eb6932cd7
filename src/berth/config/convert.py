"""Converting a setting's raw value (text from a flag or the environment, or a TOML value)
to its type, with the checks its declaration names."""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from pathlib import Path

from berth.config.table import SettingDef, setting_definition
from berth.errors import ConfigError

_TRUE_WORDS = frozenset({"1", "true", "yes", "on"})
_FALSE_WORDS = frozenset({"0", "false", "no", "off"})


def convert_setting(name: str, raw: object, *, where: str, relative_to: Path) -> object:
    """Convert and validate ``raw`` for setting ``name`` exactly as :meth:`Settings.load`
    does (text as from a flag or the environment, or a TOML value).

    ``where`` starts the error message (e.g. ``"port=abc"``), and the value follows it,
    masked when the setting is secret; relative paths are taken relative to
    ``relative_to``.  Returns the typed value (``None`` for an empty optional
    one).  Raises :class:`ConfigError` for an unknown name or an invalid value.
    """
    return convert_value(setting_definition(name), raw, where, relative_to)


def convert_value(defn: SettingDef, raw: object, where: str, relative_to: Path) -> object:
    """Convert ``raw`` (text from a flag or the environment, or a TOML value) to the type of
    ``defn``; :class:`ConfigError` starting with ``where`` when it is invalid."""

    def bad(reason: str) -> ConfigError:
        # A secret's value never goes into the message (it reaches terminals and logs).
        shown = defn.shown(raw) if isinstance(raw, str) else raw
        return ConfigError(f"{where}: invalid {defn.name} {shown!r}: {reason}")

    if defn.list_value:
        raw = _list_text(raw, bad)
    if raw is None or (isinstance(raw, str) and raw.strip() == "" and defn.optional):
        if defn.optional:
            return None
        raise bad("a value is required")
    value: object
    if defn.kind == "bool":
        if isinstance(raw, bool):
            return raw
        word = raw.strip().lower() if isinstance(raw, str) else None
        if word in _TRUE_WORDS:
            return True
        if word in _FALSE_WORDS:
            return False
        raise bad("expected true or false")
    if defn.kind == "int":
        if isinstance(raw, bool) or not isinstance(raw, int | str):
            raise bad("expected an integer")
        try:
            value = int(raw)
        except ValueError:
            raise bad("expected an integer") from None
    elif defn.kind == "float":
        if isinstance(raw, bool) or not isinstance(raw, int | float | str):
            raise bad("expected a number")
        try:
            value = float(raw)
        except ValueError:
            raise bad("expected a number") from None
        if not math.isfinite(value):
            raise bad("expected a finite number")
    elif defn.kind == "path":
        if not isinstance(raw, str | os.PathLike):
            raise bad("expected a path")
        path = Path(raw).expanduser()
        value = path if path.is_absolute() else relative_to / path
    else:
        if not isinstance(raw, str):
            raise bad("expected a string")
        value = raw.strip()
        if not value:
            raise bad("a value is required")
        if defn.choices and value not in defn.choices:
            raise bad(f"expected one of {', '.join(defn.choices)}")
        problem = defn.check(value) if defn.check is not None else None
        if problem is not None:
            raise bad(problem)
    if isinstance(value, int | float):
        if defn.minimum is not None and value < defn.minimum:
            raise bad(f"must be at least {_number(defn.minimum)}")
        if defn.maximum is not None and value > defn.maximum:
            raise bad(f"must be at most {_number(defn.maximum)}")
    return value


def _list_text(raw: object, bad: Callable[[str], ConfigError]) -> object:
    """A list setting's value as the comma list text its check reads: a TOML array of
    strings (or of GPU indexes) joined, a string as given.  An empty string or array is
    refused: it would read as unset (the default) where "none" may be meant."""
    if isinstance(raw, list):
        if not raw:
            raise bad(
                "an empty list; leave the setting out for the default (an empty list for "
                "none is read only in agent.yaml's policy:)"
            )
        items = [
            str(item) if isinstance(item, int) and not isinstance(item, bool) else item
            for item in raw
        ]
        if not all(isinstance(item, str) and item.strip() for item in items):
            raise bad("expected a string or a list of non-empty strings")
        if any("," in item for item in items):
            raise bad("a list item must not hold a comma")
        return ", ".join(items)
    if isinstance(raw, str) and not raw.strip():
        raise bad("an empty value names nothing; leave the setting out for the default")
    return raw


def _number(bound: float) -> str:
    return str(int(bound)) if float(bound).is_integer() else str(bound)
