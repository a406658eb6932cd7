"""The result type every doctor check returns, and how results combine."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

Verdict = Literal["ok", "warn", "fail"]

_RANK: dict[Verdict, int] = {"ok": 0, "warn": 1, "fail": 2}


@dataclass(frozen=True)
class Check:
    """One line of the report.

    ``name`` says what was checked (``port public``, ``cert cluster``); ``verdict`` is
    ``ok``, ``warn`` (works, but not as well as it could, or not yet) or ``fail`` (something
    a user will hit); ``detail`` is what was found; ``hint`` is the command or action that
    fixes it (``""`` when there is nothing to do).
    """

    name: str
    verdict: Verdict
    detail: str
    hint: str = ""


def worst(verdicts: Iterable[Verdict]) -> Verdict:
    """The most severe of ``verdicts`` (``ok`` for none)."""
    return max(verdicts, key=_RANK.__getitem__, default="ok")


def failed(checks: Iterable[Check]) -> bool:
    """Whether any check failed (``berth doctor`` then exits 1)."""
    return any(check.verdict == "fail" for check in checks)
