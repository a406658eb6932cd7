"""The ``berth`` command line: one typer app, one module per command group, each loaded only
when it runs.

Every command module pulls in what it needs (the admin API's models, the store, the agent,
Docker's SDK), and together they are most of berth: importing them all cost about 0.8 s on
every call, ``berth --help`` included. So the root group knows its commands by name
(:data:`COMMANDS`) and imports a command's module when that command is run or asked for its
own help. ``berth --help`` lists each command with the summary kept beside its name;
``tests/test_cli_lazy.py`` checks that each summary is the first paragraph of the command's
own help, so the two cannot drift apart.
"""

from __future__ import annotations

import importlib
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import typer
from typer.core import TyperCommand, TyperGroup

from berth import __version__
from berth.cli.context import HELP_OPTIONS, CliContext
from berth.errors import BerthError
from berth.paths import BerthHome, resolve_home


@dataclass(frozen=True)
class LazyCommand:
    """A command of the root group: ``berth.cli.<module>.<attribute>``, a typer app (a group
    of commands) or a command function, and the summary ``berth --help`` shows for it."""

    name: str
    module: str
    attribute: str
    summary: str


#: The root group's commands, in the order ``berth --help`` lists them.
COMMANDS = (
    LazyCommand("usage", "usage_cmd", "usage",
                "Requests and tokens per day, key, model or node, from the usage ledger."),
    LazyCommand("status", "daemon_cmd", "status",
                "The daemon, its listeners, nodes and deployments at a glance."),
    LazyCommand("pull", "models_cmd", "pull",
                "Download a model, or a LoRA adapter, from the Hugging Face hub into "
                "$BERTH_HOME/models and register it."),
    LazyCommand("run", "deploy_cmd", "run",
                "Deploy a model on an engine and wait until it serves."),
    LazyCommand("ps", "deploy_cmd", "ps",
                "List deployments: the active ones and those that stopped or failed in the "
                "last 10 minutes, with why (--all: every one)."),
    LazyCommand("stop", "deploy_cmd", "stop",
                "Stop a deployment's engine (with no id: the only active one, or --all)."),
    LazyCommand("logs", "deploy_cmd", "logs", "Print a deployment's engine log."),
    LazyCommand("demo", "demo", "demo",
                "Run berth's main job end to end on this host, then clean up."),
    LazyCommand("routing", "routing_cmd", "routing",
                "Show the ranked candidates for MODEL (affinity, in flight, p95; their slots "
                "at the admission queue, known or assumed) and dropped ones; the routing policy "
                "and how the last request went (the matched prefix, and why a load bound "
                "overrode it); under ``prefix``, what each engine last said of its cache "
                "(llama.cpp's /slots, vLLM's or SGLang's /metrics)."),
    LazyCommand("plan", "plan_cmd", "plan",
                "Show a deployment's VRAM estimate and where it would go, with the reasons."),
    LazyCommand("doctor", "doctor_cmd", "doctor",
                "Check this host: Python and packages, the home and its secrets, ports, the CA "
                "and certificates, engines, Docker and GPUs, and on an agent its leader and "
                "pinned CA."),
    LazyCommand("daemon", "daemon_cmd", "daemon_app",
                "Start, stop and inspect the leader daemon."),
    LazyCommand("models", "models_cmd", "models_app",
                "Register, list and remove model weights."),
    LazyCommand("adapters", "adapters_cmd", "adapters_app",
                "Register, list and remove LoRA adapters of registered models."),
    LazyCommand("key", "keys_cmd", "key_app", "Create, change, list and revoke API keys."),
    LazyCommand("config", "config_cmd", "config_app", "Inspect and change berth's settings."),
    LazyCommand("nodes", "nodes_cmd", "nodes_app",
                "Enroll, list, inspect, cordon, drain and remove the cluster's nodes."),
    LazyCommand("ca", "ca_cmd", "ca_app",
                "Rotate the cluster CA: status, rotate, retire the old root."),
    LazyCommand("agent", "agent_cmd", "app", "Run this host as a node of a berth leader."),
    LazyCommand("backup", "backup_cmd", "backup_app",
                "Back up a leader's state (database, CA, key pepper, config) and restore it."),
    LazyCommand("deploy", "bootstrap_cmd", "deploy_app",
                "Set this host up as a leader on a public domain."),
    LazyCommand("service", "service_cmd", "service_app",
                "Service profiles: a model and how to deploy it (engine, runtime, GPUs, node)."),
    LazyCommand("route", "route_cmd", "route_app",
                "Routes: the model names clients use, each in front of services by priority."),
    LazyCommand("desk", "desk_cmd", "desk_app",
                "Offer this leader's models to an ow desk: register, serve jobs, status, pool "
                "tests."),
    LazyCommand("leader", "leader_cmd", "leader_app",
                "Shared leadership (leader_ha): this leader's role, and handing it over."),
)  # fmt: skip


def load_command(entry: LazyCommand) -> Any:
    """The click command ``entry`` names, its module imported now."""
    target = getattr(importlib.import_module(f"berth.cli.{entry.module}"), entry.attribute)
    if isinstance(target, typer.Typer):  # a group, as add_typer would have made it
        command: Any = typer.main.get_group(target)
    else:  # a command function
        single = typer.Typer(context_settings=HELP_OPTIONS, add_completion=False)
        single.command(entry.name)(target)
        command = typer.main.get_command(single)
    command.name = entry.name
    return command


class LazyGroup(TyperGroup):
    """The root group: :data:`COMMANDS` by name, each loaded when it is looked up to run.

    While the root's own help is drawn, a lookup answers a placeholder carrying the summary
    instead, so listing the commands imports none of them."""

    def __init__(self, **attrs: Any) -> None:
        super().__init__(**attrs)
        self._lazy = {entry.name: entry for entry in COMMANDS}
        self._drawing_help = False
        for entry in COMMANDS:  # names for list_commands and typo suggestions, in order
            self.commands[entry.name] = TyperCommand(
                name=entry.name, help=entry.summary, short_help=entry.summary
            )

    def get_command(self, ctx: Any, cmd_name: str) -> Any:
        entry = self._lazy.get(cmd_name)
        if entry is not None and not self._drawing_help:
            self.commands[cmd_name] = load_command(entry)
            del self._lazy[cmd_name]
        return self.commands.get(cmd_name)

    def format_help(self, ctx: Any, formatter: Any) -> None:
        self._drawing_help = True
        try:
            super().format_help(ctx, formatter)
        finally:
            self._drawing_help = False


app = typer.Typer(
    cls=LazyGroup,
    context_settings=HELP_OPTIONS,
    name="berth",
    help="berth: one OpenAI-compatible endpoint in front of the engines on your GPU hosts.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)


def _version(value: bool) -> None:
    if value:
        print(f"berth {__version__}")
        raise typer.Exit()


@app.callback()
def root(
    ctx: typer.Context,
    home: Path | None = typer.Option(
        None, "--home", help="berth's state folder (default: $BERTH_HOME, else ~/.berth)."
    ),
    version: bool = typer.Option(
        False, "--version", callback=_version, is_eager=True, help="Print the version."
    ),
) -> None:
    ctx.obj = CliContext(BerthHome(resolve_home(home)))


def main() -> None:
    """Entry point: run the app; a ``BerthError`` becomes one line on stderr and an exit code."""
    try:
        app()
    except BerthError as exc:
        from berth.cli.common import err_console

        err_console.print("[bold red]error:[/] ", end="", markup=True)
        err_console.print(str(exc), markup=False, soft_wrap=True)
        sys.exit(exc.exit_code)
    except KeyboardInterrupt:
        sys.exit(130)
