"""``berth route …``: the model names clients use, each in front of one or more services by
priority, with an optional fallback route. Everything goes through the daemon's admin API
(``/admin/routes``); the services are :mod:`berth.cli.service_cmd`'s.
"""

from __future__ import annotations

import typer
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from berth.api import FallbackIn, Route, RouteIn
from berth.cli.common import console, context, print_json, print_table, request_body
from berth.cli.context import HELP_OPTIONS
from berth.errors import ConfigError

route_app = typer.Typer(
    context_settings=HELP_OPTIONS,
    no_args_is_help=True,
    help="Routes: the model names clients use, each in front of services by priority.",
)


@route_app.command("create")
def create_route(
    ctx: typer.Context,
    public_name: str = typer.Argument(..., help="The model name clients will use."),
    service: str = typer.Option(..., "--service", "-s", help="The service it sends requests to."),
    priority: int = typer.Option(
        0, "--priority", "-p", help="Higher is tried first; equal priorities share the load."
    ),
    fallback: str | None = typer.Option(
        None, "--fallback", help="Route tried when no service behind this one is ready."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print JSON."),
) -> None:
    """Put a service behind a route (creating the route if it is new).

    Run it once per service to put several behind one name.  ``--fallback`` sets the
    route's fallback (a route has one; giving another replaces it).
    """
    body = request_body(
        RouteIn, name=public_name, service=service, priority=priority, fallback=fallback
    )
    with context(ctx).client() as client:
        record = client.add_route(body)
    if as_json:
        print_json(record)
        return
    _print_route(record)


def _print_route(record: Route) -> None:
    console.print(
        f"route [bold]{escape(record.name)}[/]: {escape(_route_line(record))}",
        soft_wrap=True,
        markup=True,
    )


def _route_line(record: Route) -> str:
    services = ", ".join(f"{s.service} (priority {s.priority})" for s in record.services)
    line = services
    if record.fallback:
        line += f"; falls back to {record.fallback}"
    serving = ", ".join(record.serving) or "nothing ready"
    return f"{line}; now served by {serving}"


@route_app.command("ls")
def list_routes(
    ctx: typer.Context, as_json: bool = typer.Option(False, "--json", help="Print JSON.")
) -> None:
    """List routes: their services by priority, fallback, and who answers now."""
    with context(ctx).client() as client:
        records = client.routes()
    if as_json:
        print_json(records)
        return
    if not records:
        console.print("no routes; create one with `berth route create NAME --service S`")
        return
    table = Table()
    table.add_column("ROUTE", no_wrap=True)
    table.add_column("SERVICES (PRIORITY, READY)")
    table.add_column("FALLBACK")
    table.add_column("SERVED BY")
    for r in records:
        services = ", ".join(f"{s.service} ({s.priority}, {s.ready})" for s in r.services)
        serving = Text(", ".join(r.serving)) if r.serving else Text("nothing ready", style="red")
        table.add_row(r.name, services, r.fallback or "-", serving)
    print_table(table)


@route_app.command("show")
def show_route(
    ctx: typer.Context,
    public_name: str = typer.Argument(..., help="The route's name."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON."),
) -> None:
    """Show one route, and why nothing answers when nothing does."""
    with context(ctx).client() as client:
        record = client.route(public_name)
    if as_json:
        print_json(record)
        return
    _print_route(record)
    if record.reason:
        console.print(record.reason, markup=False, soft_wrap=True)


@route_app.command("fallback")
def set_fallback(
    ctx: typer.Context,
    public_name: str = typer.Argument(..., help="The route's name."),
    fallback: str | None = typer.Argument(None, help="The route to fall back to."),
    clear: bool = typer.Option(False, "--none", help="Remove the route's fallback."),
) -> None:
    """Set or remove a route's fallback."""
    if (fallback is None) == (not clear):
        raise ConfigError("give a fallback route, or --none to remove the fallback")
    with context(ctx).client() as client:
        record = client.set_route_fallback(public_name, request_body(FallbackIn, fallback=fallback))
    _print_route(record)


@route_app.command("rm")
def remove_route(
    ctx: typer.Context,
    public_name: str = typer.Argument(..., help="The route's name."),
    service: str | None = typer.Option(
        None, "--service", "-s", help="Take only this service out (default: the whole route)."
    ),
) -> None:
    """Remove a route, or one service from it (a route left with none is removed)."""
    with context(ctx).client() as client:
        result = client.remove_route(public_name, service=service)
    left = result.route
    if left is None:
        console.print(f"route {public_name} removed")
    else:
        console.print(f"service {service} taken out of route {public_name}; {_route_line(left)}")
