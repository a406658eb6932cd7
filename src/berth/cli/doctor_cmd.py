"""``berth doctor``: what works on this host, and why not where it does not.

The checks live in :mod:`berth.doctor`; this module renders them.
"""

from __future__ import annotations

from dataclasses import asdict

import typer
from rich.table import Table
from rich.text import Text

from berth.cli.common import console, context, print_json
from berth.doctor import Check, failed, run_checks

_STYLES = {"ok": "green", "warn": "yellow", "fail": "red"}


def doctor(
    ctx: typer.Context,
    leader_only: bool = typer.Option(
        False,
        "--leader-only",
        help="A control plane host: skip engine programs, Docker, images and GPUs.",
    ),
    as_json: bool = typer.Option(False, "--json", help="Print JSON."),
) -> None:
    """Check this host: Python and packages, the home and its secrets, ports, the CA and
    certificates, engines, Docker and GPUs, and on an agent its leader and pinned CA.

    Each line is ok, warn or fail, with the command that fixes it.  Exits 1 when a check
    fails.  ``--json`` prints a list of ``{"name", "verdict", "detail", "hint"}``.
    """
    checks = run_checks(context(ctx).home, leader_only=leader_only)
    if as_json:
        print_json([asdict(check) for check in checks])
    else:
        console.print(render(checks))
        counts = {verdict: sum(c.verdict == verdict for c in checks) for verdict in _STYLES}
        console.print(f"{counts['ok']} ok, {counts['warn']} warn, {counts['fail']} fail")
    if failed(checks):
        raise typer.Exit(1)


def render(checks: list[Check]) -> Table:
    """The report as a table; a hint goes under its detail, after an arrow."""
    table = Table("CHECK", "RESULT", "DETAIL")
    for check in checks:
        detail = Text(check.detail, overflow="fold")
        if check.hint:
            detail.append("\n→ " + check.hint, style="dim" if check.verdict == "ok" else "bold")
        table.add_row(check.name, Text(check.verdict, style=_STYLES[check.verdict]), detail)
    return table
