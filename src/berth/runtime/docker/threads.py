"""Where the docker runtime's blocking calls run: never on the event loop.

Every Docker call blocks on the engine's socket, so each one runs on the runtime's own thread
pool (never the event loop, and never the default executor the store shares); a call that
lasts as long as an image pull runs on a thread of its own, so it cannot hold a pool thread
for minutes.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import threading
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError, ThreadPoolExecutor
from typing import ParamSpec, TypeVar

T = TypeVar("T")
P = ParamSpec("P")


class DockerThreads:
    """A pool of ``max_workers`` threads for short calls, and threads of their own for long
    ones."""

    def __init__(self, max_workers: int = 8) -> None:
        self._pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="berth-docker")

    async def call(self, function: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        """``function(*args, **kwargs)`` on the pool; its result or its exception."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, functools.partial(function, *args, **kwargs))

    async def run_long(self, name: str, function: Callable[[], None]) -> None:
        """``function()`` on a new daemon thread named ``berth-<name>``.

        A caller cancelled meanwhile stops waiting; the thread runs on (``function`` must see
        for itself that it should stop) and its outcome is dropped.
        """
        outcome: Future[None] = Future()

        def body() -> None:
            try:
                function()
            except BaseException as exc:
                with contextlib.suppress(InvalidStateError):
                    outcome.set_exception(exc)
            else:
                with contextlib.suppress(InvalidStateError):
                    outcome.set_result(None)

        threading.Thread(target=body, name=f"berth-{name}", daemon=True).start()
        await asyncio.wrap_future(outcome)

    def shutdown(self) -> None:
        """Stop the pool; calls not started yet are cancelled."""
        self._pool.shutdown(wait=False, cancel_futures=True)
