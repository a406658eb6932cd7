"""What every CLI command shares: the home, the consoles, the daemon client, JSON output."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from typing import ParamSpec, TypeVar

import typer
from pydantic import BaseModel, ValidationError
from rich import box
from rich.console import Console
from rich.table import Table

from berth.api import describe_invalid
from berth.cli.context import CliContext
from berth.errors import ConfigError
from berth.paths import BerthHome, resolve_home

_P = ParamSpec("_P")
_Body = TypeVar("_Body", bound=BaseModel)

#: Markup is off by default: names a user chose (keys, models, services, routes, nodes) may
#: hold ``[`` and ``]`` and must print as written.  A message that styles itself passes
#: ``markup=True`` and wraps every value it interpolates in :func:`rich.markup.escape`.
console = Console(highlight=False, markup=False)
err_console = Console(stderr=True, highlight=False, markup=False)


#: Wider than any table of records: what "the width its rows need" is measured within.
_UNBOUNDED_WIDTH = 100_000


def record_table(*, title: str | None = None) -> Table:
    """An empty table of records (deployments, keys, usage) in the CLI's compact style: a
    rule under the header and no frame, so that 80 columns hold the values that must stay
    whole (mark those columns ``no_wrap``; give free text ``overflow="fold"``)."""
    return Table(
        title=title,
        title_justify="left",
        box=box.SIMPLE_HEAD,
        show_edge=False,
        pad_edge=False,
        collapse_padding=True,
    )


def word_width(header: str, texts: Iterable[str]) -> int:
    """The width of a column that may wrap between words but never inside one: its longest
    word, or its header."""
    return max([len(header), *(len(word) for text in texts for word in text.split())])


def print_table(table: Table, *, out: Console | None = None) -> None:
    """Print ``table`` so that no value is cut short.

    On a terminal the table fits the terminal's width: columns made ``no_wrap`` (ids,
    ports, dates) keep their values whole, a column given a ``width`` (see
    :func:`word_width`) wraps only between words, and the others fold.  Piped or redirected,
    where rich would assume 80 columns, it is printed at the width its rows need (a
    column's ``width`` is dropped), so a program or file reading it gets every value whole,
    one row a line.
    """
    target = out or console
    if target.is_terminal:
        target.print(table)
        return
    for column in table.columns:
        column.width = None
    natural = target.measure(table, options=target.options.update_width(_UNBOUNDED_WIDTH))
    shown_width = target.width
    target.width = max(shown_width, natural.maximum)
    try:
        target.print(table)
    finally:
        target.width = shown_width


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
