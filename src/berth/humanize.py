"""Short human-readable forms of numbers, for the CLI's tables and the agent's status panel,
and the durations people type (``30s``, ``10m``, ``2h``)."""

from __future__ import annotations

import math
import re

#: Seconds per unit of a typed duration.
_DURATION_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_DURATION_PART = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h|d)")


def age(seconds: float) -> str:
    """A short human age: ``42s``, ``5m``, ``3h``, ``2d``."""
    seconds = max(seconds, 0)
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{int(seconds // size)}{unit}"
    return f"{int(seconds)}s"


def printable(text: str) -> str:
    """``text`` with each character ``str.isprintable`` refuses (a control character such as
    ESC or CR, a line separator, a bidirectional override) written as its Python escape
    (``\\x1b``, ``\\r``, ``\\u202e``): a name a terminal shows as what it is, on one line,
    that can neither move its cursor nor colour it."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def parse_duration(text: str) -> float:
    """Seconds in a duration as people type it: a number with a unit (``ms``, ``s``, ``m``,
    ``h``, ``d``), or several run together (``1h30m``); a bare number is seconds (``90``,
    ``2.5``).

    Raises ``ValueError`` naming the text and the accepted form for anything else (an empty
    string, a negative number, an unknown unit such as ``10 min``, infinity).
    """
    cleaned = text.strip().lower()
    problem = f"{text!r} is not a duration: use a number and a unit, e.g. 30s, 10m, 2h, 1h30m"
    if not cleaned:
        raise ValueError(problem)
    try:
        seconds = float(cleaned)
    except ValueError:
        parts = _DURATION_PART.findall(cleaned)
        if not parts or "".join(n + u for n, u in parts) != cleaned:
            raise ValueError(problem) from None
        seconds = sum(float(number) * _DURATION_UNITS[unit] for number, unit in parts)
    if not math.isfinite(seconds) or seconds < 0:
        raise ValueError(problem)
    return seconds


def duration(seconds: float) -> str:
    """``seconds`` in the shortest exact form :func:`parse_duration` reads back: ``45s``,
    ``10m``, ``1h30m``, ``2.5s``; ``0s`` for zero."""
    if seconds <= 0:
        return "0s"
    whole = int(seconds)
    if whole != seconds:
        return f"{seconds:g}s"
    parts = []
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60), ("s", 1)):
        if whole >= size:
            parts.append(f"{whole // size}{unit}")
            whole %= size
    return "".join(parts)
