"""The rate-limit headers of the OpenAI API, and its duration format.

On every answer to a key with a requests- or tokens-per-minute limit berth sends what the
OpenAI API sends (platform.openai.com/docs/guides/rate-limits, "Rate limits in headers"):

=================================  =================================================
``x-ratelimit-limit-requests``     requests allowed per minute
``x-ratelimit-remaining-requests`` requests that may be made now
``x-ratelimit-reset-requests``     time until the requests limit is back to full
``x-ratelimit-limit-tokens``       tokens allowed per minute
``x-ratelimit-remaining-tokens``   tokens left now
``x-ratelimit-reset-tokens``       time until the tokens limit is back to full
=================================  =================================================

Reset times are written as OpenAI writes them: Go's duration format, e.g. ``12ms``, ``1s``,
``1.5s``, ``6m0s``, ``1h0m0s``.
"""

from __future__ import annotations

import math

from berth.admission.bucket import TokenBucket

Header = tuple[bytes, bytes]


def format_duration(seconds: float) -> str:
    """``seconds`` in OpenAI's (Go's) duration format, rounded up to the millisecond:
    ``0s``, ``12ms``, ``1s``, ``1.5s``, ``6m0s``, ``2h3m4.5s``."""
    total_ms = math.ceil(seconds * 1000 - 1e-6) if seconds > 0 else 0
    if total_ms < 1000:
        return f"{total_ms}ms" if total_ms else "0s"
    if total_ms < 60_000:  # the usual case of a per-minute limit: seconds only
        whole, millis = divmod(total_ms, 1000)
        return f"{whole}.{millis:03d}".rstrip("0") + "s" if millis else f"{whole}s"
    hours, rest = divmod(total_ms, 3_600_000)
    minutes, rest = divmod(rest, 60_000)
    whole, millis = divmod(rest, 1000)
    secs = f"{whole}.{millis:03d}".rstrip("0") if millis else str(whole)
    if hours:
        return f"{hours}h{minutes}m{secs}s"
    if minutes:
        return f"{minutes}m{secs}s"
    return f"{secs}s"


REQUESTS_HEADERS = (
    b"x-ratelimit-limit-requests",
    b"x-ratelimit-remaining-requests",
    b"x-ratelimit-reset-requests",
)
TOKENS_HEADERS = (
    b"x-ratelimit-limit-tokens",
    b"x-ratelimit-remaining-tokens",
    b"x-ratelimit-reset-tokens",
)


def bucket_headers(names: tuple[bytes, bytes, bytes], bucket: TokenBucket) -> list[Header]:
    """The three headers of one limit, named ``names`` (:data:`REQUESTS_HEADERS` or
    :data:`TOKENS_HEADERS`), as ``bucket`` is at its last reading."""
    level = bucket.level
    reset_s = (bucket.capacity - level) / bucket.rate_per_s
    return [
        (names[0], bucket.capacity_text),
        (names[1], b"%d" % level if level > 0 else b"0"),
        (names[2], format_duration(reset_s).encode()),
    ]
