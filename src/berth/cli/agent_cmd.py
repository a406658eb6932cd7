"""``berth agent register``, ``start``, ``status``, ``logs`` and ``install-service``: the
agent side.

These commands run on an agent host and do not need a leader daemon on it.
"""

from __future__ import annotations

import os
import pwd
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import typer
from rich.markup import escape

from berth.agent import systemd_unit
from berth.agent.systemd_unit import UnitScope
from berth.atomic import write_atomic
from berth.cli import adopt_cmd
from berth.cli.common import console, context, err_console
from berth.cli.context import HELP_OPTIONS
from berth.errors import BerthError, ConfigError, ConflictError
from berth.paths import BerthHome, resolve_home

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
    system: bool = typer.Option(
        False,
        "--system/--user",
        help="A system unit in /etc/systemd/system running as $SUDO_USER (run it via sudo), "
        "or a unit for your own user manager (the default).",
    ),
    user_name: str | None = typer.Option(
        None, "--user-name", help="With --system: the account to run the agent as (not root)."
    ),
    unit_dir: Path | None = typer.Option(
        None,
        "--unit-dir",
        help="Write the unit in this folder instead of systemd's (packaging, tests).",
    ),
    no_start: bool = typer.Option(
        False, "--no-start", help="Write the unit; print the systemctl commands, run none."
    ),
    dry_run: bool = typer.Option(
        False, "--dry-run", "--print", help="Print the unit on stdout; write nothing."
    ),
    force: bool = typer.Option(False, "--force", help="Replace a different existing unit."),
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
        account = _account(name)
        if not _home_given(ctx):
            # sudo sets HOME to root's: the default home is the service user's, not root's.
            home = BerthHome(resolve_home(Path(account.pw_dir) / ".berth"))
    elif os.geteuid() == 0:
        _warn(
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
        _check_home_owner(home, account)
    systemctl = shutil.which("systemctl")
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
        systemd_version=_systemd_version(systemctl),
    )
    text = systemd_unit.render_unit(unit)
    if dry_run:
        sys.stdout.write(text)
        return

    directory = unit_dir or systemd_unit.default_unit_dir(
        scope, user_home=Path.home(), xdg_config_home=os.environ.get("XDG_CONFIG_HOME")
    )
    path = directory.absolute() / systemd_unit.UNIT_NAME
    try:
        existing = path.read_text() if path.exists() else None
    except OSError as exc:
        raise ConfigError(f"cannot read {path}: {exc.strerror}") from None
    replaced = existing is not None and existing != text
    if replaced and not force:
        raise ConflictError(
            f"{path} exists and differs from the unit berth would write; add --force to "
            "replace it (--dry-run prints the new one)"
        )
    if existing == text:
        console.print(f"{path} is up to date", soft_wrap=True, markup=False)
    else:
        _write_unit(path, text, system=system)
        runs_as = f"runs as {unit.user_name}" if unit.user_name else "runs as you"
        console.print(
            f"wrote {path} ({scope} unit; node {identity.label}, {runs_as}, home {home.root})",
            soft_wrap=True,
            markup=False,
        )
    if existing is None:
        _warn_if_agent_running(home)
    _activate(scope, systemctl, restart=replaced, no_start=no_start)
    if scope == "user":
        _hint_linger()


def _home_given(ctx: typer.Context) -> bool:
    """Whether the home was chosen (``--home`` or ``$BERTH_HOME``) rather than defaulted."""
    return ctx.find_root().params.get("home") is not None or bool(os.environ.get("BERTH_HOME"))


def _account(name: str) -> pwd.struct_passwd:
    """The passwd entry of ``name``; :class:`ConfigError` when there is none or it is uid 0."""
    try:
        account = pwd.getpwnam(name)
    except KeyError:
        raise ConfigError(f"there is no user {name!r} on this host") from None
    if account.pw_uid == 0:
        raise ConfigError(
            f"refusing to write a unit that runs the agent as root ({name} has uid 0): run it "
            "via sudo from the account that should run the agent, or pass --user-name NAME"
        )
    return account


def _check_home_owner(home: BerthHome, account: pwd.struct_passwd) -> None:
    """Refuse a home the service user does not own: the agent could not read its key."""
    owner_uid = home.root.stat().st_uid
    if owner_uid == account.pw_uid:
        return
    try:
        owner = pwd.getpwuid(owner_uid).pw_name
    except KeyError:
        owner = f"uid {owner_uid}"
    fix = f"sudo chown -R {account.pw_name} {shlex.quote(str(home.root))}"
    if owner_uid != 0:
        fix = f"pass --user-name {owner}, or {fix}"
    raise ConfigError(
        f"{home.root} belongs to {owner}, not {account.pw_name}, who would run the agent "
        f"and could not read its key; {fix}"
    )


def _systemd_version(systemctl: str | None) -> int | None:
    """The running systemd's release from ``systemctl --version``; ``None`` if unknown."""
    if systemctl is None:
        return None
    try:
        result = subprocess.run(
            [systemctl, "--version"], capture_output=True, text=True, timeout=10, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return systemd_unit.parse_systemd_version(result.stdout) if result.returncode == 0 else None


def _write_unit(path: Path, text: str, *, system: bool) -> None:
    """Write ``path`` atomically, mode 0644 (systemd reads units as any user)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, text, mode=0o644)
    except OSError as exc:
        hint = " (a --system unit needs root: run it via sudo)" if system else ""
        raise ConfigError(f"cannot write {path}: {exc.strerror}{hint}") from None


def _activate(scope: UnitScope, systemctl: str | None, *, restart: bool, no_start: bool) -> None:
    """Run (or, where that cannot work, print) the systemctl commands that start the unit."""
    commands = systemd_unit.systemctl_commands(scope, restart=restart)
    flag = "--user " if scope == "user" else ""
    reason = None
    if no_start:
        reason = "to load and start it"
    elif systemctl is None:
        reason = "systemctl is not installed here; on a systemd host, run"
    elif not Path("/run/systemd/system").is_dir():
        reason = "systemd is not running on this host (no /run/systemd/system); where it is, run"
    if reason is not None:
        console.print(f"{reason}:")
        for command in commands:
            console.print(f"  {shlex.join(command)}", soft_wrap=True, markup=False)
        return
    assert systemctl is not None
    for command in commands:
        console.print(f"$ {shlex.join(command)}", soft_wrap=True, markup=False)
        result = subprocess.run(
            [systemctl, *command[1:]], capture_output=True, text=True, timeout=120, check=False
        )
        if result.returncode != 0:
            detail = (result.stderr or result.stdout).strip().splitlines()
            raise BerthError(
                f"`{shlex.join(command)}` failed ({detail[0] if detail else result.returncode}); "
                "the unit is written: fix that and run the remaining systemctl commands"
            )
    console.print(
        f"{systemd_unit.UNIT_NAME} is enabled and started; check it with `berth agent status` and "
        f"`journalctl {flag}-u berth-agent -f`",
        soft_wrap=True,
    )


def _warn_if_agent_running(home: BerthHome) -> None:
    from berth.agent.runner import read_status
    from berth.errors import ConflictError

    try:
        data = read_status(home)
    except ConflictError:
        return  # a malformed status file says nothing about a running agent
    if data is not None and data["running"]:
        _warn(
            f"an agent already runs for {home.root} (pid {data['pid']}); stop it, or the "
            "service keeps failing (and retrying) until it does"
        )


def _hint_linger() -> None:
    """Say how to start a user unit at boot, unless lingering is already on."""
    name = pwd.getpwuid(os.geteuid()).pw_name
    if not (Path("/var/lib/systemd/linger") / name).exists():
        console.print(
            f"a user unit runs while {name} is logged in; to start it at boot: "
            f"sudo loginctl enable-linger {name}",
            soft_wrap=True,
            markup=False,
        )


def _warn(message: str) -> None:
    err_console.print(f"warning: {message}", markup=False, soft_wrap=True)


# Servers this host runs without berth (src/berth/cli/adopt_cmd.py).
app.command("adopt")(adopt_cmd.adopt)
app.command("adopted")(adopt_cmd.adopted)
app.command("unadopt")(adopt_cmd.unadopt)
