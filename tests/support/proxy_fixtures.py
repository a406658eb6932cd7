"""Helpers for the proxy tests: a fixed resolver, and the proxy served by uvicorn on loopback."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator, Callable
from typing import Any

import uvicorn
from uvicorn.server import ServerState

from berth.daemon.proxy import OpenAIProxy
from berth.errors import NotFoundError
from berth.observability.metrics import ProxyMetrics
from berth.routing.errors import NoReadyDeploymentError
from berth.routing.resolver import Upstream


class StaticResolver:
    """An ``UpstreamResolver`` over a fixed table.

    ``routes`` maps a public model name to its engine's base URL (deployment ``d-<model>``
    on node ``local``); names in ``loading`` are known but have no ready deployment.
    """

    def __init__(self, routes: dict[str, str], loading: tuple[str, ...] = ()) -> None:
        self.routes = routes
        self.loading = loading

    def candidates(self, model: str) -> list[Upstream]:
        if model in self.loading:
            raise NoReadyDeploymentError(model, retry_after_s=2.5, detail="loading")
        base_url = self.routes.get(model)
        if base_url is None:
            raise NotFoundError("model", model)
        return [Upstream(base_url, f"d-{model}", "local", model)]

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
async def running_proxy(
    resolver: StaticResolver,
    metrics: ProxyMetrics,
    *,
    wrap: Callable[[OpenAIProxy], Any] | None = None,
    **options: Any,
) -> AsyncIterator[str]:
    """An :class:`OpenAIProxy` over ``resolver``, started and served; yields its base URL.

    ``wrap`` builds the ASGI app served around the proxy (e.g. one that sets the scope's API
    key, as the listener does)."""
    proxy = OpenAIProxy(resolver, metrics, **options)
    await proxy.startup()
    try:
        async with serve_asgi(wrap(proxy) if wrap is not None else proxy) as url:
            yield url
    finally:
        await proxy.shutdown()


def sample(metrics: ProxyMetrics, name: str, **labels: str) -> float:
    """The value of one series (0.0 when it does not exist yet)."""
    value = metrics.registry.get_sample_value(name, labels)
    return 0.0 if value is None else value
