"""Health probes of an engine's HTTP server, shared by every runtime.

Engines are probed on the host's loopback, so proxies from the environment are ignored.  An
engine with an API key gets it as ``Authorization: Bearer`` with every probe: the three
engines leave ``/health`` public today, but an adopted server's model list may not be.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Literal

import httpx

#: How waiting for health ended: the engine answered 200, exited first, or ran out of time.
HealthOutcome = Literal["healthy", "exited", "timeout"]


def _auth_headers(api_key: str | None) -> dict[str, str]:
    return {} if api_key is None else {"Authorization": f"Bearer {api_key}"}


async def probe_health(url: str, timeout_s: float, *, api_key: str | None = None) -> bool:
    """One probe: whether ``GET url`` answers 200 within ``timeout_s`` seconds (sending
    ``api_key`` as a Bearer token when given)."""
    async with httpx.AsyncClient(trust_env=False, headers=_auth_headers(api_key)) as client:
        try:
            response = await client.get(url, timeout=timeout_s)
        except httpx.TransportError:
            return False
    return response.status_code == 200


async def wait_for_health(
    url: str,
    timeout_s: float,
    *,
    alive: Callable[[], Awaitable[bool]],
    poll_interval_s: float,
    probe_timeout_s: float,
    api_key: str | None = None,
) -> HealthOutcome:
    """Poll ``GET url`` every ``poll_interval_s`` seconds until it answers 200.

    Any other status, a refused connection or a probe taking longer than
    ``probe_timeout_s`` counts as "not yet".  Before each probe ``alive()`` says whether the
    engine still runs; ``"exited"`` is returned as soon as it does not, ``"timeout"`` once
    ``timeout_s`` seconds have passed.  ``api_key`` goes with every probe as a Bearer token.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    async with httpx.AsyncClient(trust_env=False, headers=_auth_headers(api_key)) as client:
        while True:
            if not await alive():
                return "exited"
            remaining = deadline - loop.time()
            if remaining <= 0:
                return "timeout"
            try:
                response = await client.get(url, timeout=max(0.05, min(probe_timeout_s, remaining)))
            except httpx.TransportError:
                pass
            else:
                if response.status_code == 200:
                    return "healthy"
            remaining = deadline - loop.time()
            await asyncio.sleep(max(0.0, min(poll_interval_s, remaining)))
