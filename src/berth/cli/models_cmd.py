"""``berth models add|ls|show|rm`` and ``berth pull``."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.markup import escape

from berth.api import AdapterIn, ModelIn
from berth.api.pulls import PullIn, pulled_registration
from berth.cli.adapters_cmd import print_added
from berth.cli.common import (
    console,
    context,
    err_console,
    print_json,
    print_table,
    record_table,
    request_body,
)
from berth.cli.context import HELP_OPTIONS
from berth.errors import ConfigError, ConflictError

models_app = typer.Typer(
    context_settings=HELP_OPTIONS,
    help="Register, list and remove model weights.",
    no_args_is_help=True,
)


def _size(size_bytes: int) -> str:
    size = float(size_bytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} GiB"


@models_app.command("add")
def add(
    ctx: typer.Context,
    name: str = typer.Argument(..., help="The name deployments and clients use."),
    path_arg: Path | None = typer.Argument(None, metavar="[PATH]", help="Same as --path."),
    path_opt: Path | None = typer.Option(None, "--path", help="A GGUF file or a model folder."),
    node: str | None = typer.Option(
        None, "--node", help="Node label or id whose host holds PATH (default: this host)."
    ),
) -> None:
    """Register weights under NAME: on this host, or at PATH on another node's host."""
    if (path_arg is None) == (path_opt is None):
        raise ConfigError("give the model path once: as PATH or as --path")
    path = path_arg or path_opt
    assert path is not None
    remote = node is not None and node != "local"
    if remote and not path.is_absolute():
        raise ConfigError(f"a path on another node must be absolute, not {str(path)!r}")
    # A local path is resolved where the user is; a remote one is taken as written.
    shown = str(path) if remote else str(path.expanduser().resolve())
    body = request_body(ModelIn, name=name, path=shown, node=node)
    with context(ctx).client() as client:
        record = client.add_model(body)
    if remote:
        console.print(
            f"added model [bold]{escape(record.name)}[/] at {escape(str(shown))} "
            f"on node {escape(str(node))}",
            markup=True,
            soft_wrap=True,  # one line, the path whole, so it can be copied
        )
        return
    console.print(
        f"added model [bold]{escape(record.name)}[/] ({_size(record.size_bytes)})", markup=True
    )
    if record.warning is not None:
        err_console.print(f"warning: {record.warning}", markup=False, soft_wrap=True)


@models_app.command("ls")
def ls(ctx: typer.Context, as_json: bool = typer.Option(False, "--json")) -> None:
    """List registered models."""
    with context(ctx).client() as client:
        records = client.models()
    if as_json:
        print_json(records)
        return
    # Names and sizes stay whole; a long path folds rather than being cut.
    table = record_table()
    for column in ("NAME", "SOURCE", "SIZE", "PATH"):
        whole = column in ("NAME", "SIZE")
        table.add_column(column, no_wrap=whole, overflow="ellipsis" if whole else "fold")
    for r in records:
        source = r.source if not r.repo_id else f"hub:{r.repo_id}"
        table.add_row(r.name, source, _size(r.size_bytes), r.path)
    print_table(table)


@models_app.command("show")
def show(
    ctx: typer.Context,
    name: str = typer.Argument(...),
    as_json: bool = typer.Option(False, "--json", help="Print JSON."),
) -> None:
    """Show a model and, for each copy of its files (on this host or an agent's), the shape
    read there and the VRAM one deployment needs (one GPU, the trained context)."""
    with context(ctx).client() as client:
        detail = client.model(name)
    if as_json:
        print_json(detail)
        return
    source = detail.source if not detail.repo_id else f"hub:{detail.repo_id}"
    console.print(f"model {detail.name} ({source})", markup=False, soft_wrap=True)
    for copy in detail.copies:
        console.print(f"node {copy.node_label}: {copy.path}", markup=False, soft_wrap=True)
        shape = copy.shape
        if shape is not None:
            read = "GGUF header" if shape.format == "gguf" else "config.json"
            kv = ",".join(str(h) for h in sorted(set(shape.kv_heads)))
            console.print(
                f"  shape: {shape.architecture} from its {read}, {shape.block_count} layers, "
                f"embedding {shape.embedding_length}, {shape.head_count} heads ({kv} KV), "
                f"key/value {shape.key_length}/{shape.value_length}, trained context "
                f"{shape.context_length or 'not stated'}, weights {_size(shape.weights_bytes)}",
                markup=False,
                soft_wrap=True,
            )
        if copy.estimate is not None:
            line = f"  estimate ({copy.estimate.engine}): {copy.estimate.summary}"
            console.print(line, markup=False, soft_wrap=True)
        if copy.problem is not None:
            console.print(f"  no estimate: {copy.problem}", markup=False, soft_wrap=True)


@models_app.command("rm")
def rm(ctx: typer.Context, name: str = typer.Argument(...)) -> None:
    """Unregister a model (its files stay where they are)."""
    with context(ctx).client() as client:
        client.remove_model(name)
    console.print(f"removed model {name}")


def pull(
    ctx: typer.Context,
    repo: str = typer.Argument(..., help="Hugging Face repository, e.g. org/model."),
    name: str | None = typer.Option(None, "--name", help="Model name (default: the repo)."),
    revision: str | None = typer.Option(None, "--revision", help="Branch, tag or commit."),
    base: str | None = typer.Option(
        None,
        "--base",
        help="For an adapter repository: the model it adapts (default: the registered model "
        "pulled from the repository its adapter_config.json names).",
    ),
) -> None:
    """Download a model, or a LoRA adapter, from the Hugging Face hub into
    $BERTH_HOME/models and register it."""
    from berth.runtime.hf_pull import pull_model

    cli = context(ctx)
    body = request_body(PullIn, repo=repo, name=name, revision=revision, base=base)
    with cli.client() as client:
        models = client.models()  # fails if no daemon
        taken = {m.name for m in models} | {a.name for a in client.adapters()}
        if body.registered_name in taken:
            raise ConflictError(f"a model or adapter named {body.registered_name!r} already exists")
        path = pull_model(repo, revision=revision, models_dir=cli.home.models_dir)
        registration = pulled_registration(body, path, models)
        if isinstance(registration, AdapterIn):
            added = client.add_adapter(registration)
            console.print(
                f"pulled adapter [bold]{escape(added.name)}[/] into {escape(str(path))}",
                markup=True,
            )
            print_added(added, None)
            return
        record = client.add_model(registration)
    console.print(
        f"pulled [bold]{escape(record.name)}[/] into {escape(str(path))} "
        f"({_size(record.size_bytes)})",
        markup=True,
    )
