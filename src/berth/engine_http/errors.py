"""The errors of berth's HTTP/1.1 client to engines (:mod:`berth.engine_http.pool`).

Every one is an :class:`UpstreamError` and names the engine's ``origin``::

    UpstreamError
    ├── UpstreamConnectError      the connection was refused, failed or not made in time
    ├── UpstreamTimeoutError      the engine sent nothing for read_timeout_s
    ├── UpstreamDisconnectError   the engine closed the connection before the answer ended
    └── UpstreamProtocolError     the engine's bytes are not an HTTP/1.1 answer
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from berth.errors import BerthError

if TYPE_CHECKING:
    from berth.engine_http.origin import Origin


class UpstreamError(BerthError):
    """The engine could not be asked, or did not answer properly; ``origin`` names it."""

    def __init__(self, origin: Origin, why: str) -> None:
        self.origin = origin
        self.why = why
        super().__init__(f"http://{origin.host}:{origin.port} {why}")


class UpstreamConnectError(UpstreamError):
    """No connection: refused, unreachable, or not accepted within the connect timeout
    (``timed_out``). Nothing was sent.  ``engine_side``: the engine itself did not take it
    (it refused the connection, or, through an agent, the agent could not reach it), while
    the host or the agent answered."""

    def __init__(
        self, origin: Origin, why: str, *, timed_out: bool = False, engine_side: bool = False
    ) -> None:
        self.timed_out = timed_out
        self.engine_side = engine_side
        super().__init__(origin, why)


class UpstreamTimeoutError(UpstreamError):
    """The engine sent nothing for ``timeout_s``: before its headers, or between two pieces of
    its body. The connection has been closed."""

    def __init__(self, origin: Origin, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        super().__init__(origin, f"sent nothing for {timeout_s} s")


class UpstreamDisconnectError(UpstreamError):
    """The engine closed or reset the connection before its answer was complete;
    ``answered`` says whether some of the answer had arrived."""

    def __init__(self, origin: Origin, why: str, *, answered: bool) -> None:
        self.answered = answered
        super().__init__(origin, why)


class UpstreamProtocolError(UpstreamError):
    """The engine's bytes could not be parsed as an HTTP/1.1 answer (or came unasked)."""
