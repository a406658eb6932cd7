"""The admin API (``/admin/*``) and the plain endpoints (``/healthz``, ``/readyz``, ``/metrics``).

Served by FastAPI; authentication happens before a request reaches these routes (see
``daemon/app.py``).  Every error is answered in the OpenAI error shape, like ``/v1/*``.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import AsyncIterator
from dataclasses import asdict
from pathlib import Path
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, Field, field_validator
from starlette.exceptions import HTTPException as StarletteHTTPException

from berth import __version__
from berth.cluster.link import LOCAL_NODE_ID
from berth.daemon.admin_metrics import build_metrics_router
from berth.daemon.admin_nodes import build_node_router
from berth.daemon.admin_routing import build_routing_router
from berth.daemon.lifecycle import DeployOptions, LifecycleManager
from berth.daemon.services import LeaderServices
from berth.errors import BerthError, ConfigError, ConflictError, NotFoundError
from berth.keys import generate_secret, hash_secret, key_prefix, parse_tier
from berth.openai_errors import error_body, error_from_exception
from berth.store import ApiKeyRecord, DeploymentRecord, ModelRecord, Store
from berth.store.states import TERMINAL_STATES

#: Model names: letters, digits and ``. _ - : /`` (hub ids like ``org/model:q4``), starting
#: with a letter or digit, no ``..``: safe in URLs, file names and the OpenAI ``model`` field.
MODEL_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:/-]{0,199}$"


class ModelIn(BaseModel):
    name: str = Field(pattern=MODEL_NAME_PATTERN)
    path: str
    source: Literal["local", "hub"] = "local"
    repo_id: str | None = None
    revision: str | None = None
    #: A node id or label: the weights are at ``path`` on that node's host (not checked here).
    node: str | None = None

    @field_validator("name")
    @classmethod
    def _no_parent_segments(cls, name: str) -> str:
        if ".." in name:
            raise ValueError("must not contain '..'")
        return name


class DeploymentIn(BaseModel):
    model: str
    engine: str = "llamacpp"
    node: str = "local"
    runtime: str | None = None
    gpus: list[int] = Field(default_factory=list)
    ctx: int | None = Field(default=None, gt=0)
    extra_args: list[str] = Field(default_factory=list)
    served_model_name: str | None = None
    image: str | None = Field(default=None, max_length=512)


class KeyIn(BaseModel):
    name: str = Field(min_length=1, max_length=200)
    tier: str = "standard"


def model_json(record: ModelRecord) -> dict[str, Any]:
    data = asdict(record)
    data["created_at"] = record.created_at.isoformat()
    return data


def deployment_json(
    record: DeploymentRecord, lifecycle: LifecycleManager | None = None
) -> dict[str, Any]:
    """A deployment for the admin API; ``progress`` says what a loading one is busy with
    (an image pull), ``None`` otherwise."""
    data = asdict(record)
    data["progress"] = lifecycle.progress(record.id) if lifecycle is not None else None
    data["state"] = str(record.state)
    data["gpus"] = list(record.gpus)
    data["extra_args"] = list(record.extra_args)
    data["created_at"] = record.created_at.isoformat()
    data["updated_at"] = record.updated_at.isoformat()
    return data


def key_json(record: ApiKeyRecord) -> dict[str, Any]:
    data = asdict(record)
    data["created_at"] = record.created_at.isoformat()
    data["revoked_at"] = record.revoked_at.isoformat() if record.revoked_at else None
    return data


def _is_gguf(path: Path) -> bool:
    """Whether ``path`` starts with the GGUF magic ``b"GGUF"`` (the GGUF spec's header)."""
    with path.open("rb") as handle:
        return handle.read(4) == b"GGUF"


def _path_size_bytes(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


#: Seconds between checks whether a followed deployment has stopped.
FOLLOW_CHECK_INTERVAL_S = 1.0


async def _follow_until_settled(
    store: Store, deployment_id: str, first: bytes, chunks: AsyncIterator[bytes]
) -> AsyncIterator[bytes]:
    """Relay a followed log until the client leaves or the deployment is stopped or failed
    (then the rest of the log is flushed and the stream ends, like ``docker logs -f``)."""
    queue: asyncio.Queue[bytes] = asyncio.Queue(maxsize=64)

    async def pump() -> None:
        async for chunk in chunks:
            await queue.put(chunk)

    pumping = asyncio.create_task(pump())
    try:
        yield first
        while True:
            try:
                yield await asyncio.wait_for(queue.get(), FOLLOW_CHECK_INTERVAL_S)
                continue
            except TimeoutError:
                pass
            if pumping.done() and queue.empty():
                # The log source ended early: its node's link was lost, or the log went away.
                error = None if pumping.cancelled() else pumping.exception()
                if error is not None:
                    yield f"\nberth: the log stream ended: {error}\n".encode()
                return
            record = await asyncio.to_thread(store.get_deployment, deployment_id)
            if record.state in TERMINAL_STATES:
                await asyncio.sleep(FOLLOW_CHECK_INTERVAL_S)  # the engine's last lines
                while not queue.empty():
                    yield queue.get_nowait()
                return
    finally:
        pumping.cancel()


def build_admin_app(services: LeaderServices) -> FastAPI:
    """The FastAPI app for everything that is not ``/v1/*``."""
    app = FastAPI(title="berth admin API", version=__version__, docs_url=None, redoc_url=None)
    store = services.store
    lifecycle = services.lifecycle

    @app.exception_handler(BerthError)
    async def _berth_error(_request: Request, exc: BerthError) -> Response:
        status, body, headers = error_from_exception(exc)
        return Response(body, status_code=status, headers=headers, media_type="application/json")

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_request: Request, exc: StarletteHTTPException) -> Response:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        body = error_body(str(exc.detail), type=kind)
        return Response(body, status_code=exc.status_code, media_type="application/json")

    @app.exception_handler(RequestValidationError)
    async def _invalid(_request: Request, exc: RequestValidationError) -> Response:
        first = exc.errors()[0] if exc.errors() else {}
        if first.get("type") == "json_invalid":
            body = error_body("request body is not valid JSON", type="invalid_request_error")
            return Response(body, status_code=400, media_type="application/json")
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        message = f"{where}: {first.get('msg', 'invalid request')}" if where else "invalid request"
        body = error_body(message, type="invalid_request_error", param=where or None)
        return Response(body, status_code=400, media_type="application/json")

    @app.get("/healthz")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/readyz")
    async def readyz() -> Response:
        if services.ready:
            return JSONResponse({"status": "ready"})
        return JSONResponse({"status": "starting"}, status_code=503)

    @app.get("/metrics")
    async def metrics() -> Response:
        payload, content_type = services.metrics.render()
        return Response(payload, media_type=content_type)

    @app.get("/admin/info")
    async def info() -> dict[str, Any]:
        return {
            "version": __version__,
            "pid": services.pid,
            "home": str(services.home.root),
            "started_at": services.started_at,
            "uptime_s": round(time.time() - services.started_at, 1),
            "ca_fingerprint": services.ca.fingerprint_sha256,
            "ca_file": str(services.home.ca_dir / "ca.pem"),
            "listeners": [asdict(listener) for listener in services.listeners],
            "cluster_url": services.cluster_url,
            # No --public-cert: clients must trust the berth CA (ca_file) to reach /v1.
            "public_cert_from_ca": services.settings.public_cert is None,
            "ready": services.ready,
            # A control plane only: no engines on the leader's host (the leader_only setting).
            "leader_only": services.leader_only,
            "runtimes": [asdict(runtime) for runtime in services.runtimes],
        }

    @app.get("/admin/config")
    async def config() -> Any:
        return services.settings.as_json()

    # -- models ------------------------------------------------------------------------------
    @app.get("/admin/models")
    async def list_models() -> list[dict[str, Any]]:
        records = await asyncio.to_thread(store.list_models)
        locations = await asyncio.to_thread(store.list_model_locations)
        return [
            {
                **model_json(r),
                "locations": {x.node_id: x.path for x in locations if x.model_name == r.name},
            }
            for r in records
        ]

    @app.post("/admin/models", status_code=201)
    async def add_model(body: ModelIn) -> dict[str, Any]:
        path = Path(body.path)
        if not path.is_absolute():
            raise ConfigError(f"model path must be absolute, not {body.path!r}")
        if body.node is not None:
            node = await asyncio.to_thread(store.lookup_node, body.node)
            if node.id != LOCAL_NODE_ID:
                return await _add_remote_location(body.name, node.id, str(path))
        if not path.exists():
            raise ConfigError(f"model path does not exist: {path}")
        path = path.resolve()
        if path.is_file() and not _is_gguf(path):
            raise ConfigError(f"{path} is not a GGUF file; register a .gguf file or a model folder")
        record = await asyncio.to_thread(
            store.add_model,
            body.name,
            str(path),
            source=body.source,
            repo_id=body.repo_id,
            revision=body.revision,
            size_bytes=_path_size_bytes(path),
        )
        await lifecycle.refresh_known_models()
        return model_json(record)

    async def _add_remote_location(name: str, node_id: str, path: str) -> dict[str, Any]:
        # The path lives on the agent's host: the leader cannot check it.
        try:
            record = await asyncio.to_thread(store.get_model, name)
        except NotFoundError:
            # The leader has no copy: "remote" keeps it from being run on node local.
            record = await asyncio.to_thread(store.add_model, name, path, source="remote")
        await asyncio.to_thread(store.set_model_location, name, node_id, path)
        await lifecycle.refresh_known_models()
        return {**model_json(record), "locations": {node_id: path}}

    @app.delete("/admin/models/{name:path}")
    async def remove_model(name: str) -> dict[str, str]:
        await asyncio.to_thread(store.remove_model, name)
        await lifecycle.refresh_known_models()
        return {"removed": name}

    # -- deployments -------------------------------------------------------------------------
    @app.get("/admin/deployments")
    async def list_deployments(active: bool = False) -> list[dict[str, Any]]:
        records = await asyncio.to_thread(store.list_deployments, active_only=active)
        nodes = {n.id: n for n in await asyncio.to_thread(store.list_nodes, True)}
        listed = []
        for record in records:
            data = deployment_json(record, lifecycle)
            node = nodes.get(record.node_id)
            data["node_label"] = node.label if node is not None else record.node_id
            data["node_connected"] = record.node_id == LOCAL_NODE_ID or services.hub.is_connected(
                record.node_id
            )
            listed.append(data)
        return listed

    @app.post("/admin/deployments", status_code=201)
    async def create_deployment(body: DeploymentIn) -> dict[str, Any]:
        if services.leader_only and body.node == LOCAL_NODE_ID:
            raise ConflictError(
                "this leader runs no engines (leader_only is set): run the deployment on an "
                "agent with --node LABEL (`berth nodes ls` lists them)"
            )
        record = await lifecycle.deploy(
            DeployOptions(
                model_name=body.model,
                engine=body.engine,
                node_id=body.node,
                runtime=body.runtime or services.settings.default_runtime,
                gpus=tuple(body.gpus),
                ctx=body.ctx,
                extra_args=tuple(body.extra_args),
                served_model_name=body.served_model_name,
                image=body.image,
            )
        )
        return deployment_json(record, lifecycle)

    @app.get("/admin/deployments/{deployment_id}")
    async def get_deployment(deployment_id: str) -> dict[str, Any]:
        record = await asyncio.to_thread(store.get_deployment, deployment_id)
        return deployment_json(record, lifecycle)

    @app.post("/admin/deployments/{deployment_id}/stop")
    async def stop_deployment(deployment_id: str) -> dict[str, Any]:
        return deployment_json(await lifecycle.stop(deployment_id), lifecycle)

    @app.get("/admin/deployments/{deployment_id}/logs")
    async def deployment_logs(
        deployment_id: str, tail: int = 100, follow: bool = False
    ) -> Response:
        record = await asyncio.to_thread(store.get_deployment, deployment_id)
        link = services.links.get(record.node_id)
        if link is None:
            raise ConfigError(f"node {record.node_id} is not connected")
        chunks = link.logs(deployment_id, tail_lines=max(tail, 0), follow=follow)
        # Pull the first chunk now so a missing log is a clean 404, not a broken stream.
        first = await anext(chunks, b"")
        body = _follow_until_settled(store, deployment_id, first, chunks) if follow else None

        async def whole() -> AsyncIterator[bytes]:
            yield first
            async for chunk in chunks:
                yield chunk

        return StreamingResponse(body or whole(), media_type="text/plain; charset=utf-8")

    # -- keys --------------------------------------------------------------------------------
    @app.get("/admin/keys")
    async def list_keys() -> list[dict[str, Any]]:
        return [key_json(r) for r in await asyncio.to_thread(store.list_api_keys)]

    @app.post("/admin/keys", status_code=201)
    async def create_key(body: KeyIn) -> dict[str, Any]:
        tier = parse_tier(body.tier)
        secret = generate_secret()
        record = await asyncio.to_thread(
            store.add_api_key,
            body.name,
            tier,
            hash_secret(secret, services.pepper),
            key_prefix(secret),
        )
        return {**key_json(record), "secret": secret}

    @app.delete("/admin/keys/{key_id}")
    async def revoke_key(key_id: str) -> dict[str, Any]:
        record = await asyncio.to_thread(store.revoke_api_key, key_id)
        services.authenticator.forget_all()
        return key_json(record)

    app.include_router(build_node_router(services))
    app.include_router(build_metrics_router(services))
    app.include_router(build_routing_router(services))

    @app.post("/admin/shutdown", status_code=202)
    async def shutdown() -> dict[str, str]:
        os.kill(services.pid, signal.SIGTERM)
        return {"status": "stopping"}

    return app
