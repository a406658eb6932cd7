"""Health probes of an engine's HTTP server, shared by every runtime.

Engines are probed on the host's loopback over plain HTTP, so proxies from the environment
are ignored. An engine with an API key gets it as ``Authorization: Bearer`` with every probe
(:func:`bearer_headers`): the three engines leave ``/health`` public today, but an adopted
server's model list may not be. One :class:`HealthProber` per runtime sends every probe through one
``httpx.AsyncClient``. An httpx client made with its defaults also builds a TLS context that
loads the CA bundle, about 90 ms of CPU on a busy 2-core host: made per probe, on the event
loop, every watch interval for every deployment, it stalled each request the leader or agent
was serving at that moment (issue 13). The prober makes one client, loading no CA bundle.

Each probe still opens its own connection and asks the engine to close it
(``Connection: close``): an idle keep-alive connection would hold one of the engine's HTTP
threads between probes (llama.cpp serves each connection on a thread of a fixed pool) and
could be closed by the engine just as the next probe is sent, failing a healthy engine; and a
fresh connection also checks that the engine still accepts new ones. The prober keeps no
connection between probes, so there is nothing to close.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping
from typing import Literal

import httpx

#: How waiting for health ended: the engine answered 200, exited first, or ran out of time.
HealthOutcome = Literal["healthy", "exited", "timeout"]


def bearer_headers(api_key: str | None) -> dict[str, str]:
    """The headers that present ``api_key`` to an engine (none without a key)."""
    return {} if api_key is None else {"Authorization": f"Bearer {api_key}"}


class HealthProber:
    """Probes ``GET url`` of engines on this host through one shared HTTP client.

    Probes speak plain HTTP only (engines and adopted servers are reached at
    ``http://host:port``), so the client loads no CA bundle: a verifying TLS context, which
    httpx builds for every client by default, costs about 90 ms of CPU under the GIL, and
    even built once on a worker thread it would hold up the event loop that long.
    """

    def __init__(self) -> None:
        self._client = httpx.AsyncClient(
            trust_env=False,
            verify=False,  # never used: probe() refuses any URL but http://
            limits=httpx.Limits(max_keepalive_connections=0),
            headers={"Connection": "close"},
        )

    async def probe(
        self, url: str, timeout_s: float, *, headers: Mapping[str, str] | None = None
    ) -> bool:
        """One probe: whether ``GET url`` answers 200 within ``timeout_s`` seconds, sending
        ``headers`` too (an engine's key: :func:`bearer_headers`).

        A refused or broken connection, a timeout and an answer httpx cannot read are
        ``False``, never raised. Raises ``ValueError`` for a URL that is not ``http://``.
        """
        if not url.startswith("http://"):
            raise ValueError(f"health probes speak plain HTTP only, not {url!r}")
        try:
            response = await self._client.get(url, timeout=timeout_s, headers=headers)
        except httpx.HTTPError:
            return False
        return response.status_code == 200

    async def wait(
        self,
        url: str,
        timeout_s: float,
        *,
        alive: Callable[[], Awaitable[bool]],
        poll_interval_s: float,
        probe_timeout_s: float,
        headers: Mapping[str, str] | None = None,
    ) -> HealthOutcome:
        """Poll ``GET url`` every ``poll_interval_s`` seconds until it answers 200.

        Any other status, a refused connection or a probe taking longer than
        ``probe_timeout_s`` counts as "not yet".  Before each probe ``alive()`` says whether
        the engine still runs; ``"exited"`` is returned as soon as it does not, ``"timeout"``
        once ``timeout_s`` seconds have passed. ``headers`` go with every probe.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while True:
            if not await alive():
                return "exited"
            remaining = deadline - loop.time()
            if remaining <= 0:
                return "timeout"
            if await self.probe(url, max(0.05, min(probe_timeout_s, remaining)), headers=headers):
                return "healthy"
            remaining = deadline - loop.time()
            await asyncio.sleep(max(0.0, min(poll_interval_s, remaining)))
