"""How the proxy reaches a deployment's engine: directly, over berth's pooled HTTP/1.1 client,
or through its node's agent tunnel; either way the answer comes back as an
:class:`~berth.engine_http.answer.EngineAnswer` once its head is in.

Failures before the head become the proxy's errors here, once: an engine that cannot be
reached is :class:`EngineUnreachableError` (502), one that does not answer in time
:class:`EngineTimeoutError` (504); nothing has reached the client then, so the dispatch loop
may try another node.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TYPE_CHECKING

from berth.engine_http.answer import EngineAnswer, HttpOpener
from berth.engine_http.errors import UpstreamConnectError, UpstreamError, UpstreamTimeoutError
from berth.engine_http.origin import Origin, parse_origin
from berth.engine_http.pool import UpstreamPool
from berth.engine_http.request import EngineRequest
from berth.routing.errors import EngineSignalError, EngineTimeoutError, EngineUnreachableError

if TYPE_CHECKING:
    from berth.routing.resolver import Upstream

#: The ``authorization`` header requests to a local engine (by deployment id) must carry, or
#: ``None`` (:meth:`berth.agent.core.AgentCore.engine_auth`).
EngineAuth = Callable[[str], tuple[bytes, bytes] | None]

_MAX_CACHED_TARGETS = 4096
_GET = b"GET"


class EngineClient:
    """Sends ``POST`` requests to engines. ``connect_timeout_s``, ``read_timeout_s`` and
    ``max_connections`` are :class:`UpstreamPool`'s; ``tunnels`` reaches remote engines
    (``None``: this leader has no agent links), whose agent adds each engine's key;
    ``engine_auth`` gives the key header of an engine reached directly (node ``local``'s:
    the key never leaves the host that runs the engine). Call :meth:`startup` before use."""

    def __init__(
        self,
        *,
        tunnels: HttpOpener | None,
        connect_timeout_s: float,
        read_timeout_s: float | None,
        max_connections: int,
        engine_auth: EngineAuth | None = None,
    ) -> None:
        self._tunnels = tunnels
        self._engine_auth = engine_auth
        self._connect_timeout_s = connect_timeout_s
        self.read_timeout_s = read_timeout_s
        self._max_connections = max_connections
        self._pool: UpstreamPool | None = None
        self._targets: dict[tuple[str, str], tuple[Origin, bytes]] = {}

    async def startup(self) -> None:
        """Open the pool of HTTP connections to engines. Idempotent."""
        if self._pool is not None:
            return
        # No cookie jar and no decompression: engines' cookies never travel from one client's
        # request to another's, and bytes are relayed as the engine sent them.
        self._pool = UpstreamPool(
            connect_timeout_s=self._connect_timeout_s,
            read_timeout_s=self.read_timeout_s,
            max_connections=self._max_connections,
        )

    async def shutdown(self) -> None:
        """Close the connections to engines. Idempotent."""
        pool, self._pool = self._pool, None
        if pool is not None:
            await pool.close()

    async def open(self, upstream: Upstream, request: EngineRequest) -> EngineAnswer:
        """Send ``request`` to ``upstream``; its answer once the head is in. Raises
        :class:`EngineUnreachableError` or :class:`EngineTimeoutError`."""
        pool = self._pool
        if pool is None:
            raise RuntimeError("EngineClient.startup() was not awaited")
        try:
            if upstream.remote:
                return await self._open_remote(upstream, request)
            origin, target = self._engine_target(upstream.base_url, request.path)
            if request.query:
                target += b"?" + request.query
            forward = request.headers
            auth = self._engine_auth(upstream.deployment_id) if self._engine_auth else None
            headers = forward if auth is None else [*forward, auth]
            return await pool.request(origin, request.method, target, headers, request.body)
        except UpstreamConnectError as exc:
            raise EngineUnreachableError(upstream, exc.why, engine_side=exc.engine_side) from exc
        except UpstreamTimeoutError as exc:
            raise EngineTimeoutError(upstream, self.read_timeout_s) from exc
        except UpstreamError as exc:  # a connection the engine broke before its answer
            why = f"failed before answering ({exc.why})"
            raise EngineUnreachableError(upstream, why, engine_side=True) from exc

    async def get(
        self, upstream: Upstream, path: str, *, limit_bytes: int, timeout_s: float
    ) -> bytes:
        """``GET path`` of ``upstream``'s engine (its ``/slots``, its ``/metrics``: the
        routing policy's cache signals, :class:`berth.routing.cache_probe.EngineGetter`):
        its body, at most ``limit_bytes``, once it answered 200, all within ``timeout_s``.
        Raises :class:`EngineSignalError` when it is unreachable, too slow, answers another
        status or more bytes than the limit."""
        pool = self._pool
        if pool is None:
            raise RuntimeError("EngineClient.startup() was not awaited")
        deployment_id = upstream.deployment_id
        try:
            async with asyncio.timeout(timeout_s):
                if upstream.remote:
                    if self._tunnels is None:
                        raise EngineSignalError("no agent links", deployment_id=deployment_id)
                    request = EngineRequest(path, b"", [], b"", _GET)
                    answer: EngineAnswer = await self._tunnels.open_http(
                        upstream.node_id, deployment_id, request, timeout_s
                    )
                else:
                    origin, target = self._engine_target(upstream.base_url, path)
                    auth = self._engine_auth(deployment_id) if self._engine_auth else None
                    answer = await pool.request(
                        origin, _GET, target, [] if auth is None else [auth]
                    )
                try:
                    body = await answer.read(limit_bytes + 1)
                finally:
                    answer.close()
        except TimeoutError as exc:
            why = f"GET {path} took over {timeout_s:g} s"
            raise EngineSignalError(why, deployment_id=deployment_id) from exc
        except UpstreamError as exc:
            why = f"GET {path} failed ({exc.why})"
            raise EngineSignalError(why, deployment_id=deployment_id) from exc
        if answer.status != 200:
            why = f"GET {path} answered {answer.status}"
            raise EngineSignalError(why, deployment_id=deployment_id)
        if len(body) > limit_bytes:
            why = f"GET {path} answered over {limit_bytes} bytes"
            raise EngineSignalError(why, deployment_id=deployment_id)
        return body

    async def _open_remote(self, upstream: Upstream, request: EngineRequest) -> EngineAnswer:
        if self._tunnels is None:
            why = "could not be reached (this leader has no agent links)"
            raise UpstreamConnectError(Origin(upstream.node_id, 0), why)
        return await self._tunnels.open_http(
            upstream.node_id, upstream.deployment_id, request, self.read_timeout_s
        )

    def _engine_target(self, base_url: str, path: str) -> tuple[Origin, bytes]:
        """A local engine's origin and the request target for ``path`` (its base URL's path
        first); cached (a handful of entries per deployment)."""
        key = (base_url, path)
        found = self._targets.get(key)
        if found is None:
            if len(self._targets) >= _MAX_CACHED_TARGETS:
                self._targets.clear()
            prefix = base_url.split("://", 1)[-1].partition("/")[2].rstrip("/")
            target = (f"/{prefix}{path}" if prefix else path).encode("latin-1")
            found = self._targets[key] = (parse_origin(base_url), target)
        return found
