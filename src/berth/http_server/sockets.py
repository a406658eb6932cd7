"""Listening TCP sockets, bound the one way every berth listener binds them.

The leader's public and cluster listeners and an agent's direct ingress bind here, before the
server that serves them starts, so that a port in use fails the start with the listener's name.
"""

from __future__ import annotations

import errno
import socket

from berth.http_server.errors import BindError


def bind_tcp(name: str, host: str, port: int, *, backlog: int = 2048) -> socket.socket:
    """A non-blocking listening TCP socket on ``host`` (an address or name; an IPv6 address
    may be in brackets) and ``port`` (0: any free one), with ``SO_REUSEADDR``.

    Raises :class:`BindError` naming the listener ``name``, the address and the port when
    binding fails (a port in use: ``public listener 127.0.0.1:11500: address already in use``).
    """
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY on accepted connections only when the
    # listening socket says TCP, and without it a head and body written as two TLS records
    # wait ~40 ms for the client's delayed ACK (Nagle).
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        reason = "address already in use" if exc.errno == errno.EADDRINUSE else exc.strerror
        raise BindError(name, host, port, str(reason), exc) from exc
    sock.listen(backlog)
    sock.setblocking(False)
    return sock
