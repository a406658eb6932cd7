"""Running berth's long-lived processes (the leader, the agent) on the fastest event loop.

uvloop (a dependency of berth) is used when it can be imported: its TLS and
TCP transports are markedly faster than asyncio's on the leader's hot path, and it sets
``TCP_NODELAY`` on every TCP connection. Without it, asyncio's own loop runs the same code.
:func:`freeze_startup_objects` keeps full garbage collections from stalling that loop.
"""

from __future__ import annotations

import asyncio
import gc
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


def freeze_startup_objects() -> None:
    """Collect garbage once, then take every object alive now out of the cycle collector's
    sight (``gc.freeze``); call it once a long-lived process has started.

    Such a process's heap is mostly what it built while starting: modules, classes, the app,
    the ORM's mappers. Every full (generation 2) collection traverses all of it while holding
    the GIL, which stalled the leader's event loop for 50-250 ms at a time on a busy 2-core
    host (issue 13); afterwards those collections traverse only what was allocated since.
    Reference counting still frees frozen objects; only a reference cycle among them that
    becomes garbage later is never reclaimed, which is why it is called once, after start-up,
    and not while per-request state is being built.
    """
    gc.collect()
    gc.freeze()
