"""Retry before the first byte: which failed attempts may go to another node (pure).

An attempt that failed before any byte reached the client is retried on another node when
the failure says nothing about the request itself: the connection was refused or reset, no
answer head came in time, a stream's first byte did not come within the first-byte timeout
(an engine that accepted the request and went silent), the node's link was down, or the
engine answered 502, 503 or 504.
An engine's other answers (its 4xx above all) are the caller's answer: never retried, and
not held against the node.
"""

from __future__ import annotations

import enum
from typing import Literal

#: Attempts per request by default (the first and two retries); a setting.
DEFAULT_MAX_ATTEMPTS = 3
#: Engine statuses that mean "this engine cannot serve now", not "this request is wrong".
RETRYABLE_STATUSES = frozenset({502, 503, 504})


class AttemptFailure(enum.Enum):
    CONNECT = "connect"  # refused, unreachable, or reset before the answer's head
    TIMEOUT = "timeout"  # no answer head within the read timeout
    FIRST_BYTE_TIMEOUT = "first_byte_timeout"  # a stream's first byte not within its timeout
    NODE_UNREACHABLE = "node_unreachable"  # the node's agent link is down


Decision = Literal["retry", "answer"]


def classify(failure: AttemptFailure | None, status: int | None = None) -> Decision:
    """``"retry"`` for a failure or a 502/503/504 answer; ``"answer"`` for anything else."""
    if failure is not None:
        return "retry"
    if status is not None and status in RETRYABLE_STATUSES:
        return "retry"
    return "answer"
