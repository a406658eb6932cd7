"""``berth key create|set|ls|revoke``: API keys, their tiers and limits."""

from __future__ import annotations

from datetime import UTC, date, datetime, time
from typing import TypedDict

import typer

from berth.api import ApiKey, KeyChangeIn, KeyIn, RoleName, role_name
from berth.cli.common import console, context, print_json, print_table, record_table, request_body
from berth.cli.context import HELP_OPTIONS
from berth.errors import ConfigError
from berth.keys import validate_key_name
from berth.vocab.limits import (
    ANY_MODEL_WORD,
    NUMERIC_LIMITS,
    UNLIMITED_WORD,
    LimitName,
    describe_limit,
    parse_limit,
    parse_limit_name,
    parse_models,
)
from berth.vocab.roles import parse_role, parse_tier, role_of_tier

key_app = typer.Typer(
    context_settings=HELP_OPTIONS,
    help="Create, change, list and revoke API keys.",
    no_args_is_help=True,
)

#: What ``--expires`` takes to remove an expiry.
NEVER_WORD = "never"

_LIMIT_HELP = f"a whole number (200k, 2m also work) or {UNLIMITED_WORD!r}"
_ROLE = typer.Option(
    None,
    "--role",
    help="An admin key's role: viewer (reads only), operator (deploys, stops, manages models, "
    "services and keys of other tiers) or admin (everything; the default).",
)
_RPM = typer.Option(None, "--rpm", help=f"Requests per minute: {_LIMIT_HELP}.")
_TPM = typer.Option(None, "--tpm", help=f"Tokens per minute (prompt + completion): {_LIMIT_HELP}.")
_CONCURRENCY = typer.Option(
    None, "--max-concurrency", help=f"Requests in flight at once: {_LIMIT_HELP}."
)
_DAILY = typer.Option(None, "--daily-tokens", help=f"Tokens per UTC day: {_LIMIT_HELP}.")
_MONTHLY = typer.Option(None, "--monthly-tokens", help=f"Tokens per UTC month: {_LIMIT_HELP}.")
_MODELS = typer.Option(
    None,
    "--models",
    help=f"Models or routes it may use, comma-separated ({ANY_MODEL_WORD!r}: any).",
)


def parse_expiry(text: str, now: datetime) -> datetime:
    """``--expires``: a date (the key stops working at its start, 00:00 UTC) or a date and
    time (``2027-01-01T12:00``, UTC unless it names a zone).  Raises :class:`ConfigError`
    for anything else or a moment not after ``now``."""
    value = text.strip()
    try:
        moment = datetime.combine(date.fromisoformat(value), time(), tzinfo=UTC)
    except ValueError:
        try:
            moment = datetime.fromisoformat(value)
        except ValueError:
            raise ConfigError(
                f"--expires: {text!r} is not a date (2027-01-01) or date and time "
                "(2027-01-01T12:00:00+00:00)"
            ) from None
        if moment.tzinfo is None:
            moment = moment.replace(tzinfo=UTC)
    if moment <= now:
        raise ConfigError(f"--expires: {moment.isoformat()} is in the past")
    return moment.astimezone(UTC)


class _LimitFields(TypedDict, total=False):
    """The limit fields of a key's request body (:class:`~berth.api.KeyIn`,
    :class:`~berth.api.KeyChangeIn`), for the flags given."""

    rpm: int | None
    tpm: int | None
    max_concurrency: int | None
    daily_tokens: int | None
    monthly_tokens: int | None
    models: list[str] | None


class _NewKey(_LimitFields, total=False):
    """What ``berth key create`` sends beside the name and tier."""

    role: RoleName
    expires_at: datetime


class _KeyChanges(_LimitFields, total=False):
    """What ``berth key set`` sends: only what it was told to change."""

    tier: str
    role: RoleName
    expires_at: datetime | None
    clear: list[LimitName]


def _add_limits(
    fields: _LimitFields,
    rpm: str | None,
    tpm: str | None,
    max_concurrency: str | None,
    daily_tokens: str | None,
    monthly_tokens: str | None,
    models: str | None,
) -> None:
    """Put the limit fields of a request body in ``fields``, only for the flags given."""
    texts = (rpm, tpm, max_concurrency, daily_tokens, monthly_tokens)
    for name, text in zip(NUMERIC_LIMITS, texts, strict=True):
        if text is not None:
            fields[name] = parse_limit(name, text)
    if models is not None:
        allowed = parse_models(models)
        fields["models"] = None if allowed is None else sorted(allowed)


@key_app.command("create")
def create(
    ctx: typer.Context,
    name: str = typer.Argument(..., help="A label for the key."),
    # Help text is rich markup: a literal "[" is written "\\[".
    tier: str = typer.Option("standard", "--tier", help="admin, standard or a \\[tiers.NAME]."),
    role: str | None = _ROLE,
    rpm: str | None = _RPM,
    tpm: str | None = _TPM,
    max_concurrency: str | None = _CONCURRENCY,
    daily_tokens: str | None = _DAILY,
    monthly_tokens: str | None = _MONTHLY,
    models: str | None = _MODELS,
    expires: str | None = typer.Option(
        None, "--expires", help="When it stops working: a date (UTC) or an ISO date and time."
    ),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """Create a key; its secret is shown once and never stored.

    Limits not given are the tier's (config.toml's \\[tiers.NAME]).
    """
    # refuse a bad tier name, role, limit or expiry before asking the daemon
    role_of_tier(parse_tier(tier), role)
    validate_key_name(name)
    fields: _NewKey = {}
    _add_limits(fields, rpm, tpm, max_concurrency, daily_tokens, monthly_tokens, models)
    if role is not None:
        fields["role"] = role_name(parse_role(role))
    if expires is not None:
        fields["expires_at"] = parse_expiry(expires, datetime.now(UTC))
    body = request_body(KeyIn, name=name, tier=tier, **fields)
    with context(ctx).client() as client:
        record = client.create_key(body)
    if as_json:
        print_json(record)
        return
    # The secret first: it exists nowhere else, so nothing printed after it may lose it.
    console.print("secret (shown once, store it now):")
    print(record.secret, flush=True)
    role_shown = f" with the {record.role} role" if record.role is not None else ""
    console.print(f"created {record.tier} key {record.id} ({record.name}){role_shown}")


@key_app.command("set")
def set_(
    ctx: typer.Context,
    ident: str = typer.Argument(..., metavar="NAME_OR_ID", help="The key's name or id."),
    tier: str | None = typer.Option(None, "--tier", help="Move the key to this tier."),
    role: str | None = _ROLE,
    rpm: str | None = _RPM,
    tpm: str | None = _TPM,
    max_concurrency: str | None = _CONCURRENCY,
    daily_tokens: str | None = _DAILY,
    monthly_tokens: str | None = _MONTHLY,
    models: str | None = _MODELS,
    expires: str | None = typer.Option(
        None, "--expires", help=f"A new expiry (a date, UTC), or {NEVER_WORD!r} for none."
    ),
    clear: list[str] = typer.Option(
        [],
        "--clear",
        help="Give a limit back to the tier (rpm, tpm, max-concurrency, daily-tokens, "
        "monthly-tokens, models, or all); repeat or separate with commas.",
    ),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """Change a key's tier, role, limits or expiry; what is not given stays as it is."""
    fields: _KeyChanges = {}
    _add_limits(fields, rpm, tpm, max_concurrency, daily_tokens, monthly_tokens, models)
    if tier is not None:
        fields["tier"] = parse_tier(tier)
    if role is not None:
        fields["role"] = role_name(parse_role(role))
    if expires is not None:
        is_never = expires.strip().lower() == NEVER_WORD
        fields["expires_at"] = None if is_never else parse_expiry(expires, datetime.now(UTC))
    cleared = _cleared(clear)
    if cleared:
        fields["clear"] = cleared
    if not fields:
        raise ConfigError("nothing to change: give --tier, --role, a limit, --expires or --clear")
    body = request_body(KeyChangeIn, **fields)
    with context(ctx).client() as client:
        record = client.change_key(ident, body)
    if as_json:
        print_json(record)
        return
    console.print(f"changed key {record.id} ({record.name}): {_summary(record)}")


def _cleared(values: list[str]) -> list[LimitName]:
    names: list[LimitName] = []
    for value in values:
        for part in value.split(","):
            if part.strip().lower() == "all":
                return [*NUMERIC_LIMITS, "models"]
            name = parse_limit_name(part)
            if name not in names:
                names.append(name)
    return names


def _summary(record: ApiKey) -> str:
    limits = record.limits
    shown = [
        f"{name}={describe_limit(getattr(limits, name))}"
        for name in NUMERIC_LIMITS
        if getattr(limits, name) is not None
    ]
    if limits.models is not None:
        shown.append(f"models={','.join(limits.models)}")
    role = f"role {record.role}, " if record.role is not None else ""
    return f"tier {record.tier}, {role}" + (", ".join(shown) if shown else "no limits")


@key_app.command("ls")
def ls(ctx: typer.Context, as_json: bool = typer.Option(False, "--json")) -> None:
    """List keys with their limits and use (prefixes only; secrets are never stored).

    A limit marked * is the key's own; the others are its tier's. TODAY and MONTH are the
    tokens used in the UTC day and month, out of the budget when there is one.
    """
    with context(ctx).client() as client:
        records = client.keys()
    if as_json:
        print_json(records)
        return
    # Ids, tiers and dates stay whole (a user copies an id to revoke it); the rest folds.
    table = record_table()
    for column in ("ID", "NAME", "TIER", "ROLE", "PREFIX", "RPM", "TPM", "CONC", "TODAY", "MONTH",
                   "MODELS", "EXPIRES", "REVOKED"):  # fmt: skip
        whole = column in ("ID", "TIER", "ROLE", "EXPIRES", "REVOKED")
        table.add_column(column, no_wrap=whole, overflow="ellipsis" if whole else "fold")
    for r in records:
        table.add_row(
            r.id,
            r.name,
            r.tier,
            r.role or "",
            r.prefix,
            _limit(r, "rpm"),
            _limit(r, "tpm"),
            _limit(r, "max_concurrency"),
            _budget(r.use.day_tokens, r.limits.daily_tokens, r, "daily_tokens"),
            _budget(r.use.month_tokens, r.limits.monthly_tokens, r, "monthly_tokens"),
            _limit(r, "models"),
            _when(r.expires_at),
            _when(r.revoked_at),
        )
    print_table(table)


def _when(moment: datetime | None) -> str:
    """A UTC moment as a date, with the time when it is not midnight."""
    if moment is None:
        return ""
    moment = moment.astimezone(UTC)
    return moment.date().isoformat() if moment.time() == time() else moment.isoformat()[:16]


def compact(number: int) -> str:
    """A count as a table shows it: 950, 12.5k, 200k, 3M, 1.2G."""
    for size, unit in ((10**9, "G"), (10**6, "M"), (10**3, "k")):
        if number >= size and number >= 10_000:
            value = number / size
            return (
                f"{value:.1f}".rstrip("0").rstrip(".") if value < 100 else f"{value:.0f}"
            ) + unit
    return str(number)


def _limit(record: ApiKey, name: LimitName) -> str:
    value = getattr(record.limits, name)
    if isinstance(value, list):
        text = describe_limit(frozenset(value))
    else:
        text = "-" if value is None else compact(value)
    return text + "*" if name in record.overridden else text


def _budget(used: int, budget: int | None, record: ApiKey, name: LimitName) -> str:
    if budget is None:
        return compact(used)
    mark = "*" if name in record.overridden else ""
    return f"{compact(used)}/{compact(budget)}{mark}"


@key_app.command("revoke")
def revoke(
    ctx: typer.Context,
    ident: str = typer.Argument(..., metavar="NAME_OR_ID", help="The key's name or id."),
) -> None:
    """Revoke a key at once."""
    with context(ctx).client() as client:
        record = client.revoke_key(ident)
    console.print(f"revoked {record.id} ({record.name})")
