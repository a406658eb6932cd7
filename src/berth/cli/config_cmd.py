"""``berth config show`` and ``berth config set-public|set-cluster|set-public-tls|set-policy``.

The ``set-*`` commands take ``key=value`` pairs, validate each value with the setting's own
rules (:func:`berth.config.convert_setting`), and write them to ``$BERTH_HOME/config.toml``
(atomically, other sections kept).  A running daemon keeps the settings it started with.
"""

from __future__ import annotations

import ssl
from collections.abc import Mapping, Sequence
from pathlib import Path

import typer
from rich.table import Table

from berth.api.client import DaemonClient
from berth.cli.common import console, context, err_console, print_json
from berth.cli.context import HELP_OPTIONS
from berth.config import Settings, convert_setting, read_config_file, write_config_values
from berth.errors import BerthError, ConfigError
from berth.paths import BerthHome

config_app = typer.Typer(
    context_settings=HELP_OPTIONS,
    help="Inspect and change berth's settings.",
    no_args_is_help=True,
)

#: ``berth config set-public``: key → setting.
PUBLIC_KEYS: Mapping[str, str] = {
    "host": "public_host",
    "port": "public_port",
    "bind": "public_bind",
}
#: ``berth config set-cluster``: key → setting.
CLUSTER_KEYS: Mapping[str, str] = {
    "host": "cluster_host",
    "port": "cluster_port",
    "bind": "cluster_bind",
}
#: ``berth config set-public-tls``: key → setting.
TLS_KEYS: Mapping[str, str] = {"cert": "public_cert", "key": "public_key"}
#: ``berth config set-policy``: key → setting (``[agent_policy]``, node local's policy).
POLICY_KEYS: Mapping[str, str] = {
    key: f"policy_{key}"
    for key in ("engines", "images", "model_roots", "gpus", "allow_args", "refuse_args")
}

_PAIRS_ARGUMENT_HELP = "KEY=VALUE pairs"
#: Hosts that only this machine can reach.
LOOPBACK_HOSTS = frozenset({"127.0.0.1", "::1", "[::1]", "localhost"})


@config_app.command("show")
def show(ctx: typer.Context, as_json: bool = typer.Option(False, "--json")) -> None:
    """Every setting, its value and where it came from (flag, env, file, autodetect, default),
    the public and cluster URLs they make, and the config file.

    ``--json`` prints ``{"config_file", "public_url", "cluster_url", "settings": {name:
    {"value", "source"}}}``.
    """
    home = context(ctx).home
    settings = Settings.load(home)
    if as_json:
        print_json(
            {
                "config_file": str(home.config_file),
                "config_file_exists": home.config_file.exists(),
                "public_url": settings.public_url(),
                "cluster_url": settings.cluster_url(),
                "settings": settings.as_json(),
            }
        )
        return
    missing = "" if home.config_file.exists() else " (not created yet)"
    console.print(f"config file: {home.config_file}{missing}", soft_wrap=True)
    console.print(f"public URL:  {settings.public_url()}", soft_wrap=True)
    console.print(f"cluster URL: {settings.cluster_url()}", soft_wrap=True)
    table = Table("SETTING", "VALUE", "SOURCE")
    for row in settings.rows():
        table.add_row(row.name, row.value, row.source)
    console.print(table)


def parse_pairs(
    pairs: Sequence[str], keys: Mapping[str, str], *, relative_to: Path
) -> dict[str, object]:
    """``["host=a", "port=443"]`` → ``{"public_host": "a", "public_port": 443}``.

    ``keys`` maps each accepted key to its setting; values are converted and validated as
    the setting is (:func:`convert_setting`), relative paths taken from ``relative_to``.
    Raises :class:`ConfigError` for no pairs, a pair without ``=`` or with an empty key or
    value, an unknown or repeated key (the message lists the valid keys), or a bad value.
    """
    valid = ", ".join(f"{key}=" for key in keys)
    if not pairs:
        raise ConfigError(f"nothing to set: give one or more of {valid}")
    updates: dict[str, object] = {}
    for pair in pairs:
        key, equals, raw = pair.partition("=")
        if not equals or not key:
            raise ConfigError(
                f"malformed argument {pair!r}: expected KEY=VALUE, KEY one of {valid}"
            )
        if key not in keys:
            raise ConfigError(f"unknown key {key!r}; valid keys: {valid}")
        name = keys[key]
        if name in updates:
            raise ConfigError(f"{key}= is given twice")
        if not raw.strip():
            raise ConfigError(f"{key}= needs a value")
        updates[name] = convert_setting(name, raw, where=pair, relative_to=relative_to)
    return updates


@config_app.command(
    "set-public",
    no_args_is_help=True,
    epilog="Example: berth config set-public host=api.example.com port=443 bind=0.0.0.0",
)
def set_public(
    ctx: typer.Context,
    pairs: list[str] | None = typer.Argument(
        None, metavar="host=H port=P bind=B", help=_PAIRS_ARGUMENT_HELP, show_default=False
    ),
) -> None:
    """Set how clients reach the leader's public HTTPS listener: the host name in its URL,
    its port, and the address it binds (0.0.0.0 for every interface)."""
    _apply(context(ctx).home, parse_pairs(pairs or [], PUBLIC_KEYS, relative_to=Path.cwd()))


@config_app.command(
    "set-cluster",
    no_args_is_help=True,
    epilog="Example: berth config set-cluster host=cluster.example.com port=11501 bind=0.0.0.0",
)
def set_cluster(
    ctx: typer.Context,
    pairs: list[str] | None = typer.Argument(
        None, metavar="host=H port=P bind=B", help=_PAIRS_ARGUMENT_HELP, show_default=False
    ),
) -> None:
    """Set how agents reach the leader's cluster listener: the host name in the URL agents
    dial (and in its certificate), its port, and the address it binds."""
    _apply(context(ctx).home, parse_pairs(pairs or [], CLUSTER_KEYS, relative_to=Path.cwd()))


@config_app.command(
    "set-public-tls",
    no_args_is_help=True,
    epilog="Example: berth config set-public-tls cert=/etc/berth/fullchain.pem "
    "key=/etc/berth/privkey.pem",
)
def set_public_tls(
    ctx: typer.Context,
    pairs: list[str] | None = typer.Argument(
        None, metavar="cert=PATH key=PATH", help=_PAIRS_ARGUMENT_HELP, show_default=False
    ),
) -> None:
    """Serve the public listener with your own PEM certificate (full chain) and key instead
    of one issued by the berth CA.  A path that does not exist yet is written with a warning;
    files that exist must load as a certificate and its matching, unencrypted key."""
    home = context(ctx).home
    updates = parse_pairs(pairs or [], TLS_KEYS, relative_to=Path.cwd())
    before = Settings.load(home)
    cert = updates.get("public_cert", before.public_cert)
    key = updates.get("public_key", before.public_key)
    if cert is None or key is None:
        given, missing = ("cert", "key") if key is None else ("key", "cert")
        raise ConfigError(
            f"{given}= needs its pair: give both cert= and key= (no {missing} is set yet)"
        )
    assert isinstance(cert, Path) and isinstance(key, Path)
    _check_tls_files(cert, key)
    _apply(home, updates, before=before)


@config_app.command(
    "set-policy",
    no_args_is_help=True,
    epilog="Example: berth config set-policy model_roots=/root/.berth/models,/data/models",
)
def set_policy(
    ctx: typer.Context,
    pairs: list[str] | None = typer.Argument(
        None,
        metavar="model_roots=A,B engines=E,F ...",
        help=f"{_PAIRS_ARGUMENT_HELP}; keys: {', '.join(POLICY_KEYS)}",
        show_default=False,
    ),
) -> None:
    """Set what this host's own node (node local) lets berth run: the agent policy's comma
    lists, e.g. model_roots, the only folders whose files engines are given (a value
    replaces the default list, so name every folder to keep)."""
    _apply(context(ctx).home, parse_pairs(pairs or [], POLICY_KEYS, relative_to=Path.cwd()))


def _check_tls_files(cert: Path, key: Path) -> None:
    """Warn about a file that is not there yet; refuse folders and files that exist but do
    not load together (ssl's own check, the one the listener makes at start)."""
    missing = False
    for what, path in (("certificate", cert), ("key", key)):
        if path.is_dir():
            raise ConfigError(f"the {what} {path} is a folder, not a PEM file")
        if not path.exists():
            missing = True
            err_console.print(
                f"warning: the {what} {path} does not exist yet; the daemon will not start "
                "until it does",
                markup=False,
                soft_wrap=True,
            )
    if missing:
        return

    def no_password() -> bytes:
        raise ConfigError(f"the key {key} is encrypted; the listener needs an unencrypted key")

    try:
        ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(
            cert, key, password=no_password
        )
    except ssl.SSLError as exc:
        raise ConfigError(
            f"{cert} and {key} do not load as a certificate and its key: {exc.reason or exc}"
        ) from None
    except OSError as exc:
        raise ConfigError(f"cannot read {exc.filename or cert}: {exc.strerror}") from None


def _shown(value: object) -> str:
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def _apply(
    home: BerthHome, updates: Mapping[str, object], *, before: Settings | None = None
) -> None:
    """Write ``updates`` (setting → typed value) to ``config.toml`` and say what changed,
    which URL results, and what still overrides the file."""
    before = before or Settings.load(home)
    path = home.config_file
    in_file = read_config_file(path)
    changed: dict[str, object] = {}
    lines: list[str] = []
    for name, value in updates.items():
        old, source = before.value(name), before.source(name)
        file_value = in_file.get(name)
        stored = (
            file_value is not None
            and convert_setting(name, file_value.raw, where=str(path), relative_to=path.parent)
            == value
        )
        if stored:
            lines.append(f"  {name:<13} {_shown(value)} (unchanged)")
            continue
        changed[name] = str(value) if isinstance(value, Path) else value
        if old == value:  # the same value, from another source: now the file sets it
            lines.append(f"  {name:<13} {_shown(value)} ({source}, now set in the file)")
        else:
            lines.append(f"  {name:<13} {_shown(old)} ({source}) → {_shown(value)}")
    if changed:
        # The values together, as the daemon would read them (a cross-setting rule such as
        # public_cert needing public_key), before anything is written.
        Settings.load(home, flags=changed)
        home.ensure()
        write_config_values(path, changed)
        console.print(f"updated {path}", soft_wrap=True)
    else:
        console.print(f"{path} already has these values", soft_wrap=True)
    for line in lines:
        console.print(line, markup=False, soft_wrap=True)

    after = Settings.load(home)
    if any(name.startswith("public_") for name in updates):
        console.print(f"public URL:  {after.public_url()}", soft_wrap=True)
    if any(name.startswith("cluster_") for name in updates):
        console.print(f"cluster URL: {after.cluster_url()}", soft_wrap=True)
        if after.leader_url:
            _warn(f"leader_url ({after.source('leader_url')}) is what agents dial, not "
                  "cluster_host:cluster_port")  # fmt: skip
    for listener in ("public", "cluster"):
        host, bind = after.value(f"{listener}_host"), after.value(f"{listener}_bind")
        touched = f"{listener}_host" in updates or f"{listener}_bind" in updates
        if touched and bind in LOOPBACK_HOSTS and host not in LOOPBACK_HOSTS:
            _warn(
                f"{listener}_bind is {bind}: only this host can reach the {listener} listener, "
                f"not {host}; set bind=0.0.0.0 or an address of this host"
            )
    for name in updates:
        if after.source(name) == "env":
            _warn(f"BERTH_{name.upper()} is set in the environment and overrides the file")
        if name.endswith("_port") and after.value(name) == 0:
            _warn(f"{name} = 0 picks a free port at each start; others need a fixed one")
    if changed:
        _say_when_it_applies(home)


def _warn(message: str) -> None:
    err_console.print(f"warning: {message}", markup=False, soft_wrap=True)


def _say_when_it_applies(home: BerthHome) -> None:
    with DaemonClient(home, timeout_s=5.0) as client:
        if not client.is_running():
            console.print("takes effect at the next `berth daemon start`")
            return
        try:
            pid = f" (pid {client.info().pid})"
        except BerthError:
            pid = ""
    console.print(
        f"[yellow]note:[/] the running daemon{pid} keeps its current settings until it is "
        "restarted: `berth daemon stop`, then `berth daemon start`",
        soft_wrap=True,
        markup=True,
    )
