"""The docker runtime: each engine runs in a container on this host's Docker engine.

Containers are driven through the ``docker`` SDK.  Every SDK call blocks on the Docker
socket, so each one runs on this runtime's own thread pool (never the event loop, and never
the default executor the store shares); an image pull and a container's log copy run on
threads of their own for as long as they last.

A container berth starts is named ``berth-<deployment id>`` and labelled with its deployment,
model and engine, the node that runs it and the berth home that owns it
(``docker ps --filter label=berth.deployment``).  Its engine port is published on the host's
127.0.0.1 only, at a port Docker picks free; the model is bind-mounted read-only.  The
container's output is copied into the deployment's engine log file, so ``berth logs`` reads
one file whatever the runtime, and the log outlives the container, which is removed when the
deployment stops.

After a restart, containers are found again by their labels (:meth:`DockerRuntime.attach`,
:meth:`DockerRuntime.owned`): Docker, not berth, keeps them running.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import docker
import docker.errors
import docker.types
import docker.utils
import requests
import urllib3.exceptions
from docker.constants import DEFAULT_DOCKER_API_VERSION

from berth.errors import EngineError
from berth.runtime.base import ContainerSpec, EngineHandle, LaunchSpec, ProgressListener
from berth.runtime.health import HealthProber
from berth.runtime.process import DEFAULT_LOG_TAIL_LINES

log = logging.getLogger(__name__)

#: The Docker engine used when neither the ``docker_host`` setting nor ``DOCKER_HOST`` names
#: one: the socket Docker's own client uses by default.
DEFAULT_DOCKER_HOST = "unix:///var/run/docker.sock"

DEPLOYMENT_LABEL = "berth.deployment"
NODE_LABEL = "berth.node"
HOME_LABEL = "berth.home"
#: Container names: this prefix and the deployment id.
CONTAINER_PREFIX = "berth-"

# The statuses Docker reports about one layer of a pull.
_LAYER_STATUSES = frozenset(
    {
        "Pulling fs layer",
        "Waiting",
        "Downloading",
        "Verifying Checksum",
        "Download complete",
        "Extracting",
        "Pull complete",
        "Already exists",
    }
)
# Seconds between two progress messages of one pull (Docker sends many per second).
_PROGRESS_EVERY_S = 1.0
# Seconds one Docker API call may take (a stop adds its grace period to this).
_API_TIMEOUT_S = 60
# Seconds stop() waits for a container's log copy to catch up before it returns.
_LOG_DRAIN_S = 2.0

T = TypeVar("T")

#: What a call through the SDK can raise when Docker refuses or the connection breaks: the
#: SDK's own errors, the HTTP client's, a malformed streamed message, or the socket's.
DOCKER_ERRORS: tuple[type[BaseException], ...] = (
    docker.errors.DockerException,
    docker.errors.StreamParseError,
    requests.RequestException,
    urllib3.exceptions.HTTPError,
    OSError,
)
_DOCKER_OR_ENGINE_ERRORS: tuple[type[BaseException], ...] = (*DOCKER_ERRORS, EngineError)


def resolve_docker_host(configured: str | None) -> str:
    """The Docker engine to use: ``configured`` (a setting), else ``$DOCKER_HOST``, else
    :data:`DEFAULT_DOCKER_HOST`."""
    return configured or os.environ.get("DOCKER_HOST") or DEFAULT_DOCKER_HOST


@dataclass(frozen=True)
class DockerStatus:
    """Whether a Docker engine answers, and a line saying which one or why not."""

    available: bool
    detail: str


class PullProgress:
    """Folds the JSON messages of an image pull into one line of progress.

    Docker reports each layer separately (``{"id": layer, "status": "Downloading",
    "progressDetail": {"current": n, "total": m}}``, then ``"Download complete"``,
    ``"Pull complete"`` or ``"Already exists"``); this keeps the latest count per layer.
    """

    def __init__(self, image: str) -> None:
        self.image = image
        self._bytes: dict[str, tuple[int, int]] = {}
        self._done: set[str] = set()
        self._layers: set[str] = set()

    def feed(self, message: dict[str, Any]) -> None:
        """Take one message of the pull's stream (unknown shapes are ignored)."""
        layer = message.get("id")
        status = str(message.get("status", ""))
        if not isinstance(layer, str) or status not in _LAYER_STATUSES:
            return  # "Pulling from ...", "Digest: ...", "Status: ..." are about the image
        self._layers.add(layer)
        detail = message.get("progressDetail") or {}
        if status == "Downloading" and isinstance(detail, dict):
            current, total = detail.get("current"), detail.get("total")
            if isinstance(current, int) and isinstance(total, int) and total > 0:
                self._bytes[layer] = (current, total)
        elif status == "Download complete" and layer in self._bytes:
            total = self._bytes[layer][1]
            self._bytes[layer] = (total, total)  # extracting next: done once "Pull complete"
        elif status in ("Pull complete", "Already exists"):
            self._done.add(layer)

    def line(self) -> str:
        """``pulling IMAGE: 1.2 GB of 4.5 GB, 3/7 layers done`` (the byte count once known)."""
        text = f"pulling {self.image}"
        if self._bytes:
            current = sum(c for c, _ in self._bytes.values())
            total = sum(t for _, t in self._bytes.values())
            text += f": {_size(current)} of {_size(total)}"
        if self._layers:
            text += f"{',' if self._bytes else ':'} {len(self._done)}/{len(self._layers)} layers"
            text += " done"
        return text


def _size(count: int) -> str:
    value = float(count)
    for unit in ("B", "kB", "MB", "GB"):
        if value < 1000 or unit == "GB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1000
    raise AssertionError("unreachable")


def docker_error_text(exc: BaseException) -> str:
    """A short reason for a failed Docker call: Docker's own explanation when it gave one,
    else what the connection reported (socket missing, refused, not allowed)."""
    if isinstance(exc, docker.errors.APIError) and exc.explanation:
        return str(exc.explanation)
    chain: list[BaseException] = []
    current: BaseException | None = exc
    while current is not None and len(chain) < 10:
        chain.append(current)
        current = current.__cause__ or current.__context__
    text = " ".join(str(e) for e in chain)
    if any(isinstance(e, FileNotFoundError) for e in chain) or "No such file" in text:
        return "its socket does not exist (is dockerd running?)"
    if any(isinstance(e, PermissionError) for e in chain) or "Permission denied" in text:
        return "permission denied on its socket (is this user in the docker group?)"
    if any(isinstance(e, ConnectionRefusedError) for e in chain) or "refused" in text:
        return "connection refused"
    return str(exc) or type(exc).__name__


class DockerRuntime:
    """Runs engines as containers on one Docker engine (the ``docker`` runtime).

    ``host`` is the Docker engine's URL (``unix:///var/run/docker.sock``, ``tcp://…``);
    ``home`` and ``node_id`` are written into every container's labels and select the
    containers this runtime owns after a restart.  ``client_factory(host)`` makes the SDK
    client (tests pass a fake); the real one connects and asks the engine's API version.
    """

    name: str = "docker"

    def __init__(
        self,
        *,
        host: str,
        home: Path,
        node_id: str,
        poll_interval_s: float = 0.25,
        probe_timeout_s: float = 2.0,
        log_tail_lines: int = DEFAULT_LOG_TAIL_LINES,
        client_factory: Callable[[str], Any] | None = None,
    ) -> None:
        self.host = host
        self._home = str(home)
        self._node_id = node_id
        self._poll_interval_s = poll_interval_s
        self._probe_timeout_s = probe_timeout_s
        self._log_tail_lines = log_tail_lines
        self._client_factory = client_factory or connect_docker
        self._client: Any = None
        self._client_lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="berth-docker")
        self._running: dict[str, bool] = {}
        self._log_copies: dict[str, threading.Thread] = {}
        self._health = HealthProber()  # one HTTP client for every probe

    # -- the engine connection -------------------------------------------------------------

    async def status(self) -> DockerStatus:
        """Whether the Docker engine answers: its version, or why it cannot be used."""
        try:
            client = await self._call(self._connected)
            version = await self._call(client.version)
        except EngineError as exc:
            return DockerStatus(False, str(exc))
        except DOCKER_ERRORS as exc:
            return DockerStatus(False, f"no Docker engine at {self.host}: {docker_error_text(exc)}")
        return DockerStatus(
            True,
            f"Docker {version.get('Version', '?')} (API {version.get('ApiVersion', '?')}) "
            f"at {self.host}",
        )

    def _connected(self) -> Any:
        """The SDK client, connected on first use (and again after a failed attempt)."""
        with self._client_lock:
            if self._client is None:
                try:
                    self._client = self._client_factory(self.host)
                except DOCKER_ERRORS as exc:
                    reason = docker_error_text(exc)
                    raise EngineError(f"no Docker engine at {self.host}: {reason}") from exc
            return self._client

    async def _call(self, function: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, lambda: function(*args, **kwargs))

    # -- Runtime ---------------------------------------------------------------------------

    async def start(
        self, spec: LaunchSpec, on_progress: ProgressListener | None = None
    ) -> EngineHandle:
        """Pull the image when it is missing, then create and start the container.

        Returns once the container runs, before the engine is healthy.  ``on_progress`` gets
        the pull's progress about once a second (on the event loop).  Raises
        :class:`~berth.errors.EngineError` when there is no Docker engine, the image cannot
        be pulled (the message carries Docker's reason) or the container cannot be created
        or started; nothing is left behind then.
        """
        container = spec.container
        if container is None:
            raise EngineError("no container in the launch spec", deployment_id=spec.deployment_id)
        loop = asyncio.get_running_loop()
        cancelled = threading.Event()

        def progress(line: str) -> None:
            if on_progress is not None and not cancelled.is_set():
                with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                    loop.call_soon_threadsafe(on_progress, line)

        try:
            await self._call(self._connected)
            try:
                await self._run_thread(
                    f"pull-{spec.deployment_id}", self._ensure_image, spec, progress, cancelled
                )
            except asyncio.CancelledError:
                cancelled.set()  # the pull thread stops at Docker's next message
                raise
            creating = asyncio.ensure_future(self._call(self._create_and_start, spec, container))
            try:
                return await asyncio.shield(creating)
            except asyncio.CancelledError:
                # The worker thread goes on regardless: remove what it creates.
                await asyncio.shield(self._remove_created(creating))
                raise
        except DOCKER_ERRORS as exc:
            raise EngineError(
                f"Docker engine at {self.host}: {docker_error_text(exc)}",
                deployment_id=spec.deployment_id,
            ) from exc

    async def _remove_created(self, creating: asyncio.Future[EngineHandle]) -> None:
        try:
            handle = await creating
            await self.stop(handle, grace_s=0)
        except _DOCKER_OR_ENGINE_ERRORS as exc:
            log.warning("removing a container whose start was cancelled failed: %s", exc)

    async def _run_thread(self, name: str, function: Callable[..., T], *args: Any) -> T:
        """Run a long blocking call (an image pull) on a thread of its own."""
        outcome: Future[T] = Future()

        def body() -> None:
            # Whoever awaited it may have given up (cancelled): then the outcome is dropped.
            try:
                value = function(*args)
            except BaseException as exc:
                with contextlib.suppress(InvalidStateError):
                    outcome.set_exception(exc)
            else:
                with contextlib.suppress(InvalidStateError):
                    outcome.set_result(value)

        threading.Thread(target=body, name=f"berth-{name}", daemon=True).start()
        return await asyncio.wrap_future(outcome)

    def _ensure_image(
        self, spec: LaunchSpec, progress: Callable[[str], None], cancelled: threading.Event
    ) -> None:
        assert spec.container is not None
        image = spec.container.image
        client = self._connected()
        try:
            client.images.get(image)
            return
        except docker.errors.ImageNotFound:
            pass
        repository, tag = docker.utils.parse_repository_tag(image)
        tracker = PullProgress(image)
        _append_log(spec.log_path, f"=== berth {_stamp()} pulling image {image}\n")
        progress(tracker.line())
        last = time.monotonic()
        started = last
        try:
            messages = client.api.pull(repository, tag=tag or "latest", stream=True, decode=True)
            for message in messages:
                if cancelled.is_set():
                    messages.close()  # closes the response: Docker drops a pull nobody reads
                    raise EngineError(
                        f"the pull of {image} was cancelled", deployment_id=spec.deployment_id
                    )
                if not isinstance(message, dict):
                    continue
                if "error" in message:
                    raise EngineError(
                        f"cannot pull image {image}: {message['error']}",
                        deployment_id=spec.deployment_id,
                    )
                tracker.feed(message)
                if time.monotonic() - last >= _PROGRESS_EVERY_S:
                    last = time.monotonic()
                    progress(tracker.line())
        except DOCKER_ERRORS as exc:
            reason = f"cannot pull image {image}: {docker_error_text(exc)}"
            _append_log(spec.log_path, f"=== berth {_stamp()} {reason}\n")
            raise EngineError(reason, deployment_id=spec.deployment_id) from exc
        except EngineError as exc:
            _append_log(spec.log_path, f"=== berth {_stamp()} {exc}\n")
            raise
        try:
            client.images.get(image)
        except docker.errors.ImageNotFound:
            raise EngineError(
                f"cannot pull image {image}: Docker finished the pull but has no such image",
                deployment_id=spec.deployment_id,
            ) from None
        took = time.monotonic() - started
        _append_log(spec.log_path, f"=== berth {_stamp()} pulled {image} in {took:.0f} s\n")
        progress(f"pulled {image}")

    def _create_and_start(self, spec: LaunchSpec, container: ContainerSpec) -> EngineHandle:
        client = self._connected()
        name = CONTAINER_PREFIX + spec.deployment_id
        labels = {
            **container.labels,
            DEPLOYMENT_LABEL: spec.deployment_id,
            NODE_LABEL: self._node_id,
            HOME_LABEL: self._home,
        }
        device_requests = []
        if container.gpus:
            device_requests.append(
                docker.types.DeviceRequest(
                    driver="nvidia",
                    device_ids=[str(index) for index in container.gpus],
                    capabilities=[["gpu"]],
                )
            )
        spec.log_path.parent.mkdir(parents=True, exist_ok=True)
        _append_log(
            spec.log_path,
            f"=== berth {_stamp()} deployment {spec.deployment_id}: container {name} from "
            f"{container.image}: {' '.join(container.command)}\n",
        )
        options: dict[str, Any] = {
            "command": list(container.command),
            "name": name,
            "labels": labels,
            "detach": True,
            # docker-init as PID 1: forwards signals to the engine and reaps the helper
            # processes vLLM and SGLang fork.
            "init": True,
            "environment": dict(spec.env),
            "ports": {f"{container.container_port}/tcp": (spec.host,)},
            "mounts": [
                docker.types.Mount(
                    target=m.target, source=str(m.source), type="bind", read_only=m.read_only
                )
                for m in container.mounts
            ],
            "device_requests": device_requests,
            "ulimits": [
                docker.types.Ulimit(name=n, soft=soft, hard=hard)
                for n, soft, hard in container.ulimits
            ],
        }
        if container.shm_size:
            options["shm_size"] = container.shm_size
        try:
            created = client.containers.create(container.image, **options)
        except docker.errors.APIError as exc:
            if exc.status_code != 409 or not self._remove_stale(name):
                raise EngineError(
                    f"cannot create container {name}: {docker_error_text(exc)}",
                    deployment_id=spec.deployment_id,
                ) from exc
            created = client.containers.create(container.image, **options)
        try:
            created.start()
            # Copy the output from the start, so an engine that exits at once leaves its reason.
            self._follow_logs(created.id, spec.log_path, since=None)
            created.reload()
            handle = self._handle(spec.deployment_id, created.attrs)
        except _DOCKER_OR_ENGINE_ERRORS as exc:
            with contextlib.suppress(*DOCKER_ERRORS):
                created.remove(force=True)
            reason = exc if isinstance(exc, EngineError) else docker_error_text(exc)
            raise EngineError(
                f"cannot start container {name}: {reason}", deployment_id=spec.deployment_id
            ) from exc
        return handle

    def _remove_stale(self, name: str) -> bool:
        """Remove a container of ours left with ``name``; False when it is not ours."""
        client = self._connected()
        try:
            stale = client.containers.get(name)
        except docker.errors.NotFound:
            return True
        if stale.labels.get(HOME_LABEL) != self._home:
            return False
        log.warning("removing container %s left from an earlier start", name)
        stale.remove(force=True)
        return True

    def _handle(self, deployment_id: str, attrs: dict[str, Any]) -> EngineHandle:
        """The handle of a container, from its ``docker inspect`` attributes.

        A container that already exited has no published port (0 then): waiting for its
        health reports how it exited, with its output.
        """
        container_id = str(attrs["Id"])
        state = attrs.get("State") or {}
        running = bool(state.get("Running"))
        port = _published_port(attrs)
        if port is None and running:
            raise EngineError("the container publishes no engine port", deployment_id=deployment_id)
        self._running[container_id] = running
        return EngineHandle(
            deployment_id=deployment_id,
            pid=int(state.get("Pid") or 0),
            port=port or 0,
            runtime="docker",
            container_id=container_id,
        )

    async def wait_healthy(self, handle: EngineHandle, spec: LaunchSpec, timeout_s: float) -> None:
        """Poll ``GET http://127.0.0.1:port{spec.health_path}`` until it answers 200.

        Raises :class:`~berth.errors.EngineError` with the container's last output when the
        container stops first (with its exit code, and whether it was killed for memory) or
        ``timeout_s`` seconds pass.
        """
        url = f"{handle.base_url}{spec.health_path}"
        outcome = await self._health.wait(
            url,
            timeout_s,
            alive=lambda: self.poll(handle),
            poll_interval_s=self._poll_interval_s,
            probe_timeout_s=self._probe_timeout_s,
        )
        if outcome == "healthy":
            return
        if outcome == "exited":
            message = f"container {await self._exit_description(handle)} before {url} answered 200"
        else:
            message = f"engine did not answer 200 on {url} within {timeout_s:g} s"
        raise EngineError(
            message, deployment_id=handle.deployment_id, log_tail=await self._log_tail(handle)
        )

    async def check_health(self, handle: EngineHandle, health_path: str, timeout_s: float) -> bool:
        """One health probe: whether ``GET health_path`` answers 200 within ``timeout_s``."""
        return await self._health.probe(f"{handle.base_url}{health_path}", timeout_s)

    async def stop(self, handle: EngineHandle, grace_s: float) -> None:
        """Stop the container (Docker sends SIGTERM, then SIGKILL after ``grace_s`` seconds)
        and remove it.  A container already gone is not an error.

        Raises :class:`~berth.errors.EngineError` when Docker cannot be reached or refuses.
        """
        container_id = _container_id(handle)
        try:
            await self._call(self._stop_and_remove, container_id, grace_s)
        except DOCKER_ERRORS as exc:
            raise EngineError(
                f"cannot stop container {container_id[:12]}: {docker_error_text(exc)}",
                deployment_id=handle.deployment_id,
            ) from exc
        self._running.pop(container_id, None)

    def _stop_and_remove(self, container_id: str, grace_s: float) -> None:
        api = self._connected().api
        with contextlib.suppress(docker.errors.NotFound):
            api.stop(container_id, timeout=math.ceil(grace_s))
        copy = self._log_copies.pop(container_id, None)
        if copy is not None:
            copy.join(_LOG_DRAIN_S)  # the container's last lines reach the log file first
        try:
            api.remove_container(container_id, force=True)
        except docker.errors.NotFound:
            pass
        except docker.errors.APIError as exc:
            if exc.status_code != 409:  # 409: someone else is removing it right now
                raise

    def is_alive(self, handle: EngineHandle) -> bool:
        """Whether the container ran when last looked at (:meth:`poll` looks again)."""
        return self._running.get(_container_id(handle), False)

    async def poll(self, handle: EngineHandle) -> bool:
        """Whether the container runs now (a removed one does not).

        Raises :class:`~berth.errors.EngineError` when Docker cannot be reached: an engine
        whose state is unknown is not reported dead.
        """
        container_id = _container_id(handle)
        try:
            attrs = await self._call(self._inspect, container_id)
        except DOCKER_ERRORS as exc:
            raise EngineError(
                f"cannot inspect container {container_id[:12]}: {docker_error_text(exc)}",
                deployment_id=handle.deployment_id,
            ) from exc
        running = attrs is not None and bool((attrs.get("State") or {}).get("Running"))
        self._running[container_id] = running
        return running

    def _inspect(self, container_id: str) -> dict[str, Any] | None:
        try:
            attrs: dict[str, Any] = self._connected().api.inspect_container(container_id)
        except docker.errors.NotFound:
            return None
        return attrs

    # -- after a restart -------------------------------------------------------------------

    async def attach(self, deployment_id: str, log_path: Path) -> EngineHandle | None:
        """Take back the running container of ``deployment_id`` (found by its labels).

        Returns ``None`` when no such container runs; a stopped one is removed (its output
        is already in the log), and so is one that publishes no port (berth cannot reach
        it).  A running one's output is copied to ``log_path`` again from now on.
        """
        try:
            found = await self._call(self._find, deployment_id)
        except DOCKER_ERRORS as exc:
            raise EngineError(
                f"cannot list containers: {docker_error_text(exc)}", deployment_id=deployment_id
            ) from exc
        if not found:
            return None
        attrs = found[0]
        container_id = str(attrs["Id"])
        since = _mtime(log_path)  # what it printed while nobody copied its output
        if not (attrs.get("State") or {}).get("Running"):
            await self._call(self._copy_and_remove, container_id, log_path, since)
            return None
        if _published_port(attrs) is None:
            log.warning("container %s of deployment %s publishes no engine port: removing it",
                        container_id[:12], deployment_id)  # fmt: skip
            await self._call(self._copy_and_remove, container_id, log_path, since)
            return None
        handle = self._handle(deployment_id, attrs)
        self._follow_logs(container_id, log_path, since=since)
        return handle

    async def owned(self) -> list[str]:
        """Deployment ids of every container (running or not) this home and node own."""
        try:
            found = await self._call(self._find, None)
        except DOCKER_ERRORS as exc:
            raise EngineError(f"cannot list containers: {docker_error_text(exc)}") from exc
        owners = set()
        for attrs in found:
            labels = (attrs.get("Config") or {}).get("Labels") or {}
            owners.add(str(labels.get(DEPLOYMENT_LABEL, "")))
        return sorted(owners - {""})

    def _find(self, deployment_id: str | None) -> list[dict[str, Any]]:
        labels = [f"{HOME_LABEL}={self._home}", f"{NODE_LABEL}={self._node_id}"]
        labels.append(f"{DEPLOYMENT_LABEL}={deployment_id}" if deployment_id else DEPLOYMENT_LABEL)
        api = self._connected().api
        found = []
        for summary in api.containers(all=True, filters={"label": labels}):
            attrs = self._inspect(str(summary["Id"]))
            if attrs is not None:
                found.append(attrs)
        return found

    def _copy_and_remove(self, container_id: str, log_path: Path, since: float | None) -> None:
        """Append what the container printed since ``since`` to the log, then remove it."""
        api = self._connected().api
        with contextlib.suppress(docker.errors.NotFound):
            output = api.logs(container_id, since=since) if since else api.logs(container_id)
            if output:
                with log_path.open("ab") as sink:
                    sink.write(bytes(output))
            api.remove_container(container_id, force=True)

    def close(self) -> None:
        """Release the thread pool and the SDK client (containers keep running)."""
        self._pool.shutdown(wait=False, cancel_futures=True)
        with self._client_lock:
            if self._client is not None:
                with contextlib.suppress(*DOCKER_ERRORS):
                    self._client.close()
                self._client = None

    # -- logs ------------------------------------------------------------------------------

    def _follow_logs(self, container_id: str, log_path: Path, *, since: float | None) -> None:
        """Copy the container's output into ``log_path`` until the container stops."""

        def copy() -> None:
            try:
                api = self._connected().api
                stream = api.logs(container_id, stream=True, follow=True, since=since)
                with log_path.open("ab") as sink:
                    for chunk in stream:
                        sink.write(chunk)
                        sink.flush()
            except DOCKER_ERRORS as exc:
                log.warning("copying the output of container %s stopped: %s",
                            container_id[:12], exc)  # fmt: skip

        thread = threading.Thread(target=copy, name=f"berth-logs-{container_id[:12]}", daemon=True)
        self._log_copies[container_id] = thread
        thread.start()

    async def _log_tail(self, handle: EngineHandle) -> str:
        container_id = _container_id(handle)

        def tail() -> str:
            try:
                raw = self._connected().api.logs(container_id, tail=self._log_tail_lines)
            except DOCKER_ERRORS:
                return ""
            return bytes(raw).decode("utf-8", errors="replace")

        return await self._call(tail)

    async def _exit_description(self, handle: EngineHandle) -> str:
        attrs = await self._call(self._inspect, _container_id(handle))
        if attrs is None:
            return "was removed"
        state = attrs.get("State") or {}
        text = f"exited with code {state.get('ExitCode', '?')}"
        if state.get("OOMKilled"):
            text += " (killed: out of memory)"
        if state.get("Error"):
            text += f" ({state['Error']})"
        return text


def connect_docker(host: str, timeout_s: float = _API_TIMEOUT_S) -> Any:
    """A real SDK client for ``host``, speaking the engine's own API version; ``timeout_s``
    bounds each call.  Raises the SDK's ``DockerException`` when no engine answers.

    The version is asked with a first client that is closed whatever happens (the SDK's
    ``version="auto"`` leaves its socket open when the engine does not answer).  A unix
    socket that does not exist is reported without trying it.
    """
    if host.startswith("unix://") and not Path(host.removeprefix("unix://")).exists():
        raise docker.errors.DockerException("its socket does not exist (is dockerd running?)")
    probe = docker.DockerClient(base_url=host, version=DEFAULT_DOCKER_API_VERSION, timeout=10)
    try:
        version = str(probe.api.version(api_version=False)["ApiVersion"])
    finally:
        probe.close()
    return docker.DockerClient(base_url=host, version=version, timeout=timeout_s)


def _container_id(handle: EngineHandle) -> str:
    if handle.container_id is None:
        raise EngineError("not a container engine", deployment_id=handle.deployment_id)
    return handle.container_id


def _published_port(attrs: dict[str, Any]) -> int | None:
    """The host port of the container's (only) published TCP port."""
    ports = ((attrs.get("NetworkSettings") or {}).get("Ports")) or {}
    for bindings in ports.values():
        for binding in bindings or ():
            host_port = binding.get("HostPort")
            if host_port:
                return int(host_port)
    return None


def _mtime(path: Path) -> float | None:
    try:
        return path.stat().st_mtime
    except OSError:
        return None


def _append_log(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a", encoding="utf-8") as sink:
        sink.write(text)


def _stamp() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
