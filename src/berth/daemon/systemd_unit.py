"""The systemd unit that runs a leader (``berth daemon start --foreground``) as a service:
pure rendering, as the agent's (:mod:`berth.agent.systemd_unit`).

``berth daemon install-service`` gathers the inputs into a :class:`LeaderUnit`;
:func:`render_unit` turns it into the unit text.  Nothing here touches the disk, the
environment or a subprocess.  Two scopes, as for the agent: ``user``
(``~/.config/systemd/user/berth-leader.service``) and ``system``
(``/etc/systemd/system/berth-leader.service``, ``User=`` set, never root).

What the unit says, and why:

- the leader runs in the foreground (``Type=simple``), logging to the journal;
- ``Restart=on-failure``: a leader that exits with an error, crashes or is killed is started
  again; one stopped on request (``systemctl stop``, ``berth daemon stop``: exit 0) is not;
- exit status 75 (``STANDBY_RESTART_EXIT``: a ``berth leader step-down``, or a lease lost
  while running engines on this host) is restarted too (``RestartForceExitStatus=``), and
  is no failure (``SuccessExitStatus=``): the leader comes back as a standby (docs/ha.md);
- a rising interval between restarts on every systemd: from ``RestartSec=`` (5 s) up to
  5 minutes, by ``RestartSteps=``/``RestartMaxDelaySec=`` where systemd has them (254 and
  newer; they must come together), else by the leader's own start
  (``--restart-backoff``, :mod:`berth.restart_backoff`), since an older systemd would warn
  about the keys and restart every 5 s for ever (Debian 12 has 252);
- ``StartLimitIntervalSec=0``: never give up restarting;
- the engines of node ``local`` outlive a crash of the leader, which takes them back when it
  starts again, so only the leader itself is signalled (``KillMode=process``); a clean stop
  stops them itself, within ``TimeoutStopSec=``;
- no setting of the leader's is written into the unit (it is world-readable): the leader
  reads ``config.toml`` in its home, and ``--env-file`` adds an ``EnvironmentFile=`` (mode
  0600, read by systemd) for what should stay out of both, such as
  ``BERTH_DATABASE_URL`` with its password or ``BERTH_CLUSTER_SECRET``.

The system unit has the agent's sandboxing (``ProtectSystem=full`` with the home writable,
``ProtectControlGroups=yes``; nothing that implies ``NoNewPrivileges=``, which the engines
of node ``local`` may need for CUDA's ``nvidia-modprobe``), ``LimitNOFILE=65536`` (a
connection per client and per engine), and ``AmbientCapabilities=CAP_NET_BIND_SERVICE`` when
a listener's port is below 1024.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Final

from berth import __version__
from berth.errors import STANDBY_RESTART_EXIT, ConfigError
from berth.restart_backoff import MAX_DELAY_S, RESTART_SEC_S
from berth.unit_files import (
    UnitScope,
    check_printable,
    check_user_name,
    escape_specifiers,
    exec_word,
    install_section,
    quote_word,
    service_head,
)

#: The unit's file name, in either scope.
UNIT_NAME: Final = "berth-leader.service"
#: With systemd 254 or newer, the delay grows over this many restarts up to
#: :data:`~berth.restart_backoff.MAX_DELAY_S`.
RESTART_STEPS: Final = 6
#: The systemd release that added ``RestartSteps=`` and ``RestartMaxDelaySec=``.
SYSTEMD_RESTART_BACKOFF_VERSION: Final = 254
#: Seconds systemd waits after SIGTERM (the leader drains its requests and stops node
#: ``local``'s engines) before SIGKILL; as ``berth daemon stop`` waits.
STOP_TIMEOUT_S: Final = 90
#: Open files for the system unit: the listeners' connections and the engines' sockets.
SYSTEM_NOFILE_LIMIT: Final = 65536
#: Ports below this need ``CAP_NET_BIND_SERVICE`` (``net.ipv4.ip_unprivileged_port_start``'s
#: default).
PRIVILEGED_PORT_BELOW: Final = 1024


@dataclass(frozen=True)
class LeaderUnit:
    """What the leader's unit is made from.

    ``python`` is the interpreter berth is installed in and ``home`` the leader's
    ``$BERTH_HOME``, both absolute; ``user_name`` is the account the system unit runs it as
    (``None`` for a user unit); ``search_path`` becomes the service's ``PATH`` (engines such
    as ``llama-server`` are found on it); ``public_url`` only describes the unit;
    ``ports`` are the listeners' ports (one below 1024 needs a capability);
    ``environment_file`` becomes ``EnvironmentFile=``; ``systemd_version`` (``None`` when
    unknown: taken as older) picks systemd's restart backoff or the leader's own.
    """

    scope: UnitScope
    python: Path
    home: Path
    public_url: str
    user_name: str | None = None
    search_path: tuple[Path, ...] = ()
    ports: tuple[int, ...] = ()
    environment_file: Path | None = None
    systemd_version: int | None = None

    @property
    def systemd_backoff(self) -> bool:
        """Whether systemd itself raises the restart delay (254 and newer)."""
        return (self.systemd_version or 0) >= SYSTEMD_RESTART_BACKOFF_VERSION

    @property
    def needs_bind_capability(self) -> bool:
        """Whether a listener's port is below 1024 (0 means any free one)."""
        return any(0 < port < PRIVILEGED_PORT_BELOW for port in self.ports)


def render_unit(unit: LeaderUnit) -> str:
    """The unit file text for ``unit``, ending in a newline.

    Raises :class:`ConfigError` when a path is relative or holds a control character, when
    a system unit has no ``user_name`` or would run as ``root``, when a user unit names a
    user, or when a user unit would need a port below 1024 (a user manager cannot grant it).
    """
    paths = [("the Python interpreter", unit.python), ("the berth home", unit.home)]
    if unit.environment_file is not None:
        paths.append(("the environment file", unit.environment_file))
    for what, path in paths:
        if not path.is_absolute():
            raise ConfigError(f"{what} must be an absolute path for a systemd unit: {path}")
        check_printable(what, str(path))
    if unit.scope == "system":
        if not unit.user_name:
            raise ConfigError("a system unit needs the user to run the leader as")
        check_user_name(unit.user_name, runs="the leader")
    else:
        if unit.user_name is not None:
            raise ConfigError("a user unit runs as its owner; it takes no user name")
        if unit.needs_bind_capability:
            low = ", ".join(str(p) for p in unit.ports if 0 < p < PRIVILEGED_PORT_BELOW)
            raise ConfigError(
                f"a user unit cannot bind port {low} (below {PRIVILEGED_PORT_BELOW}): use "
                "--system, or ports of 1024 and above behind a proxy"
            )
    for entry in unit.search_path:
        if not entry.is_absolute() or ":" in str(entry):
            raise ConfigError(f"PATH entries must be absolute and free of ':': {entry}")
        check_printable("a PATH entry", str(entry))
    description = f"berth leader: home {unit.home}, {unit.public_url}"
    check_printable("the leader's address", description)
    argv = [str(unit.python), "-m", "berth", "--home", str(unit.home), "daemon", "start"]
    argv.append("--foreground")
    if not unit.systemd_backoff:
        argv.append("--restart-backoff")
    lines = [
        f"# Written by `berth daemon install-service` (berth {__version__}).",
        "# Replace it with `berth daemon install-service --force`.",
        "[Unit]",
        f"Description={escape_specifiers(description)}",
    ]
    if unit.scope == "system":
        lines += [
            "Wants=network-online.target",
            "After=network-online.target docker.service postgresql.service",
        ]
    lines += [
        "# Never give up restarting: the leader exits on its own only on an error or a",
        "# hand-over, and comes back (as a standby after a hand-over).",
        "StartLimitIntervalSec=0",
        "",
        *service_head(
            unit.scope, user_name=unit.user_name, home=unit.home, search_path=unit.search_path
        ),
    ]
    if unit.environment_file is not None:
        lines.append(f"EnvironmentFile={quote_word(escape_specifiers(str(unit.environment_file)))}")
    lines += [
        f"ExecStart={' '.join(exec_word(word) for word in argv)}",
        "Restart=on-failure",
        f"RestartSec={RESTART_SEC_S:g}s",
    ]
    if unit.systemd_backoff:
        lines += [f"RestartSteps={RESTART_STEPS}", f"RestartMaxDelaySec={MAX_DELAY_S:g}s"]
    else:
        lines.append(
            f"# systemd {unit.systemd_version or 'before 254'} has no RestartSteps=: "
            "--restart-backoff waits longer after each failed run in a row."
        )
    lines += [
        f"# {STANDBY_RESTART_EXIT}: handed the lease over; start again as a standby.",
        f"SuccessExitStatus={STANDBY_RESTART_EXIT}",
        f"RestartForceExitStatus={STANDBY_RESTART_EXIT}",
        "# Node local's engines outlive a crash (the next leader takes them back); a clean",
        "# stop stops them itself.  So only the leader is signalled.",
        "KillMode=process",
        f"TimeoutStopSec={STOP_TIMEOUT_S}s",
        "SyslogIdentifier=berth-leader",
    ]
    if unit.scope == "system":
        lines.append(f"LimitNOFILE={SYSTEM_NOFILE_LIMIT}")
        if unit.needs_bind_capability:
            lines.append("AmbientCapabilities=CAP_NET_BIND_SERVICE")
        lines += [
            "# Sandboxing that cannot break GPU engines (see berth.daemon.systemd_unit).",
            "ProtectSystem=full",
            f"ReadWritePaths={quote_word(escape_specifiers(str(unit.home)))}",
            "ProtectControlGroups=yes",
        ]
    lines += install_section(unit.scope)
    return "\n".join(lines) + "\n"
