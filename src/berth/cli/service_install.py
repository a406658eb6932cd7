"""Installing a systemd unit for a berth process: what ``berth daemon install-service``
does around the unit text (:mod:`berth.daemon.systemd_unit`): the service account, the
running systemd's version, the unit written (replaced only with ``--force``), and
``systemctl`` run, or printed where it cannot run.

Both units go through it: the leader's (``cli/daemon_service_cmd.py``) and the agent's
(``berth agent install-service``, ``cli/agent_cmd.py``).
"""

from __future__ import annotations

import os
import pwd
import shlex
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import typer

from berth.atomic import write_atomic
from berth.cli.common import console, err_console
from berth.errors import BerthError, ConfigError, ConflictError
from berth.unit_files import UnitScope, systemctl_commands

#: Seconds ``systemctl`` (``--version``, or one command) may take.
SYSTEMCTL_TIMEOUT_S = 120


# The options both install-service commands take, defined once.
SYSTEM_OPTION = typer.Option(
    False,
    "--system/--user",
    help="A system unit in /etc/systemd/system running as $SUDO_USER (run it via sudo), "
    "or a unit for your own user manager (the default).",
)
UNIT_DIR_OPTION = typer.Option(
    None,
    "--unit-dir",
    help="Write the unit in this folder instead of systemd's (packaging, tests).",
)
NO_START_OPTION = typer.Option(
    False, "--no-start", help="Write the unit; print the systemctl commands, run none."
)
DRY_RUN_OPTION = typer.Option(
    False, "--dry-run", "--print", help="Print the unit on stdout; write nothing."
)
FORCE_OPTION = typer.Option(False, "--force", help="Replace a different existing unit.")


@dataclass(frozen=True)
class UnitWrite:
    """Where a unit went: its ``path``, whether one was there (``existed``) and whether it
    differed (``replaced``: the running service must be restarted to take it)."""

    path: Path
    existed: bool
    replaced: bool


def home_given(ctx: typer.Context) -> bool:
    """Whether the home was chosen (``--home`` or ``$BERTH_HOME``) rather than defaulted."""
    return ctx.find_root().params.get("home") is not None or bool(os.environ.get("BERTH_HOME"))


def service_account(name: str, *, runs: str) -> pwd.struct_passwd:
    """The passwd entry of ``name``, who will run ``runs`` (``"the leader"``);
    :class:`ConfigError` when there is none or it is uid 0."""
    try:
        account = pwd.getpwnam(name)
    except KeyError:
        raise ConfigError(f"there is no user {name!r} on this host") from None
    if account.pw_uid == 0:
        raise ConfigError(
            f"refusing to write a unit that runs {runs} as root ({name} has uid 0): run it "
            f"via sudo from the account that should run {runs}, or pass --user-name NAME"
        )
    return account


def check_home_owner(
    root: Path, account: pwd.struct_passwd, *, runs: str, reads: str = "its keys"
) -> None:
    """Refuse a home the service account does not own: ``runs`` could not read what it
    must (``reads``: the leader's keys, the agent's key)."""
    owner_uid = root.stat().st_uid
    if owner_uid == account.pw_uid:
        return
    try:
        owner = pwd.getpwuid(owner_uid).pw_name
    except KeyError:
        owner = f"uid {owner_uid}"
    fix = f"sudo chown -R {account.pw_name} {shlex.quote(str(root))}"
    if owner_uid != 0:
        fix = f"pass --user-name {owner}, or {fix}"
    raise ConfigError(
        f"{root} belongs to {owner}, not {account.pw_name}, who would run {runs} and could "
        f"not read {reads}; {fix}"
    )


def systemd_version(systemctl: str | None) -> int | None:
    """The running systemd's release from ``systemctl --version``; ``None`` if unknown."""
    from berth.agent.systemd_unit import parse_systemd_version

    if systemctl is None:
        return None
    try:
        result = subprocess.run(
            [systemctl, "--version"], capture_output=True, text=True, timeout=10, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return parse_systemd_version(result.stdout) if result.returncode == 0 else None


def write_unit(path: Path, text: str, *, force: bool, system: bool) -> UnitWrite:
    """Write ``text`` to ``path`` (atomically, 0644: systemd reads units as any user) unless
    it holds that already.  Raises :class:`ConflictError` when a different unit is there and
    ``force`` is false, :class:`ConfigError` when it cannot be read or written."""
    try:
        existing = path.read_text() if path.exists() else None
    except OSError as exc:
        raise ConfigError(f"cannot read {path}: {exc.strerror}") from None
    replaced = existing is not None and existing != text
    if replaced and not force:
        raise ConflictError(
            f"{path} exists and differs from the unit berth would write; add --force to "
            "replace it (--dry-run prints the new one)"
        )
    if existing != text:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            write_atomic(path, text, mode=0o644)
        except OSError as exc:
            hint = " (a --system unit needs root: run it via sudo)" if system else ""
            raise ConfigError(f"cannot write {path}: {exc.strerror}{hint}") from None
    return UnitWrite(path, existing is not None, replaced)


def activate(
    scope: UnitScope,
    systemctl: str | None,
    unit_name: str,
    *,
    restart: bool,
    no_start: bool,
) -> bool:
    """Run (or, where that cannot work, print) the ``systemctl`` commands that load, enable
    and start ``unit_name``; whether they ran.  Raises :class:`BerthError` naming the
    command that failed."""
    commands = systemctl_commands(scope, unit_name, restart=restart)
    reason = None
    if no_start:
        reason = "to load and start it"
    elif systemctl is None:
        reason = "systemctl is not installed here; on a systemd host, run"
    elif not Path("/run/systemd/system").is_dir():
        reason = "systemd is not running on this host (no /run/systemd/system); where it is, run"
    if reason is not None:
        console.print(f"{reason}:")
        for command in commands:
            console.print(f"  {shlex.join(command)}", soft_wrap=True, markup=False)
        return False
    assert systemctl is not None
    for command in commands:
        console.print(f"$ {shlex.join(command)}", soft_wrap=True, markup=False)
        result = subprocess.run(
            [systemctl, *command[1:]],
            capture_output=True,
            text=True,
            timeout=SYSTEMCTL_TIMEOUT_S,
            check=False,
        )
        if result.returncode != 0:
            detail = (result.stderr or result.stdout).strip().splitlines()
            raise BerthError(
                f"`{shlex.join(command)}` failed ({detail[0] if detail else result.returncode}); "
                "the unit is written: fix that and run the remaining systemctl commands"
            )
    return True


def hint_linger() -> None:
    """Say how to start a user unit at boot, unless lingering is already on."""
    name = pwd.getpwuid(os.geteuid()).pw_name
    if not (Path("/var/lib/systemd/linger") / name).exists():
        console.print(
            f"a user unit runs while {name} is logged in; to start it at boot: "
            f"sudo loginctl enable-linger {name}",
            soft_wrap=True,
            markup=False,
        )


def find_systemctl() -> str | None:
    """``systemctl`` on ``PATH``, or ``None``."""
    return shutil.which("systemctl")


def warn(message: str) -> None:
    err_console.print(f"warning: {message}", markup=False, soft_wrap=True)
