"""``berth daemon install-service``: the leader as a systemd service
(:mod:`berth.daemon.systemd_unit` writes the unit; :mod:`berth.cli.service_install` installs
it).

The settings are checked as the service will read them (``config.toml`` and the
``--env-file``, not this shell's ``BERTH_*``), so a bad value fails here rather than in a
restart loop; a ``BERTH_*`` variable of this shell that the service would not see is named.
"""

from __future__ import annotations

import os
import pwd
import stat
import sys
from pathlib import Path

import typer

from berth.agent.systemd_unit import default_unit_dir, search_path_for
from berth.api.client import DaemonClient
from berth.cli import service_install
from berth.cli.common import console, context
from berth.cluster.pki.ca import CA_KEY_FILE
from berth.config import Settings
from berth.config.table import ENV_PREFIX
from berth.daemon.systemd_unit import UNIT_NAME, LeaderUnit, render_unit
from berth.errors import ConfigError
from berth.paths import BerthHome, resolve_home
from berth.unit_files import UnitScope, pick_user_name

_RUNS = "the leader"


def install_service(
    ctx: typer.Context,
    system: bool = service_install.SYSTEM_OPTION,
    user_name: str | None = typer.Option(
        None, "--user-name", help="With --system: the account to run the leader as (not root)."
    ),
    env_file: Path | None = typer.Option(
        None,
        "--env-file",
        help="A file of BERTH_*=value lines for the service (EnvironmentFile=, mode 0600): "
        "for settings that stay out of config.toml, such as a database password.",
    ),
    unit_dir: Path | None = service_install.UNIT_DIR_OPTION,
    no_start: bool = service_install.NO_START_OPTION,
    dry_run: bool = service_install.DRY_RUN_OPTION,
    force: bool = service_install.FORCE_OPTION,
) -> None:
    """Run the leader as a systemd service: write berth-leader.service, start it.

    It runs `berth daemon start --foreground` with this Python and --home.
    A failure is restarted after 5 s, then longer each time up to 5 minutes
    (systemd 254+: RestartSteps=; older: the leader's --restart-backoff).
    After `berth leader step-down` it is started again, as a standby.
    Default: a unit for your own user manager; --system: a system unit that
    runs as $SUDO_USER (never root).
    """
    scope: UnitScope = "system" if system else "user"
    if user_name is not None and not system:
        raise ConfigError("--user-name applies to --system only; a user unit runs as you")
    home = context(ctx).home
    account = None
    if system:
        name = pick_user_name(
            sudo_user=os.environ.get("SUDO_USER"), user_name=user_name, runs=_RUNS
        )
        account = service_install.service_account(name, runs=_RUNS)
        if not service_install.home_given(ctx):
            # sudo sets HOME to root's: the default home is the service user's, not root's.
            home = BerthHome(resolve_home(Path(account.pw_dir) / ".berth"))
    elif os.geteuid() == 0:
        service_install.warn(
            "this user unit runs the leader as root; prefer `sudo berth daemon install-service "
            "--system` from the account that should run it"
        )
    if home.agent_config.exists() and not (home.ca_dir / CA_KEY_FILE).exists():
        raise ConfigError(
            f"{home.root} is an agent's home (agent.yaml): `berth agent install-service` "
            "runs its agent"
        )
    environment = _service_environment(env_file)
    settings = Settings.load(home, env=environment)  # as the service will: refused here
    _name_shell_settings(environment)
    python = Path(sys.executable).absolute()  # not resolved: a venv's python is a symlink
    systemctl = service_install.find_systemctl()
    unit = LeaderUnit(
        scope=scope,
        python=python,
        home=home.root,
        public_url=settings.public_url(),
        user_name=account.pw_name if account else None,
        search_path=search_path_for(python, os.environ.get("PATH")),
        ports=(settings.public_port, settings.cluster_port),
        environment_file=None if env_file is None else env_file.expanduser().absolute(),
        systemd_version=service_install.systemd_version(systemctl),
    )
    text = render_unit(unit)
    if dry_run:
        sys.stdout.write(text)
        return

    _prepare_home(home, account)
    directory = unit_dir or default_unit_dir(
        scope, user_home=Path.home(), xdg_config_home=os.environ.get("XDG_CONFIG_HOME")
    )
    written = service_install.write_unit(
        directory.absolute() / UNIT_NAME, text, force=force, system=system
    )
    if written.existed and not written.replaced:
        console.print(f"{written.path} is up to date", soft_wrap=True, markup=False)
    else:
        runs_as = f"runs as {unit.user_name}" if unit.user_name else "runs as you"
        backoff = (
            "systemd's RestartSteps="
            if unit.systemd_backoff
            else f"--restart-backoff (systemd {unit.systemd_version or 'version unknown'})"
        )
        console.print(
            f"wrote {written.path} ({scope} unit; {runs_as}, home {home.root}; restart delay "
            f"rising by {backoff})",
            soft_wrap=True,
            markup=False,
        )
    if not written.existed:
        _warn_if_leader_running(home)
    if service_install.activate(
        scope, systemctl, UNIT_NAME, restart=written.replaced, no_start=no_start
    ):
        flag = "--user " if scope == "user" else ""
        console.print(
            f"{UNIT_NAME} is enabled and started; check it with `berth daemon status` and "
            f"`journalctl {flag}-u berth-leader -f`",
            soft_wrap=True,
            markup=False,
        )
    if scope == "user":
        service_install.hint_linger()


def _service_environment(env_file: Path | None) -> dict[str, str]:
    """The ``BERTH_*`` settings the service gets: those of ``env_file`` (``KEY=value``
    lines, ``#`` comments, values optionally quoted, as systemd.exec(5)
    ``EnvironmentFile=`` reads them), none otherwise.  Refuses a file that is missing or
    that others may read (it is there for secrets)."""
    if env_file is None:
        return {}
    path = env_file.expanduser().absolute()
    try:
        info = path.stat()
        lines = path.read_text().splitlines()
    except OSError as exc:
        raise ConfigError(f"cannot read the --env-file: {exc.strerror}", path=path) from None
    if stat.S_IMODE(info.st_mode) & 0o077:
        raise ConfigError(
            f"the --env-file is readable by others (mode {stat.S_IMODE(info.st_mode):04o}); "
            f"it is for secrets: chmod 600 {path}",
            path=path,
        )
    found: dict[str, str] = {}
    for line in lines:
        text = line.strip()
        if not text or text.startswith(("#", ";")) or "=" not in text:
            continue
        key, _, value = text.partition("=")
        value = value.strip()
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
            value = value[1:-1]
        found[key.strip()] = value
    return found


def _name_shell_settings(environment: dict[str, str]) -> None:
    """Warn about ``BERTH_*`` variables of this shell the service will not see (names only:
    one may hold a password)."""
    missing = sorted(
        name
        for name in os.environ
        if name.startswith(ENV_PREFIX) and name != "BERTH_HOME" and name not in environment
    )
    if missing:
        service_install.warn(
            f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} set in this shell "
            "but the service will not see it: put the setting in config.toml, or in a file "
            "given with --env-file (mode 0600)"
        )


def _prepare_home(home: BerthHome, account: pwd.struct_passwd | None) -> None:
    """Make the home (0700) when it does not exist yet; a system unit's must belong to its
    account (made for it, when run as root)."""
    created = not home.root.exists()
    if created:
        home.root.mkdir(mode=0o700, parents=True)
    if account is not None:
        if created and os.geteuid() == 0:
            os.chown(home.root, account.pw_uid, account.pw_gid)
        service_install.check_home_owner(home.root, account, runs=_RUNS)


def _warn_if_leader_running(home: BerthHome) -> None:
    with DaemonClient(home, timeout_s=2.0) as client:
        if not client.is_running():
            return
        pid = client.info().pid
    service_install.warn(
        f"a leader already runs for {home.root} (pid {pid}), started by hand: stop it with "
        "`berth daemon stop`, or the service's leader fails (and is retried) until it is"
    )
