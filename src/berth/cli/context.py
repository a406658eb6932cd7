"""What the root command hands every command: the home ``--home`` chose, and a way to reach its
daemon.

Kept light on purpose: the root callback builds it for every command, ``berth --help``
included, so it imports nothing of the admin API. Only a command that talks to the daemon
loads the API's client and models (:meth:`CliContext.client`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from berth.paths import BerthHome

if TYPE_CHECKING:
    from berth.api.client import DaemonClient

#: ``-h`` as well as ``--help`` on every command.
HELP_OPTIONS = {"help_option_names": ["-h", "--help"]}


@dataclass
class CliContext:
    home: BerthHome

    def client(self, *, timeout_s: float = 30.0) -> DaemonClient:
        """A client of the daemon on this home's socket (``api/client.py``)."""
        from berth.api.client import DaemonClient

        return DaemonClient(self.home, timeout_s=timeout_s)
