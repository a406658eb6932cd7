"""The docker runtime's container operations: blocking sequences of Docker calls, run on the
runtime's threads (:mod:`~berth.runtime.docker.threads`), never on the event loop."""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Callable, Sequence
from pathlib import Path

from berth.errors import EngineError
from berth.runtime.docker.api import (
    ContainerConfig,
    ContainerInfo,
    DockerApi,
    DockerApiError,
    DockerConflict,
    DockerNotFound,
    DockerUnreachable,
)
from berth.runtime.docker.logs import append_output
from berth.runtime.docker.spec import HOME_LABEL

log = logging.getLogger(__name__)


def create_and_start(
    client: DockerApi,
    config: ContainerConfig,
    *,
    home: str,
    deployment_id: str,
    on_started: Callable[[str], None],
) -> ContainerInfo:
    """Create and start the container; what ``docker inspect`` says of it once started.

    A container of ``home`` left with the same name (an earlier start that died) is removed
    first; one of another home is not touched.  ``on_started(container id)`` runs as soon as
    the container started (to copy its output from the first line).  Raises
    :class:`~berth.errors.EngineError` when Docker refuses to create or start it, or it runs
    without publishing its port (the container is removed then), and
    :class:`~berth.runtime.docker.api.DockerUnreachable` when Docker cannot be reached.
    """
    try:
        try:
            container_id = client.create_container(config)
        except DockerConflict:
            if not remove_stale(client, config.name, home=home):
                raise
            container_id = client.create_container(config)
    except DockerUnreachable:
        raise
    except DockerApiError as exc:
        raise EngineError(
            f"cannot create container {config.name}: {exc.reason}", deployment_id=deployment_id
        ) from exc
    try:
        client.start_container(container_id)
        on_started(container_id)
        info = client.inspect_container(container_id)
        if info is None:
            raise DockerNotFound(f"no such container: {container_id}")
        if info.state.running and info.published_port() is None:
            raise EngineError("the container publishes no engine port", deployment_id=deployment_id)
    except (DockerApiError, EngineError) as exc:
        with contextlib.suppress(DockerApiError):
            client.remove_container(container_id)
        reason = exc.reason if isinstance(exc, DockerApiError) else exc
        raise EngineError(
            f"cannot start container {config.name}: {reason}", deployment_id=deployment_id
        ) from exc
    return info


def remove_stale(client: DockerApi, name: str, *, home: str) -> bool:
    """Remove a container of ``home`` named ``name``; False when it belongs to another home
    (then it stays).  True when there is none."""
    stale = client.inspect_container(name)
    if stale is None:
        return True
    if stale.labels.get(HOME_LABEL) != home:
        return False
    log.warning("removing container %s left from an earlier start", name)
    client.remove_container(stale.id)
    return True


def stop_and_remove(
    client: DockerApi, container_id: str, *, grace_s: float, drain: Callable[[str], None]
) -> None:
    """Stop the container (SIGTERM, SIGKILL after ``grace_s`` seconds), let ``drain(id)``
    wait for its last output to reach the log, and remove it; one already gone, or being
    removed by someone else, is not an error."""
    with contextlib.suppress(DockerNotFound):
        client.stop_container(container_id, timeout_s=math.ceil(grace_s))
    drain(container_id)
    with contextlib.suppress(DockerNotFound, DockerConflict):
        client.remove_container(container_id)


def find_containers(client: DockerApi, labels: Sequence[str]) -> list[ContainerInfo]:
    """Every container (running or not) carrying ``labels``, as ``docker inspect`` says."""
    found = []
    for container_id in client.list_containers(labels):
        info = client.inspect_container(container_id)
        if info is not None:
            found.append(info)
    return found


def copy_and_remove(
    client: DockerApi, container_id: str, log_path: Path, *, since: float | None
) -> None:
    """Append what the container printed since ``since`` to the log, then remove it."""
    with contextlib.suppress(DockerNotFound):
        append_output(client, container_id, log_path, since=since)
        client.remove_container(container_id)
