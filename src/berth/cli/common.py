"""What every CLI command shares: the home, the consoles, the daemon client, JSON output."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import typer
from rich.console import Console

from berth.api.client import DaemonClient
from berth.paths import BerthHome, resolve_home

#: ``-h`` as well as ``--help`` on every command.
HELP_OPTIONS = {"help_option_names": ["-h", "--help"]}

console = Console(highlight=False)
err_console = Console(stderr=True, highlight=False)


@dataclass
class CliContext:
    home: BerthHome

    def client(self, *, timeout_s: float = 30.0) -> DaemonClient:
        return DaemonClient(self.home, timeout_s=timeout_s)


def context(ctx: typer.Context) -> CliContext:
    """The ``CliContext`` set up by the root callback (built lazily for sub-apps)."""
    root = ctx.find_root()
    if not isinstance(root.obj, CliContext):
        root.obj = CliContext(BerthHome(resolve_home()))
    return root.obj


def print_json(data: Any) -> None:
    """Print ``data`` as JSON on stdout, plain (no colour), for scripts."""
    print(json.dumps(data, indent=2, sort_keys=True, default=str))
