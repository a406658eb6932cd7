"""Errors and close codes of the agent link protocol.

::

    BerthError
    ├── LinkError                  the agent link failed or was refused (close code, node id)
    │   └── ProtocolError          a peer broke the protocol (malformed, oversized, out of order)
    └── SpecRefusedError           a start whose spec the cluster did not sign, or not as asked
                                   (answered with error code ``spec_refused``)

A :class:`ProtocolError` always carries the :class:`CloseCode` its link closes with, so the
I/O adapters translate it into a WebSocket close in one place.
"""

from __future__ import annotations

import math
import re
from enum import IntEnum

from berth.errors import BerthError


class CloseCode(IntEnum):
    """WebSocket close codes of the agent link.

    1000-1015 are RFC 6455 section 7.4.1 codes; 4000-4999 are reserved for applications
    (section 7.4.2) and carry berth's typed refusals. :func:`agent_should_redial` says what an
    agent does on each.
    """

    NORMAL = 1000
    #: the frame exceeded ``max_frame_bytes`` (RFC 6455 "message too big")
    FRAME_TOO_LARGE = 1009
    #: the leader met a condition it could not serve the link under (its store did not
    #: answer); the agent redials (RFC 6455 "internal error")
    INTERNAL_ERROR = 1011
    #: malformed frame, a first frame that is not Hello, a frame out of order
    PROTOCOL_ERROR = 4400
    #: no client certificate, or one whose fingerprint no node has
    BAD_CERTIFICATE = 4401
    #: the certificate the link was made with (or last renewed to) has expired: the agent
    #: must be enrolled again
    CERTIFICATE_EXPIRED = 4402
    #: the node was removed with ``berth nodes remove``
    NODE_REMOVED = 4403
    #: no protocol version both sides speak
    UNSUPPORTED_VERSION = 4406
    #: no heartbeat within the node timeout
    HEARTBEAT_TIMEOUT = 4408
    #: a newer session of the same node replaced this one
    SUPERSEDED = 4409
    #: too many connection attempts; the reason carries ``retry_after_s=<seconds>``
    #: (:func:`retry_after_of`)
    RATE_LIMITED = 4429
    #: this leader is a standby (``leader_ha``); the reason is the active leader's cluster
    #: URL when one is known (:func:`active_named_in`), and the agent dials it at once
    NOT_LEADER = 4421
    #: the leader is shutting down or restarting
    LEADER_SHUTTING_DOWN = 4503


#: Codes after which an agent stops for good: redialling cannot succeed until an operator acts
#: (re-enrols the node, upgrades the agent, or stops the other copy of it).
_FINAL_CODES = frozenset(
    {
        CloseCode.BAD_CERTIFICATE,
        CloseCode.CERTIFICATE_EXPIRED,
        CloseCode.NODE_REMOVED,
        CloseCode.UNSUPPORTED_VERSION,
        CloseCode.SUPERSEDED,
    }
)


def agent_should_redial(code: int | None) -> bool:
    """Whether an agent whose link closed with ``code`` dials again (with backoff).

    A refusal an operator must resolve (bad or expired certificate, removed node, no common
    protocol version, another session of the same node) is final; anything else, including an abrupt
    close with no code, is retried.
    """
    return code not in _FINAL_CODES


def rate_limited_reason(retry_after_s: float) -> str:
    """The close reason of a ``RATE_LIMITED`` close: ``retry_after_s=<whole seconds>`` and
    a few words for a person reading the log."""
    return f"retry_after_s={max(1, math.ceil(retry_after_s))} (dialling too often)"


def retry_after_of(code: int | None, reason: str) -> float | None:
    """The seconds a ``RATE_LIMITED`` close asks the agent to wait, or ``None`` for any
    other close or a reason without a readable ``retry_after_s=`` (capped at an hour)."""
    if code != CloseCode.RATE_LIMITED:
        return None
    match = _RETRY_AFTER.search(reason)
    if match is None:
        return None
    return min(3600.0, float(match.group(1)))


_RETRY_AFTER = re.compile(r"\bretry_after_s=([0-9]{1,7}(?:\.[0-9]{1,3})?)\b")


def not_leader_reason(active_cluster_url: str | None) -> str:
    """The reason a standby closes an agent's link with (``NOT_LEADER``): ``active=<URL>``,
    or ``active=`` when it knows of no active leader."""
    return f"active={active_cluster_url or ''}"


def active_named_in(reason: str) -> str | None:
    """The active leader's cluster URL a ``NOT_LEADER`` reason names, or ``None``."""
    if not reason.startswith("active="):
        return None
    url = reason.removeprefix("active=").strip()
    return url if url.startswith("https://") else None


class LinkError(BerthError):
    """The agent link failed, was closed or refused.

    ``code`` is the close code when one is known; ``node_id`` the node when known.
    """

    http_status = 503
    error_type = "server_error"

    def __init__(
        self, message: str, *, code: CloseCode | None = None, node_id: str | None = None
    ) -> None:
        super().__init__(message)
        self.code = code
        self.node_id = node_id


class ProtocolError(LinkError):
    """A peer sent something the protocol forbids; the link closes with :attr:`code`."""

    def __init__(self, message: str, code: CloseCode = CloseCode.PROTOCOL_ERROR) -> None:
        super().__init__(message, code=code)
        self.code: CloseCode = code


class SpecRefusedError(BerthError):
    """A start refused because its spec carries no valid signature of the cluster's signing
    key, or asks for something other than what was signed (:mod:`berth.cluster.protocol.
    spec_signing`).  The agent answers it with ``ErrorCode.SPEC_REFUSED``; ``deployment_id``
    names the deployment."""

    http_status = 403
    error_type = "permission_error"

    def __init__(self, message: str, *, deployment_id: str) -> None:
        super().__init__(message)
        self.deployment_id = deployment_id
