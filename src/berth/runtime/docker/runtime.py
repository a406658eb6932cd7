"""``DockerRuntime``: each engine runs in a container on this host's Docker engine.

Docker calls run off the event loop (:mod:`~berth.runtime.docker.threads`).  The container's
engine port is published on the host's 127.0.0.1 only; the model is bind-mounted read-only;
the container is removed when the deployment stops (its output is in the deployment's log by
then).

After a restart, containers are found again by their labels (:meth:`DockerRuntime.attach`,
:meth:`DockerRuntime.owned`): Docker, not berth, keeps them running.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from berth.errors import EngineError
from berth.runtime.base import (
    ContainerSpec,
    EngineExit,
    EngineHandle,
    LaunchSpec,
    ProgressListener,
    printable_command,
)
from berth.runtime.docker.api import (
    ContainerInfo,
    DockerApi,
    DockerApiError,
)
from berth.runtime.docker.containers import (
    copy_and_remove,
    create_and_start,
    find_containers,
    stop_and_remove,
)
from berth.runtime.docker.ends import ContainerEnds
from berth.runtime.docker.logs import LogCopies, append_log, log_stamp
from berth.runtime.docker.network import ensure_engine_network
from berth.runtime.docker.pull import ensure_image
from berth.runtime.docker.sdk import connect_docker
from berth.runtime.docker.spec import (
    DEPLOYMENT_LABEL,
    container_config,
    engine_handle,
    exit_description,
    owner_labels,
)
from berth.runtime.docker.threads import DockerThreads
from berth.runtime.engine_log import DEFAULT_LOG_TAIL_LINES
from berth.runtime.health import HealthProber, bearer_headers

log = logging.getLogger(__name__)

#: The Docker engine used when neither the ``docker_host`` setting nor ``DOCKER_HOST`` names
#: one: the socket Docker's own client uses by default.
DEFAULT_DOCKER_HOST = "unix:///var/run/docker.sock"

# Seconds stop() waits for a container's log copy to catch up before it returns.
_LOG_DRAIN_S = 2.0


def resolve_docker_host(configured: str | None) -> str:
    """The Docker engine to use: ``configured`` (a setting), else ``$DOCKER_HOST``, else
    :data:`DEFAULT_DOCKER_HOST`."""
    return configured or os.environ.get("DOCKER_HOST") or DEFAULT_DOCKER_HOST


@dataclass(frozen=True)
class DockerStatus:
    """Whether a Docker engine answers, and a line saying which one or why not."""

    available: bool
    detail: str


class DockerRuntime:
    """Runs engines as containers on one Docker engine (the ``docker`` runtime).

    ``host`` is the Docker engine's URL (``unix:///var/run/docker.sock``, ``tcp://…``);
    ``home`` and ``node_id`` are written into every container's labels and select the
    containers this runtime owns after a restart.  ``client_factory(host)`` makes the
    :class:`~berth.runtime.docker.api.DockerApi` (tests pass an in-memory one); the real
    one (:func:`~berth.runtime.docker.sdk.connect_docker`) connects and asks the engine's
    API version.
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
        client_factory: Callable[[str], DockerApi] | None = None,
    ) -> None:
        self.host = host
        self._home = str(home)
        self._node_id = node_id
        self._poll_interval_s = poll_interval_s
        self._probe_timeout_s = probe_timeout_s
        self._log_tail_lines = log_tail_lines
        self._client_factory = client_factory or connect_docker
        self._client: DockerApi | None = None
        self._client_lock = threading.Lock()
        self._threads = DockerThreads()
        self._running: dict[str, bool] = {}
        #: how each container that ended exited, by container id (as :meth:`poll` saw it)
        self._exits: dict[str, EngineExit] = {}
        self._logs = LogCopies()
        self._health = HealthProber()  # one HTTP client for every probe
        self._network_ready = False
        self._ends = ContainerEnds(self._connected, owner_labels(self._home, node_id, None))

    # -- the engine connection -------------------------------------------------------------

    async def status(self) -> DockerStatus:
        """Whether the Docker engine answers: its version, or why it cannot be used."""
        try:
            client = await self._threads.call(self._connected)
            version = await self._threads.call(client.version)
        except EngineError as exc:
            return DockerStatus(False, str(exc))
        except DockerApiError as exc:
            return DockerStatus(False, f"no Docker engine at {self.host}: {exc.reason}")
        return DockerStatus(
            True, f"Docker {version.version} (API {version.api_version}) at {self.host}"
        )

    def _connected(self) -> DockerApi:
        """The Docker client, connected on first use (and again after a failed attempt)."""
        with self._client_lock:
            if self._client is None:
                try:
                    self._client = self._client_factory(self.host)
                except DockerApiError as exc:
                    raise EngineError(f"no Docker engine at {self.host}: {exc.reason}") from exc
            return self._client

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
            client = await self._threads.call(self._connected)
            try:
                await self._threads.run_long(
                    f"pull-{spec.deployment_id}",
                    functools.partial(
                        ensure_image,
                        client,
                        container.image,
                        deployment_id=spec.deployment_id,
                        log_path=spec.log_path,
                        progress=progress,
                        cancelled=cancelled,
                    ),
                )
            except asyncio.CancelledError:
                cancelled.set()  # the pull thread stops at Docker's next message
                raise
            creating = asyncio.ensure_future(
                self._threads.call(self._create_and_start, spec, container)
            )
            try:
                return await asyncio.shield(creating)
            except asyncio.CancelledError:
                # The worker thread goes on regardless: remove what it creates.
                await asyncio.shield(self._remove_created(creating))
                raise
        except DockerApiError as exc:
            raise EngineError(
                f"Docker engine at {self.host}: {exc.reason}", deployment_id=spec.deployment_id
            ) from exc

    async def _remove_created(self, creating: asyncio.Future[EngineHandle]) -> None:
        try:
            handle = await creating
            await self.stop(handle, grace_s=0)
        except (DockerApiError, EngineError) as exc:
            log.warning("removing a container whose start was cancelled failed: %s", exc)

    def _create_and_start(self, spec: LaunchSpec, container: ContainerSpec) -> EngineHandle:
        client = self._connected()
        config = container_config(spec, container, home=self._home, node_id=self._node_id)
        if not self._network_ready:  # once per runtime: Docker keeps the network
            ensure_engine_network(client)
            self._network_ready = True
        append_log(
            spec.log_path,
            f"=== berth {log_stamp()} deployment {spec.deployment_id}: container {config.name} "
            f"from {container.image} on network {config.network}: "
            f"{printable_command(container.command)}\n",
        )

        def copy_output(container_id: str) -> None:
            # From the start, so an engine that exits at once leaves its reason in the log.
            self._logs.follow(self._connected, container_id, spec.log_path, since=None)

        try:
            info = create_and_start(
                client,
                config,
                home=self._home,
                deployment_id=spec.deployment_id,
                on_started=copy_output,
            )
        except EngineError:
            self._network_ready = False  # removed meanwhile? looked at again next time
            raise
        return self._handle(spec.deployment_id, info, spec.api_key)

    def _handle(
        self, deployment_id: str, info: ContainerInfo, api_key: str | None = None
    ) -> EngineHandle:
        handle = replace(engine_handle(deployment_id, info), api_key=api_key)
        self._running[info.id] = info.state.running
        return handle

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
            headers=bearer_headers(handle.api_key),
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
        url = f"{handle.base_url}{health_path}"
        return await self._health.probe(url, timeout_s, headers=bearer_headers(handle.api_key))

    async def stop(self, handle: EngineHandle, grace_s: float) -> None:
        """Stop the container (Docker sends SIGTERM, then SIGKILL after ``grace_s`` seconds)
        and remove it.  A container already gone is not an error.

        Raises :class:`~berth.errors.EngineError` when Docker cannot be reached or refuses.
        """
        container_id = _container_id(handle)
        try:
            await self._threads.call(self._stop_and_remove, container_id, grace_s)
        except DockerApiError as exc:
            raise EngineError(
                f"cannot stop container {container_id[:12]}: {exc.reason}",
                deployment_id=handle.deployment_id,
            ) from exc
        self._running.pop(container_id, None)
        self._exits.pop(container_id, None)

    def _stop_and_remove(self, container_id: str, grace_s: float) -> None:
        def drain(stopped_id: str) -> None:  # its last lines reach the log first
            self._logs.drain(stopped_id, _LOG_DRAIN_S)

        stop_and_remove(self._connected(), container_id, grace_s=grace_s, drain=drain)

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
            info = await self._threads.call(self._inspect, container_id)
        except DockerApiError as exc:
            raise EngineError(
                f"cannot inspect container {container_id[:12]}: {exc.reason}",
                deployment_id=handle.deployment_id,
            ) from exc
        running = info is not None and info.state.running
        self._running[container_id] = running
        if info is not None and not running and info.state.exit_code is not None:
            self._exits[container_id] = EngineExit(code=info.state.exit_code)
        return running

    def exit_status(self, handle: EngineHandle) -> EngineExit | None:
        """The container's exit code as the last :meth:`poll` saw it (``None``: running,
        or removed before it was seen)."""
        return self._exits.get(_container_id(handle))

    def watch_exit(
        self, handle: EngineHandle, on_exit: Callable[[EngineExit | None], None]
    ) -> None:
        """Call ``on_exit`` on the event loop as soon as Docker reports the container's end
        (its ``die`` event: :mod:`berth.runtime.docker.ends`), with its exit code."""
        container_id = _container_id(handle)

        def ended(exit_code: int | None) -> None:
            self._running[container_id] = False
            if exit_code is not None:
                self._exits[container_id] = EngineExit(code=exit_code)
            on_exit(self._exits.get(container_id))

        self._ends.watch(container_id, ended)

    def unwatch_exit(self, handle: EngineHandle) -> None:
        """Stop watching the container's end (it is being stopped on purpose)."""
        self._ends.unwatch(_container_id(handle))

    def _inspect(self, container_id: str) -> ContainerInfo | None:
        return self._connected().inspect_container(container_id)

    # -- after a restart -------------------------------------------------------------------

    async def attach(
        self, deployment_id: str, log_path: Path, api_key: str | None = None
    ) -> EngineHandle | None:
        """Take back the running container of ``deployment_id`` (found by its labels);
        ``api_key`` is the key its engine was started with.

        Returns ``None`` when no such container runs; a stopped one is removed (its output
        is already in the log), and so is one that publishes no port (berth cannot reach
        it).  A running one's output is copied to ``log_path`` again from now on.  Raises
        :class:`~berth.errors.EngineError` when Docker cannot be reached.
        """
        try:
            found = await self._threads.call(self._find, deployment_id)
        except DockerApiError as exc:
            raise EngineError(
                f"cannot list containers: {exc.reason}", deployment_id=deployment_id
            ) from exc
        if not found:
            return None
        info = found[0]
        since = _mtime(log_path)  # what it printed while nobody copied its output
        if not info.state.running or info.published_port() is None:
            if info.state.running:
                log.warning("container %s of deployment %s publishes no engine port: removing it",
                            info.id[:12], deployment_id)  # fmt: skip
            try:
                await self._threads.call(self._copy_and_remove, info.id, log_path, since)
            except DockerApiError as exc:
                raise EngineError(
                    f"cannot remove container {info.id[:12]}: {exc.reason}",
                    deployment_id=deployment_id,
                ) from exc
            return None
        handle = self._handle(deployment_id, info, api_key)
        self._logs.follow(self._connected, info.id, log_path, since=since)
        return handle

    async def owned(self) -> list[str]:
        """Deployment ids of every container (running or not) this home and node own."""
        try:
            found = await self._threads.call(self._find, None)
        except DockerApiError as exc:
            raise EngineError(f"cannot list containers: {exc.reason}") from exc
        return sorted({info.labels.get(DEPLOYMENT_LABEL, "") for info in found} - {""})

    def _find(self, deployment_id: str | None) -> list[ContainerInfo]:
        labels = owner_labels(self._home, self._node_id, deployment_id)
        return find_containers(self._connected(), labels)

    def _copy_and_remove(self, container_id: str, log_path: Path, since: float | None) -> None:
        copy_and_remove(self._connected(), container_id, log_path, since=since)

    def close(self) -> None:
        """Release the thread pool and the Docker client (containers keep running)."""
        self._ends.close()
        self._threads.shutdown()
        with self._client_lock:
            if self._client is not None:
                with contextlib.suppress(DockerApiError):
                    self._client.close()
                self._client = None

    # -- what a failed start reports -------------------------------------------------------

    async def _log_tail(self, handle: EngineHandle) -> str:
        container_id = _container_id(handle)

        def tail() -> str:
            try:
                raw = self._connected().logs(container_id, tail=self._log_tail_lines)
            except DockerApiError:
                return ""
            return raw.decode("utf-8", errors="replace")

        return await self._threads.call(tail)

    async def _exit_description(self, handle: EngineHandle) -> str:
        try:
            info = await self._threads.call(self._inspect, _container_id(handle))
        except DockerApiError as exc:
            return f"stopped (Docker cannot say how: {exc.reason})"
        return exit_description(info)


def _container_id(handle: EngineHandle) -> str:
    if handle.container_id is None:
        raise EngineError("not a container engine", deployment_id=handle.deployment_id)
    return handle.container_id


def _mtime(path: Path) -> float | None:
    try:
        return path.stat().st_mtime
    except OSError:
        return None
