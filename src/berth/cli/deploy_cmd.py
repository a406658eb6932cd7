"""``berth run``, ``berth ps``, ``berth stop`` and ``berth logs``."""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from datetime import UTC, datetime

import typer
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from berth.api import Deployment, DeploymentIn, ListedDeployment
from berth.api.client import DaemonClient
from berth.cli.common import (
    console,
    context,
    err_console,
    print_json,
    print_table,
    record_table,
    request_body,
    word_width,
)
from berth.errors import BerthError, ConfigError, EngineError
from berth.humanize import age, printable
from berth.vocab.policies import check_restart_policy
from berth.vocab.states import DeploymentState

#: The states of a deployment still starting.
STARTING = (DeploymentState.PENDING, DeploymentState.LOADING)
#: Seconds ``berth ps`` keeps listing a deployment after it stopped or failed (``--all``:
#: all of them, however long ago).
PS_ENDED_WITHIN_S = 600


def parse_gpus(text: str | None) -> list[int]:
    """``"0,1"`` → ``[0, 1]``; ``ConfigError`` for anything but comma-separated indexes."""
    if not text:
        return []
    try:
        gpus = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ConfigError(f"--gpu takes GPU indexes like 0 or 0,1, not {text!r}") from None
    if any(g < 0 for g in gpus):
        raise ConfigError(f"--gpu indexes must be 0 or more, not {text!r}")
    return gpus


def run(
    ctx: typer.Context,
    model: str = typer.Argument(..., help="A model registered with `berth models add`."),
    engine: str = typer.Option("llamacpp", "--engine", "-e", help="llamacpp, vllm or sglang."),
    gpu: str | None = typer.Option(None, "--gpu", help="GPU indexes, e.g. 0 or 0,1."),
    ctx_len: int | None = typer.Option(None, "--ctx", min=1, help="Context length in tokens."),
    extra: list[str] = typer.Option(
        [], "--extra-arg", "-x", help="Extra engine argument (repeatable)."
    ),
    served_name: str | None = typer.Option(
        None, "--served-name", help="Model name clients use (default: the model's name)."
    ),
    node: str | None = typer.Option(
        None, "--node", help="Node to run on (default: where it fits, see `berth plan`)."
    ),
    runtime: str | None = typer.Option(
        None,
        "--runtime",
        help="process or docker (default: the default_runtime setting, process unless set).",
    ),
    image: str | None = typer.Option(
        None, "--image", help="Container image (docker runtime; default: the engine's setting)."
    ),
    max_adapters: int | None = typer.Option(
        None,
        "--max-adapters",
        min=1,
        help="vLLM/SGLang: LoRA adapters loaded at once (default: 1 when the model has adapters).",
    ),
    force: bool = typer.Option(
        False,
        "--force",
        help="Run on the GPUs asked for even where its VRAM estimate does not fit.",
    ),
    restart: str = typer.Option(
        "on-failure",
        "--restart",
        help="Start its engine again when it ends: on-failure, always or never.",
    ),
    detach: bool = typer.Option(False, "--detach", "-d", help="Return without waiting."),
    timeout: float = typer.Option(
        900.0, min=1.0, help="Seconds to wait for the engine to be ready."
    ),
) -> None:
    """Deploy a model on an engine and wait until it serves.

    Without --node and --gpu it goes where its VRAM estimate fits the free memory nodes
    report (`berth plan MODEL` shows where, and why); on hosts without GPUs, to this one.
    """
    body = request_body(
        DeploymentIn,
        model=model,
        engine=engine,
        node=node,
        gpus=parse_gpus(gpu),
        ctx=ctx_len,
        extra_args=list(extra),
        served_model_name=served_name,
        runtime=runtime,
        image=image,
        max_adapters=max_adapters,
        force=force,
        restart=check_restart_policy(restart),
    )
    with context(ctx).client() as client:
        record = client.create_deployment(body)
        if detach:
            console.print(f"{record.id} {record.state}")
            return
        record = wait_settled(client, record, f"{model} on {engine}", timeout)
    if record.state != DeploymentState.READY:
        raise EngineError(f"{record.id} {record.state}: {record.failure_reason or 'no reason'}")
    where = f"node {record.node_id}, port {record.port}"
    if record.gpus:
        where += f", GPU {','.join(map(str, record.gpus))}"
    if record.image:
        where += f", image {record.image}"
    console.print(
        f"[green]{record.id} ready[/]: model [bold]{escape(record.served_model_name)}[/] "
        f"on {record.engine} ({escape(where)})",
        markup=True,
        soft_wrap=True,  # one line for scripts reading the id and port
    )


def wait_settled(
    client: DaemonClient, record: Deployment, what: str, timeout_s: float
) -> Deployment:
    """Poll a deployment until it is no longer pending or loading, with a spinner naming
    ``what`` it starts and its progress; the last record.

    Raises :class:`BerthError` after ``timeout_s`` seconds (the deployment keeps starting).
    """
    deployment_id = record.id
    deadline = time.monotonic() + timeout_s
    still_starting = (
        f"it keeps starting in the background: `berth ps` to watch, "
        f"`berth logs {deployment_id}` for its log, `berth stop {deployment_id}` to cancel"
    )
    try:
        with console.status(f"starting {deployment_id} ({what})") as spinner:
            while record.state in STARTING:
                if time.monotonic() > deadline:
                    raise BerthError(
                        f"{deployment_id} not ready after {timeout_s:.0f}s; {still_starting}"
                    )
                time.sleep(0.5)
                record = client.deployment(deployment_id)
                doing = f": {record.progress}" if record.progress else ""
                spinner.update(f"{deployment_id} {record.state} ({what}{doing})")
    except KeyboardInterrupt:
        err_console.print(f"stopped waiting for {deployment_id}; {still_starting}")
        raise
    return record


def short_reason(reason: str | None, width: int = 100) -> str:
    """A failure reason on one line: its first line and, when the reason carries an engine log
    tail, the tail's last line (usually the engine's own error)."""
    if not reason:
        return ""
    lines = [line.strip() for line in reason.strip().splitlines() if line.strip()]
    text = lines[0] if len(lines) == 1 else f"{lines[0]} … {lines[-1]}"
    return text if len(text) <= width else text[: width - 1] + "…"


def print_deployments(records: Sequence[ListedDeployment], *, title: str | None = None) -> None:
    """The deployments table, then one line per failure reason or progress (too long for a
    table cell)."""
    print_table(deployments_table(records, title=title))
    now = datetime.now(UTC)
    for r in records:
        line = None
        if r.failure_reason:
            line = f"{r.id} {r.state}: {short_reason(r.failure_reason, width=200)}"
        elif r.state in (DeploymentState.RESTARTING, DeploymentState.CRASHLOOP):
            line = f"{r.id} {r.state}: its engine {r.last_exit or 'ended'}; started again soon"
        elif r.progress:
            line = f"{r.id} {r.state}: {r.progress}"
        elif r.state == DeploymentState.STOPPED:
            line = f"{r.id} stopped {age((now - _aware(r.updated_at)).total_seconds())} ago"
        # A reason carries the engine's log tail, whose colours (ESC) are shown as text.
        if line is not None:
            console.print(printable(line), markup=False, soft_wrap=True)
        if r.last_exit and r.state not in (DeploymentState.RESTARTING, DeploymentState.CRASHLOOP):
            plural = "s" if r.restart_count != 1 else ""
            line = f"{r.id} last exit: {r.last_exit} ({r.restart_count} restart{plural})"
            console.print(printable(line), markup=False, soft_wrap=True)


def deployments_table(records: Sequence[ListedDeployment], *, title: str | None = None) -> Table:
    """The deployments as ``berth ps`` shows them.  Ids, ports, pids and ages stay whole (a
    user copies them), a state wraps only between words, and names fold when the terminal
    is narrow; a name is shown as text, its unprintable characters escaped."""
    table = record_table(title=title)
    table.add_column("ID", no_wrap=True)
    for column in ("MODEL", "SERVICE", "ENGINE", "RUNTIME", "NODE"):
        table.add_column(column, overflow="fold")
    states = [_state(r) for r in records]
    table.add_column("STATE", width=word_width("STATE", (s for s, _ in states)))
    for column in ("RESTARTS", "PORT", "PID", "AGE"):
        table.add_column(column, no_wrap=True)
    now = datetime.now(UTC)
    for r, (state, colour) in zip(records, states, strict=True):
        created = _aware(r.created_at)
        table.add_row(
            r.id,
            # Text, never markup; escaped: a name registered before names were checked may
            # hold ESC or CR (issue 38).
            Text(printable(r.served_model_name)),
            Text(printable(r.service or "-")),
            r.engine,
            r.runtime,
            r.node_label or r.node_id,
            Text(state, style=colour),
            str(r.restart_count),
            str(r.port or "-"),
            str(r.pid or "-"),
            age((now - created).total_seconds()),
        )
    return table


def _aware(moment: datetime) -> datetime:
    return moment.replace(tzinfo=UTC) if moment.tzinfo is None else moment


_STATE_COLOURS = {
    DeploymentState.READY: "green",
    DeploymentState.FAILED: "red",
    DeploymentState.CRASHLOOP: "red",
    DeploymentState.RESTARTING: "yellow",
    DeploymentState.LOADING: "yellow",
    DeploymentState.PENDING: "yellow",
}


def _state(record: ListedDeployment) -> tuple[str, str]:
    """A deployment's state as shown, and its colour."""
    if record.state == DeploymentState.READY and not record.node_connected:
        # Not routed to while its node is unreachable; the agent reports it on return.
        return "ready (node unreachable)", "yellow"
    return str(record.state), _STATE_COLOURS.get(record.state, "white")


def ps(
    ctx: typer.Context,
    all_: bool = typer.Option(
        False, "--all", "-a", help="Include every stopped and failed one, however old."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print JSON."),
) -> None:
    """List deployments: the active ones and those that stopped or failed in the last 10
    minutes, with why (--all: every one)."""
    with context(ctx).client() as client:
        if all_:
            records = client.deployments()
        else:
            records = client.deployments(active=True, ended_within_s=PS_ENDED_WITHIN_S)
    if as_json:
        print_json(records)
    else:
        print_deployments(records)


def stop(
    ctx: typer.Context,
    deployment_id: str | None = typer.Argument(None, help="Deployment id (see berth ps)."),
    all_: bool = typer.Option(False, "--all", help="Stop every active deployment."),
) -> None:
    """Stop a deployment's engine (with no id: the only active one, or --all)."""
    with context(ctx).client(timeout_s=120.0) as client:
        if deployment_id is None:
            active = client.deployments(active=True)
            if not active:
                console.print("no active deployments")
                return
            if len(active) > 1 and not all_:
                ids = ", ".join(r.id for r in active)
                raise ConfigError(f"several deployments are active ({ids}): name one, or --all")
            targets = [r.id for r in active]
        else:
            targets = [deployment_id]
        for target in targets:
            record = client.stop_deployment(target)
            console.print(f"{record.id} {record.state}")


def logs(
    ctx: typer.Context,
    deployment_id: str = typer.Argument(..., help="Deployment id (see berth ps)."),
    follow: bool = typer.Option(False, "--follow", "-f", help="Keep printing new output."),
    tail: int = typer.Option(100, "--tail", "-n", min=0, help="Lines from the end to start."),
) -> None:
    """Print a deployment's engine log."""
    with (
        context(ctx).client() as client,
        client.logs(deployment_id, tail=tail, follow=follow) as chunks,
    ):
        for chunk in chunks:
            sys.stdout.buffer.write(chunk)
            sys.stdout.buffer.flush()
