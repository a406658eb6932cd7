"""What every CLI command shares: the home, the consoles, the daemon client, JSON output."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import ParamSpec, TypeVar

import typer
from pydantic import BaseModel, ValidationError
from rich.console import Console

from berth.api import describe_invalid
from berth.api.client import DaemonClient
from berth.errors import ConfigError
from berth.paths import BerthHome, resolve_home

_P = ParamSpec("_P")
_Body = TypeVar("_Body", bound=BaseModel)

#: ``-h`` as well as ``--help`` on every command.
HELP_OPTIONS = {"help_option_names": ["-h", "--help"]}

#: Markup is off by default: names a user chose (keys, models, services, routes, nodes) may
#: hold ``[`` and ``]`` and must print as written.  A message that styles itself passes
#: ``markup=True`` and wraps every value it interpolates in :func:`rich.markup.escape`.
console = Console(highlight=False, markup=False)
err_console = Console(stderr=True, highlight=False, markup=False)


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


def print_json(data: object) -> None:
    """Print ``data`` as JSON on stdout, plain (no colour), for scripts.

    Admin API models (:mod:`berth.api`, also inside lists and dicts) are written as the
    daemon sends them; anything else JSON does not know becomes its ``str()``.
    """
    print(json.dumps(data, indent=2, sort_keys=True, default=_jsonable))


def _jsonable(value: object) -> object:
    if isinstance(value, BaseModel):
        return value.model_dump(mode="json")
    return str(value)


def request_body(body_type: Callable[_P, _Body], /, *args: _P.args, **kwargs: _P.kwargs) -> _Body:
    """``body_type(*args, **kwargs)``: a request body for the daemon, checked here first.

    Raises :class:`ConfigError` with the message the daemon would answer (``"name: String
    should match pattern …"``), so bad input fails before anything is sent.
    """
    try:
        return body_type(*args, **kwargs)
    except ValidationError as exc:
        message, _ = describe_invalid(exc.errors()[0])
        raise ConfigError(message) from None
