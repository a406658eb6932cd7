"""Running berth's long-lived processes (the leader, the agent) on the fastest event loop.

uvloop (installed with ``uvicorn[standard]``) is used when it can be imported: its TLS and
TCP transports are markedly faster than asyncio's on the leader's hot path, and it sets
``TCP_NODELAY`` on every TCP connection. Without it, asyncio's own loop runs the same code.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def run(main: Coroutine[Any, Any, T]) -> T:
    """Run ``main`` to completion on a new event loop (uvloop when available)."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)
