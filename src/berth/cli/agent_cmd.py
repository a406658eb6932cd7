"""``berth agent register`` (and, later, ``start``, ``status``, ``logs``): the agent side.

These commands run on an agent host and do not need a leader daemon on it.
"""

from __future__ import annotations

import typer

from berth.cli.common import HELP_OPTIONS, console, context

app = typer.Typer(
    context_settings=HELP_OPTIONS,
    help="Run this host as a node of a berth leader.",
    no_args_is_help=True,
)


@app.command("register")
def register(
    ctx: typer.Context,
    uri: str = typer.Option(..., "--uri", help="The URI `berth nodes enroll` printed."),
) -> None:
    """Enroll this host: pin the leader's CA, get a client certificate, save the identity."""
    from berth.agent.registration import register_agent
    from berth.cluster.enrollment import EnrollmentURI

    home = context(ctx).home
    identity = register_agent(EnrollmentURI.parse(uri), home)
    console.print(
        f"enrolled as node [bold]{identity.label}[/] ({identity.node_id}) "
        f"with leader {identity.leader_url}"
    )
    console.print(f"identity written to {home.agent_config}", soft_wrap=True)
