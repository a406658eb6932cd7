"""``berth agent adopt``, ``adopted`` and ``unadopt``: servers this host runs without berth.

They edit ``$BERTH_HOME/adopted.yaml`` and need no running agent: a running agent (or the
leader, on its own host) reads the file again within seconds and reports the change.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import typer
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from berth.agent.adopted import (
    AdoptedEndpoint,
    adopted_endpoint,
    describe,
    fetch_model_ids,
    load_adopted,
    read_api_key,
    save_adopted,
    store_api_key,
    with_endpoint,
    without_endpoint,
)
from berth.cli.common import console, context, print_json, print_table
from berth.cli.deploy_cmd import parse_gpus
from berth.errors import ConfigError, NotFoundError
from berth.paths import BerthHome

_LOOPBACK = "127.0.0.1"


def adopt(
    ctx: typer.Context,
    container: str | None = typer.Option(
        None, "--container", help="A running container: port, GPUs and models read from Docker."
    ),
    port: int | None = typer.Option(None, "--port", min=1, max=65535, help="Its TCP port."),
    model: str | None = typer.Option(
        None, "--model", help="The model id the server serves (required with --port)."
    ),
    host: str = typer.Option(_LOOPBACK, "--host", help="Its address, as this host reaches it."),
    gpus: str | None = typer.Option(None, "--gpus", help="GPUs it uses, e.g. 0,7 (reserved)."),
    vram_mb: int | None = typer.Option(None, "--vram-mb", min=0, help="GPU memory it uses, MiB."),
    served_name: str | None = typer.Option(
        None, "--served-model-name", help="Name clients use (default: its first /v1/models id)."
    ),
    name: str | None = typer.Option(None, "--name", help="A label for it (default: the name)."),
    api_key_file: Path | None = typer.Option(
        None,
        "--api-key-file",
        help="A file holding the API key the server expects (kept by berth, mode 0600).",
    ),
) -> None:
    """Adopt an OpenAI-compatible server berth did not start: route to it, never stop it."""
    home = context(ctx).home
    if (container is None) == (port is None):
        raise ConfigError("pass --container NAME, or --port P (with --model M)")
    gpu_list = parse_gpus(gpus)
    if container is not None:
        host, port, found_gpus = _read_container(home, container)
        gpu_list = gpu_list or found_gpus
    elif model is None:
        raise ConfigError("--port needs --model: the model id the server serves")
    assert port is not None
    api_key = read_api_key(api_key_file) if api_key_file is not None else None
    model_ids = fetch_model_ids(host, port, api_key=api_key)
    endpoint = adopted_endpoint(
        name=name,
        host=host,
        port=port,
        model=model,
        served_model_name=served_name,
        gpus=gpu_list,
        vram_mb=vram_mb,
        container=container,
        model_ids=model_ids,
    )
    endpoints = with_endpoint(load_adopted(home.adopted_file), endpoint)
    if api_key is not None:
        kept = store_api_key(home.adopted_keys_dir, endpoint.name, api_key)
        endpoint = replace(endpoint, api_key_file=str(kept))
        endpoints = [*endpoints[:-1], endpoint]
    save_adopted(home.adopted_file, endpoints)
    console.print(
        f"adopted [bold]{escape(endpoint.name)}[/]: {escape(endpoint.base_url)} serves "
        f"{escape(repr(endpoint.engine_model))} as [bold]{escape(endpoint.served_model_name)}[/]"
        + escape(_gpu_text(endpoint))
        + (", with its API key" if endpoint.api_key_file else ""),
        markup=True,
        soft_wrap=True,
    )
    console.print(
        f"written to {home.adopted_file}; a running agent or leader picks it up within seconds",
        soft_wrap=True,
    )


def adopted(
    ctx: typer.Context, as_json: bool = typer.Option(False, "--json", help="Print JSON.")
) -> None:
    """List the servers this host adopted, and whether each answers now."""
    home = context(ctx).home
    rows = []
    for endpoint in load_adopted(home.adopted_file):
        try:
            key = read_api_key(Path(endpoint.api_key_file)) if endpoint.api_key_file else None
            fetch_model_ids(endpoint.host, endpoint.port, timeout_s=2.0, api_key=key)
            answers = True
        except ConfigError:
            answers = False
        rows.append((endpoint, answers))
    if as_json:
        print_json([describe(endpoint, alive) for endpoint, alive in rows])
        return
    if not rows:
        console.print(f"no adopted servers ({home.adopted_file})", soft_wrap=True)
        return
    table = Table("NAME", "SERVED AS", "MODEL", "ADDRESS", "GPUS", "VRAM MB", "ANSWERS")
    for endpoint, alive in rows:
        table.add_row(
            endpoint.name,
            endpoint.served_model_name,
            endpoint.engine_model,
            f"{endpoint.host}:{endpoint.port}",
            ",".join(map(str, endpoint.gpus)) or "-",
            str(endpoint.vram_mb) if endpoint.vram_mb is not None else "-",
            Text("yes", style="green") if alive else Text("no", style="red"),
        )
    print_table(table)


def unadopt(
    ctx: typer.Context, name: str = typer.Argument(..., help="The adopted server's name.")
) -> None:
    """Stop routing to an adopted server (it keeps running: berth never stops it)."""
    home = context(ctx).home
    endpoints = load_adopted(home.adopted_file)
    try:
        kept = without_endpoint(endpoints, name)
    except NotFoundError:
        names = ", ".join(e.name for e in endpoints) or "none"
        raise ConfigError(f"no adopted server is named {name!r} (adopted: {names})") from None
    save_adopted(home.adopted_file, kept)
    (home.adopted_keys_dir / f"{name}.key").unlink(missing_ok=True)
    console.print(f"unadopted {name}")


def _gpu_text(endpoint: AdoptedEndpoint) -> str:
    return f" on GPUs {','.join(map(str, endpoint.gpus))}" if endpoint.gpus else ""


def _read_container(home: BerthHome, name: str) -> tuple[str, int, list[int]]:
    """``(host, port, GPUs)`` of a running container: its first published TCP port (on the
    address it is published on, loopback for a wildcard) and its GPU device requests."""
    from berth.config import Settings
    from berth.runtime.docker import DockerApiError, connect_docker, resolve_docker_host

    settings = Settings.load(home)
    host = resolve_docker_host(settings.docker_host)
    try:
        client = connect_docker(host, timeout_s=10)
    except DockerApiError as exc:
        raise ConfigError(f"no Docker engine at {host}: {exc.reason}") from None
    try:
        info = client.inspect_container(name)
    except DockerApiError as exc:
        raise ConfigError(f"cannot inspect container {name}: {exc.reason}") from None
    finally:
        client.close()
    if info is None:
        raise NotFoundError("container", name)
    if not info.state.running:
        raise ConfigError(f"container {name} is not running")
    for key, bindings in sorted(info.ports.items()):
        if not key.endswith("/tcp") or not bindings:
            continue
        binding = bindings[0]
        address = binding.host_ip or _LOOPBACK
        if address in ("0.0.0.0", "::"):
            address = _LOOPBACK
        gpus = [int(device) for device in info.gpu_device_ids if device.isdigit()]
        return address, binding.host_port, gpus
    raise ConfigError(f"container {name} publishes no TCP port: berth could not reach it")
