"""``berth usage``: the usage ledger, per day, key, model or node."""

from __future__ import annotations

import csv
import sys
from datetime import UTC, datetime

import typer

from berth.api import DEFAULT_SINCE, UsageReport, UsageRow, parse_grouping, parse_since
from berth.cli.common import console, context, print_json, print_table, record_table
from berth.errors import ConfigError

#: The count columns, in the order the table and the CSV show them.
COUNT_COLUMNS = (
    "requests",
    "errors",
    "prompt_tokens",
    "cached_tokens",
    "completion_tokens",
    "total_tokens",
    "estimated_requests",
    "estimated_tokens",
)


def usage(
    ctx: typer.Context,
    key: str | None = typer.Option(None, "--key", help="One key, by name or id."),
    model: str | None = typer.Option(None, "--model", help="One model or route."),
    since: str = typer.Option(
        DEFAULT_SINCE, "--since", help="30d (today and the 29 days before, UTC) or a date."
    ),
    by: str = typer.Option("day", "--by", help="One row per day, key, model or node."),
    as_json: bool = typer.Option(False, "--json", help="Print the report as JSON."),
    as_csv: bool = typer.Option(False, "--csv", help="Print the rows as CSV."),
) -> None:
    """Requests and tokens per day, key, model or node, from the usage ledger.

    Tokens are the engines' own counts; CACHED is the part of the prompt an engine read
    from its cache (where it said: Messages API answers); ESTIMATED is the part berth
    estimated because an engine reported none. Days are UTC days.
    """
    if as_json and as_csv:
        raise ConfigError("--json and --csv: choose one")
    parse_since(since, datetime.now(UTC).date())  # bad input fails before asking the daemon
    grouping = parse_grouping(by)
    with context(ctx).client() as client:
        report = client.usage(since=since, by=grouping, key=key, model=model)
    if as_json:
        print_json(report)
    elif as_csv:
        write_csv(report)
    else:
        print_report(report)


def _group_columns(report: UsageReport) -> tuple[str, ...]:
    if report.by == "key":
        return ("key", "key_id")
    if report.by == "node":
        return ("node_id",)
    return (report.by,)


def _cell(row: UsageRow, column: str) -> str:
    value = getattr(row, column)
    if value is None:
        return ""
    return value.isoformat() if hasattr(value, "isoformat") else str(value)


def write_csv(report: UsageReport) -> None:
    """The rows as CSV on stdout (RFC 4180: a header line, then one line per row)."""
    groups = _group_columns(report)
    out = csv.writer(sys.stdout, lineterminator="\n")
    out.writerow([*groups, *COUNT_COLUMNS])
    for row in report.rows:
        out.writerow([*(_cell(row, c) for c in groups), *(_cell(row, c) for c in COUNT_COLUMNS)])


def print_report(report: UsageReport) -> None:
    """The rows as a table, with a total line and what the report covers."""
    groups = _group_columns(report)
    headers = {
        "prompt_tokens": "PROMPT",
        "cached_tokens": "CACHED",
        "completion_tokens": "COMPLETION",
        "total_tokens": "TOTAL",
        "estimated_requests": "EST. REQS",
        "estimated_tokens": "EST. TOKENS",
        "node_id": "NODE",
        "key_id": "KEY ID",
    }
    columns = [*groups, *COUNT_COLUMNS]
    # Days and ids stay whole; names and, on a narrow terminal, long counts fold.
    table = record_table()
    for column in columns:
        counted = column in COUNT_COLUMNS
        whole = column in ("day", "key_id", "node_id")
        table.add_column(
            headers.get(column, column.upper()),
            justify="right" if counted else "left",
            no_wrap=whole,
            overflow="ellipsis" if whole else "fold",
        )
    for row in report.rows:
        table.add_row(*(_number(row, c) for c in columns))
    if report.rows:
        table.add_section()
        table.add_row(
            "total", *([""] * (len(groups) - 1)), *(_number(report.total, c) for c in COUNT_COLUMNS)
        )
    scope = [f"{report.since.isoformat()} to {report.until.isoformat()} (UTC)"]
    if report.key:
        scope.append(f"key {report.key}")
    if report.model:
        scope.append(f"model {report.model}")
    console.print(f"usage, {', '.join(scope)}, by {report.by}")
    print_table(table)


def _number(row: UsageRow, column: str) -> str:
    value = getattr(row, column)
    return f"{value:,}" if isinstance(value, int) else _cell(row, column)
