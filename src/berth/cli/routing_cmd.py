"""``berth routing MODEL``: where a request for MODEL would go now, and why."""

from __future__ import annotations

import typer
from rich.table import Table

from berth.api import LastDecision, RankedCandidate
from berth.cli.common import context, print_json, print_table


def routing(
    ctx: typer.Context,
    model: str = typer.Argument(..., help="The model name clients ask for."),
    session: str | None = typer.Option(None, "--session", help="Explain for this X-Session-Id."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON."),
) -> None:
    """Show the ranked candidates for MODEL (affinity, in flight, p95; their slots at the
    admission queue, known or assumed) and dropped ones; the routing policy and how the last
    request went (the matched prefix, and why a load bound overrode it); under ``prefix``, what
    each engine last said of its cache (llama.cpp's /slots, vLLM's or SGLang's /metrics)."""
    with context(ctx).client() as client:
        explained = client.explain_routing(model, session=session)
    if as_json:
        print_json(explained)
        return
    table = Table("RANK", "DEPLOYMENT", "NODE", "SLOTS", "WHY")
    for candidate in explained.candidates:
        table.add_row(
            str(candidate.rank),
            candidate.deployment_id,
            candidate.node_id,
            slots_text(candidate),
            candidate.reason,
        )
    for dropped in explained.dropped:
        table.add_row("-", dropped.deployment_id, dropped.node_id, "", dropped.reason)
    print_table(table)
    typer.echo(f"policy: {explained.policy}")
    for candidate in explained.candidates:
        if candidate.cache_signal:
            typer.echo(f"cache of {candidate.deployment_id}: {candidate.cache_signal}")
    last = explained.last_decision
    if last is not None:
        typer.echo(f"last request: {decision_text(last)}")


def decision_text(last: LastDecision) -> str:
    """A last decision as ``berth routing`` prints it: ``matched on dep-1 (12 blocks,
    ~760 tokens): longest cached prefix ...``."""
    matched = ""
    if last.matched_blocks or last.longest_blocks:
        matched = f" ({last.matched_blocks} blocks, ~{last.matched_tokens} tokens)"
    reason = f": {last.reason}" if last.reason else ""
    return f"{last.outcome} on {last.deployment_id}{matched}{reason}"


def slots_text(candidate: RankedCandidate) -> str:
    """A candidate's slots as ``berth routing`` prints them: ``2 (--parallel 2)``, or
    ``8, assumed (default_slots: an adopted endpoint does not say)``; ``-`` when not held."""
    if candidate.slots is None:
        return "-"
    assumed = ", assumed" if candidate.slots_assumed else ""
    source = f" ({candidate.slots_from})" if candidate.slots_from else ""
    return f"{candidate.slots}{assumed}{source}"
