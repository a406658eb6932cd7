"""``berth agent register``, ``start``, ``status`` and ``logs``: the agent side.

These commands run on an agent host and do not need a leader daemon on it.
"""

from __future__ import annotations

import typer

from berth.cli.common import HELP_OPTIONS, console, context, err_console

app = typer.Typer(
    context_settings=HELP_OPTIONS,
    help="Run this host as a node of a berth leader.",
    no_args_is_help=True,
)


@app.command("register")
def register(
    ctx: typer.Context,
    uri: str = typer.Option(..., "--uri", help="The URI `berth nodes enroll` printed."),
    force: bool = typer.Option(
        False, "--force", help="Replace this home's existing identity (re-enrolment)."
    ),
) -> None:
    """Enroll this host: pin the leader's CA, get a client certificate, save the identity."""
    from berth.agent.registration import register_agent
    from berth.cluster.enrollment import EnrollmentURI
    from berth.errors import ConflictError

    home = context(ctx).home
    parsed = EnrollmentURI.parse(uri)
    if home.agent_config.exists() and not force:
        raise ConflictError(
            f"{home.root} is already enrolled ({home.agent_config}); "
            "add --force to replace its identity"
        )
    identity = register_agent(parsed, home)
    console.print(
        f"enrolled as node [bold]{identity.label}[/] ({identity.node_id}) "
        f"with leader {identity.leader_url}"
    )
    console.print(f"identity written to {home.agent_config}", soft_wrap=True)


@app.command("start")
def start(
    ctx: typer.Context,
    verbose: bool = typer.Option(
        False, "--verbose", "-v", help="Log to the terminal (debug level) instead of the panel."
    ),
) -> None:
    """Dial the leader and serve this host's engines until stopped (Ctrl-C)."""
    from berth import eventloop
    from berth.agent.runner import run_agent

    home = context(ctx).home
    code = eventloop.run(run_agent(home, verbose=verbose, console=console))
    raise typer.Exit(code)


@app.command("status")
def status(
    ctx: typer.Context,
    as_json: bool = typer.Option(False, "--json", help="Print JSON."),
) -> None:
    """Whether the agent runs, its link to the leader, and its recent activity."""
    import time

    from berth.agent.runner import read_status
    from berth.cli.common import age, print_json

    home = context(ctx).home
    data = read_status(home)
    if data is None:
        err_console.print(f"no agent has run for {home.root} (start one with: berth agent start)")
        raise typer.Exit(1)
    if as_json:
        print_json(data)
        raise typer.Exit(0 if data["running"] else 1)
    state = str(data["state"]) if data["running"] else "not running"
    console.print(f"agent   {state} (pid {data['pid']})")
    console.print(f"leader  {data['leader_url']}")
    console.print(f"node    {data['label']} ({data['node_id']})")
    since = data.get("connected_since")
    if data["running"] and isinstance(since, int | float):
        console.print(f"linked  {age(time.time() - since)}")
    if data.get("last_error"):
        console.print(f"error   {data['last_error']}", soft_wrap=True)
    for line in data.get("recent") or []:  # type: ignore[attr-defined]
        console.print(f"  {line}", style="dim", soft_wrap=True)
    raise typer.Exit(0 if data["running"] else 1)


@app.command("logs")
def logs(
    ctx: typer.Context,
    follow: bool = typer.Option(False, "--follow", "-f", help="Keep printing new lines."),
    tail: int = typer.Option(100, "--tail", "-n", help="Lines from the end to start with."),
) -> None:
    """The agent's log ($BERTH_HOME/logs/agent.log)."""
    import asyncio
    import contextlib
    import sys

    from berth.runtime.process import follow_log, read_log_tail

    path = context(ctx).home.agent_log
    if not path.exists():
        err_console.print(f"no agent log at {path}")
        raise typer.Exit(1)
    if not follow:
        sys.stdout.write(read_log_tail(path, tail))
        return

    async def stream() -> None:
        async for chunk in follow_log(path, from_start_lines=tail):
            sys.stdout.write(chunk.decode(errors="replace"))
            sys.stdout.flush()

    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(stream())
