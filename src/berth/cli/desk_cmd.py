"""``berth desk register``, ``serve``, ``status``, ``check`` and ``link``: this leader's models
offered to an ow desk (``docs/desk.md``).

Every command needs the leader running on this home (it is asked what it serves, and jobs go
through its router), except ``status``, ``check`` and ``link``, which talk to the desk only.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING

import typer

from berth.cli.common import console, context, err_console, print_json
from berth.cli.context import HELP_OPTIONS
from berth.desk.client import WAIT_MAX_S, WAIT_MIN_S
from berth.desk.wire import PRICE_MAX_CENTS, PRICE_MIN_CENTS
from berth.errors import ConfigError

if TYPE_CHECKING:
    from berth.desk.commands import NodeReport

desk_app = typer.Typer(
    context_settings=HELP_OPTIONS,
    help="Offer this leader's models to an ow desk: register, serve jobs, status, pool tests.",
    no_args_is_help=True,
)

_POOL_HELP = "The desk's URL (default: the desk_pool_url setting, else the registered pool)."


@desk_app.command("register")
def register(
    ctx: typer.Context,
    pool_url: str | None = typer.Option(None, "--pool-url", help=_POOL_HELP),
    models: list[str] = typer.Option(
        [], "--model", help="A served model to offer (repeat; default: every served model)."
    ),
    price: int | None = typer.Option(
        None,
        "--price",
        help=f"Cents per million tokens, {PRICE_MIN_CENTS} to {PRICE_MAX_CENTS} "
        "(default: the desk suggests one).",
    ),
) -> None:
    """Register served models with the desk as one machine; print each node code and price."""
    from berth.desk.client import DeskClient
    from berth.desk.commands import register_models, resolve_pool_url
    from berth.desk.leader import LeaderClient
    from berth.desk.state import DeskFiles

    home = context(ctx).home
    url = resolve_pool_url(home, pool_url)

    async def main() -> None:
        async with LeaderClient(home.socket_file) as leader, DeskClient(url) as desk:
            done = await register_models(
                files=DeskFiles(home),
                leader=leader,
                desk=desk,
                models=models,
                price=price,
                warn=lambda line: err_console.print(
                    f"warning: {line}", markup=False, soft_wrap=True
                ),
                now=time.time,
            )
        for registration in done:
            node = registration.node
            basis = "set by you" if node.price_basis == "host" else "suggested by the desk"
            shown = f"{node.price} cents per million tokens ({basis})" if node.price else "-"
            verb = "already registered" if registration.already else "registered"
            console.print(f"{node.model}: {verb}, node code {node.code}, price {shown}",
                          markup=False, soft_wrap=True)  # fmt: skip
        console.print(f"secrets in {DeskFiles(home).nodes_file}", markup=False, soft_wrap=True)

    asyncio.run(main())


@desk_app.command("serve")
def serve(
    ctx: typer.Context,
    pool_url: str | None = typer.Option(None, "--pool-url", help=_POOL_HELP),
    wait_s: int | None = typer.Option(
        None,
        "--wait",
        help=f"Seconds ({WAIT_MIN_S} to {WAIT_MAX_S}) the desk may hold each claim for a job "
        "(x-ow-wait; one-model hosts).",
    ),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Debug logging."),
) -> None:
    """Pulse and claim jobs until stopped (Ctrl-C); each job runs through the leader's router."""
    from berth import eventloop
    from berth.desk.commands import resolve_pool_url
    from berth.desk.serve import serve as run_serve

    if wait_s is not None and not WAIT_MIN_S <= wait_s <= WAIT_MAX_S:
        raise ConfigError(f"--wait {wait_s}: the desk holds a claim {WAIT_MIN_S} to {WAIT_MAX_S} s")
    home = context(ctx).home
    url = resolve_pool_url(home, pool_url)
    raise typer.Exit(eventloop.run(run_serve(home, pool_url=url, wait_s=wait_s, verbose=verbose)))


@desk_app.command("status")
def status(
    ctx: typer.Context,
    pool_url: str | None = typer.Option(None, "--pool-url", help=_POOL_HELP),
    models: list[str] = typer.Option(
        [], "--model", help="A registered model (repeat; default: all)."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print JSON."),
) -> None:
    """Each registered model's state on the desk, its pool test, and when it was last seen."""
    from berth.desk.client import DeskClient
    from berth.desk.commands import node_statuses, pick_nodes, resolve_pool_url
    from berth.desk.state import DeskFiles, load_nodes

    home = context(ctx).home
    url = resolve_pool_url(home, pool_url)
    nodes = pick_nodes(load_nodes(DeskFiles(home)), models)

    async def main() -> bool:
        async with DeskClient(url) as desk:
            reports = await node_statuses(desk, nodes)
        if as_json:
            print_json([_status_json(r) for r in reports])
            return all(r.error is None for r in reports)
        for report in reports:
            node = report.node
            if report.status is None:
                err_console.print(f"{node.model} ({node.code}): {report.error}", markup=False)
                continue
            found = report.status
            console.print(f"{node.model} ({node.code}): {found.state.upper()}", markup=False)
            console.print(f"  check      {_shown(found.check)}", markup=False, soft_wrap=True)
            console.print(f"  last seen  {_shown(found.last_seen)}", markup=False)
        return all(r.error is None for r in reports)

    if not asyncio.run(main()):
        raise typer.Exit(1)


@desk_app.command("check")
def check(
    ctx: typer.Context,
    pool_url: str | None = typer.Option(None, "--pool-url", help=_POOL_HELP),
    models: list[str] = typer.Option(
        [], "--model", help="A registered model (repeat; default: all)."
    ),
) -> None:
    """Request a pool test of each registered model and print its result as the desk gives it.

    The test is a job the desk hands out: `berth desk serve` must be running to answer it.
    """
    from berth.desk.client import DeskClient
    from berth.desk.commands import pick_nodes, request_checks, resolve_pool_url
    from berth.desk.state import DeskFiles, load_nodes

    home = context(ctx).home
    url = resolve_pool_url(home, pool_url)
    files = DeskFiles(home)
    nodes = pick_nodes(load_nodes(files), models)

    async def main() -> bool:
        async with DeskClient(url) as desk:
            reports = await request_checks(desk, files, nodes, time.time)
        for report in reports:
            if report.check_result is None:
                err_console.print(f"{report.node.model}: {report.error}", markup=False)
                continue
            console.print(f"{report.node.model}: pool test requested; result:", markup=False)
            print(report.check_result)
        return all(r.error is None for r in reports)

    if not asyncio.run(main()):
        raise typer.Exit(1)


@desk_app.command("link")
def link(
    ctx: typer.Context,
    pool_url: str | None = typer.Option(None, "--pool-url", help=_POOL_HELP),
) -> None:
    """Print a one-time code that links this machine to your account on the desk."""
    from berth.desk.client import DeskClient
    from berth.desk.commands import link_machine, resolve_pool_url
    from berth.desk.state import DeskFiles, load_nodes

    home = context(ctx).home
    url = resolve_pool_url(home, pool_url)
    book = load_nodes(DeskFiles(home))

    async def main() -> None:
        async with DeskClient(url) as desk:
            code = await link_machine(desk, book)
        console.print(f"code     {code.code} (one-time)", markup=False)
        console.print(f"expires  {_shown(code.expires_at)}", markup=False)
        console.print(f"enter it at {url}/account/machines", markup=False, soft_wrap=True)

    asyncio.run(main())


def _status_json(report: NodeReport) -> dict[str, object]:
    found = report.status
    return {
        "model": report.node.model,
        "code": report.node.code,
        "state": found.state if found else None,
        "check": found.check if found else None,
        "lastSeen": found.last_seen if found else None,
        "error": str(report.error) if report.error else None,
    }


def _shown(value: object) -> str:
    """A value the desk gave, as text: strings as they are, anything else as JSON."""
    import json

    if value is None:
        return "-"
    return value if isinstance(value, str) else json.dumps(value, sort_keys=True)
