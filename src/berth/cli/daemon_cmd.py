"""``berth daemon start|stop|status`` and ``berth status``."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import signal
import subprocess
import sys
import time
from datetime import UTC
from pathlib import Path

import typer
from rich.markup import escape
from rich.table import Table

from berth.api import DaemonInfo, ListenerInfo
from berth.api.client import DaemonClient
from berth.cli.common import console, context, err_console, print_json, print_table
from berth.cli.context import HELP_OPTIONS, CliContext
from berth.cli.daemon_service_cmd import install_service
from berth.cli.leadership_lines import database_line, role_line, say_controller_when_stopped
from berth.config import Settings
from berth.errors import ConfigError, DaemonError
from berth.humanize import age
from berth.paths import BerthHome
from berth.restart_backoff import RunRecord, next_run, read_record, start_delay_s, write_record
from berth.runtime.proc import pid_running
from berth.store import Store

daemon_app = typer.Typer(
    context_settings=HELP_OPTIONS,
    help="Start, stop and inspect the leader daemon.",
    no_args_is_help=True,
)

daemon_app.command("install-service")(install_service)

#: Seconds ``berth daemon start`` waits for the daemon to answer on its socket.
START_TIMEOUT_S = 60.0


def _flags(**values: object) -> dict[str, object]:
    return {name: value for name, value in values.items() if value is not None}


@daemon_app.command("start")
def start(
    ctx: typer.Context,
    foreground: bool = typer.Option(False, "--foreground", help="Stay attached; log to stderr."),
    restart_backoff: bool = typer.Option(
        False,
        "--restart-backoff",
        help="With --foreground, under a service manager with no rising restart delay "
        "(systemd before 254): wait longer before starting after each failed run in a row, "
        "up to 5 minutes (install-service writes it where needed).",
    ),
    public_host: str | None = typer.Option(None, help="Host name clients use for the leader."),
    public_port: int | None = typer.Option(None, help="Port of the public HTTPS listener."),
    public_bind: str | None = typer.Option(None, help="Address the public listener binds."),
    public_cert: Path | None = typer.Option(None, help="PEM certificate for the public listener."),
    public_key: Path | None = typer.Option(None, help="PEM private key for --public-cert."),
    cluster_host: str | None = typer.Option(None, help="Host name agents use for the leader."),
    cluster_port: int | None = typer.Option(None, help="Port of the cluster listener."),
    cluster_bind: str | None = typer.Option(None, help="Address the cluster listener binds."),
    leader_url: str | None = typer.Option(None, help="Cluster URL advertised to agents."),
    leader_only: bool | None = typer.Option(
        None,
        "--leader-only/--no-leader-only",
        help="Run no engines on this host: a control plane for agents only.",
        show_default=False,
    ),
) -> None:
    """Start the leader: HTTPS on the public listener, the cluster listener for agents, the
    CLI socket and, unless leader-only, the local node's engines."""
    cli = context(ctx)
    flags = _flags(
        public_host=public_host,
        public_port=public_port,
        public_bind=public_bind,
        public_cert=str(public_cert) if public_cert else None,
        public_key=str(public_key) if public_key else None,
        cluster_host=cluster_host,
        cluster_port=cluster_port,
        cluster_bind=cluster_bind,
        leader_url=leader_url,
        leader_only=leader_only,
    )
    settings = Settings.load(cli.home, flags=flags)
    if settings.public_cert is not None and settings.public_key is not None:
        from berth.daemon.public_tls import public_ssl_context

        public_ssl_context(settings.public_cert, settings.public_key)  # refused here, not in a log
    if foreground:
        _run_foreground(cli.home, settings, restart_backoff=restart_backoff)
        return
    if restart_backoff:
        raise ConfigError("--restart-backoff applies to --foreground (a service's own start)")
    with cli.client() as client:
        if client.is_running():
            raise DaemonError(f"a berth daemon is already running for {cli.home.root}")
    cli.home.ensure()
    argv = [
        sys.executable,
        "-m",
        "berth",
        "--home",
        str(cli.home.root),
        "daemon",
        "start",
        "--foreground",
    ]
    for name, value in flags.items():
        option = f"--{name.replace('_', '-')}"
        if isinstance(value, bool):  # an on/off switch: --leader-only / --no-leader-only
            argv.append(option if value else option.replace("--", "--no-", 1))
        else:
            argv += [option, str(value)]
    log_file = cli.home.daemon_log
    log_offset = log_file.stat().st_size if log_file.exists() else 0
    with open(log_file, "ab") as log_out:
        process = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=log_out,
            stderr=log_out,
            start_new_session=True,
            cwd="/",
        )
    info = _wait_started(cli, process, log_file, log_offset)
    with cli.client() as client:
        leader = client.leader()
    _print_banner(info, log_file, role=role_line(leader), database=database_line(settings))


def _run_foreground(home: BerthHome, settings: Settings, *, restart_backoff: bool) -> None:
    """Run the leader in this process until it stops; exit with its status (0, or
    ``STANDBY_RESTART_EXIT`` after a hand-over).  With ``restart_backoff``, wait first after
    failed runs in a row and record this run (:mod:`berth.restart_backoff`)."""
    from berth import eventloop
    from berth.daemon.server import serve  # the server stack loads only when needed

    logging.basicConfig(
        level=settings.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    # httpx logs every request at INFO: each health probe, every few seconds per engine.
    logging.getLogger("httpx").setLevel(max(logging.WARNING, logging.getLogger().level))
    record = _wait_out_failures(home) if restart_backoff else None
    status = eventloop.run(serve(home, settings))
    if record is not None:  # ended cleanly: the next start waits for nothing
        restart_backoff_record(home, dataclasses.replace(record, clean_exit=True))
    if status:
        raise typer.Exit(status)


def _wait_out_failures(home: BerthHome) -> RunRecord:
    """Wait as long as the failed runs before this one ask, then record this run."""
    path = home.restart_record("leader")
    previous = read_record(path)
    run = next_run(previous, time.time())
    delay_s = start_delay_s(run.failures)
    if delay_s > 0 and previous is not None:
        logging.getLogger("berth.daemon").warning(
            "%d failed runs in a row (the last started %.0f s ago): waiting %.0f s more before "
            "starting (--restart-backoff; %s)",
            run.failures,
            run.started_at - previous.started_at,
            delay_s,
            path,
        )
        time.sleep(delay_s)  # a service manager's stop (SIGTERM) ends it at once
    run = dataclasses.replace(run, started_at=time.time())
    restart_backoff_record(home, run)
    return run


def restart_backoff_record(home: BerthHome, record: RunRecord) -> None:
    """Write the leader's restart record; a home that cannot take it is logged, not fatal
    (the delay is a courtesy to the host, never a reason not to start)."""
    try:
        home.ensure()
        write_record(home.restart_record("leader"), record)
    except OSError as exc:
        logging.getLogger("berth.daemon").warning("cannot write the restart record: %s", exc)


def _wait_started(
    cli: CliContext, process: subprocess.Popen[bytes], log_file: Path, log_offset: int
) -> DaemonInfo:
    deadline = time.monotonic() + START_TIMEOUT_S
    with cli.client(timeout_s=5.0) as client:
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise _start_failure(process.returncode, log_file, log_offset)
            if client.is_running():
                info = client.info()
                # Another start may have won the race for this home: only our child counts.
                if info.ready and info.pid == process.pid:
                    return info
            time.sleep(0.2)
    raise DaemonError(f"the daemon did not answer within {START_TIMEOUT_S:.0f}s; see {log_file}")


def _start_failure(code: int, log_file: Path, log_offset: int) -> DaemonError:
    """The reason a background start failed: the last line this start wrote, then the rest."""
    with open(log_file, "rb") as log_in:
        log_in.seek(log_offset)
        lines = log_in.read().decode("utf-8", "replace").strip().splitlines()
    reason = lines[-1].removeprefix("error: ") if lines else f"exit code {code}"
    tail = "\n".join(lines[-15:-1])
    message = f"the daemon failed to start: {reason}"
    if tail:
        message += f"\nearlier lines of {log_file}:\n{tail}"
    return DaemonError(message)


def _print_banner(info: DaemonInfo, log_file: Path, *, role: str, database: str) -> None:
    """The started leader: its listeners, CA, log, mode, runtimes, GPUs; whether it joined
    as the controller or a standby member (``role``), and its ``database`` (issue 41)."""
    console.print(
        f"[bold green]berth leader running[/] (pid {info.pid}, v{info.version})", markup=True
    )
    for listener in info.listeners:
        console.print(f"  {listener.name:<15} {listener.url}", soft_wrap=True)
    console.print(f"  {'CA fingerprint':<15} {info.ca_fingerprint}", soft_wrap=True)
    console.print(f"  {'CA certificate':<15} {info.ca_file}", soft_wrap=True)
    console.print(f"  {'log':<15} {log_file}", soft_wrap=True)
    console.print(f"  {'role':<15} {role}", soft_wrap=True, markup=False)
    console.print(f"  {'database':<15} {database}", soft_wrap=True, markup=False)
    if info.leader_only:
        console.print(
            f"  {'mode':<15} leader-only: no engines on this host; run models on agents "
            "(berth run MODEL --node LABEL)",
            soft_wrap=True,
        )
    for runtime in info.runtimes:
        mark = "[green]available[/]" if runtime.available else "[yellow]unavailable[/]"
        label = f"runtime {runtime.name}"
        console.print(
            f"  {label:<15} {mark}: {escape(runtime.detail)}", soft_wrap=True, markup=True
        )
    if info.simulated_gpus_mb:
        sizes = ", ".join(f"{size} MiB" for size in info.simulated_gpus_mb)
        console.print(
            f"  {'GPUs':<15} [yellow]simulated[/]: {sizes} (simulated_gpus, a testing aid: "
            "NVML is not asked; engines run on the CPU)",
            soft_wrap=True,
            markup=True,
        )
    if info.public_cert_from_ca:
        console.print(
            f"[yellow]note:[/] the public listener's certificate is issued by the berth CA "
            f"(no --public-cert); clients must trust {escape(str(info.ca_file))}",
            soft_wrap=True,
            markup=True,
        )


@daemon_app.command("stop")
def stop(
    ctx: typer.Context,
    timeout: float = typer.Option(90.0, help="Seconds to wait for engines to stop."),
    no_drain: bool = typer.Option(
        False, "--no-drain", help="Close the listeners at once, without the drain_s drain."
    ),
) -> None:
    """Stop the daemon and every engine it started.

    A leader that serves first drains for ``drain_s`` seconds (``/readyz`` answers 503 while
    requests are still served, so a load balancer moves away first); ``--no-drain`` sends the
    second SIGTERM that ends the drain at once."""
    home = context(ctx).home
    pid = _daemon_pid(home)
    if pid is None:
        console.print("berth daemon is not running")
        _warn_about_orphans(home)
        return
    drain_s = Settings.load(home).drain_s
    os.kill(pid, signal.SIGTERM)
    if no_drain and drain_s > 0:
        time.sleep(0.2)  # two signals sent back to back may reach the daemon as one
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    label = "stopping the daemon and its engines"
    if drain_s > 0 and not no_drain:
        label = f"draining (at most {drain_s:g} s: /readyz 503, still serving), then {label}"
    deadline = time.monotonic() + timeout + (0.0 if no_drain else drain_s)
    with console.status(label):
        while time.monotonic() < deadline:
            if not pid_running(pid):
                console.print(f"berth daemon stopped (pid {pid})")
                return
            time.sleep(0.2)
    raise DaemonError(f"daemon (pid {pid}) still running after {timeout:.0f}s")


def _warn_about_orphans(home: BerthHome) -> None:
    """After a crash the store may still list engines that run on: say so, and how to fix it."""
    if not home.db_file.exists():
        return
    settings = Settings.load(home)
    store = Store(settings.database_url)
    try:
        active = store.list_deployments(active_only=True)
    finally:
        store.close()
    if active:
        ids = ", ".join(f"{r.id} (pid {r.pid or '?'})" for r in active)
        err_console.print(
            f"warning: the daemon did not shut down cleanly; these deployments may still run: "
            f"{ids}. Run `berth daemon start` (it re-attaches or stops them), then "
            "`berth daemon stop`.",
            markup=False,
        )


def _daemon_pid(home: BerthHome) -> int | None:
    """The running daemon's pid: as it reports itself over the socket, else from the pid file
    when that process really is a berth daemon.  A stale pid file (its pid recycled by some
    other program after a crash) is removed, and that program is never signalled."""
    with DaemonClient(home, timeout_s=5.0) as client, contextlib.suppress(DaemonError):
        # An answer this berth cannot read (a daemon of another version): the pid file.
        if client.is_running():
            return client.info().pid
    try:
        pid = int(home.pid_file.read_text().strip())
    except (FileNotFoundError, ValueError):
        return None
    if pid_running(pid) and _is_berth_daemon(pid):
        return pid
    home.pid_file.unlink(missing_ok=True)
    return None


def _is_berth_daemon(pid: int) -> bool:
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return b"berth" in b" ".join(argv) and b"daemon" in argv and b"--foreground" in argv


@daemon_app.command("status")
def daemon_status(
    ctx: typer.Context, as_json: bool = typer.Option(False, "--json", help="Print JSON.")
) -> None:
    """Whether the daemon runs, its pid, uptime and listeners."""
    with context(ctx).client() as client:
        info = client.info()
    if as_json:
        print_json(info)
        return
    mode = ", leader-only (no local engines)" if info.leader_only else ""
    console.print(f"[green]running[/] pid {info.pid}, up {age(info.uptime_s)}{mode}", markup=True)
    for listener in info.listeners:
        console.print(f"  {listener.name:<8} {listener.url}{_certificate_note(listener)}",
                      soft_wrap=True)  # fmt: skip
    console.print(f"  CA       {info.ca_fingerprint}", soft_wrap=True)


def _certificate_note(listener: ListenerInfo) -> str:
    """`` (certificate until 2027-12-02 03:13 UTC)``: when the certificate a TLS listener
    serves now ends (its serial is in ``--json``); ``""`` for the socket."""
    if listener.certificate_not_after is None:
        return ""
    return (
        f" (certificate until {listener.certificate_not_after.astimezone(UTC):%Y-%m-%d %H:%M} UTC)"
    )


def status(
    ctx: typer.Context, as_json: bool = typer.Option(False, "--json", help="Print JSON.")
) -> None:
    """The daemon, its listeners, nodes and deployments at a glance.

    With the daemon stopped and leadership shared, the controller as the database has it."""
    cli = context(ctx)
    try:
        with cli.client() as client:
            info = client.info()
            leader = client.leader()
            nodes = client.nodes()
            deployments = client.deployments(active=True)
    except DaemonError:
        say_controller_when_stopped(cli.home)
        raise
    if as_json:
        print_json({"daemon": info, "leader": leader, "nodes": nodes, "deployments": deployments})
        return
    console.print(
        f"[bold]daemon[/]  [green]running[/] pid {info.pid}, up {age(info.uptime_s)}, "
        f"home {escape(str(info.home))}{', leader-only' if info.leader_only else ''}",
        markup=True,
    )
    if leader.ha:  # shared leadership (leader_ha): this leader's role and the active's address
        console.print(
            f"  leader   {leader.role}, epoch {leader.epoch}, active "
            f"{leader.active_address or 'none'}; {role_line(leader)}",
            soft_wrap=True,
            markup=False,
        )
    for listener in info.listeners:
        console.print(f"  {listener.name:<8} {listener.url}{_certificate_note(listener)}")
    node_table = Table(
        "NODE", "LABEL", "STATUS", "HOST", "GPUS", "VRAM", title="nodes", title_justify="left"
    )
    for node in nodes:
        vram_mb = node.vram_total_mb
        node_table.add_row(
            node.id,
            node.label,
            node.status,
            node.hostname or "-",
            str(node.gpu_count),
            f"{vram_mb / 1024:.1f} GiB" if vram_mb else "-",
        )
    print_table(node_table)
    from berth.cli.deploy_cmd import print_deployments

    print_deployments(deployments, title="deployments")
