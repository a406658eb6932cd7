"""The seam between berth and a Docker engine: the :class:`DockerApi` Protocol, the typed
values it returns, and the errors it raises.

:class:`DockerApi` is the part of the Engine API berth uses (images, containers, logs), as
blocking calls; the real implementation (``runtime/docker/sdk.py``) drives the ``docker``
SDK and is the only module that sees the SDK's untyped values, and tests use an in-memory
one.  Names follow Docker's own (``inspect``, ``pull``, ``labels``); the JSON shapes are those
of the Docker Engine API reference (``/containers/{id}/json``, ``/images/create``).

Errors::

    DockerApiError      Docker refused a call (``reason``: its explanation, in plain words)
    ├── DockerUnreachable  no Docker engine answers (socket missing, refused, not allowed)
    ├── DockerNotFound     no such container or image (HTTP 404)
    └── DockerConflict     a name in use, or a removal already in progress (HTTP 409)

They never reach users as such: the runtime turns them into
:class:`~berth.errors.EngineError`, the CLI and ``berth doctor`` into their own messages.
"""

from __future__ import annotations

from collections.abc import Generator, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from berth.runtime.base import Mount


class DockerApiError(Exception):
    """A Docker call failed; ``reason`` says why in plain words, ``status_code`` is the Engine
    API's HTTP status when it answered."""

    def __init__(self, reason: str, *, status_code: int | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.status_code = status_code


class DockerUnreachable(DockerApiError):
    """No Docker engine answers at the host (or the connection broke)."""


class DockerNotFound(DockerApiError):
    """The container or image does not exist."""


class DockerConflict(DockerApiError):
    """The call clashes with the container's state: its name is taken, or it is being
    removed already."""


@dataclass(frozen=True)
class EngineVersion:
    """What ``GET /version`` says: the engine's release and its API version."""

    version: str
    api_version: str


@dataclass(frozen=True)
class EngineInfo:
    """The part of ``GET /info`` berth reads: the OCI runtimes registered (``runc``,
    ``nvidia``)."""

    runtimes: frozenset[str]


@dataclass(frozen=True)
class ImageInfo:
    """An image in the engine's local store: its id (``sha256:<hex>``) and size in bytes."""

    id: str
    size_bytes: int

    @property
    def short_id(self) -> str:
        """The id's first 10 hex digits, as ``docker images`` shows it."""
        return self.id.removeprefix("sha256:")[:10]


@dataclass(frozen=True)
class PortBinding:
    """Where a container port is published on the host."""

    host_ip: str
    host_port: int


@dataclass(frozen=True)
class ContainerState:
    """A container's ``State``: whether it runs, its main process as the host sees it (0
    when not running), how it exited (``exit_code`` None while it never did)."""

    running: bool
    pid: int = 0
    exit_code: int | None = None
    oom_killed: bool = False
    error: str = ""


@dataclass(frozen=True)
class ContainerInfo:
    """What ``docker inspect`` says about a container, in the parts berth reads.

    ``ports`` maps ``"8080/tcp"`` to where it is published (empty when it is not, or the
    container does not run); ``gpu_device_ids`` are the devices its device requests name;
    ``networks`` the names of the networks it is attached to.
    """

    id: str
    name: str
    labels: Mapping[str, str]
    state: ContainerState
    ports: Mapping[str, tuple[PortBinding, ...]] = field(default_factory=dict)
    gpu_device_ids: tuple[str, ...] = ()
    networks: tuple[str, ...] = ()

    def published_port(self) -> int | None:
        """The host port of the container's first published port; ``None`` when none is."""
        for bindings in self.ports.values():
            for binding in bindings:
                return binding.host_port
        return None


@dataclass(frozen=True)
class ContainerConfig:
    """A container to create: what ``docker run`` would be told.

    ``ports`` maps a container TCP port to the host address it is published on (Docker
    picks the host port); ``gpu_device_ids`` go in one NVIDIA device request; ``ulimits``
    are ``(name, soft, hard)``; ``shm_size`` is ``/dev/shm``'s size as Docker parses it
    (``"16g"``); ``init`` runs docker-init as PID 1 (it forwards signals and reaps children).
    """

    image: str
    name: str
    command: tuple[str, ...]
    labels: Mapping[str, str]
    environment: Mapping[str, str] = field(default_factory=dict)
    ports: Mapping[int, str] = field(default_factory=dict)
    mounts: tuple[Mount, ...] = ()
    gpu_device_ids: tuple[str, ...] = ()
    ulimits: tuple[tuple[str, int, int], ...] = ()
    shm_size: str | None = None
    init: bool = True
    network: str | None = None


@dataclass(frozen=True)
class NetworkInfo:
    """What ``docker network inspect`` says about a network, in the parts berth reads: its
    driver, its driver options (``com.docker.network.bridge.enable_icc``) and labels."""

    id: str
    name: str
    driver: str
    options: Mapping[str, str] = field(default_factory=dict)
    labels: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class PullMessage:
    """One message of an image pull's stream (``POST /images/create``).

    ``layer`` is the layer id the message is about (``None`` for messages about the image:
    ``"Pulling from ..."``, ``"Digest: ..."``); ``current_bytes``/``total_bytes`` come with
    ``"Downloading"``; ``error`` is set when the pull failed.
    """

    status: str
    layer: str | None = None
    current_bytes: int | None = None
    total_bytes: int | None = None
    error: str | None = None


def decode_pull_message(raw: Mapping[str, object]) -> PullMessage:
    """A pull message from its JSON object (``{"id": ..., "status": ..., "progressDetail":
    {"current": n, "total": m}}`` or ``{"error": ...}``); unknown fields are ignored, and
    fields of the wrong type are taken as missing."""
    layer = raw.get("id")
    detail = raw.get("progressDetail")
    current = total = None
    if isinstance(detail, Mapping):
        current, total = _integer(detail.get("current")), _integer(detail.get("total"))
    error = raw.get("error")
    return PullMessage(
        status=str(raw.get("status", "")),
        layer=layer if isinstance(layer, str) else None,
        current_bytes=current,
        total_bytes=total,
        error=None if error is None else str(error),
    )


def _integer(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


@dataclass(frozen=True)
class ContainerEnded:
    """A container's ``die`` event: its id and exit code (``None`` when the event has
    none)."""

    container_id: str
    exit_code: int | None


class EventStream(Protocol):
    """Docker's events stream, as :meth:`DockerApi.container_ends` opens it: iterating
    blocks for the next event; :meth:`close`, from any thread, ends the iteration."""

    def __iter__(self) -> Iterator[ContainerEnded]: ...

    def close(self) -> None: ...


class DockerApi(Protocol):
    """The calls berth makes to one Docker engine.  Every one blocks on the engine's socket
    (run them off the event loop) and raises :class:`DockerApiError` (a subclass where one
    fits) when the engine refuses or cannot be reached."""

    def version(self) -> EngineVersion:
        """The engine's version."""
        ...

    def info(self) -> EngineInfo:
        """The engine's configuration (the runtimes registered)."""
        ...

    def inspect_image(self, image: str) -> ImageInfo | None:
        """The image ``repository:tag`` in the local store; ``None`` when it is not there."""
        ...

    def pull(self, image: str) -> Generator[PullMessage, None, None]:
        """Pull ``image`` (``repository[:tag]``, tag ``latest`` when none), yielding Docker's
        progress messages as they come; closing the generator drops the pull."""
        ...

    def create_container(self, config: ContainerConfig) -> str:
        """Create (not start) a container; its id.  :class:`DockerConflict` when the name is
        taken, :class:`DockerNotFound` when the image is missing."""
        ...

    def start_container(self, container_id: str) -> None:
        """Start a created container."""
        ...

    def inspect_container(self, container: str) -> ContainerInfo | None:
        """The container with this id or name; ``None`` when there is none."""
        ...

    def list_containers(self, labels: Sequence[str]) -> list[str]:
        """The ids of every container, running or not, carrying all of ``labels`` (each
        ``key`` or ``key=value``)."""
        ...

    def stop_container(self, container_id: str, timeout_s: int) -> None:
        """SIGTERM the container, SIGKILL after ``timeout_s`` seconds; returns once it
        stopped.  :class:`DockerNotFound` when it does not exist."""
        ...

    def remove_container(self, container_id: str) -> None:
        """Remove the container, running or not.  :class:`DockerNotFound` when it does not
        exist, :class:`DockerConflict` when its removal is already under way."""
        ...

    def inspect_network(self, name: str) -> NetworkInfo | None:
        """The network with this name or id; ``None`` when there is none."""
        ...

    def create_network(
        self, name: str, *, options: Mapping[str, str], labels: Mapping[str, str]
    ) -> str:
        """Create a bridge network with these driver options and labels; its id.
        :class:`DockerConflict` when the name is taken."""
        ...

    def logs(
        self, container_id: str, *, since: float | None = None, tail: int | None = None
    ) -> bytes:
        """The container's output (stdout and stderr as Docker interleaved them): all of it,
        or what came after ``since`` (a Unix time), or its last ``tail`` lines."""
        ...

    def follow_logs(self, container_id: str, *, since: float | None = None) -> Iterator[bytes]:
        """The container's output from ``since`` (default: its start) as it is written, until
        the container stops."""
        ...

    def container_ends(self, labels: Sequence[str]) -> EventStream:
        """Follow the ``die`` events of the containers carrying all of ``labels``, as they
        happen (``GET /events``), until the stream is closed or the engine goes away."""
        ...

    def close(self) -> None:
        """Release the connection (containers keep running)."""
        ...
