"""Short human-readable forms of numbers, for the CLI's tables and the agent's status panel."""

from __future__ import annotations


def age(seconds: float) -> str:
    """A short human age: ``42s``, ``5m``, ``3h``, ``2d``."""
    seconds = max(seconds, 0)
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{int(seconds // size)}{unit}"
    return f"{int(seconds)}s"
