"""Who sends a request over the leader's Unix socket, which carries no key: the desk worker,
or the CLI and anything else its owner runs.

The socket (mode 0600) admits only its owner, so what a caller there says of itself is
trusted: ``berth desk serve`` sends :data:`SOCKET_CALLER_HEADER` ``desk`` on every request.
Only the socket's listener reads the header; on the public listener a request is its key's,
whatever it sends. Each caller is counted in the usage ledger and the per-key metrics under
its own name (``berth usage --by key``), and the desk's requests are admitted under the
``desk_tier`` setting's tier (:class:`berth.admission.Admission`).
"""

from __future__ import annotations

import enum
from typing import Final


class SocketCaller(enum.Enum):
    """A caller over the Unix socket; its value is the key id (and the name) its requests
    are counted under."""

    #: the CLI, scripts, anything that does not say: unlimited, at the ``admin`` priority
    CLI = "socket:cli"
    #: ``berth desk serve``'s jobs, speed and pool tests: under the desk tier
    DESK = "socket:desk"


#: The request header a socket caller names itself with (its value: ``desk``).
SOCKET_CALLER_HEADER: Final = "x-berth-client"
#: That header's value from the desk worker.
DESK_CALLER: Final = "desk"
_BY_HEADER: Final = {DESK_CALLER.encode(): SocketCaller.DESK}


def socket_caller(header: bytes | None) -> SocketCaller:
    """The caller a socket request's :data:`SOCKET_CALLER_HEADER` value names (absent or
    anything else: :attr:`SocketCaller.CLI`)."""
    if header is None:
        return SocketCaller.CLI
    return _BY_HEADER.get(header.strip().lower(), SocketCaller.CLI)
