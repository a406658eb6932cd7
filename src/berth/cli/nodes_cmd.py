"""``berth nodes enroll|ls|show|remove|cordon|uncordon|drain``."""

from __future__ import annotations

import time
from datetime import UTC, datetime
from urllib.parse import parse_qs, urlsplit

import typer
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from berth.api import DEFAULT_DRAIN_GRACE_S, DrainIn, EnrollIn, NodeMaintenance
from berth.cli.common import (
    console,
    context,
    err_console,
    print_json,
    print_table,
    record_table,
    request_body,
)
from berth.cli.context import HELP_OPTIONS
from berth.errors import ConfigError
from berth.humanize import age, duration, parse_duration

nodes_app = typer.Typer(
    context_settings=HELP_OPTIONS,
    help="Enroll, list, inspect, cordon, drain and remove the cluster's nodes.",
    no_args_is_help=True,
)


def _vram(mb: int) -> str:
    return f"{mb / 1024:.1f} GiB" if mb else "-"


def _heartbeat(at: float | None) -> str:
    return "-" if at is None else f"{age(time.time() - at)} ago"


def _data_path(path: str | None, reason: str | None) -> str:
    if path is None:
        return "- (not connected)"
    return f"{path}: {reason}" if reason else path


def _when(epoch_s: float) -> str:
    return datetime.fromtimestamp(epoch_s, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


@nodes_app.command("enroll")
def enroll(
    ctx: typer.Context, label: str = typer.Argument(..., help="The new node's label.")
) -> None:
    """Create a single-use enrollment URI for a new host (valid 10 minutes)."""
    with context(ctx).client() as client:
        issued = client.enroll_node(request_body(EnrollIn, label=label))
    console.print(f"enrollment URI for [bold]{escape(issued.label)}[/] (single use):", markup=True)
    print(issued.uri)
    console.print("run this on the new host:")
    print(f"berth agent register --uri '{issued.uri}'")
    console.print(f"expires at {_when(issued.expires_at)}")
    leader = urlsplit(issued.uri.replace("berth://", "x://", 1)).query
    host = urlsplit(parse_qs(leader).get("leader", [""])[0]).hostname or ""
    if host in ("127.0.0.1", "::1", "localhost"):
        err_console.print(
            f"note: agents will dial {host}, which only this host can reach; set cluster_host "
            "(and cluster_bind) to an address the new host can reach, or BERTH_LEADER_URL",
            soft_wrap=True,
        )


@nodes_app.command("ls")
def ls(ctx: typer.Context, as_json: bool = typer.Option(False, "--json")) -> None:
    """List nodes: status, data path (direct or tunnel), GPUs, VRAM, agent version, last
    heartbeat, the certificate's time left."""
    with context(ctx).client() as client:
        nodes = client.nodes()
    if as_json:
        print_json(nodes)
        return
    # Ids and statuses stay whole (a user copies an id); labels and paths fold.
    table = record_table()
    columns = ("ID", "LABEL", "STATUS", "PATH", "GPUS", "VRAM", "AGENT", "HEARTBEAT", "CERT")
    for column in columns:
        whole = column in ("ID", "GPUS", "VRAM")
        table.add_column(column, no_wrap=whole, overflow="ellipsis" if whole else "fold")
    for n in nodes:
        table.add_row(
            n.id,
            n.label,
            _status(n.status, n.maintenance),
            n.data_path or "-",
            str(n.gpu_count),
            _vram(n.vram_total_mb),
            n.agent_version or "-",
            _heartbeat(n.last_heartbeat_at),
            _cert_left(n.cert_not_after, n.cert_renewal_error),
        )
    print_table(table)


def _status(status: str, maintenance: NodeMaintenance | None) -> str:
    """The node's status, with its maintenance: ``ready, cordoned``, ``ready, draining: 1 of
    2 moved``."""
    return status if maintenance is None else f"{status}, {maintenance.summary}"


def _cert_left(not_after: float | None, renewal_error: str | None) -> str:
    """The node certificate's time left (``15h left``), ``expired``, and whether its last
    renewal was refused."""
    if not_after is None:
        return "-"
    left = not_after - time.time()
    text = f"{age(left)} left" if left > 0 else "expired"
    return f"{text}, renewal refused: {renewal_error}" if renewal_error else text


@nodes_app.command("show")
def show(
    ctx: typer.Context,
    ident: str = typer.Argument(..., metavar="ID", help="Node id or label."),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """One node in detail: data path and why, hardware, GPUs, capabilities, versions, and
    the agent policy it reported."""
    with context(ctx).client() as client:
        node = client.node(ident)
    if as_json:
        print_json(node)
        return
    memory = node.memory_total_mb
    rows = [
        ("id", node.id),
        ("label", node.label),
        ("status", _status(node.status, node.maintenance)),
        ("host", node.hostname or "-"),
        ("cpus", str(node.cpu_count or "-")),
        ("memory", f"{memory / 1024:.1f} GiB" if memory else "-"),
        ("agent", node.agent_version or "-"),
        ("protocol", str(node.protocol_version or "-")),
        ("data path", _data_path(node.data_path, node.data_path_reason)),
        ("advertised", node.advertised_address or "-"),
        ("capabilities", ", ".join(node.capabilities) or "-"),
        ("certificate", node.cert_fingerprint or "-"),
        ("heartbeat", _heartbeat(node.last_heartbeat_at)),
        ("policy", node.policy.summary if node.policy is not None else "-"),
    ]
    for name, value in rows:
        console.print(f"{name:<13} {value}", markup=False, soft_wrap=True)
    if node.maintenance is not None:
        _print_maintenance(node.maintenance)
    if node.gpus:
        table = Table("GPU", "NAME", "MEMORY", "USED", "UUID")
        for gpu in node.gpus:
            table.add_row(
                str(gpu.index),
                gpu.name,
                _vram(gpu.memory_total_mb),
                _vram(gpu.memory_used_mb),
                gpu.uuid,
            )
        print_table(table)
    if node.adopted:
        table = Table("ADOPTED", "SERVED AS", "ADDRESS", "GPUS", "ANSWERS")
        for endpoint in node.adopted:
            table.add_row(
                endpoint.name,
                endpoint.served_model_name,
                f"{endpoint.host}:{endpoint.port}",
                ",".join(map(str, endpoint.gpus)) or "-",
                Text("yes", style="green") if endpoint.alive else Text("no", style="red"),
            )
        print_table(table)


@nodes_app.command("remove")
def remove(
    ctx: typer.Context,
    ident: str = typer.Argument(..., metavar="ID", help="Node id or label."),
) -> None:
    """Remove a node: its certificate is refused from now on and its link is closed."""
    with context(ctx).client() as client:
        removed = client.remove_node(ident)
    console.print(f"removed node {removed.label} ({removed.id})")


def _print_maintenance(maintenance: NodeMaintenance) -> None:
    """The drain of ``nodes show``: when, its grace, and each deployment's step and why."""
    if maintenance.drain_started_at is not None:
        grace = duration(maintenance.grace_s or 0.0)
        force = ", --force" if maintenance.force else ""
        line = f"started {_when(maintenance.drain_started_at)}, grace {grace}{force}"
        if maintenance.finished_at is not None:
            line += f", finished {_when(maintenance.finished_at)}"
        console.print(f"{'drain':<13} {line}", markup=False, soft_wrap=True)
    moves = {m.deployment_id: m for m in maintenance.moves}
    now = {a.deployment_id: a for a in maintenance.actions}
    if not moves and not now:
        return
    table = Table("DEPLOYMENT", "STEP", "REPLACEMENT", "WHY")
    for deployment_id in sorted(set(moves) | set(now)):
        move = moves.get(deployment_id)
        action = now.get(deployment_id)
        step = move.step if move is not None else "-"
        why = action.reason if action is not None else (move.note if move else None)
        table.add_row(
            deployment_id,
            step,
            (move.replacement_id if move is not None else None) or "-",
            why or "-",
        )
    print_table(table)


@nodes_app.command("cordon")
def cordon(
    ctx: typer.Context,
    ident: str = typer.Argument(..., metavar="ID", help="Node id or label."),
) -> None:
    """Place nothing new on a node (deployments, on-demand loads, scale-out); what runs
    there keeps running."""
    with context(ctx).client() as client:
        client.cordon_node(ident)
    console.print(f"node {ident} cordoned: nothing new is placed there", markup=False)


@nodes_app.command("uncordon")
def uncordon(
    ctx: typer.Context,
    ident: str = typer.Argument(..., metavar="ID", help="Node id or label."),
) -> None:
    """Let placement use a node again; a drain under way stops where it is."""
    with context(ctx).client() as client:
        done = client.uncordon_node(ident)
    if done.was is None:
        console.print(f"node {done.label} was not cordoned", markup=False)
        return
    console.print(
        f"node {done.label} uncordoned (it was {done.was.summary})", markup=False, soft_wrap=True
    )


@nodes_app.command("drain")
def drain(
    ctx: typer.Context,
    ident: str = typer.Argument(..., metavar="ID", help="Node id or label."),
    grace: str = typer.Option(
        duration(DEFAULT_DRAIN_GRACE_S),
        "--grace",
        help="How long a deployment's requests in flight may take once its replacement is "
        "ready, before it is stopped anyway (30s, 5m, ...).",
    ),
    force: bool = typer.Option(
        False,
        "--force",
        help="Stop the deployments that cannot move (pinned to the node, or fitting nowhere "
        "else) instead of leaving them running.",
    ),
) -> None:
    """Cordon a node, then move each deployment off it: a replacement starts elsewhere
    first, the old one stops once its requests in flight have finished. Follow it with
    `berth nodes ls` or `berth nodes show`."""
    try:
        grace_s = parse_duration(grace)
    except ValueError as exc:
        raise ConfigError(f"--grace: {exc}") from None
    with context(ctx).client() as client:
        started = client.drain_node(ident, request_body(DrainIn, grace_s=grace_s, force=force))
    console.print(
        f"node {ident}: {started.summary}; follow it with: berth nodes show {ident}",
        markup=False,
        soft_wrap=True,
    )
