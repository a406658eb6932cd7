"""The real :class:`~berth.runtime.docker.api.DockerApi`: the ``docker`` SDK.

The SDK returns Docker's JSON as untyped dicts and raises its own errors, the HTTP client's
and the socket's; this module is the one place that sees them.  Every answer leaves it as one
of the seam's typed values, every failure as a :class:`~berth.runtime.docker.api.DockerApiError`
whose reason is in plain words (:func:`docker_error_text`).
"""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Generator, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import docker
import docker.errors
import docker.types
import docker.utils
import requests
import urllib3.exceptions
from docker.constants import DEFAULT_DOCKER_API_VERSION

from berth.runtime.docker.api import (
    ContainerConfig,
    ContainerEnded,
    ContainerInfo,
    ContainerState,
    DockerApiError,
    DockerConflict,
    DockerNotFound,
    DockerUnreachable,
    EngineInfo,
    EngineVersion,
    EventStream,
    ImageInfo,
    NetworkInfo,
    PortBinding,
    PullMessage,
    decode_pull_message,
)

#: Seconds one Docker API call may take by default (a stop adds its grace period to this).
API_TIMEOUT_S = 60

#: What a call through the SDK can raise when Docker refuses or the connection breaks: the
#: SDK's own errors, the HTTP client's, a malformed streamed message, or the socket's.
_SDK_ERRORS: tuple[type[BaseException], ...] = (
    docker.errors.DockerException,
    docker.errors.StreamParseError,
    requests.RequestException,
    urllib3.exceptions.HTTPError,
    OSError,
)


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


@contextlib.contextmanager
def _translated() -> Iterator[None]:
    """SDK, HTTP and socket errors raised in the block leave it as :class:`DockerApiError`."""
    try:
        yield
    except docker.errors.APIError as exc:
        status = exc.status_code
        kind = {404: DockerNotFound, 409: DockerConflict}.get(status or 0, DockerApiError)
        raise kind(docker_error_text(exc), status_code=status) from exc
    except docker.errors.StreamParseError as exc:
        raise DockerApiError(docker_error_text(exc)) from exc
    except _SDK_ERRORS as exc:
        raise DockerUnreachable(docker_error_text(exc)) from exc


def connect_docker(host: str, timeout_s: float = API_TIMEOUT_S) -> SdkDockerApi:
    """A client of the Docker engine at ``host``, speaking the engine's own API version;
    ``timeout_s`` bounds each call.  Raises :class:`DockerUnreachable` when no engine answers.

    The version is asked with a first client that is closed whatever happens (the SDK's
    ``version="auto"`` leaves its socket open when the engine does not answer).  A unix
    socket that does not exist, or refuses, is reported without the SDK trying it.
    """
    if host.startswith("unix://"):
        _check_socket(host.removeprefix("unix://"))
    with _translated():
        probe = docker.DockerClient(base_url=host, version=DEFAULT_DOCKER_API_VERSION, timeout=10)
        try:
            version = str(probe.api.version(api_version=False)["ApiVersion"])
        finally:
            probe.close()
        return SdkDockerApi(docker.DockerClient(base_url=host, version=version, timeout=timeout_s))


def _check_socket(path: str) -> None:
    """Raise :class:`DockerUnreachable` unless something accepts connections on the unix
    socket at ``path``.  Asked here because the SDK's unix transport leaves its socket open
    when the connection is refused or not allowed (a stale socket file, a user outside the
    docker group)."""
    if not Path(path).exists():
        raise DockerUnreachable("its socket does not exist (is dockerd running?)")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(10)
        try:
            probe.connect(path)
        except OSError as exc:
            raise DockerUnreachable(docker_error_text(exc)) from None


class SdkDockerApi:
    """:class:`~berth.runtime.docker.api.DockerApi` over a connected ``docker.DockerClient``
    (:func:`connect_docker` makes one)."""

    def __init__(self, client: Any) -> None:
        self._client = client
        self._api = client.api

    def version(self) -> EngineVersion:
        with _translated():
            found: Mapping[str, Any] = self._client.version()
        return EngineVersion(str(found.get("Version", "?")), str(found.get("ApiVersion", "?")))

    def info(self) -> EngineInfo:
        with _translated():
            found: Mapping[str, Any] = self._client.info()
        return EngineInfo(frozenset(str(name) for name in found.get("Runtimes") or {}))

    def inspect_image(self, image: str) -> ImageInfo | None:
        try:
            with _translated():
                found: Mapping[str, Any] = self._api.inspect_image(image)
        except DockerNotFound:
            return None
        return ImageInfo(id=str(found.get("Id", "")), size_bytes=int(found.get("Size") or 0))

    def pull(self, image: str) -> Generator[PullMessage, None, None]:
        repository, tag = docker.utils.parse_repository_tag(image)
        with _translated():
            stream = self._api.pull(repository, tag=tag or "latest", stream=True, decode=True)
            try:
                for raw in stream:
                    if isinstance(raw, Mapping):
                        yield decode_pull_message(raw)
            finally:
                stream.close()  # closes the response: Docker drops a pull nobody reads

    def create_container(self, config: ContainerConfig) -> str:
        with _translated():
            created = self._client.containers.create(config.image, **_create_options(config))
        return str(created.id)

    def start_container(self, container_id: str) -> None:
        with _translated():
            self._api.start(container_id)

    def inspect_container(self, container: str) -> ContainerInfo | None:
        try:
            with _translated():
                attrs: Mapping[str, Any] = self._api.inspect_container(container)
        except DockerNotFound:
            return None
        return _container_info(attrs)

    def list_containers(self, labels: Sequence[str]) -> list[str]:
        with _translated():
            found = self._api.containers(all=True, filters={"label": list(labels)})
        return [str(summary["Id"]) for summary in found]

    def stop_container(self, container_id: str, timeout_s: int) -> None:
        with _translated():
            self._api.stop(container_id, timeout=timeout_s)

    def remove_container(self, container_id: str) -> None:
        with _translated():
            self._api.remove_container(container_id, force=True)

    def inspect_network(self, name: str) -> NetworkInfo | None:
        try:
            with _translated():
                found: Mapping[str, Any] = self._api.inspect_network(name)
        except DockerNotFound:
            return None
        return NetworkInfo(
            id=str(found.get("Id", "")),
            name=str(found.get("Name", "")),
            driver=str(found.get("Driver", "")),
            options={str(k): str(v) for k, v in (found.get("Options") or {}).items()},
            labels={str(k): str(v) for k, v in (found.get("Labels") or {}).items()},
        )

    def create_network(
        self, name: str, *, options: Mapping[str, str], labels: Mapping[str, str]
    ) -> str:
        with _translated():
            created: Mapping[str, Any] = self._api.create_network(
                name, driver="bridge", options=dict(options), labels=dict(labels)
            )
        return str(created.get("Id", ""))

    def logs(
        self, container_id: str, *, since: float | None = None, tail: int | None = None
    ) -> bytes:
        options: dict[str, Any] = {}
        if since:
            options["since"] = since
        if tail is not None:
            options["tail"] = tail
        with _translated():
            return bytes(self._api.logs(container_id, **options))

    def follow_logs(self, container_id: str, *, since: float | None = None) -> Iterator[bytes]:
        with _translated():
            stream = self._api.logs(container_id, stream=True, follow=True, since=since)
            try:
                for chunk in stream:
                    yield bytes(chunk)
            finally:
                stream.close()

    def container_ends(self, labels: Sequence[str]) -> EventStream:
        filters = {"type": "container", "event": "die", "label": list(labels)}
        with _translated():
            return _DieEvents(self._api.events(decode=True, filters=filters))

    def close(self) -> None:
        with contextlib.suppress(*_SDK_ERRORS):
            self._client.close()


class _DieEvents:
    """The SDK's cancellable events stream, read as :class:`ContainerEnded` values."""

    def __init__(self, stream: Any) -> None:
        self._stream = stream

    def __iter__(self) -> Iterator[ContainerEnded]:
        with _translated():
            for raw in self._stream:
                if not isinstance(raw, Mapping) or raw.get("status") != "die":
                    continue
                attributes = (raw.get("Actor") or {}).get("Attributes") or {}
                code = str(attributes.get("exitCode", ""))
                yield ContainerEnded(str(raw.get("id", "")), int(code) if code.isdigit() else None)

    def close(self) -> None:
        with contextlib.suppress(*_SDK_ERRORS, OSError):
            self._stream.close()


def _create_options(config: ContainerConfig) -> dict[str, Any]:
    """The SDK's ``containers.create`` arguments for ``config`` (besides the image)."""
    device_requests = []
    if config.gpu_device_ids:
        device_requests.append(
            docker.types.DeviceRequest(
                driver="nvidia", device_ids=list(config.gpu_device_ids), capabilities=[["gpu"]]
            )
        )
    options: dict[str, Any] = {
        "command": list(config.command),
        "name": config.name,
        "labels": dict(config.labels),
        "detach": True,
        "init": config.init,
        "environment": dict(config.environment),
        "ports": {f"{port}/tcp": (address,) for port, address in config.ports.items()},
        "mounts": [
            docker.types.Mount(
                target=m.target, source=str(m.source), type="bind", read_only=m.read_only
            )
            for m in config.mounts
        ],
        "device_requests": device_requests,
        "ulimits": [
            docker.types.Ulimit(name=name, soft=soft, hard=hard)
            for name, soft, hard in config.ulimits
        ],
    }
    if config.shm_size:
        options["shm_size"] = config.shm_size
    if config.network:
        options["network"] = config.network
    return options


def _container_info(attrs: Mapping[str, Any]) -> ContainerInfo:
    """A container's typed view from its ``docker inspect`` attributes."""
    state = attrs.get("State") or {}
    exit_code = state.get("ExitCode")
    ports: dict[str, tuple[PortBinding, ...]] = {}
    for key, bindings in ((attrs.get("NetworkSettings") or {}).get("Ports") or {}).items():
        published = tuple(
            PortBinding(host_ip=str(b.get("HostIp") or ""), host_port=int(b["HostPort"]))
            for b in bindings or ()
            if b.get("HostPort")
        )
        if published:
            ports[str(key)] = published
    device_ids = [
        str(device)
        for request in (attrs.get("HostConfig") or {}).get("DeviceRequests") or ()
        for device in request.get("DeviceIDs") or ()
    ]
    return ContainerInfo(
        id=str(attrs["Id"]),
        name=str(attrs.get("Name") or "").removeprefix("/"),
        labels={
            str(k): str(v) for k, v in ((attrs.get("Config") or {}).get("Labels") or {}).items()
        },
        state=ContainerState(
            running=bool(state.get("Running")),
            pid=int(state.get("Pid") or 0),
            exit_code=int(exit_code) if isinstance(exit_code, int) else None,
            oom_killed=bool(state.get("OOMKilled")),
            error=str(state.get("Error") or ""),
        ),
        ports=ports,
        gpu_device_ids=tuple(device_ids),
        networks=tuple(
            str(name) for name in ((attrs.get("NetworkSettings") or {}).get("Networks") or {})
        ),
    )
