"""Waking a serving process of the host: one Unix datagram socket per worker, in the
abstract namespace (``\\0berth-host-<token>-<worker>``: no file to clean up, gone with the
process), non-blocking.

A wake carries a table row (4 bytes, little-endian): the row the sleeper should look at.
Wakes are hints, the rows are the truth: a receiver reads every pending wake at once and
acts on what the rows say, and a wake that finds nobody (the worker is restarting) or a
full socket buffer is dropped, which costs the sleeper only the hint (see
:class:`~berth.host.deployments.SharedDeployments` for what it then waits for). A datagram
was chosen over an eventfd (which must be inherited through the supervisor) and a pipe
(a stream, so wakes could tear): one ``sendto`` costs about 2 us on the developers' VM,
and only a slot handed to another process sends one.
"""

from __future__ import annotations

import socket
import struct

_ROW = struct.Struct("<I")


def wake_address(token: str, worker: int) -> bytes:
    return f"\0berth-host-{token}-{worker}".encode()


class WakeSender:
    """Sends wakes to the workers of the host named by ``token``."""

    def __init__(self, token: str) -> None:
        self._token = token
        self._socket = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._socket.setblocking(False)

    def wake(self, worker: int, row: int) -> bool:
        """Tell ``worker`` to look at ``row``; ``False`` when the wake was dropped."""
        try:
            self._socket.sendto(_ROW.pack(row), wake_address(self._token, worker))
        except (BlockingIOError, ConnectionRefusedError, FileNotFoundError):
            return False
        return True

    def close(self) -> None:
        self._socket.close()


class WakeBox(WakeSender):
    """Worker ``worker``'s own socket: it sends wakes and receives its own."""

    def __init__(self, token: str, worker: int) -> None:
        super().__init__(token)
        self._inbox = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._inbox.bind(wake_address(token, worker))
        self._inbox.setblocking(False)

    def fileno(self) -> int:
        """The descriptor to watch for wakes (``loop.add_reader``)."""
        return self._inbox.fileno()

    def drain(self) -> set[int]:
        """The rows of every wake pending (empty when none)."""
        rows: set[int] = set()
        while True:
            try:
                data = self._inbox.recv(64)
            except BlockingIOError:
                return rows
            if len(data) == _ROW.size:
                rows.add(_ROW.unpack(data)[0])

    def close(self) -> None:
        self._inbox.close()
        super().close()
