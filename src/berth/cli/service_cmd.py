"""``berth service …``: service profiles (``berth route …``, the names clients use in front of
them, is :mod:`berth.cli.route_cmd`).

A service is a model plus how to deploy it, and how many replicas of it run
(``--min-replicas``/``--max-replicas``, ``--idle-timeout``; ``berth service scale`` changes
them); ``berth service deploy`` starts a deployment of it by hand.  A route is a public model
name in front of one or more services (by priority) with an optional fallback route.
Everything goes through the daemon's admin API (``/admin/services``, ``/admin/routes``).
"""

from __future__ import annotations

from datetime import UTC, datetime

import typer
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from berth.api import (
    DeployIn,
    ScaleIn,
    ScalingDecisionOut,
    Service,
    ServiceDetail,
    ServiceIn,
)
from berth.cli.common import console, context, print_json, print_table, request_body
from berth.cli.context import HELP_OPTIONS
from berth.cli.deploy_cmd import parse_gpus, wait_settled
from berth.errors import ConfigError, EngineError
from berth.humanize import age, duration
from berth.vocab.policies import check_restart_policy, check_routing_policy
from berth.vocab.states import DeploymentState

service_app = typer.Typer(
    context_settings=HELP_OPTIONS,
    no_args_is_help=True,
    help="Service profiles: a model and how to deploy it (engine, runtime, GPUs, node).",
)


# -- services ----------------------------------------------------------------------------------


@service_app.command("create")
def create_service(
    ctx: typer.Context,
    name: str = typer.Argument(..., help="The service's name (also the engines' served name)."),
    model: str = typer.Option(..., "--model", "-m", help="A model from `berth models ls`."),
    engine: str = typer.Option("llamacpp", "--engine", "-e", help="llamacpp, vllm or sglang."),
    runtime: str | None = typer.Option(
        None, "--runtime", help="process or docker (default: the default_runtime setting)."
    ),
    gpu: str | None = typer.Option(None, "--gpu", help="GPU indexes, e.g. 0 or 0,1."),
    ctx_len: int | None = typer.Option(None, "--ctx", min=1, help="Context length in tokens."),
    extra: list[str] = typer.Option(
        [], "--extra-arg", "-x", help="Extra engine argument (repeatable)."
    ),
    image: str | None = typer.Option(
        None, "--image", help="Container image (docker runtime; default: the engine's setting)."
    ),
    node_label: str | None = typer.Option(
        None, "--node-label", help="The node its deployments run on (default: chosen at deploy)."
    ),
    min_replicas: int = typer.Option(
        0, "--min-replicas", help="Replicas kept running (0: started on demand, by a request)."
    ),
    max_replicas: int = typer.Option(
        1, "--max-replicas", help="Replicas berth starts at most (scale out up to this)."
    ),
    idle_timeout: str | None = typer.Option(
        None,
        "--idle-timeout",
        help="Stop a replica after this long without a request, e.g. 30s, 10m, 2h "
        "(default: never), down to --min-replicas.",
    ),
    pin: bool = typer.Option(
        False, "--pin", help="Never evict its replicas to make room for another service."
    ),
    priority: int = typer.Option(
        0, "--priority", help="A start evicts only services of at most its priority."
    ),
    capacity: int | None = typer.Option(
        None,
        "--capacity",
        help="Requests one replica serves at once (default: the engine's slots, e.g. "
        "llama.cpp --parallel).",
    ),
    max_adapters: int | None = typer.Option(
        None,
        "--max-adapters",
        min=1,
        help="vLLM/SGLang: LoRA adapters loaded at once (default: 1 when the model has adapters).",
    ),
    restart: str = typer.Option(
        "on-failure",
        "--restart",
        help="Start its engine again when it ends: on-failure, always or never.",
    ),
    first_byte_timeout: float | None = typer.Option(
        None,
        "--first-byte-timeout",
        min=0,
        help="Seconds a streamed request waits for its first byte before it goes to another "
        "deployment (0: off; default: the first_byte_timeout_s setting).",
        rich_help_panel="Stream timeouts",
    ),
    stream_idle_timeout: float | None = typer.Option(
        None,
        "--stream-idle-timeout",
        min=0,
        help="Longest silence inside a stream, in seconds, before it ends with an error "
        "(0: off; default: the stream_idle_timeout_s setting).",
        rich_help_panel="Stream timeouts",
    ),
    routing_policy: str | None = typer.Option(
        None,
        "--routing-policy",
        help="How a request picks among its replicas: least-load or prefix (the one whose "
        "engine cached the longest prefix of the prompt); default: the routing_policy setting.",
    ),
    as_json: bool = typer.Option(False, "--json", help="Print JSON."),
) -> None:
    """Create a service profile."""
    body = request_body(
        ServiceIn,
        name=name,
        model=model,
        engine=engine,
        runtime=runtime,
        gpus=parse_gpus(gpu),
        ctx=ctx_len,
        extra_args=list(extra),
        image=image,
        node_label=node_label,
        min_replicas=min_replicas,
        max_replicas=max_replicas,
        idle_timeout=idle_timeout,
        pinned=pin,
        priority=priority,
        capacity=capacity,
        max_adapters=max_adapters,
        restart=check_restart_policy(restart),
        first_byte_timeout_s=first_byte_timeout,
        stream_idle_timeout_s=stream_idle_timeout,
        routing_policy=None if routing_policy is None else check_routing_policy(routing_policy),
    )
    with context(ctx).client() as client:
        record = client.create_service(body)
    if as_json:
        print_json(record)
    else:
        _print_created(record)


def _print_created(record: Service) -> None:
    """What ``berth service create`` says of the new ``record``: its settings, its scaling
    and the next step (a route in front of it)."""
    console.print(
        f"service [bold]{escape(record.name)}[/] created: {escape(_settings(record))}",
        soft_wrap=True,
        markup=True,
    )
    console.print(f"scaling: {_scaling(record)}", markup=False, soft_wrap=True)
    if record.scaling.min_replicas == 0:
        how = "it loads on demand, at the first request for the route"
    else:
        how = f"{record.scaling.min_replicas} replica(s) start now"
    console.print(
        f"next: `berth route create PUBLIC-NAME --service {record.name}`; {how}",
        markup=False,
        soft_wrap=True,
    )


def _scaling(record: Service) -> str:
    """A service's scaling settings on one line."""
    scaling = record.scaling
    on_demand = " (on demand)" if scaling.min_replicas == 0 else ""
    idle = scaling.idle_timeout_s
    parts = [
        f"replicas {scaling.min_replicas}-{scaling.max_replicas}{on_demand}",
        f"idle timeout {'never' if idle is None else duration(idle)}",
        f"capacity {scaling.replica_capacity}"
        + (" (the engine's slots)" if scaling.capacity is None else ""),
    ]
    if scaling.pinned:
        parts.append("pinned")
    if scaling.priority:
        parts.append(f"priority {scaling.priority}")
    return ", ".join(parts)


def _replicas(record: Service) -> str:
    """A service's replicas by state: ``1 ready, 1 loading``; ``none``."""
    order = (
        DeploymentState.READY,
        DeploymentState.LOADING,
        DeploymentState.PENDING,
        DeploymentState.RESTARTING,
        DeploymentState.CRASHLOOP,
        DeploymentState.STOPPING,
    )
    parts = [f"{record.replicas[s]} {s}" for s in order if record.replicas.get(s)]
    return ", ".join(parts) or "none"


def _decision(decision: ScalingDecisionOut) -> str:
    when = age((datetime.now(UTC) - decision.at).total_seconds())
    ids = f" {', '.join(decision.deployment_ids)}" if decision.deployment_ids else ""
    return f"{decision.action}{ids} ({when} ago): {decision.reason}"


def _settings(record: Service) -> str:
    """A service's settings on one line."""
    parts = [f"model {record.model}", f"{record.engine} ({record.runtime})"]
    if record.gpus:
        parts.append("GPUs " + ",".join(map(str, record.gpus)))
    if record.ctx:
        parts.append(f"ctx {record.ctx}")
    if record.extra_args:
        parts.append("args " + " ".join(record.extra_args))
    if record.image:
        parts.append(f"image {record.image}")
    if record.max_adapters:
        plural = "s" if record.max_adapters != 1 else ""
        parts.append(f"{record.max_adapters} adapter slot{plural}")
    parts.append(f"node {record.node_label}" if record.node_label else "any node")
    parts.append(f"restart {record.restart_policy}")
    if record.routing_policy is not None:
        parts.append(f"routing {record.routing_policy}")
    for what, value in (
        ("first byte within", record.first_byte_timeout_s),
        ("stream silence at most", record.stream_idle_timeout_s),
    ):
        if value is not None:
            parts.append(f"{what} {duration(value)}" if value else f"{what}: no bound")
    return ", ".join(parts)


@service_app.command("ls")
def list_services(
    ctx: typer.Context, as_json: bool = typer.Option(False, "--json", help="Print JSON.")
) -> None:
    """List service profiles, with their ready deployments and the routes that name them."""
    with context(ctx).client() as client:
        records = client.services()
    if as_json:
        print_json(records)
        return
    if not records:
        console.print("no services; create one with `berth service create NAME --model M`")
        return
    table = Table()
    for column in ("NAME", "MODEL", "ENGINE", "NODE", "GPUS", "CTX", "REPLICAS", "IDLE", "READY"):
        table.add_column(column, no_wrap=column in ("NAME", "MODEL", "REPLICAS"))
    table.add_column("ROUTES")
    for r in records:
        ready = Text(str(r.ready), style="green") if r.ready else Text("0")
        scaling = r.scaling
        marks = "".join((" pinned" if scaling.pinned else "",
                         f" p{scaling.priority}" if scaling.priority else ""))  # fmt: skip
        idle = scaling.idle_timeout_s
        table.add_row(
            r.name,
            r.model,
            f"{r.engine} ({r.runtime})",
            r.node_label or "-",
            ",".join(map(str, r.gpus)) or "-",
            str(r.ctx or "-"),
            f"{scaling.min_replicas}-{scaling.max_replicas}{marks}",
            "never" if idle is None else duration(idle),
            ready + (f" (+{r.queued} queued)" if r.queued else ""),
            ", ".join(r.routes) or "-",
        )
    print_table(table)


@service_app.command("show")
def show_service(
    ctx: typer.Context,
    name: str = typer.Argument(..., help="The service's name."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON."),
) -> None:
    """Show a service profile, its active deployments and the routes that name it."""
    with context(ctx).client() as client:
        detail = client.service(name)
    if as_json:
        print_json(detail)
        return
    print_detail(detail)


def print_detail(detail: ServiceDetail) -> None:
    """What ``berth service show`` prints: settings, scaling, replicas, last decision."""
    console.print(
        f"[bold]{escape(detail.name)}[/]: {escape(_settings(detail))}", soft_wrap=True, markup=True
    )
    console.print(f"scaling: {_scaling(detail)}", markup=False, soft_wrap=True)
    console.print(f"routes: {', '.join(detail.routes) or 'none'}", markup=False)
    queued = f", {detail.queued} request(s) waiting for a load" if detail.queued else ""
    console.print(f"replicas: {_replicas(detail)}{queued}", markup=False)
    if not detail.deployments:
        how = "a request for a route to it loads one" if detail.scaling.max_replicas else ""
        console.print(f"deployments: none ({how or 'max_replicas is 0'})", markup=False)
    for d in detail.deployments:
        port = f", port {d.port}" if d.port else ""
        console.print(f"deployment {d.id}: {d.state} on node {d.node_id}{port}")
    if detail.last_decision is not None:
        line = f"last decision: {_decision(detail.last_decision)}"
        console.print(line, markup=False, soft_wrap=True)
    if detail.decision is not None and detail.decision != detail.last_decision:
        console.print(f"now: {_decision(detail.decision)}", markup=False, soft_wrap=True)


@service_app.command("scale")
def scale_service(
    ctx: typer.Context,
    name: str = typer.Argument(..., help="The service's name."),
    min_replicas: int | None = typer.Option(None, "--min", help="Replicas kept running."),
    max_replicas: int | None = typer.Option(None, "--max", help="Replicas berth starts at most."),
    idle_timeout: str | None = typer.Option(
        None, "--idle-timeout", help="e.g. 30s, 10m, 2h, or never."
    ),
    pin: bool | None = typer.Option(
        None, "--pin/--no-pin", help="Never evict its replicas for another service."
    ),
    priority: int | None = typer.Option(None, "--priority", help="Eviction priority."),
    capacity: int | None = typer.Option(
        None, "--capacity", help="Requests one replica serves at once."
    ),
    restart: str | None = typer.Option(
        None, "--restart", help="Restart policy of replicas started from now on."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print JSON."),
) -> None:
    """Change how many replicas of a service run (and when they stop or are evicted), or
    their restart policy.

    Refused with the reason, and nothing changed, when the result is not valid (min above
    max, a negative count, an idle timeout that does not parse).
    """
    changes = (min_replicas, max_replicas, idle_timeout, pin, priority, capacity, restart)
    if all(value is None for value in changes):
        raise ConfigError("give at least one of --min, --max, --idle-timeout, --pin, "
                          "--priority, --capacity, --restart")  # fmt: skip
    body = request_body(
        ScaleIn,
        min_replicas=min_replicas,
        max_replicas=max_replicas,
        idle_timeout=idle_timeout,
        pinned=pin,
        priority=priority,
        capacity=capacity,
        restart=None if restart is None else check_restart_policy(restart),
    )
    with context(ctx).client() as client:
        detail = client.scale_service(name, body)
    if as_json:
        print_json(detail)
        return
    print_detail(detail)


@service_app.command("timeouts")
def set_service_timeouts(
    ctx: typer.Context,
    name: str = typer.Argument(..., help="The service's name."),
    first_byte: float | None = typer.Option(
        None, "--first-byte", min=0, help="Seconds to a streamed answer's first byte (0: off)."
    ),
    stream_idle: float | None = typer.Option(
        None, "--stream-idle", min=0, help="Longest silence inside a stream, seconds (0: off)."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print JSON."),
) -> None:
    """Set how long the service's streamed answers may take to begin, and be silent.

    Past the first, a request that got nothing yet goes to another deployment (the silent
    engine's exchange closed); past the second, the stream ends with an error event.
    """
    if first_byte is None and stream_idle is None:
        raise ConfigError("give --first-byte, --stream-idle or both")
    body = request_body(ScaleIn, first_byte_timeout_s=first_byte, stream_idle_timeout_s=stream_idle)
    with context(ctx).client() as client:
        detail = client.scale_service(name, body)
    if as_json:
        print_json(detail)
        return
    print_detail(detail)


@service_app.command("routing")
def set_service_routing(
    ctx: typer.Context,
    name: str = typer.Argument(..., help="The service's name."),
    policy: str = typer.Argument(..., help="least-load, prefix, or default (the setting)."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON."),
) -> None:
    """Set how a request for the service picks among its replicas, from the next one on.

    ``prefix`` sends it where the longest prefix of its prompt was served before (that
    engine's cache holds it), unless that replica is busier than prefix_load_factor times
    the mean; ``least-load`` by session affinity, requests in flight and p95 latency.
    """
    body = request_body(
        ScaleIn, routing_policy="default" if policy == "default" else check_routing_policy(policy)
    )
    with context(ctx).client() as client:
        detail = client.scale_service(name, body)
    if as_json:
        print_json(detail)
        return
    print_detail(detail)


@service_app.command("rm")
def remove_service(
    ctx: typer.Context, name: str = typer.Argument(..., help="The service's name.")
) -> None:
    """Delete a service profile (refused while a route names it or it has active
    deployments)."""
    with context(ctx).client() as client:
        client.remove_service(name)
    console.print(f"service {name} removed")


@service_app.command("deploy")
def deploy_service(
    ctx: typer.Context,
    name: str = typer.Argument(..., help="The service's name."),
    node: str | None = typer.Option(
        None,
        "--node",
        help="Node label or id (default: the service's node_label, else where it fits).",
    ),
    force: bool = typer.Option(
        False, "--force", help="Run on the service's GPUs even where its estimate does not fit."
    ),
    detach: bool = typer.Option(False, "--detach", "-d", help="Return without waiting."),
    timeout: float = typer.Option(
        900.0, min=1.0, help="Seconds to wait for the engine to be ready."
    ),
) -> None:
    """Start a deployment of a service and wait until it serves."""
    with context(ctx).client() as client:
        record = client.deploy_service(name, request_body(DeployIn, node=node, force=force))
        if detach:
            console.print(f"{record.id} {record.state}")
            return
        record = wait_settled(client, record, f"service {name}", timeout)
    if record.state != DeploymentState.READY:
        raise EngineError(f"{record.id} {record.state}: {record.failure_reason or 'no reason'}")
    gpus = f", GPU {','.join(map(str, record.gpus))}" if record.gpus else ""
    console.print(
        f"[green]{record.id} ready[/]: service [bold]{escape(name)}[/] "
        f"(model {escape(record.model_name)} "
        f"on {record.engine}, node {escape(record.node_id)}, port {record.port}{gpus})",
        markup=True,
        soft_wrap=True,  # one line for scripts reading the id and port
    )
