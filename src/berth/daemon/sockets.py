"""The leader's listening sockets, bound before anything else starts.

A port in use fails the start with the listener's name (``DaemonError``), and the Unix
socket file is created with mode 0600 from the first instant.
"""

from __future__ import annotations

import logging
import os
import resource
import socket
from dataclasses import dataclass
from pathlib import Path

from berth.config import Settings
from berth.errors import DaemonError
from berth.http_server.errors import BindError
from berth.http_server.sockets import bind_tcp
from berth.paths import BerthHome

log = logging.getLogger(__name__)


# -- sockets ------------------------------------------------------------------------------


@dataclass
class LeaderSockets:
    """The leader's three listening sockets, bound before anything else starts: ``public``
    (HTTPS), ``cluster`` (agents) and ``unix`` (the local CLI, at ``unix_path``)."""

    public: socket.socket
    cluster: socket.socket
    unix: socket.socket
    unix_path: Path

    @property
    def public_port(self) -> int:
        """The bound public port (the real one, also for ``public_port = 0``)."""
        return int(self.public.getsockname()[1])

    @property
    def cluster_port(self) -> int:
        """The bound cluster port."""
        return int(self.cluster.getsockname()[1])

    def close(self) -> None:
        """Close all three (closing one a server already closed does nothing) and remove the
        socket file."""
        for sock in (self.public, self.cluster, self.unix):
            sock.close()
        self.unix_path.unlink(missing_ok=True)


def bind_listener(name: str, host: str, port: int) -> socket.socket:
    """:func:`berth.http_server.sockets.bind_tcp` for one of the leader's listeners.

    Raises ``DaemonError`` naming the listener, address and port when binding fails.
    """
    try:
        return bind_tcp(name, host, port)
    except BindError as exc:
        raise DaemonError(str(exc)) from exc


def bind_unix(path: Path) -> socket.socket:
    """Bind the local CLI socket with mode 0600 (the umask covers the moment of creation).

    Raises ``DaemonError`` when a daemon already listens on ``path``; a stale socket file (no
    one answers on it) is removed first.
    """
    if path.exists():
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(str(path))
        except OSError:
            path.unlink()  # a stale socket from a daemon that died
        else:
            raise DaemonError(f"a berth daemon already listens on {path}")
        finally:
            probe.close()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old_umask = os.umask(0o177)
    try:
        sock.bind(str(path))
    finally:
        os.umask(old_umask)
    os.chmod(path, 0o600)
    sock.listen(512)
    sock.setblocking(False)
    return sock


def bind_sockets(home: BerthHome, settings: Settings) -> LeaderSockets:
    """Bind the public, cluster and Unix sockets, in that order; a failure closes those
    already bound and raises ``DaemonError`` (:func:`bind_listener`, :func:`bind_unix`)."""
    public = bind_listener("public", settings.public_bind, settings.public_port)
    try:
        cluster = bind_listener("cluster", settings.cluster_bind, settings.cluster_port)
    except DaemonError:
        public.close()
        raise
    try:
        unix = bind_unix(home.socket_file)
    except BaseException:
        public.close()
        cluster.close()
        raise
    return LeaderSockets(public, cluster, unix, home.socket_file)


def raise_open_files_limit(wanted: int) -> None:
    """Raise this process's soft limit of open files towards ``wanted`` (never past the hard
    limit), so that the listeners' connection caps, not ``EMFILE``, are what refuses."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError) as exc:
            log.warning("could not raise the open files limit to %d: %s", target, exc)
