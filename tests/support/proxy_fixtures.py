"""Helpers for the proxy tests: a fixed resolver, and the proxy served on loopback by berth's
own HTTP server (as the leader serves it) or, as an ASGI app, by uvicorn."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator, Callable
from typing import Any

import uvicorn
from uvicorn.server import ServerState

from berth.errors import NotFoundError
from berth.gateway.proxy import OpenAIProxy
from berth.http_server.limits import ListenerLimits
from berth.http_server.protocol import Handler
from berth.http_server.server import HttpServer
from berth.observability.metrics import ProxyMetrics
from berth.routing.errors import NoReadyDeploymentError
from berth.routing.resolver import Upstream, UpstreamResolver


class StaticResolver:
    """An ``UpstreamResolver`` over a fixed table.

    ``routes`` maps a public model name to its engine's base URL (deployment ``d-<model>``
    on node ``local``, with ``slots``: ``None`` for unknown); names in ``loading`` are known
    but have no ready deployment.
    """

    def __init__(
        self, routes: dict[str, str], loading: tuple[str, ...] = (), *, slots: int | None = None
    ) -> None:
        self.routes = routes
        self.loading = loading
        self.slots = slots

    def candidates(self, model: str) -> list[Upstream]:
        if model in self.loading:
            raise NoReadyDeploymentError(model, retry_after_s=2.5, detail="loading")
        base_url = self.routes.get(model)
        if base_url is None:
            raise NotFoundError("model", model)
        return [Upstream(base_url, f"d-{model}", "local", model, slots=self.slots)]

    def models(self) -> list[str]:
        return sorted({*self.routes, *self.loading})


@contextlib.asynccontextmanager
async def serve_asgi(app: Any) -> AsyncIterator[str]:
    """Serve ``app`` with uvicorn's httptools protocol on 127.0.0.1; yield its base URL.

    This is what ``uvicorn.Server`` does, minus its 0.1 s polling loop, so that a test does not
    spend a quarter of a second starting and stopping a server.
    """
    config = uvicorn.Config(
        app, http="httptools", lifespan="off", proxy_headers=False, log_level="warning"
    )
    config.load()
    state = ServerState()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    loop = asyncio.get_running_loop()
    server = await loop.create_server(
        lambda: config.http_protocol_class(config=config, server_state=state, app_state={}),
        sock=sock,
    )
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.close()
        for connection in list(state.connections):
            connection.shutdown()
        if state.tasks:
            _, pending = await asyncio.wait(list(state.tasks), timeout=2.0)
            for task in pending:
                task.cancel()
        await server.wait_closed()


@contextlib.asynccontextmanager
async def serve_berth(handler: Handler, limits: ListenerLimits | None = None) -> AsyncIterator[str]:
    """Serve ``handler`` with berth's HTTP server on 127.0.0.1; yield its base URL."""
    server = HttpServer("test", handler, limits)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)
    sock.setblocking(False)
    port = sock.getsockname()[1]
    await server.start(sock)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await server.close(2.0)


@contextlib.asynccontextmanager
async def running_proxy(
    resolver: UpstreamResolver,
    metrics: ProxyMetrics,
    *,
    server: str = "berth",
    wrap: Callable[[OpenAIProxy], Handler] | None = None,
    **options: Any,
) -> AsyncIterator[str]:
    """An :class:`OpenAIProxy` over ``resolver``, started and served; yields its base URL.

    ``server``: ``"berth"`` (berth's HTTP server, the proxy's own request and writer, as the
    leader serves ``/v1``) or ``"uvicorn"`` (the proxy as an ASGI app). ``wrap`` builds the
    handler berth's server calls around the proxy (e.g. one that hands it an API key, as the
    listener's authentication does).
    """
    proxy = OpenAIProxy(resolver, metrics, **options)
    await proxy.startup()
    try:
        if server == "uvicorn":
            async with serve_asgi(proxy) as url:
                yield url
        else:
            async with serve_berth(wrap(proxy) if wrap is not None else proxy.handle) as url:
                yield url
    finally:
        await proxy.shutdown()


def sample(metrics: ProxyMetrics, name: str, **labels: str) -> float:
    """The value of one series (0.0 when it does not exist yet)."""
    value = metrics.registry.get_sample_value(name, labels)
    return 0.0 if value is None else value
