"""``berth plan MODEL_OR_SERVICE``: the VRAM estimate and where a deployment would go.

A dry run through the daemon (``POST /admin/plan``): the same facts, estimate and placement
``berth run`` and ``berth service deploy`` act on, printed with the reasons.  Nothing
changes.  The exit code says the verdict, so a script can test it: 0 when the deployment
would be placed, :data:`REFUSED_EXIT_CODE` when it would be refused (the reasons printed,
or kept in ``--json``), 2 for bad input (no such model, service or node; a bad flag).
"""

from __future__ import annotations

import typer
from rich.markup import escape
from rich.table import Table

from berth.api import Plan, PlanIn
from berth.cli.common import console, context, print_json, request_body
from berth.cli.deploy_cmd import parse_gpus
from berth.placement.estimate import mib

#: ``berth plan``'s exit code for a plan placement refuses (0: it would place).
REFUSED_EXIT_CODE = 3


def plan(
    ctx: typer.Context,
    target: str = typer.Argument(..., help="A service (berth service ls) or a model."),
    node: str | None = typer.Option(None, "--node", help="Plan for this node (label or id)."),
    ctx_len: int | None = typer.Option(None, "--ctx", min=1, help="Context length in tokens."),
    engine: str | None = typer.Option(
        None,
        "--engine",
        "-e",
        help="llamacpp, vllm or sglang (default: the service's, else llamacpp).",
    ),
    gpu: str | None = typer.Option(None, "--gpu", help="GPU indexes, e.g. 0 or 0,1."),
    runtime: str | None = typer.Option(None, "--runtime", help="process or docker."),
    extra: list[str] | None = typer.Option(
        None, "--extra-arg", "-x", help="Extra engine argument (repeatable)."
    ),
    force: bool = typer.Option(False, "--force", help="As berth run --force."),
    max_adapters: int | None = typer.Option(
        None, "--max-adapters", min=1, help="As berth run --max-adapters (vLLM/SGLang)."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print JSON."),
) -> None:
    """Show a deployment's VRAM estimate and where it would go, with the reasons.

    Nothing is started or changed. Exit codes: 0 it would be placed, 3 it would be refused
    (the reasons are printed, and kept with --json), 2 bad input (no such model, service
    or node).
    """
    body = request_body(
        PlanIn,
        target=target,
        node=node,
        ctx=ctx_len,
        engine=engine,
        gpus=parse_gpus(gpu) if gpu is not None else None,
        runtime=runtime,
        extra_args=list(extra) if extra else None,
        force=force,
        max_adapters=max_adapters,
    )
    with context(ctx).client() as client:
        answer = client.plan(body)
    if as_json:
        print_json(answer)
    else:
        print_plan(answer)
    if not answer.placed:
        raise typer.Exit(REFUSED_EXIT_CODE)


def print_plan(answer: Plan) -> None:
    """The plan for people: the estimate and its inputs, the verdict, the reasons, the GPUs
    looked at."""
    out = console
    what = (
        f"model {answer.model}"
        if answer.kind == "model"
        else (f"service {answer.target} (model {answer.model})")
    )
    out.print(
        f"plan for [bold]{escape(what)}[/] on {answer.engine} ({answer.runtime})",
        soft_wrap=True,
        markup=True,
    )
    estimate = answer.estimate
    if estimate is None:
        out.print(f"estimate: none ({answer.estimate_problem})", markup=False, soft_wrap=True)
    else:
        out.print(f"estimate: {estimate.summary}", markup=False, soft_wrap=True)
        width = max(len(i.name) for i in estimate.inputs)
        for item in estimate.inputs:
            out.print(f"  {item.name:<{width}}  {item.value}", markup=False, soft_wrap=True)
        for note in estimate.notes:
            out.print(f"  note: {note}", markup=False, soft_wrap=True)
    if answer.placed:
        gpus = f" GPU {','.join(map(str, answer.gpus))}" if answer.gpus else ""
        where = f"node {answer.node_label}{gpus}"
        out.print(
            f"[green]would run on {escape(where)}[/] (model {escape(str(answer.model_source))})",
            soft_wrap=True,
            markup=True,
        )
    else:
        out.print(f"[red]refused[/] ({answer.refusal_reason}): ", end="", markup=True)
        out.print(answer.refusal or "", markup=False, soft_wrap=True)
    eviction = answer.eviction
    if eviction is not None:
        lead = "first stops" if eviction.needed else "would fit after stopping"
        out.print(f"eviction: {lead} {', '.join(eviction.deployment_ids)}", soft_wrap=True)
        for line in eviction.reasons:
            out.print(f"  {line}", markup=False, soft_wrap=True)
    for note in answer.adapter_notes:
        out.print(f"adapters: {note}", markup=False, soft_wrap=True)
    if answer.reasons:
        out.print("why:")
        for line in answer.reasons:
            out.print(f"  - {line}", markup=False, soft_wrap=True)
    if answer.considered:
        table = Table(title="GPUs looked at", title_justify="left")
        for column in ("NODE", "GPU", "NAME", "TOTAL", "FREE", "VERDICT", "DETAIL"):
            table.add_column(column)
        for o in answer.considered:
            name = f"{o.name} (simulated)" if o.simulated and "simulated" not in o.name else o.name
            table.add_row(o.node_label, str(o.index), name, mib(o.total_mb), mib(o.free_mb),
                          o.verdict.replace("_", " "), o.detail)  # fmt: skip
        out.print(table)
