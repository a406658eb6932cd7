"""The systemd unit that runs ``berth agent start`` as a service: pure rendering and decisions.

``berth agent install-service`` gathers the inputs (this Python, the home, the service user,
the search path, the systemd version) into an :class:`AgentUnit`; :func:`render_unit` turns it
into the unit text.  Nothing here touches the disk, the environment or a subprocess.

Two scopes:

- ``user``: ``~/.config/systemd/user/berth-agent.service``, run by the user's own service
  manager (``systemctl --user``); it starts at boot only with lingering enabled
  (``loginctl enable-linger``).
- ``system``: ``/etc/systemd/system/berth-agent.service`` with ``User=`` set; never root.

What the unit must not break (the agent's contract, see :mod:`berth.agent.runner`):

- engines outlive a restart of the agent, which re-attaches them, so only the agent's own
  process is signalled on stop (``KillMode=process``);
- engines need the GPUs (``/dev/nvidia*``), and CUDA may call the setuid
  ``nvidia-modprobe`` to create ``/dev/nvidia-uvm`` on first use, so nothing that implies
  ``NoNewPrivileges=yes`` is set: per systemd.exec(5) that excludes ``ProtectKernel*=``,
  ``ProtectClock=``, ``ProtectHostname=``, ``RestrictRealtime=``, ``LockPersonality=``,
  ``SystemCallFilter=`` and the like for a unit with ``User=``;
- engines keep files in ``/tmp`` that must survive an agent restart (no ``PrivateTmp=``),
  models and caches live under the home directory (no ``ProtectHome=``), and the docker
  runtime needs Docker's socket (no ``RestrictAddressFamilies=``).

Restarts: a failing agent is restarted for ever (``Restart=on-failure``,
``StartLimitIntervalSec=0``) with an interval that grows from 5 s to 300 s: systemd's own
``RestartSteps=`` from 254 on, the agent's ``--paced-restarts`` before; an agent the leader
refused for good (its node must be enrolled again) exits 78 and is not restarted
(``RestartPreventExitStatus=78``; :mod:`berth.agent.exit_status`).

The system unit keeps what is left and costs nothing: ``/usr``, ``/boot`` and ``/etc``
read-only (``ProtectSystem=full``, with the berth home writable wherever it lives) and the
cgroup tree read-only (``ProtectControlGroups=yes``).  A user manager cannot set up those
mount namespaces without ``PrivateUsers=``, which would hide the real root from
``nvidia-modprobe`` too, so the user unit has none.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from berth import __version__
from berth.agent.exit_status import (
    EXIT_REENROLL,
    RESTART_DELAY_S,
    RESTART_MAX_DELAY_S,
    RESTART_STEPS,
)
from berth.errors import ConfigError
from berth.unit_files import UnitScope as UnitScope  # the agent CLI's type, defined once there
from berth.unit_files import check_printable as _check_printable
from berth.unit_files import check_user_name, install_section, pick_user_name, service_head
from berth.unit_files import escape_specifiers as _escape_specifiers
from berth.unit_files import exec_word as _exec_word
from berth.unit_files import quote_word as _quote

#: The unit's file name, in either scope.
UNIT_NAME = "berth-agent.service"
#: Where system units written by an administrator live (systemd.unit(5), "Unit File Load Path").
SYSTEM_UNIT_DIR = Path("/etc/systemd/system")
#: The systemd release that added ``RestartSteps=`` and ``RestartMaxDelaySec=``: from it on
#: systemd raises the restart interval (:data:`RESTART_DELAY_S` growing to
#: :data:`RESTART_MAX_DELAY_S` over :data:`RESTART_STEPS` restarts); before it the agent
#: paces its own restarts the same way (``--paced-restarts``, :mod:`berth.agent.exit_status`).
SYSTEMD_RESTART_BACKOFF_VERSION = 254
#: The flag of ``berth agent start`` that makes the agent space out its own restarts.
PACED_RESTARTS_FLAG = "--paced-restarts"
#: Seconds systemd waits for the agent to close its link after SIGTERM before SIGKILL.
STOP_TIMEOUT_S = 30
#: Open files for the system unit: each tunneled request holds a socket to its engine, and
#: systemd's default soft limit for services (1024) is low for a busy node.
SYSTEM_NOFILE_LIMIT = 65536

_VERSION_LINE = re.compile(r"^systemd (\d+)\b")


@dataclass(frozen=True)
class AgentUnit:
    """What the agent's unit is made from.

    ``python`` is the interpreter berth is installed in and ``home`` the agent's
    ``$BERTH_HOME``, both absolute; ``user_name`` is the account the system unit runs the agent
    as (``None`` for a user unit); ``search_path`` becomes the service's ``PATH`` (engines such
    as ``llama-server`` and ``vllm`` are found on it); ``label`` and ``leader_url`` only
    describe the unit; ``systemd_version`` (``None`` when unknown) turns on the restart
    backoff where systemd supports it.
    """

    scope: UnitScope
    python: Path
    home: Path
    label: str
    leader_url: str
    user_name: str | None = None
    search_path: tuple[Path, ...] = ()
    systemd_version: int | None = None


def render_unit(unit: AgentUnit) -> str:
    """The unit file text for ``unit``, ending in a newline.

    Raises :class:`ConfigError` when a path is relative or holds a control character (a unit
    file line cannot carry it), when a system unit has no ``user_name`` or would run as
    ``root``, or when a user unit names a user.
    """
    for what, path in (("the Python interpreter", unit.python), ("the berth home", unit.home)):
        if not path.is_absolute():
            raise ConfigError(f"{what} must be an absolute path for a systemd unit: {path}")
        _check_printable(what, str(path))
    if unit.scope == "system":
        if not unit.user_name:
            raise ConfigError("a system unit needs the user to run the agent as")
        check_service_user_name(unit.user_name)
    elif unit.user_name is not None:
        raise ConfigError("a user unit runs as its owner; it takes no user name")
    for entry in unit.search_path:
        if not entry.is_absolute() or ":" in str(entry):
            raise ConfigError(f"PATH entries must be absolute and free of ':': {entry}")
        _check_printable("a PATH entry", str(entry))
    description = f"berth agent: node {unit.label} of {unit.leader_url}"
    _check_printable("the node label and leader URL", description)
    native_backoff = (unit.systemd_version or 0) >= SYSTEMD_RESTART_BACKOFF_VERSION
    command = [str(unit.python), "-m", "berth", "--home", str(unit.home), "agent", "start"]
    if not native_backoff:
        command.append(PACED_RESTARTS_FLAG)
    exec_start = " ".join(_exec_word(word) for word in command)
    lines = [
        f"# Written by `berth agent install-service` (berth {__version__}).",
        "# Replace it with `berth agent install-service --force`; logs: `berth agent logs`.",
        "[Unit]",
        f"Description={_escape_specifiers(description)}",
    ]
    if unit.scope == "system":
        lines += [
            "Wants=network-online.target",
            "After=network-online.target docker.service",
        ]
    else:
        lines += [
            "# A user manager cannot order itself after the system's network-online.target;",
            "# the agent redials the leader with backoff until the network is up.",
        ]
    lines += [
        "# Never give up restarting a failure (the interval grows); a node the leader",
        f"# refused for good exits {EXIT_REENROLL} and stays stopped until it is enrolled again.",
        "StartLimitIntervalSec=0",
        "",
        *service_head(
            unit.scope, user_name=unit.user_name, home=unit.home, search_path=unit.search_path
        ),
        f"ExecStart={exec_start}",
        "Restart=on-failure",
        f"RestartSec={RESTART_DELAY_S}s",
        f"RestartPreventExitStatus={EXIT_REENROLL}",
    ]
    if native_backoff:
        lines += [f"RestartSteps={RESTART_STEPS}", f"RestartMaxDelaySec={RESTART_MAX_DELAY_S}s"]
    else:
        lines += [
            f"# systemd {unit.systemd_version or '(version unknown)'} keeps RestartSec= fixed: "
            f"{PACED_RESTARTS_FLAG}",
            "# has the agent wait longer after each failure in a row (up to "
            f"{RESTART_MAX_DELAY_S} s).",
        ]
    lines += [
        "# Engines outlive an agent restart (the next agent re-attaches them); `berth stop`",
        "# on the leader ends them.  So only the agent itself is signalled on stop.",
        "KillMode=process",
        f"TimeoutStopSec={STOP_TIMEOUT_S}s",
        "SyslogIdentifier=berth-agent",
    ]
    if unit.scope == "system":
        lines += [
            f"LimitNOFILE={SYSTEM_NOFILE_LIMIT}",
            "# Sandboxing that cannot break GPU engines (see berth.agent.systemd_unit).",
            "ProtectSystem=full",
            f"ReadWritePaths={_quote(_escape_specifiers(str(unit.home)))}",
            "ProtectControlGroups=yes",
        ]
    lines += install_section(unit.scope)
    return "\n".join(lines) + "\n"


def check_service_user_name(name: str) -> None:
    """Refuse ``root`` (and an empty or malformed name) as the system unit's user.

    Raises :class:`ConfigError`.  The account's uid is checked by the caller, which can look
    it up; this only knows the name.
    """
    check_user_name(name, runs="the agent")


def service_user_name(*, sudo_user: str | None, user_name: str | None) -> str:
    """The account a system unit runs the agent as: ``user_name`` if given, else the
    ``$SUDO_USER`` who ran ``sudo berth agent install-service --system``.

    Raises :class:`ConfigError` when neither names one, or the one named is ``root``.
    """
    return pick_user_name(sudo_user=sudo_user, user_name=user_name, runs="the agent")


def default_unit_dir(
    scope: UnitScope, *, user_home: Path, xdg_config_home: str | None = None
) -> Path:
    """Where the unit goes: ``$XDG_CONFIG_HOME/systemd/user`` (else
    ``~/.config/systemd/user``) for a user unit, ``/etc/systemd/system`` for a system unit.

    A relative ``$XDG_CONFIG_HOME`` is ignored, as the XDG base directory spec requires.
    """
    if scope == "system":
        return SYSTEM_UNIT_DIR
    config = Path(xdg_config_home) if xdg_config_home else None
    if config is None or not config.is_absolute():
        config = user_home / ".config"
    return config / "systemd" / "user"


def parse_systemd_version(text: str) -> int | None:
    """The release number from ``systemctl --version`` output (``systemd 252 (252.39-1)``),
    or ``None`` when the first line does not read like that."""
    first = text.strip().splitlines()[0] if text.strip() else ""
    found = _VERSION_LINE.match(first)
    return int(found.group(1)) if found else None


def search_path_for(python: Path, path_env: str | None) -> tuple[Path, ...]:
    """The service's ``PATH``: ``python``'s folder first (a virtual environment's ``bin``,
    where ``vllm`` and friends are installed), then the absolute entries of ``path_env``
    (the installer's ``$PATH``), each once, in order."""
    entries: list[Path] = [python.parent]
    for raw in (path_env or "").split(":"):
        if raw and raw.startswith("/") and raw.isprintable():
            entries.append(Path(raw))
    seen: set[Path] = set()
    unique: list[Path] = []
    for entry in entries:
        if entry not in seen:
            seen.add(entry)
            unique.append(entry)
    return tuple(unique)
