"""The HTTP contract of the direct data path: how the leader addresses an agent's ingress
(``docs/protocol.md``, Direct data path). No I/O; the agent's ingress
(:mod:`berth.agent.ingress`) serves it and the leader's data paths
(:mod:`berth.cluster.leader.direct_path`) speak it.

- ``GET /healthz`` answers ``200`` with ``{"node_id", "exchanges"}``: the leader's probe;
- ``POST /d/<deployment id><engine target>`` (``/d/d-1a2b3c4d/v1/chat/completions``) is one
  exchange with that deployment's engine, its body and answer relayed as through the tunnel;
- ``GET /d/<deployment id>`` followed by one of :data:`GET_ENGINE_PATHS` (``/slots``,
  ``/metrics``) is the same for the engines' cache signals, which the prefix routing
  policy reads on the probe cycle (:mod:`berth.routing.cache_probe`);
- a relay failure before the engine's head is answered ``502`` (``503`` for ``refused``) with
  :data:`RESET_HEADER` set to the :class:`~berth.cluster.protocol.frames.ResetCode` a tunnel
  stream would have been reset with; a failure after the head cuts the connection off.
"""

from __future__ import annotations

from typing import Final

#: Exchanges an ingress relays at once (``503`` beyond), as many as streams on one link.
MAX_DIRECT_EXCHANGES: Final = 4096
#: Connections the leader opens to one ingress at most: one per exchange, and room for its
#: probes beside them (a probe queued behind busy connections would take a busy node for a
#: dead one). The ingress admits that many.
MAX_DIRECT_CONNECTIONS: Final = MAX_DIRECT_EXCHANGES + 64
HEALTH_PATH: Final = b"/healthz"
DEPLOYMENT_PREFIX: Final = b"/d/"
#: The engine paths an ingress relays a bodyless ``GET`` to (every other one is ``POST`` only).
GET_ENGINE_PATHS: Final = frozenset({b"/slots", b"/metrics"})
#: The header of an answer that reports a relay failure; its value is a reset code.
RESET_HEADER: Final = b"x-berth-reset"


def deployment_target(deployment_id: str, target: bytes) -> bytes:
    """The ingress target for ``target`` (origin form, ``/v1/...``) on ``deployment_id``."""
    return DEPLOYMENT_PREFIX + deployment_id.encode("latin-1") + target


def split_deployment_target(path: bytes) -> tuple[str, bytes] | None:
    """``(deployment id, engine path)`` of an ingress path (without its query), or ``None``
    when it is neither ``/d/<id>/v1/...`` nor ``/d/<id>`` and one of
    :data:`GET_ENGINE_PATHS`."""
    if not path.startswith(DEPLOYMENT_PREFIX):
        return None
    deployment, sep, rest = path[len(DEPLOYMENT_PREFIX) :].partition(b"/")
    if not deployment or not sep:
        return None
    if not rest.startswith(b"v1/") and b"/" + rest not in GET_ENGINE_PATHS:
        return None
    return deployment.decode("latin-1"), b"/" + rest


def parse_address(text: str) -> tuple[str, int] | None:
    """``HOST:PORT`` (``[v6]:PORT`` for IPv6) as host and port, or ``None`` for anything
    else (a port outside 1-65535 included)."""
    host, sep, port = text.strip().rpartition(":")
    host = host.removeprefix("[").removesuffix("]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        return None
    return host, int(port)
