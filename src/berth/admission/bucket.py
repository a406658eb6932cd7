"""A per-minute limit as a token bucket: pure arithmetic on a clock reading.

A limit of ``N`` per minute is a bucket holding at most ``N``, refilled continuously at
``N / 60`` per second. A request (or a token) takes from it; a full bucket allows a burst
of ``N`` at once, and from empty one more every ``60 / N`` seconds. This is the rule the
OpenAI API documents for its own limits ("the bucket refills continuously"), and its
headers fall out of it: what is left (``remaining``) and how long until the bucket is full
again (``reset``). The level may go below zero when a request used more tokens than it
reserved at admission: the debt is paid back by the refill before anything else passes.
"""

from __future__ import annotations

import math

SECONDS_PER_MINUTE = 60.0


class TokenBucket:
    """``per_minute`` (at least 1) at most, refilled at ``per_minute / 60`` per second.

    Times are monotonic seconds (:meth:`berth.admission.clock.Clock.monotonic`); the bucket
    starts full at ``now``.
    """

    __slots__ = ("capacity", "capacity_text", "level", "rate_per_s", "updated_at")

    def __init__(self, per_minute: int, now: float) -> None:
        if per_minute < 1:
            raise ValueError("a bucket holds at least 1")
        self.capacity = float(per_minute)
        self.capacity_text = b"%d" % per_minute  # the limit header, written once
        self.rate_per_s = per_minute / SECONDS_PER_MINUTE
        self.level = self.capacity
        self.updated_at = now

    def refill(self, now: float) -> float:
        """Add what flowed in since the last reading; return the level now."""
        elapsed = now - self.updated_at
        if elapsed > 0:
            level = self.level + elapsed * self.rate_per_s
            capacity = self.capacity
            self.level = level = level if level < capacity else capacity  # min(), inlined
            self.updated_at = now
            return level
        return self.level

    def wait_s(self, amount: float) -> float:
        """Seconds from the last reading until the level reaches ``amount`` (0 if it has)."""
        missing = amount - self.level
        return missing / self.rate_per_s if missing > 0 else 0.0

    def take(self, amount: float) -> None:
        """Take ``amount`` (a negative one gives back, never above capacity)."""
        level = self.level - amount
        capacity = self.capacity
        self.level = level if level < capacity else capacity

    @property
    def remaining(self) -> int:
        """Whole units left now (never below 0)."""
        return max(0, math.floor(self.level))

    @property
    def reset_s(self) -> float:
        """Seconds until the bucket is full again."""
        return (self.capacity - self.level) / self.rate_per_s

    def resized(self, per_minute: int, now: float) -> TokenBucket:
        """A bucket of the new size, holding what this one holds now (at most its size)."""
        bucket = TokenBucket(per_minute, now)
        bucket.level = min(bucket.capacity, self.refill(now))
        return bucket
