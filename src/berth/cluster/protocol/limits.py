"""The bounds of one agent link, which both ends should share (no I/O).

:class:`LinkLimits` bounds every WebSocket message, the streams open at once and each
stream's credit window (``docs/protocol.md``, Frames and Flow control); the session
(:class:`~berth.cluster.protocol.session.LinkSession`) enforces them on what it takes and
what it is asked to send. The frame layout's own bounds (the header,
the JSON body) are :mod:`berth.cluster.protocol.frames`'s constants.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from berth.cluster.protocol.frames import DEFAULT_MAX_FRAME_BYTES, HEADER_BYTES, MAX_JSON_BYTES


@dataclass(frozen=True)
class LinkLimits:
    """The bounds of one link; both sides should use the same values.

    ``max_frame_bytes`` bounds every WebSocket message; ``max_streams`` the streams open at
    once; ``stream_window_bytes`` the credit each side starts with per stream, which is also
    the most payload one stream can have buffered at its receiver.
    """

    max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES
    max_streams: int = 4096
    stream_window_bytes: int = 256 * 1024

    def __post_init__(self) -> None:
        # A STREAM_OPEN/STREAM_HEAD carries a full window of payload beside its JSON body.
        if self.stream_window_bytes + MAX_JSON_BYTES + HEADER_BYTES > self.max_frame_bytes:
            raise ValueError("stream_window_bytes + the JSON limit must fit max_frame_bytes")

    @functools.cached_property
    def max_payload_bytes(self) -> int:
        """Largest payload one STREAM_DATA frame may carry (read once per frame sent)."""
        return min(self.max_frame_bytes - HEADER_BYTES, self.stream_window_bytes)
