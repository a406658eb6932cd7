"""Pulling an engine's image: the pull itself, and its progress folded into one line.

A pull can take minutes (vLLM's image is several GB); it runs on a thread of its own, reports
a line of progress about once a second, writes its start and end into the deployment's log,
and stops at Docker's next message once the start is cancelled.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

from berth.errors import EngineError
from berth.runtime.docker.api import DockerApi, DockerApiError, PullMessage
from berth.runtime.docker.logs import append_log, log_stamp

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


class PullProgress:
    """Folds the messages of an image pull into one line of progress.

    Docker reports each layer separately (``Downloading`` with a byte count, then
    ``Download complete``, ``Pull complete`` or ``Already exists``); this keeps the latest
    count per layer.
    """

    def __init__(self, image: str) -> None:
        self.image = image
        self._bytes: dict[str, tuple[int, int]] = {}
        self._done: set[str] = set()
        self._layers: set[str] = set()

    def feed(self, message: PullMessage) -> None:
        """Take one message of the pull's stream (messages about the image are ignored)."""
        layer, status = message.layer, message.status
        if layer is None or status not in _LAYER_STATUSES:
            return  # "Pulling from ...", "Digest: ...", "Status: ..." are about the image
        self._layers.add(layer)
        if status == "Downloading":
            current, total = message.current_bytes, message.total_bytes
            if current is not None and total is not None and total > 0:
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


def ensure_image(
    api: DockerApi,
    image: str,
    *,
    deployment_id: str,
    log_path: Path,
    progress: Callable[[str], None],
    cancelled: threading.Event,
) -> None:
    """Pull ``image`` unless the engine has it; blocks until the pull ends.

    ``progress(line)`` gets :class:`PullProgress` lines about once a second, then
    ``pulled IMAGE``.  Raises :class:`~berth.errors.EngineError` (also written into the log at
    ``log_path``) when Docker reports an error, the pull breaks off or ends without the
    image, or ``cancelled`` is set (seen at Docker's next message; the pull is dropped).
    A failure to ask whether the image is there raises
    :class:`~berth.runtime.docker.api.DockerApiError`.
    """
    if api.inspect_image(image) is not None:
        return
    tracker = PullProgress(image)
    append_log(log_path, f"=== berth {log_stamp()} pulling image {image}\n")
    progress(tracker.line())
    last = time.monotonic()
    started = last
    try:
        messages = api.pull(image)
        for message in messages:
            if cancelled.is_set():
                messages.close()  # Docker drops a pull nobody reads
                raise EngineError(f"the pull of {image} was cancelled", deployment_id=deployment_id)
            if message.error is not None:
                raise EngineError(
                    f"cannot pull image {image}: {message.error}", deployment_id=deployment_id
                )
            tracker.feed(message)
            if time.monotonic() - last >= _PROGRESS_EVERY_S:
                last = time.monotonic()
                progress(tracker.line())
    except DockerApiError as exc:
        reason = f"cannot pull image {image}: {exc.reason}"
        append_log(log_path, f"=== berth {log_stamp()} {reason}\n")
        raise EngineError(reason, deployment_id=deployment_id) from exc
    except EngineError as exc:
        append_log(log_path, f"=== berth {log_stamp()} {exc}\n")
        raise
    if api.inspect_image(image) is None:
        raise EngineError(
            f"cannot pull image {image}: Docker finished the pull but has no such image",
            deployment_id=deployment_id,
        )
    took = time.monotonic() - started
    append_log(log_path, f"=== berth {log_stamp()} pulled {image} in {took:.0f} s\n")
    progress(f"pulled {image}")
