"""``berth adapters add|ls|show|rm``: LoRA adapters served under their own names."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.markup import escape
from rich.table import Table

from berth.api import Adapter, AdapterIn, AddedAdapter
from berth.cli.common import console, context, print_json, print_table, request_body
from berth.cli.context import HELP_OPTIONS
from berth.errors import ConfigError

adapters_app = typer.Typer(
    context_settings=HELP_OPTIONS,
    help="Register, list and remove LoRA adapters of registered models.",
    no_args_is_help=True,
)


@adapters_app.command("add")
def add(
    ctx: typer.Context,
    name: str = typer.Argument(..., help="The name clients ask for as the model."),
    base: str = typer.Option(..., "--base", help="The registered model it adapts."),
    path: Path = typer.Option(
        ..., "--path", help="A PEFT folder (vLLM, SGLang) or a GGUF LoRA file (llama.cpp)."
    ),
    node: str | None = typer.Option(
        None, "--node", help="Node label or id whose host holds PATH (default: this host)."
    ),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """Register the adapter NAME of model BASE, at PATH on this host or on another node's."""
    remote = node is not None and node != "local"
    if remote and not path.is_absolute():
        raise ConfigError(f"a path on another node must be absolute, not {str(path)!r}")
    shown = str(path) if remote else str(path.expanduser().resolve())
    body = request_body(AdapterIn, name=name, base=base, path=shown, node=node)
    with context(ctx).client() as client:
        added = client.add_adapter(body)
    if as_json:
        print_json(added)
        return
    print_added(added, node)


def print_added(added: AddedAdapter, node: str | None) -> None:
    """What ``adapters add`` (and ``berth pull`` of an adapter) says of the new adapter."""
    rank = f", rank {added.rank}" if added.rank is not None else ""
    where = f" on node {node}" if node not in (None, "local") else ""
    console.print(
        f"added adapter [bold]{escape(added.name)}[/] of {escape(added.base)} "
        f"({added.format}{rank}){escape(where)}",
        markup=True,
    )
    if not added.checked:
        console.print("  its files are on another host: the engine checks them when it loads it")
    for deployment in added.restart_needed:
        console.print(
            f"  deployment {deployment} of {added.base} needs a restart to serve it "
            f"(berth stop {deployment}, then berth run {added.base} again)"
        )


@adapters_app.command("ls")
def ls(ctx: typer.Context, as_json: bool = typer.Option(False, "--json")) -> None:
    """List registered adapters and where each is loaded."""
    with context(ctx).client() as client:
        records = client.adapters()
    if as_json:
        print_json(records)
        return
    table = Table("NAME", "BASE", "FORMAT", "RANK", "NODES", "LOADED ON")
    for r in records:
        table.add_row(
            r.name,
            r.base,
            r.format,
            str(r.rank) if r.rank is not None else "-",
            ", ".join(sorted(r.locations)),
            ", ".join(x.deployment_id for x in r.loaded_on) or "-",
        )
    print_table(table)


@adapters_app.command("show")
def show(
    ctx: typer.Context,
    name: str = typer.Argument(...),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """Show one adapter: its base, files per node, and the engines that have it loaded."""
    with context(ctx).client() as client:
        record = client.adapter(name)
    if as_json:
        print_json(record)
        return
    _print_adapter(record)


def _print_adapter(record: Adapter) -> None:
    console.print(f"[bold]{escape(record.name)}[/] (adapter of {escape(record.base)})", markup=True)
    console.print(f"  format:         {record.format}")
    console.print(f"  rank:           {record.rank if record.rank is not None else 'unknown'}")
    modules = ", ".join(record.target_modules) or "unknown"
    console.print(f"  target modules: {modules}")
    if record.repo_id:
        console.print(f"  pulled from:    {record.repo_id}")
    for node_id, path in sorted(record.locations.items()):
        console.print(f"  on node {node_id}: {path}")
    loaded = ", ".join(f"{x.deployment_id} (node {x.node_id})" for x in record.loaded_on)
    console.print(f"  loaded on:      {loaded or 'none'}")


@adapters_app.command("rm")
def rm(
    ctx: typer.Context,
    name: str = typer.Argument(...),
    node: str | None = typer.Option(
        None, "--node", help="Remove only this node's copy (default: the adapter)."
    ),
) -> None:
    """Unregister an adapter (its files stay where they are)."""
    with context(ctx).client() as client:
        removed = client.remove_adapter(name, node)
    where = f" from node {removed.node}" if removed.node else ""
    console.print(f"removed adapter {removed.removed}{where}")
