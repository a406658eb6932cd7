"""``berth deploy bootstrap``: make this host a leader served on a public domain.

It writes ``config.toml`` for a leader behind a reverse proxy (the public listener on
127.0.0.1 for the proxy, the cluster listener on every interface for agents), creates the
database, the CA and its server certificates, and a first admin key (printed once), then
prints what is left to do: start the daemon, put Caddy in front (``Caddyfile.example``), open
the cluster port, enroll agents.
"""

from __future__ import annotations

import ipaddress
import re
from pathlib import Path
from typing import Any, Final

import typer
from rich.markup import escape

from berth.backup import running_daemon
from berth.cli.common import console, context, err_console, print_json
from berth.cli.context import HELP_OPTIONS
from berth.cluster.pki.ca import CertificateAuthority
from berth.config import SETTINGS_BY_NAME, Settings, write_config_values
from berth.errors import ConfigError, ConflictError
from berth.keys import (
    generate_secret,
    hash_secret,
    key_prefix,
    load_or_create_pepper,
    validate_key_name,
)
from berth.paths import BerthHome, resolve_home
from berth.store import Store
from berth.store.db import is_sqlite, parse_database_url
from berth.vocab.roles import Tier

deploy_app = typer.Typer(
    context_settings=HELP_OPTIONS,
    help="Set this host up as a leader on a public domain.",
    no_args_is_help=True,
)

#: Where the public listener binds behind a reverse proxy on the same host.
PROXY_BIND: Final = "127.0.0.1"
#: Where the cluster listener binds: agents dial it directly, from anywhere.
CLUSTER_BIND: Final = "0.0.0.0"
#: Where the next steps tell the operator to put the CA for Caddy (Caddyfile.example).
CADDY_CA_FILE: Final = "/etc/caddy/berth-ca.pem"

# RFC 1123 host names: dot-separated labels of letters, digits and inner hyphens.
_LABEL = r"(?!-)[a-z0-9-]{1,63}(?<!-)"
_HOST_NAME = re.compile(rf"{_LABEL}(?:\.{_LABEL})*\.?")


def validate_host(text: str, flag: str, *, allow_ip: bool) -> str:
    """``text`` as a bare host name (lowercase, no trailing dot), for ``flag``.

    Raises :class:`ConfigError` for a URL, a port, a path, an empty or malformed name, or an
    IP address when ``allow_ip`` is false (automatic HTTPS needs a domain name).
    """
    host = text.strip().lower()
    if "://" in host or "/" in host:
        raise ConfigError(f"{flag} takes a bare domain such as api.example.com, not {text!r}")
    try:
        ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        pass
    else:
        if allow_ip:
            return host.strip("[]")
        raise ConfigError(
            f"{flag} {text!r} is an IP address; Caddy's automatic HTTPS needs a domain name "
            "whose DNS record points at this host"
        )
    if ":" in host:
        raise ConfigError(f"{flag} takes a domain without a port, not {text!r}")
    if len(host) > 253 or not _HOST_NAME.fullmatch(host):
        raise ConfigError(f"{flag} {text!r} is not a valid domain name")
    return host.rstrip(".")


def deploy_config(
    domain: str, cluster_domain: str | None, *, leader_only: bool
) -> dict[str, object]:
    """The ``config.toml`` settings of a leader on ``domain`` behind a reverse proxy.

    ``leader_only`` is written only when this berth has that setting.
    """
    values: dict[str, object] = {
        "public_host": domain,
        "public_bind": PROXY_BIND,
        "cluster_host": cluster_domain or domain,
        "cluster_bind": CLUSTER_BIND,
    }
    if leader_only and "leader_only" in SETTINGS_BY_NAME:
        values["leader_only"] = True
    return values


def _existing_state(home: BerthHome, database_url: str) -> list[str]:
    found = []
    if home.config_file.exists():
        found.append(str(home.config_file))
    url = parse_database_url(database_url)
    if is_sqlite(url):
        path = Path(url.database or "").expanduser()
        if url.database and path.is_file() and path.stat().st_size > 0:
            found.append(str(path))
    else:
        with Store(database_url) as store:
            if store.schema_version() > 0:
                found.append(f"the {url.get_backend_name()} database")
    return found


def _berth(home: Path) -> str:
    return "berth" if home == resolve_home() else f"berth --home {home}"


@deploy_app.command("bootstrap")
def bootstrap(
    ctx: typer.Context,
    domain: str = typer.Option(..., "--domain", help="Public domain clients use (DNS → here)."),
    cluster_domain: str | None = typer.Option(
        None, "--cluster-domain", help="Domain agents dial (default: --domain)."
    ),
    leader_only: bool = typer.Option(
        False, "--leader-only", help="Run no engines on this host; all engines on agents."
    ),
    key_name: str = typer.Option("admin", "--key-name", help="Name of the first admin key."),
    force: bool = typer.Option(
        False,
        "--force",
        help="Bootstrap over an existing config or database (both are kept and updated).",
    ),
    as_json: bool = typer.Option(False, "--json", help="Print the result as JSON."),
) -> None:
    """Write config.toml, the database, the CA and a first admin key for a public leader."""
    home = context(ctx).home
    public_host = validate_host(domain, "--domain", allow_ip=False)
    cluster_host = (
        validate_host(cluster_domain, "--cluster-domain", allow_ip=True)
        if cluster_domain is not None
        else None
    )
    if not key_name.strip():
        raise ConfigError("--key-name must not be empty")
    validate_key_name(key_name.strip())
    before = Settings.load(home)
    existing = _existing_state(home, before.database_url)
    if existing and not force:
        raise ConflictError(
            f"{home.root} already has {' and '.join(existing)}; pass --force to bootstrap over "
            "them (the database, CA and other settings are kept)"
        )

    home.ensure()
    values = deploy_config(public_host, cluster_host, leader_only=leader_only)
    write_config_values(home.config_file, values)
    settings = Settings.load(home)
    with Store(settings.database_url) as store:
        schema_version = store.migrate()
        ca = CertificateAuthority.load_or_create(home.ca_dir)
        _issue_server_certificates(home, settings, ca)
        pepper = load_or_create_pepper(home.pepper_file)
        secret = generate_secret()
        key = store.add_api_key(
            key_name.strip(), Tier.ADMIN, hash_secret(secret, pepper), key_prefix(secret)
        )

    overridden = [n for n in values if settings.source(n) not in ("file", "default")]
    notes = [
        f"{SETTINGS_BY_NAME[n].env_var} in the environment overrides {n} in config.toml"
        for n in overridden
    ]
    if leader_only and "leader_only" not in SETTINGS_BY_NAME:
        notes.append("this berth has no leader_only setting yet: it was not written")
    running = running_daemon(home)
    if running is not None:
        notes.append(
            f"a daemon of this home is running ({running}): restart it for the new settings"
        )
    result: dict[str, Any] = {
        "home": str(home.root),
        "config_file": str(home.config_file),
        "settings": {name: settings.value(name) for name in values},
        "database": next(r.value for r in settings.rows() if r.name == "database_url"),
        "schema_version": schema_version,
        "ca_file": str(ca.cert_path),
        "ca_fingerprint": ca.fingerprint_sha256,
        "admin_key": {"id": key.id, "name": key.name, "tier": key.tier, "secret": secret},
        "notes": notes,
    }
    if as_json:
        print_json(result)
        return
    _print_result(home, settings, result)
    for note in notes:
        err_console.print(f"[yellow]note:[/] {escape(note)}", soft_wrap=True, markup=True)


def _issue_server_certificates(
    home: BerthHome, settings: Settings, ca: CertificateAuthority
) -> None:
    """The public and cluster certificates for the new hosts, now rather than at the first
    start, so they can be inspected (and handed to a proxy) before then."""
    from berth.cluster.leader.listener import cluster_tls_files
    from berth.daemon.public_tls import public_tls_files

    public_tls_files(settings, home, ca)
    cluster_tls_files(ca, settings.cluster_hosts(), home.ca_dir)


def _toml_value(value: object) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def _print_result(home: BerthHome, settings: Settings, result: dict[str, Any]) -> None:
    berth = _berth(home.root)
    shown = ", ".join(f"{k} = {_toml_value(v)}" for k, v in result["settings"].items())
    console.print(
        f"[bold green]leader bootstrapped[/] in {escape(str(home.root))}",
        soft_wrap=True,
        markup=True,
    )
    console.print(f"  config    {home.config_file}  ({shown})", soft_wrap=True, markup=False)
    console.print(
        f"  database  {result['database']} (schema version {result['schema_version']})",
        soft_wrap=True,
        markup=False,
    )
    console.print(f"  CA        {result['ca_file']}  {result['ca_fingerprint']}", soft_wrap=True)
    key = result["admin_key"]
    console.print(f"admin key {key['id']} ({key['name']}); secret (shown once, store it now):")
    print(key["secret"])
    port, cluster_port = settings.public_port, settings.cluster_port
    steps = [
        f"start the leader:  {berth} daemon start",
        f"give Caddy the CA (public, not secret):  sudo install -m 0644 {result['ca_file']} "
        f"{CADDY_CA_FILE}",
        f"put Caddy in front: copy Caddyfile.example to /etc/caddy/Caddyfile, set the site to "
        f"{settings.public_host} (proxied to https://127.0.0.1:{port}), then: "
        "sudo systemctl reload caddy   (DNS for it must point here; open ports 80 and 443)",
        f"open the cluster port to agents, directly (not through Caddy): TCP {cluster_port} on "
        f"{settings.cluster_host}, e.g.  sudo ufw allow {cluster_port}/tcp",
        f"enroll each GPU host:  {berth} nodes enroll gpu-1   then run the printed "
        "berth agent register --uri '...' on that host, and berth agent start",
        f"try it:  curl https://{settings.public_host}/v1/models "
        "-H 'Authorization: Bearer <the admin key above>'",
    ]
    console.print("next steps:")
    for number, step in enumerate(steps, 1):
        console.print(f"  {number}. {step}", soft_wrap=True, markup=False)
