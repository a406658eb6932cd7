"""systemd unit files as berth writes them: the syntax of a value, the account a system unit
runs as, and the ``systemctl`` commands that load a unit.  Pure: nothing here touches the
disk, the environment or a subprocess.

The agent's unit (``berth.agent.systemd_unit``) and the leader's
(``berth.daemon.systemd_unit``) are both written with these; each module says what its unit
holds and why.  Sources: systemd.syntax(7) "Quoting", systemd.unit(5) "Specifiers",
systemd.service(5) ``ExecStart=`` and systemd.exec(5) ``Environment=``.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Literal

from berth.errors import ConfigError

UnitScope = Literal["user", "system"]


def check_printable(what: str, text: str) -> None:
    """Raise :class:`~berth.errors.ConfigError` when ``text`` holds a control character a
    unit file line cannot carry (``what`` names it in the message)."""
    if not text.isprintable():
        raise ConfigError(f"{what} holds a control character a unit file cannot carry: {text!r}")


def escape_specifiers(text: str) -> str:
    """``text`` with ``%`` doubled: it starts a specifier in most unit settings."""
    return text.replace("%", "%%")


def quote_word(word: str) -> str:
    """``word`` as one item under systemd.syntax(7) "Quoting": double-quoted, with
    backslashes and double quotes escaped, when it holds whitespace, a quote or a backslash."""
    if word and not any(ch.isspace() or ch in "\"'\\" for ch in word):
        return word
    return '"' + word.replace("\\", "\\\\").replace('"', '\\"') + '"'


def exec_word(word: str) -> str:
    """One word of ``ExecStart=``: specifiers escaped, ``$`` doubled (``ExecStart=`` expands
    ``$NAME`` at run time; ``$$`` is a literal ``$``), quoted when needed."""
    return quote_word(escape_specifiers(word).replace("$", "$$"))


def environment_line(name: str, value: str) -> str:
    """``Environment="NAME=value"``: ``Environment=`` does no ``$`` expansion, only
    specifiers."""
    return f"Environment={quote_word(f'{name}={escape_specifiers(value)}')}"


def check_user_name(name: str, *, runs: str) -> None:
    """Refuse ``root`` (and an empty or malformed name) as the account a system unit runs
    ``runs`` (``"the agent"``, ``"the leader"``) as.  Raises
    :class:`~berth.errors.ConfigError`.  The account's uid is checked by the caller, which
    can look it up; this only knows the name."""
    if name == "root":
        raise ConfigError(
            f"refusing to write a unit that runs {runs} as root: run it via sudo from the "
            f"account that should run {runs}, or pass --user-name NAME"
        )
    if not name or any(ch.isspace() or not ch.isprintable() or ch in "%/:" for ch in name):
        raise ConfigError(f"not a usable user name for a systemd unit: {name!r}")


def pick_user_name(*, sudo_user: str | None, user_name: str | None, runs: str) -> str:
    """The account a system unit runs ``runs`` as: ``user_name`` if given, else the
    ``$SUDO_USER`` who ran ``sudo berth ... install-service --system``.  Raises
    :class:`~berth.errors.ConfigError` when neither names one, or the one named is
    ``root``."""
    chosen = user_name if user_name is not None else sudo_user
    if not chosen:
        raise ConfigError(
            f"--system needs the user to run {runs} as, and $SUDO_USER is not set: run it via "
            f"sudo from the account that should run {runs}, or pass --user-name NAME"
        )
    check_user_name(chosen, runs=runs)
    return chosen


def systemctl_commands(scope: UnitScope, unit_name: str, *, restart: bool) -> list[list[str]]:
    """The ``systemctl`` command lines that load, enable and start ``unit_name``.

    ``restart`` (the unit replaced a different one) restarts a running service so the new
    unit takes effect; ``enable --now`` alone would leave the old one running.
    """
    base = ["systemctl", "--user"] if scope == "user" else ["systemctl"]
    commands = [[*base, "daemon-reload"]]
    if restart:
        commands += [[*base, "enable", unit_name], [*base, "restart", unit_name]]
    else:
        commands.append([*base, "enable", "--now", unit_name])
    return commands


def service_head(
    scope: UnitScope, *, user_name: str | None, home: Path, search_path: Sequence[Path]
) -> list[str]:
    """The first lines of the ``[Service]`` section every berth unit shares: a simple
    service, its account (a system unit's ``User=``), ``BERTH_HOME``, berth's ``PATH``
    (none when ``search_path`` is empty) and unbuffered Python output."""
    lines = ["[Service]", "Type=simple"]
    if scope == "system":
        lines.append(f"User={escape_specifiers(str(user_name))}")
    lines.append(environment_line("BERTH_HOME", str(home)))
    if search_path:
        lines.append(environment_line("PATH", ":".join(str(p) for p in search_path)))
    lines.append(environment_line("PYTHONUNBUFFERED", "1"))
    return lines


def install_section(scope: UnitScope) -> list[str]:
    """The unit's last lines: the ``[Install]`` section, after a blank line; a system unit
    starts with the machine, a user unit with its user's manager."""
    target = "multi-user.target" if scope == "system" else "default.target"
    return ["", "[Install]", f"WantedBy={target}"]
