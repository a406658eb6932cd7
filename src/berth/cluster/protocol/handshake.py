"""The agent link's handshake rules, with no I/O and no state (``docs/protocol.md``, Handshake).

The agent's first frame is Hello (its protocol range, version, capabilities, inventory and
engines); the leader answers with Welcome at the highest version both ranges share
(:func:`negotiate_version`) and the :class:`WelcomeTerms` it chose, or refuses the link with
``UNSUPPORTED_VERSION`` when the ranges do not meet. Here are those rules: the Welcome that
answers a Hello (:func:`welcome_for`) and what each side's first message must be
(:func:`read_hello`, :func:`read_welcome`). :class:`~berth.cluster.protocol.session.LinkSession`
keeps the handshake's state (which side it is, what was sent and taken) and calls these.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from berth.cluster.protocol.errors import CloseCode, ProtocolError
from berth.cluster.protocol.frames import Frame, Hello, Welcome, decode_frame


@dataclass(frozen=True)
class WelcomeTerms:
    """What the leader says in Welcome besides the negotiated version and its clock: the node
    id (from the agent's certificate), its own version, the heartbeat interval it wants and
    the link timeout both ends keep, in seconds, its capabilities, and the cluster URLs of
    every leader sharing its database (empty for a lone leader)."""

    node_id: str
    leader_version: str
    heartbeat_interval_s: float = 5.0
    capabilities: Sequence[str] = ()
    link_timeout_s: float = 6.0
    leaders: Sequence[str] = ()


def negotiate_version(peer_min: int, peer_max: int, ours: tuple[int, int]) -> int | None:
    """The highest protocol version in both ``[peer_min, peer_max]`` and ``ours``, or None."""
    high = min(peer_max, ours[1])
    return high if high >= max(peer_min, ours[0]) else None


def welcome_for(
    hello: Hello, terms: WelcomeTerms, versions: tuple[int, int], *, server_time: float
) -> Welcome:
    """The leader's Welcome answering ``hello``: the highest version both the agent's range
    and ``versions`` (the leader's ``(min, max)``) share, ``terms``, and ``server_time`` (the
    leader's clock, epoch seconds).

    Raises :class:`ProtocolError` (``UNSUPPORTED_VERSION``) when the two ranges do not meet;
    the caller closes the link with that code.
    """
    version = negotiate_version(hello.protocol_min, hello.protocol_max, versions)
    if version is None:
        raise ProtocolError(
            f"agent speaks protocol {hello.protocol_min}-{hello.protocol_max}, "
            f"the leader {versions[0]}-{versions[1]}",
            CloseCode.UNSUPPORTED_VERSION,
        )
    return Welcome(
        protocol_version=version,
        leader_version=terms.leader_version,
        node_id=terms.node_id,
        server_time=server_time,
        heartbeat_interval_s=terms.heartbeat_interval_s,
        capabilities=list(terms.capabilities),
        link_timeout_s=terms.link_timeout_s,
        leaders=list(terms.leaders),
    )


def read_hello(message: bytes, max_frame_bytes: int) -> Hello:
    """The agent's first message, which must be Hello.

    Raises :class:`ProtocolError` for anything else (an unknown frame type included), and as
    :func:`~berth.cluster.protocol.frames.decode_frame` does for bytes that are no frame.
    """
    frame = _read_greeting(message, max_frame_bytes)
    if not isinstance(frame, Hello):
        raise ProtocolError(f"the agent's first frame must be Hello, not {_name(frame)}")
    return frame


def read_welcome(message: bytes, max_frame_bytes: int, versions: tuple[int, int]) -> Welcome:
    """The leader's first message, which must be Welcome at a version in ``versions`` (this
    side's ``(min, max)``).

    Raises :class:`ProtocolError` for anything else (``UNSUPPORTED_VERSION`` for a version
    outside our range), and as :func:`~berth.cluster.protocol.frames.decode_frame` does.
    """
    frame = _read_greeting(message, max_frame_bytes)
    if not isinstance(frame, Welcome):
        raise ProtocolError(f"the leader's first frame must be Welcome, not {_name(frame)}")
    low, high = versions
    if not low <= frame.protocol_version <= high:
        raise ProtocolError(
            f"leader chose protocol {frame.protocol_version}, outside {low}-{high}",
            CloseCode.UNSUPPORTED_VERSION,
        )
    return frame


def _read_greeting(message: bytes, max_frame_bytes: int) -> Frame:
    frame = decode_frame(message, max_frame_bytes)
    if frame is None:
        raise ProtocolError("the first frame must be Hello or Welcome, not unknown")
    return frame


def _name(frame: Frame) -> str:
    return type(frame).__name__
