"""Where an engine answers: the :class:`Origin` (host and port) berth's HTTP/1.1 client
connects to, read from a deployment's base URL.

A deployment on a remote node has no origin the leader connects to: the proxy reaches it
through that node's agent (its ``Upstream`` is ``remote``, with no base URL), and an error
of that exchange names the node as ``Origin(NODE, 0)``.
"""

from __future__ import annotations

from typing import NamedTuple
from urllib.parse import urlsplit


class Origin(NamedTuple):
    """Where requests go: a host name or address and a TCP port (plain HTTP)."""

    host: str
    port: int


def parse_origin(base_url: str) -> Origin:
    """The :class:`Origin` of an ``http://host[:port][/...]`` URL (port 80 when absent).

    Raises :class:`ValueError` for another scheme or a URL without a host.
    """
    parts = urlsplit(base_url)
    if parts.scheme != "http" or not parts.hostname:
        raise ValueError(f"not a plain http:// URL with a host: {base_url!r}")
    return Origin(parts.hostname, parts.port or 80)
