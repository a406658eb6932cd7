"""A container's output in its deployment's log file.

Docker keeps a container's output only as long as the container; berth copies it into the
deployment's engine log as it is written (a thread per running container), so ``berth logs``
reads one file whatever the runtime and the log outlives the container.  berth's own lines
in that file (a pull, a container created) start with ``=== berth <UTC time>``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path

from berth.runtime.docker.api import DockerApi, DockerApiError

log = logging.getLogger(__name__)


def log_stamp() -> str:
    """The UTC time as berth's lines in an engine log show it (ISO 8601, seconds)."""
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def append_log(path: Path, text: str) -> None:
    """Append ``text`` to the log at ``path`` (its folder created when missing)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a", encoding="utf-8") as sink:
        sink.write(text)


def append_output(
    api: DockerApi, container_id: str, log_path: Path, *, since: float | None
) -> None:
    """Append what the container printed (after ``since``, a Unix time, when given) to the
    log.  Raises :class:`~berth.runtime.docker.api.DockerApiError`."""
    output = api.logs(container_id, since=since)
    if output:
        with log_path.open("ab") as sink:
            sink.write(output)


class LogCopies:
    """The threads copying running containers' output into log files, one per container."""

    def __init__(self) -> None:
        self._threads: dict[str, threading.Thread] = {}

    def follow(
        self,
        connect: Callable[[], DockerApi],
        container_id: str,
        log_path: Path,
        *,
        since: float | None,
    ) -> None:
        """Copy the container's output (from ``since``, default its start) into ``log_path``
        until the container stops, on a thread of its own; ``connect()`` gives the Docker
        client there (so connecting never blocks the caller)."""

        def copy() -> None:
            try:
                stream = connect().follow_logs(container_id, since=since)
                with log_path.open("ab") as sink:
                    for chunk in stream:
                        sink.write(chunk)
                        sink.flush()
            except (DockerApiError, OSError) as exc:
                log.warning("copying the output of container %s stopped: %s",
                            container_id[:12], exc)  # fmt: skip

        thread = threading.Thread(target=copy, name=f"berth-logs-{container_id[:12]}", daemon=True)
        self._threads[container_id] = thread
        thread.start()

    def drain(self, container_id: str, timeout_s: float) -> None:
        """Wait up to ``timeout_s`` seconds for the copy of a stopped container's output to
        reach its end, and forget it."""
        thread = self._threads.pop(container_id, None)
        if thread is not None:
            thread.join(timeout_s)
