"""The limit on failed authentication per client address (pure: no clock, no I/O).

A token bucket per address: an address holds up to ``burst`` tokens and regains
``rate_per_s`` of them a second. Each request whose secret is not already known valid takes
one (:meth:`FailedAuthLimiter.take`) before its secret is looked up, so a burst of
concurrent guesses is held to the bucket too, before any of them has failed; a secret that
turns out valid gives its token back (:meth:`FailedAuthLimiter.give_back`), so only failures
cost an address anything. An address with no token left is refused (429) with the seconds
until its next token, without a store read. Requests carrying a key the authenticator has
already found valid never reach the limiter: a client with a good key is served from an
address that is spraying bad ones (the cluster listener's first limiter counted every
attempt, and refused a busy address's valid tokens for it).

Each refusal says whether it opens an audit window for its address (the first refusal, then
at most one every ``audit_window_s``), with the refusals since the last line, so a spray
writes one audit line per address per window instead of one per guess.

The table of addresses is bounded (``max_addresses``, least recently used dropped first); an
address whose bucket is full and whose audit window is over is forgotten at once. IPv6
addresses count by their /64, the block one host or customer usually holds.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from typing import Final

#: Seconds between two audit lines about one address's refusals.
AUDIT_WINDOW_S: Final = 60.0
#: Most addresses the limiter remembers (least recently used dropped first).
MAX_ADDRESSES: Final = 10_000
#: The prefix length an IPv6 address is counted by.
IPV6_PREFIX_BITS: Final = 64


@dataclass(frozen=True)
class Refused:
    """A request the limiter refused: retry after ``retry_after_s`` seconds.

    ``audit`` is true when this refusal opens a new audit window for its address (write one
    line); ``refused_before`` is then how many refusals the window before it held (0 for the
    first refusal of a lockout).
    """

    retry_after_s: float
    audit: bool
    refused_before: int


@dataclass
class _Bucket:
    tokens: float
    updated_at: float
    audited_at: float | None = None
    refused_since_audit: int = 0


def address_key(address: str) -> str:
    """What ``address`` counts as: an IPv4 address as itself (an IPv4-mapped IPv6 one too),
    an IPv6 address as its /:data:`IPV6_PREFIX_BITS` network, anything else unchanged."""
    try:
        parsed = ipaddress.ip_address(address)
    except ValueError:
        return address
    if isinstance(parsed, ipaddress.IPv6Address):
        if parsed.ipv4_mapped is not None:
            return str(parsed.ipv4_mapped)
        return str(ipaddress.IPv6Network((parsed, IPV6_PREFIX_BITS), strict=False))
    return str(parsed)


class FailedAuthLimiter:
    """The token buckets of the module docstring: ``burst`` tokens at most (at least 1),
    ``rate_per_s`` regained a second (above 0; the ``auth_failure_*`` settings). Times are
    seconds from any monotonic origin, passed in by the caller."""

    def __init__(
        self,
        *,
        burst: int,
        rate_per_s: float,
        audit_window_s: float = AUDIT_WINDOW_S,
        max_addresses: int = MAX_ADDRESSES,
    ) -> None:
        if burst < 1 or rate_per_s <= 0:
            raise ValueError(f"burst {burst} must be >= 1 and rate_per_s {rate_per_s} > 0")
        self.burst = burst
        self.rate_per_s = rate_per_s
        self._audit_window_s = audit_window_s
        self._max_addresses = max_addresses
        # address key -> its bucket, least recently used first
        self._buckets: dict[str, _Bucket] = {}

    def __len__(self) -> int:
        """How many addresses are remembered."""
        return len(self._buckets)

    def take(self, address: str, now: float) -> Refused | None:
        """Take a token for an attempt from ``address`` at ``now``: ``None`` when allowed
        (the token stays taken unless :meth:`give_back` returns it), else the refusal."""
        key = address_key(address)
        bucket = self._buckets.pop(key, None)
        if bucket is None:
            if len(self._buckets) >= self._max_addresses:
                del self._buckets[next(iter(self._buckets))]
            bucket = _Bucket(tokens=float(self.burst), updated_at=now)
        self._buckets[key] = bucket  # now the most recently used
        self._refill(bucket, now)
        if bucket.tokens >= 1.0:
            bucket.tokens -= 1.0
            return None
        retry_after_s = (1.0 - bucket.tokens) / self.rate_per_s
        audited_at = bucket.audited_at
        if audited_at is None or now - audited_at >= self._audit_window_s:
            refused_before = bucket.refused_since_audit
            bucket.audited_at, bucket.refused_since_audit = now, 0
            return Refused(retry_after_s, audit=True, refused_before=refused_before)
        bucket.refused_since_audit += 1
        return Refused(retry_after_s, audit=False, refused_before=0)

    def give_back(self, address: str, now: float) -> None:
        """The attempt from ``address`` that :meth:`take` allowed carried a valid key: its
        token is returned (an address is forgotten once its bucket is full again and its
        audit window over)."""
        key = address_key(address)
        bucket = self._buckets.get(key)
        if bucket is None:
            return
        self._refill(bucket, now)
        bucket.tokens = min(float(self.burst), bucket.tokens + 1.0)
        if bucket.tokens >= self.burst and (
            bucket.audited_at is None or now - bucket.audited_at >= self._audit_window_s
        ):
            del self._buckets[key]

    def _refill(self, bucket: _Bucket, now: float) -> None:
        elapsed = max(0.0, now - bucket.updated_at)
        bucket.tokens = min(float(self.burst), bucket.tokens + elapsed * self.rate_per_s)
        bucket.updated_at = now
