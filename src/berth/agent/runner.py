"""``berth agent start``: one agent process, from its identity to a final refusal or a signal.

It builds the same agent core and process runtime the leader uses for its own node (with a
journal of running engines, so a restarted agent takes its engines back), dials the leader,
and shows a live status panel on a terminal. The full log always goes to
``$BERTH_HOME/logs/agent.log``. SIGINT/SIGTERM close the link; engines keep running (their
deployments belong to the leader: ``berth stop`` ends them) and the next agent re-attaches
them.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import os
import signal
import time
from collections.abc import Mapping

from cryptography import x509
from rich.console import Console, Group
from rich.live import Live
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from berth.agent.adopted import AdoptedWatcher
from berth.agent.core import AgentCore
from berth.agent.dialer import AgentDialer, AgentStatus
from berth.agent.exit_status import EXIT_REENROLL, exit_status, paced_wait_s
from berth.agent.identity import (
    AgentIdentity,
    load_agent_identity,
    pinned_bundle,
    read_agent_document,
)
from berth.agent.ingress import AgentIngress
from berth.agent.leaders import LEADERS_FILE, LeaderList
from berth.agent.owner import own_engines
from berth.agent.policy import policy_from_document
from berth.agent.renewal import REENROLL_HINT, CertificateFacts, certificate_line
from berth.agent.service import AgentService
from berth.agent.spec_keys import pinned_spec_keys
from berth.cluster.protocol.errors import CloseCode
from berth.config import Settings
from berth.errors import ConfigError, ConflictError
from berth.eventloop import freeze_startup_objects
from berth.humanize import age
from berth.observability.loop_lag import LoopLagMonitor
from berth.observability.tracing_setup import open_tracing
from berth.paths import BerthHome
from berth.runtime.docker import DockerRuntime, resolve_docker_host
from berth.runtime.engines import EngineBinaries
from berth.runtime.gpu import inventory_for
from berth.runtime.proc import pid_running
from berth.runtime.process import ProcessRuntime
from berth.vocab.agent_policy import AgentPolicy

log = logging.getLogger("berth.agent")

_FINAL_HINTS = {
    CloseCode.NODE_REMOVED: "the node was removed from the cluster",
    CloseCode.BAD_CERTIFICATE: "the leader knows no node of this certificate",
    CloseCode.CERTIFICATE_EXPIRED: "the certificate expired before it was renewed",
    CloseCode.SUPERSEDED: "another agent with this identity is connected; stop one of them",
    CloseCode.UNSUPPORTED_VERSION: "the leader speaks another protocol version; upgrade berth",
}


def read_status(home: BerthHome) -> dict[str, object] | None:
    """The last status an agent wrote, with ``running`` saying whether its process lives."""
    path = home.agent_status_file
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except ValueError as exc:
        raise ConflictError(f"{path}: malformed agent status file: {exc}") from None
    pid = data.get("pid")
    data["running"] = isinstance(pid, int) and pid_running(pid) and data.get("state") != "stopped"
    return dict(data)


def _configure_logging(home: BerthHome, *, verbose: bool, to_stderr: bool) -> None:
    root = logging.getLogger()
    root.setLevel(logging.DEBUG if verbose else logging.INFO)
    for handler in list(root.handlers):
        root.removeHandler(handler)
    file_handler = logging.FileHandler(home.agent_log)
    file_handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root.addHandler(file_handler)
    if to_stderr:
        stream = logging.StreamHandler()
        stream.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
        root.addHandler(stream)
    for noisy in ("aiohttp.access", "asyncio", "httpx"):  # httpx: a line per health probe
        logging.getLogger(noisy).setLevel(logging.WARNING)


def render_status(status: AgentStatus) -> Panel:
    """The live panel: status, leader, node, uptime, operation, last error, activity."""
    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="bold")
    grid.add_column()
    colour = {"connected": "green", "backoff": "yellow", "stopped": "red", "expired": "red"}.get(
        status.state, ""
    )
    grid.add_row("status", Text(status.state, style=colour))
    grid.add_row("leader", status.leader_url)
    grid.add_row("node", f"{status.label} ({status.node_id})")
    grid.add_row("uptime", age(time.time() - status.started_at))
    grid.add_row("operation", status.operation or "-")
    if status.cert_not_after is not None:
        line = certificate_line(CertificateFacts(status.cert_serial, 0.0, status.cert_not_after),
                                time.time())  # fmt: skip
        grid.add_row("certificate", f"{line}; {status.renewal_state or '-'}")
    grid.add_row(
        "last error", Text(status.last_error or "-", style="red" if status.last_error else "")
    )
    recent = Text("\n".join(status.recent) or "-", style="dim")
    return Panel(Group(grid, Text(""), Text("recent activity", style="bold"), recent),
                 title="berth agent", expand=False)  # fmt: skip


async def run_agent(
    home: BerthHome,
    *,
    verbose: bool,
    console: Console,
    flags: Mapping[str, object] | None = None,
    failures_in_a_row: int = 0,
) -> int:
    """Run the agent until a final refusal or SIGINT/SIGTERM; its exit status
    (:func:`berth.agent.exit_status.exit_status`: 0 stopped, 78 the node must be enrolled
    again, 1 another final refusal).

    ``flags`` are settings given on the command line (``agent_advertise``);
    ``failures_in_a_row`` (paced restarts) delays the first dial by
    :func:`~berth.agent.exit_status.paced_wait_s`. Raises
    :class:`berth.errors.ConfigError` when the agent is not registered (no or a malformed
    ``agent.yaml``, or a malformed ``policy:`` in it) or its direct ingress cannot bind its
    port, and :class:`ConflictError` when another agent runs on this home (or holds its
    owner lock), or its engine warden cannot be started (:mod:`berth.agent.owner`).
    """
    identity = load_agent_identity(home)
    home.ensure()
    running = read_status(home)
    if running is not None and running["running"] and running.get("pid") != os.getpid():
        raise ConflictError(f"an agent already runs for {home.root} (pid {running['pid']})")
    panel = console.is_terminal and not verbose
    _configure_logging(home, verbose=verbose, to_stderr=not panel)
    settings = Settings.load(home, flags)
    policy = policy_from_document(
        read_agent_document(home.agent_config),
        path=home.agent_config,
        base=settings.agent_policy(os.environ),
    )
    core = _build_core(home, settings, identity, policy)
    status = AgentStatus(
        identity.leader_url, identity.node_id, identity.label, path=home.agent_status_file
    )
    loop_lag = LoopLagMonitor()  # berth_event_loop_lag_seconds, carried in heartbeats
    # OpenTelemetry: each relay to an engine traced under the leader's request, when
    # [tracing] or OTEL_* name a collector (the agent has no /metrics: its drops are logged
    # when it stops).
    node = {"berth.node": identity.node_id}
    tracing = open_tracing(settings, os.environ, service_name="berth-agent", attributes=node)
    service = AgentService(
        core,
        on_activity=status.activity,
        models_dir=home.models_dir,
        loop_lag=loop_lag.histogram,
        tracer=tracing.relays(identity.node_id) if tracing is not None else None,
    )
    ingress = None
    try:  # a port in use fails the start before any engine is re-attached
        ingress = _ingress(home, settings, identity, service)
        # Held until this process ends; its warden stops the engines if it does not come
        # back.  A start that fails before this leaves the earlier warden in charge.
        await own_engines(home, "agent", settings, identity.node_id)
    except (ConfigError, ConflictError):
        if ingress is not None:
            await ingress.close()
        await service.close()
        core.close()
        raise
    restored = await core.restore()
    if restored:
        status.activity(f"re-attached engines: {', '.join(restored)}")
    assert core.adopted is not None
    await core.adopted.check_once()  # Hello reports the adopted servers as they are now
    core.adopted.start()
    leaders = LeaderList.load(home.root / LEADERS_FILE, identity.leader_url)
    paced_s = paced_wait_s(failures_in_a_row)
    if paced_s > 0:
        status.activity(
            f"paced restart: {failures_in_a_row} failure(s) in a row; dialling in {paced_s:.0f} s"
        )
    dialer = AgentDialer(
        identity,
        service,
        status,
        redial_max_s=settings.redial_max_s,
        leaders=leaders,
        first_dial_after_s=paced_s,
    )
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, lambda: asyncio.ensure_future(dialer.stop()))
    log.info("agent %s (%s) starting; leader %s", identity.label, identity.node_id,
             identity.leader_url)  # fmt: skip
    log.info("agent policy: %s", policy.summary())
    if settings.simulated_gpus:
        # A testing aid that must never go unnoticed on a real GPU host: in the status
        # panel's recent activity and the log.
        status.activity(
            f"simulated GPUs (simulated_gpus): {settings.simulated_gpus}; NVML is not asked, "
            "engines run on the CPU"
        )
    freeze_startup_objects()  # full collections then skip the start-up heap
    loop_lag.start()
    try:
        await _dial(dialer, status, console, panel=panel)
    finally:
        await core.adopted.stop()
        if ingress is not None:
            await ingress.close()
        await service.close()
        core.close()
        loop_lag.stop()
        if tracing is not None:
            if tracing.dropped:
                log.warning("tracing: %d spans dropped, the export queue full", tracing.dropped)
            await asyncio.to_thread(tracing.shutdown)
        status.set("stopped")
    if dialer.final_code == CloseCode.NODE_REMOVED:
        # This host left the cluster: the engines it ran for the leader go with it.
        status.activity("node removed: stopping every engine")
        await core.stop_all(grace_s=settings.stop_grace_s)
    code = exit_status(dialer.final_code)
    if dialer.final_code is not None:
        _print_final(console, status, dialer.final_code, code)
    return code


def _print_final(console: Console, status: AgentStatus, final_code: int, code: int) -> None:
    """Say why the agent stopped on the leader's final refusal ``final_code``, with a hint;
    when the node must be enrolled again, the command comes last (``systemctl status`` shows
    the last lines) and goes to the status file (``berth agent status``)."""
    hint = _FINAL_HINTS.get(CloseCode(final_code), "")
    console.print(f"berth agent stopped: {status.last_error}", soft_wrap=True)
    if hint:
        console.print(hint, soft_wrap=True)
    if code == EXIT_REENROLL:
        status.needs_reenrollment(REENROLL_HINT.format(label=status.label))
        log.error("this node must be enrolled again; fix: %s", status.fix)
        console.print(f"fix: {status.fix}", soft_wrap=True)


def _build_core(
    home: BerthHome, settings: Settings, identity: AgentIdentity, policy: AgentPolicy
) -> AgentCore:
    """The agent's engine core on ``home``: engines, runtimes and inventory of ``settings``,
    starting only what ``policy`` allows."""
    return AgentCore(
        ProcessRuntime(process_tree=settings.process_tree),
        EngineBinaries(
            llama_server=str(settings.llama_server_bin) if settings.llama_server_bin else None,
            vllm=str(settings.vllm_bin) if settings.vllm_bin else None,
            sglang_python=str(settings.sglang_python),
        ),
        inventory_for(settings.simulated_gpus),
        logs_dir=home.logs_dir,
        journal_path=home.agent_engines_file,
        keys_dir=home.engine_keys_dir,
        docker=DockerRuntime(
            host=resolve_docker_host(settings.docker_host),
            home=home.root,
            node_id=identity.node_id,
        ),
        docker_shm_size=settings.docker_shm_size,
        adopted=AdoptedWatcher(home.adopted_file),
        policy=policy,
        spec_keys=functools.partial(pinned_spec_keys, home),  # runs only what was signed
    )


async def _dial(dialer: AgentDialer, status: AgentStatus, console: Console, *, panel: bool) -> int:
    """Run ``dialer`` to its exit code, under the live status panel when ``panel``."""
    if not panel:
        return await dialer.run()
    with Live(render_status(status), console=console, refresh_per_second=2) as live:
        refresher = asyncio.create_task(_refresh(live, status))
        try:
            code = await dialer.run()
        finally:
            refresher.cancel()
        live.update(render_status(status))
    return code


def _ingress(
    home: BerthHome, settings: Settings, identity: AgentIdentity, service: AgentService
) -> AgentIngress | None:
    """The direct ingress when ``agent_advertise`` is set, its port bound (a port in use
    fails the start here), else ``None``."""
    if settings.agent_advertise is None:
        return None
    ingress = AgentIngress(
        node_id=identity.node_id,
        advertise=settings.agent_advertise,
        bind_host=settings.agent_ingress_bind,
        key_path=identity.key_path,
        cert_path=home.root / "ingress.crt",
        ca_certificate=x509.load_pem_x509_certificates(  # every root, not the first only
            pinned_bundle(identity.ca_path.read_bytes(), identity.pins)
        ),
        relay=service.relay.relay_exchange,
        limits=settings.listener_limits(),
    )
    ingress.bind()
    service.use_ingress(ingress)
    log.info("direct ingress bound on %s, advertised as %s", settings.agent_ingress_bind,
             settings.agent_advertise)  # fmt: skip
    return ingress


async def _refresh(live: Live, status: AgentStatus) -> None:
    while True:
        await asyncio.sleep(0.5)
        try:
            live.update(render_status(status))
        except Exception:  # a redraw must never stop the agent; the log says what broke
            log.exception("status panel redraw failed")
