"""``berth agent register``, ``start``, ``status``, ``logs`` and ``install-service``: the
agent side.

These commands run on an agent host and do not need a leader daemon on it.
"""

from __future__ import annotations

import os
import pwd
import sys
import time
from pathlib import Path

import typer
from rich.markup import escape

from berth.agent import systemd_unit
from berth.agent.systemd_unit import UnitScope
from berth.cli import adopt_cmd, service_install
from berth.cli.common import console, context, err_console
from berth.cli.context import HELP_OPTIONS
from berth.errors import ConfigError, ConflictError
from berth.paths import BerthHome, resolve_home

#: Who the service runs, in the install messages.
_RUNS = "the agent"

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
    from berth.cluster.pki.enrollment import EnrollmentURI

    home = context(ctx).home
    parsed = EnrollmentURI.parse(uri)
    if home.agent_config.exists() and not force:
        raise ConflictError(
            f"{home.root} is already enrolled ({home.agent_config}); "
            "add --force to replace its identity"
        )
    identity = register_agent(parsed, home)
    console.print(
        f"enrolled as node [bold]{escape(identity.label)}[/] ({identity.node_id}) "
        f"with leader {escape(identity.leader_url)}",
        markup=True,
    )
    console.print(f"identity written to {home.agent_config}", soft_wrap=True)


@app.command("start")
def start(
    ctx: typer.Context,
    verbose: bool = typer.Option(
        False, "--verbose", "-v", help="Log to the terminal (debug level) instead of the panel."
    ),
    advertise: str | None = typer.Option(
        None,
        "--advertise",
        metavar="HOST:PORT",
        help="Serve the leader's requests directly at this address, which the leader must "
        "reach (a LAN address; open the port to the leader): the direct data path. "
        "Setting agent_advertise.",
    ),
    paced_restarts: bool = typer.Option(
        False,
        "--paced-restarts",
        help="After failing exits in a row, wait longer before dialling (5 s growing to "
        "300 s): the unit passes it where systemd cannot raise the interval itself.",
    ),
) -> None:
    """Dial the leader and serve this host's engines until stopped (Ctrl-C).

    Exits 0 when stopped, 78 when the leader refused the node for good (enroll it again:
    the command is printed), 1 on another final refusal."""
    from berth import eventloop
    from berth.agent.exit_status import (
        EXIT_FAILED,
        Failures,
        after_exit,
        read_failures,
        write_failures,
    )
    from berth.agent.runner import run_agent
    from berth.config.table import address_problem

    problem = address_problem(advertise) if advertise is not None else None
    if problem is not None:
        raise typer.BadParameter(problem, param_hint="'--advertise'")
    home = context(ctx).home
    flags = {"agent_advertise": advertise}
    started_at = time.time()
    failures = read_failures(home.root) if paced_restarts else Failures()
    code = EXIT_FAILED  # unless run_agent returns: an error is a failing exit too
    try:
        code = eventloop.run(
            run_agent(
                home,
                verbose=verbose,
                console=console,
                flags=flags,
                failures_in_a_row=failures.in_a_row,
            )
        )
    finally:
        if paced_restarts and home.root.is_dir():
            write_failures(home.root, after_exit(failures, code, started_at, time.time()))
    raise typer.Exit(code)


@app.command("status")
def status(
    ctx: typer.Context,
    as_json: bool = typer.Option(False, "--json", help="Print JSON."),
) -> None:
    """Whether the agent runs, its link to the leader, and its recent activity."""
    import time

    from berth.agent.runner import read_status
    from berth.cli.common import print_json
    from berth.humanize import age

    home = context(ctx).home
    data = read_status(home)
    if data is None:
        err_console.print(f"no agent has run for {home.root} (start one with: berth agent start)")
        raise typer.Exit(1)
    if as_json:
        print_json(data)
        raise typer.Exit(0 if data["running"] else 1)
    state = str(data["state"]) if data["running"] else "not running"
    if _certificate_expired(home):
        state = "expired (the certificate; see fix below)"
    if data["running"] and state != "connected":
        state = f"disconnected ({state})"  # the link is down: dialling or backing off
    console.print(f"agent   {state} (pid {data['pid']})")
    console.print(f"leader  {data['leader_url']}")
    console.print(f"node    {data['label']} ({data['node_id']})")
    since = data.get("connected_since")
    if data["running"] and isinstance(since, int | float):
        console.print(f"linked  {age(time.time() - since)}")
    if data.get("last_error"):
        console.print(f"error   {data['last_error']}", soft_wrap=True)
    expired = _print_certificate(home, data)
    if data.get("fix") and not expired:  # refused for good: enroll the node again
        console.print(f"fix     {data['fix']}", soft_wrap=True)
    for line in data.get("recent") or []:  # type: ignore[attr-defined]
        console.print(f"  {line}", style="dim", soft_wrap=True)
    raise typer.Exit(0 if data["running"] and not expired else 1)


def _certificate_expired(home: BerthHome) -> bool:
    from berth.agent.renewal import read_certificate

    facts = read_certificate(home.agent_cert)
    return facts is not None and facts.not_after <= time.time()


def _print_certificate(home: BerthHome, data: dict[str, object]) -> bool:
    """Print the certificate line (read from ``agent.crt``: true also of an agent that is
    not running), the renewal's state, and the fix when it expired; whether it did."""
    from berth.agent.renewal import REENROLL_HINT, certificate_line, read_certificate

    facts = read_certificate(home.agent_cert)
    if facts is None:
        return False
    console.print(f"cert    {certificate_line(facts, time.time())}", soft_wrap=True)
    certificate = data.get("certificate")
    renewal = certificate.get("renewal") if isinstance(certificate, dict) else None
    if renewal and data["running"]:
        console.print(f"renewal {renewal}", soft_wrap=True)
    if facts.not_after > time.time():
        return False
    label = str(data.get("label") or "LABEL")
    console.print(f"fix     {REENROLL_HINT.format(label=label)}", soft_wrap=True)
    return True


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

    from berth.runtime.engine_log import follow_log, read_log_tail

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


@app.command("install-service")
def install_service(
    ctx: typer.Context,
    system: bool = service_install.SYSTEM_OPTION,
    user_name: str | None = typer.Option(
        None, "--user-name", help="With --system: the account to run the agent as (not root)."
    ),
    unit_dir: Path | None = service_install.UNIT_DIR_OPTION,
    no_start: bool = service_install.NO_START_OPTION,
    dry_run: bool = service_install.DRY_RUN_OPTION,
    force: bool = service_install.FORCE_OPTION,
) -> None:
    """Run the agent as a systemd service: write berth-agent.service, enable and start it.

    Default: a unit for your own user manager; --system: a system unit that runs as $SUDO_USER.
    Never as root; the unit runs this Python with --home, so it does not depend on PATH.
    """
    from berth.agent.identity import load_agent_identity

    scope: UnitScope = "system" if system else "user"
    if user_name is not None and not system:
        raise ConfigError("--user-name applies to --system only; a user unit runs as you")
    home = context(ctx).home
    account: pwd.struct_passwd | None = None
    if system:
        name = systemd_unit.service_user_name(
            sudo_user=os.environ.get("SUDO_USER"), user_name=user_name
        )
        account = service_install.service_account(name, runs=_RUNS)
        if not service_install.home_given(ctx):
            # sudo sets HOME to root's: the default home is the service user's, not root's.
            home = BerthHome(resolve_home(Path(account.pw_dir) / ".berth"))
    elif os.geteuid() == 0:
        service_install.warn(
            "this user unit runs the agent as root; prefer `sudo berth agent install-service "
            "--system` from the account that should run it"
        )
    if not home.agent_config.exists():
        raise ConfigError(
            f"{home.root} has no agent identity; register this host first with "
            "`berth agent register --uri '...'` (the URI `berth nodes enroll` prints)"
        )
    identity = load_agent_identity(home)
    if account is not None:
        service_install.check_home_owner(home.root, account, runs=_RUNS, reads="its key")
    systemctl = service_install.find_systemctl()
    unit = systemd_unit.AgentUnit(
        scope=scope,
        python=Path(sys.executable).absolute(),  # not resolved: a venv's python is a symlink
        home=home.root,
        label=identity.label,
        leader_url=identity.leader_url,
        user_name=account.pw_name if account else None,
        search_path=systemd_unit.search_path_for(
            Path(sys.executable).absolute(), os.environ.get("PATH")
        ),
        systemd_version=service_install.systemd_version(systemctl),
    )
    text = systemd_unit.render_unit(unit)
    if dry_run:
        sys.stdout.write(text)
        return

    directory = unit_dir or systemd_unit.default_unit_dir(
        scope, user_home=Path.home(), xdg_config_home=os.environ.get("XDG_CONFIG_HOME")
    )
    written = service_install.write_unit(
        directory.absolute() / systemd_unit.UNIT_NAME, text, force=force, system=system
    )
    if written.existed and not written.replaced:
        console.print(f"{written.path} is up to date", soft_wrap=True, markup=False)
    else:
        runs_as = f"runs as {unit.user_name}" if unit.user_name else "runs as you"
        console.print(
            f"wrote {written.path} ({scope} unit; node {identity.label}, {runs_as}, "
            f"home {home.root})",
            soft_wrap=True,
            markup=False,
        )
    if not written.existed:
        _warn_if_agent_running(home)
    if service_install.activate(
        scope, systemctl, systemd_unit.UNIT_NAME, restart=written.replaced, no_start=no_start
    ):
        flag = "--user " if scope == "user" else ""
        console.print(
            f"{systemd_unit.UNIT_NAME} is enabled and started; check it with `berth agent "
            f"status` and `journalctl {flag}-u berth-agent -f`",
            soft_wrap=True,
        )
    if scope == "user":
        service_install.hint_linger()


def _warn_if_agent_running(home: BerthHome) -> None:
    from berth.agent.runner import read_status

    try:
        data = read_status(home)
    except ConflictError:
        return  # a malformed status file says nothing about a running agent
    if data is not None and data["running"]:
        service_install.warn(
            f"an agent already runs for {home.root} (pid {data['pid']}); stop it, or the "
            "service keeps failing (and retrying) until it does"
        )


# Servers this host runs without berth (src/berth/cli/adopt_cmd.py).
app.command("adopt")(adopt_cmd.adopt)
app.command("adopted")(adopt_cmd.adopted)
app.command("unadopt")(adopt_cmd.unadopt)
